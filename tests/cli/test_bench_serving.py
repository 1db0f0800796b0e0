"""``kvcache bench --serving``: the whole command at tiny sizes on the CPU (structure, not
speed)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcache.bench.serving import tail_busy, union_length  # noqa: E402
from kvcache.cli import main  # noqa: E402

TINY = ["bench", "--serving", "--model", "llama", "--tiny", "--device", "cpu", "--layers", "1",
        "--batch", "2"]


# The bare `--tiny --json` run (every system, the JSON report) is asserted on in
# test_bench_serving_tiny.py: one run of that command serves all its tests (it was run twice, once
# here in-process and once there in a fresh process).


def test_serving_table_says_what_was_skipped(capsys, monkeypatch):
    # the cuda backend in its CPU test mode, as (a) runs on a GPU
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c",
                        "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    rows = {ln[:3]: ln for ln in out.splitlines() if ln[:3] in ("(a)", "(b)", "(c)")}
    assert set(rows) == {"(a)", "(b)", "(c)"}
    assert "skipped: --skip" in rows["(b)"] and "skipped: --skip" in rows["(c)"]
    assert "skipped" not in rows["(a)"] and "(cuda, rope=cache)" in rows["(a)"] and "(roofline)" in out
    # a smoke run's ratios are not held against the GPU targets
    assert "targets: not judged on a --tiny smoke run" in out and "MISSED" not in out


def test_serving_rejects_an_unknown_system_to_skip(capsys):
    assert main(TINY + ["--skip", "a,e"]) == 2
    assert "unknown system(s) e" in capsys.readouterr().err


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_length([]) == 0


def test_serving_on_a_missing_gpu_says_so_before_any_work(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["bench", "--serving", "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_tail_busy_is_the_covered_share_of_the_last_window():
    spans = [(0, 10), (10, 12), (14, 15), (18, 20)]      # the last 10: 12..14 and 15..18 idle
    assert tail_busy(spans, 10) == pytest.approx(0.5)
    assert tail_busy(spans, 2) == pytest.approx(1.0)
    assert tail_busy(spans + [(11, 19)], 10) == pytest.approx(1.0)    # overlaps count once
    assert tail_busy([], 5) is None and tail_busy(spans, 0) is None


@pytest.mark.parametrize("rope", ["cache", "model"])
def test_serving_rope_option_picks_who_rotates_in_a(capsys, monkeypatch, rope):
    # (a) runs inside the cache's fused RoPE by default (--rope cache), outside it with --rope model
    from kvcache.integrations import transformers as kvt
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    entered = []
    real = kvt.fused_rope
    # patched where TransformersAdapter.session looks it up
    monkeypatch.setattr(kvt.adapter, "fused_rope",
                        lambda model, cache: entered.append(1) or real(model, cache))
    extra = [] if rope == "cache" else ["--rope", "model"]
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c", "--backend",
                        "cuda", "--json"] + extra) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["workload"]["a_rope"] == rope and res["systems"]["a"]["tokens"] == 2 * 3
    assert bool(entered) == (rope == "cache")


KV_BUDGET = ["bench", "--serving", "--tiny", "--device", "cpu", "--workload", "kv-budget"]


def test_kv_budget_quantized_pages_hold_more_at_the_same_budget(capsys):
    # one budget in bytes for both runs: int8 pages are smaller, so it holds more of them
    from kvcache.bench.serving import print_kv_budget_result
    assert main(KV_BUDGET + ["--kv-dtype", "int8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    w, auto, quant = res["workload"], res["systems"]["auto"], res["systems"]["quantized"]
    assert w["kind"] == "kv-budget" and w["a_kv_dtype"] == "int8"
    assert (auto["kv_dtype"], quant["kv_dtype"]) == ("float32", "int8")
    budget = w["kv_budget_bytes"]
    assert auto["kv_bytes"] <= budget and quant["kv_bytes"] <= budget
    assert quant["token_capacity"] > auto["token_capacity"]
    assert quant["token_capacity"] == quant["kv_pages"] * w["page_size"]
    # the default budget holds half the batch in float32: that run cannot run them all at once
    assert auto["peak_running"] < w["batch"]
    assert quant["peak_running"] >= auto["peak_running"]
    for r in (auto, quant):
        assert r["new_tokens"] == w["requests"] * w["new_tokens"] and r["preemptions"] >= 0
    assert 0 <= res["same_tokens"] <= res["compared"] == w["requests"]
    assert set(res["verdicts"]) == {"more concurrent sequences", "higher tokens/s"}
    # the table: both runs, the token count; a smoke run's verdicts are not printed
    print_kv_budget_result(res)
    out = capsys.readouterr().out
    assert any(ln.startswith("float32 ") for ln in out.splitlines())
    assert any(ln.startswith("int8 ") for ln in out.splitlines())
    assert "greedy tokens equal in both runs" in out and "not judged" in out
    assert "PASS" not in out and "MISS" not in out
    res["targets_judged"] = True
    print_kv_budget_result(res)
    out = capsys.readouterr().out
    assert f"{res['verdicts']['more concurrent sequences']} more concurrent sequences" in out
    assert f"{res['verdicts']['higher tokens/s']} higher tokens/s" in out


def test_window_budget_window_groups_hold_more_at_the_same_budget(capsys):
    # one budget in bytes for both runs: with window groups the windowed layers keep only their
    # windows' pages, so the full layer holds more tokens and more sequences run at once
    from kvcache.bench.serving import print_window_budget_result
    assert main(["bench", "--serving", "--tiny", "--device", "cpu", "--workload",
                 "window-budget", "--kv-budget-mib", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    w, pages, window = res["workload"], res["systems"]["pages"], res["systems"]["window"]
    assert w["kind"] == "window-budget" and w["layers"] == 6 and w["kv_budget_given"]
    assert pages["kv_bytes"] <= w["kv_budget_bytes"] >= window["kv_bytes"]
    assert window["token_capacity"] > 2 * pages["token_capacity"]
    assert not pages["window_groups"] and window["window_groups"]
    assert window["peak_running"] >= pages["peak_running"]
    for r in (pages, window):
        assert r["new_tokens"] == w["requests"] * w["new_tokens"]
    assert res["same_tokens"] == res["compared"] == w["requests"]      # float32 on the CPU
    print_window_budget_result(res)
    out = capsys.readouterr().out
    assert "every page" in out and "window groups" in out and "not judged" in out


def test_window_budget_rescore_judges_the_requests_whose_tokens_differ():
    # the runs' batches differ, so bfloat16 tokens may part at near-ties: the requests that
    # differ are judged by the model's own teacher-forced logits, and a token far from the
    # argmax (a key wrongly kept or dropped) fails, naming the request and the run
    from kvcache.bench.serving.window_budget import _rescore, build_window_model
    from kvcache.demo.check import teacher_forced_logits
    net = build_window_model(6, True, "cpu", "float32", 0)
    prompt = list(range(1, 30))
    with torch.no_grad():
        good = net.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=4,
                            min_new_tokens=4)[0, len(prompt):].tolist()
    worst = int(teacher_forced_logits(net, prompt, good)[2].argmin())
    bad = good[:2] + [worst] + good[3:]
    res = _rescore(net, [prompt, prompt], {"pages": [good, good], "window": [good, bad]})
    assert (res["differ"], res["judged"], res["passed"]) == (1, 1, 0)
    assert res["problems"][0].startswith("request 1 (window): new token 2 is")
    res = _rescore(net, [prompt, prompt], {"pages": [good, good], "window": [good, good]})
    assert (res["differ"], res["judged"], res["passed"], res["problems"]) == (0, 0, 0, [])


def test_the_timed_whole_run_serves_its_prompts_cold():
    # the bench warms up on the very prompts it then times: the timed run hit the prefix
    # cache for most prompt pages (912 of 1,030 tokens here), so (a) and (d) timed hits, not
    # serving; the runner now forgets them before the timed run, the index still on
    from kvcache.bench.serving.measure import measure
    from kvcache.bench.serving.model import build_model, workload
    from kvcache.bench.serving.runners import EngineRunner
    net = build_model("llama", 1, True, "cpu", "float32", 0)
    prompts = workload(8, (32, 64), net.config.vocab_size, 0)
    runner = EngineRunner(net, "reference", "cpu", 4, 100)
    hits = []
    real = runner.run

    def run(p, n):
        before = runner.engine.stats.prefix_hit_tokens
        out = real(p, n)
        hits.append(runner.engine.stats.prefix_hit_tokens - before)
        return out
    runner.run = run
    measure(runner, prompts, 3, prompts[:2], 1, 3, "cpu", False)
    assert hits[-1] == 0 and runner.engine.cache.config.prefix_cache
    assert max(hits[:-1]) > 0          # the decode runs still meet their cached prompts


def test_serving_kv_dtype_reaches_the_engine_on_the_random_workload(capsys):
    """A quantized ``--kv-dtype`` reaches (a), and (p) runs the same Engine at the same batch
    with pages of the compute dtype in the same run: quantized over 16-bit tokens/s and decode
    step are ratios of one run (judged >= 1.0 on a full run); without one, no (p)."""
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c",
                        "--kv-dtype", "int8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    a, p = res["systems"]["a"], res["systems"]["p"]
    assert res["workload"]["a_kv_dtype"] == "int8" and a["kv_dtype"] == "int8"
    assert "kv int8" in a["system"] and a["tokens"] == 2 * 3
    assert p["kv_dtype"] == "float32" and "kv " not in p["system"] and p["tokens"] == 2 * 3
    assert res["ratios"]["a_over_p_tokens_per_s"] > 0 and "a_decode_step_over_p" in res["ratios"]
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c,p",
                        "--kv-dtype", "int8"]) == 0
    out = capsys.readouterr().out
    assert "(p) kvcache Engine, 16-bit pages (same batch)" in out and "skipped: --skip" in out
    # without a quantized --kv-dtype no (p): test_deterministic_adds_system_d_and_its_ratios


@pytest.mark.parametrize("extra, error", [
    (["--kv-dtype", "int4"], "--kv-dtype int4: backend 'reference' does not store it"),
    ([], "declares no quantized KV format"),
    (["--kv-budget-mib", "0.01"], "the longest request needs"),
], ids=["format-not-stored", "no-quantized-format", "budget-too-small"])
def test_kv_budget_mistakes_are_usage_errors(capsys, monkeypatch, extra, error):
    import dataclasses
    from kvcache.reference import ReferenceBackend
    caps = ReferenceBackend.capabilities
    # a backend storing int8 only, or no quantized format at all
    kept = ("float32", "int8") if "int4" in extra else ("float32",)
    if "--kv-budget-mib" not in extra:
        monkeypatch.setattr(ReferenceBackend, "capabilities",
                            dataclasses.replace(caps, kv_dtypes=kept))
    assert main(KV_BUDGET + extra) == 2
    assert error in capsys.readouterr().err


def test_kv_budget_mib_is_only_for_the_kv_budget_workload(capsys):
    assert main(TINY + ["--kv-budget-mib", "1"]) == 2
    assert "only with --workload kv-budget or window-budget" in capsys.readouterr().err


@pytest.mark.slow       # 20 s on 2 cores; the TP engine itself runs in CI through tests/distributed
def test_tp_workload_times_tp1_and_tp2_in_one_run(capsys):
    # two gloo processes on the CPU (the GPU run: two GPUs, NCCL, docs/distributed.md)
    assert main(["bench", "--serving", "--tiny", "--device", "cpu", "--workload", "tp",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    w = res["workload"]
    assert w["kind"] == "tp" and w["layers"] == 1 and w["batch"] == 4
    for side in ("tp1", "tp2"):
        assert res[side]["decode_step_ms"] > 0 and res[side]["tokens_per_s"] > 0
    assert res["step_ratio"] == pytest.approx(res["tp2"]["decode_step_ms"]
                                              / res["tp1"]["decode_step_ms"])
    from kvcache.bench.serving import print_tp_result
    print_tp_result(res)
    out = capsys.readouterr().out
    assert "TP1" in out and "TP2" in out and "not judged here" in out


def test_deterministic_adds_system_d_and_its_ratios(capsys):
    """``--deterministic``: (d), the Engine with deterministic=True, on the same work as (a), in
    the same run; its decode step and tokens/s against (a)'s. Without the option (d) is not in
    the table at all."""
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c", "--json",
                        "--deterministic"]) == 0
    res = json.loads(capsys.readouterr().out)
    d = res["systems"]["d"]
    assert "deterministic" in d["system"] and d["tokens"] == 2 * 3
    assert 0 <= d["same_tokens_as_a"] <= 2              # a count (a near-tie may part them)
    assert res["ratios"]["d_over_a_tokens_per_s"] > 0 and "d_decode_step_over_a" in res["ratios"]
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c"]) == 0
    out = capsys.readouterr().out
    assert "(d)" not in out and "(p)" not in out
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c",
                        "--deterministic"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("(d)")]
    assert rows and "deterministic" in rows[0]



def test_deterministic_shared_prefix_asks_every_request_equal(capsys):
    """``--workload shared-prefix --deterministic``: both Engines (prefix cache on and off) run
    deterministic, and the report judges every request's tokens equal on and off."""
    assert main(TINY + ["--workload", "shared-prefix", "--requests", "4", "--new-tokens", "3",
                        "--skip", "b", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "greedy tokens equal with the cache on and off: 4/4 requests (deterministic=True" in out
    assert "every request's tokens equal with the cache on and off: met" in out


# ---------------------------------------------------------------- --runs N
RUNS = TINY + ["--requests", "3", "--new-tokens", "3", "--skip", "b,c", "--deterministic"]
"""(a) and (d), 3 requests (the whole run) apart from the decode step's 2 (--batch 2)."""


class Clock:
    """The serving bench's timed runs, recorded in order as (system, prompts, new tokens), each
    given its wall from ``walls`` ((system, prompts, new tokens): one wall per round) where it
    has one, else the clock's. The (a)/(d) Engines are told apart by (d)'s name."""

    def __init__(self, monkeypatch, walls=None):
        import importlib

        from kvcache.bench.serving.runners import EngineRunner
        # the module: the package's name ``measure`` is its function
        timing = importlib.import_module("kvcache.bench.serving.measure")
        self.calls, self.walls, self.last = [], walls or {}, None
        real_run, real_timed = EngineRunner.run, timing._timed

        def run(runner, prompts, new_tokens):
            self.ran(("d" if "deterministic" in runner.name else "a", len(prompts), new_tokens))
            return real_run(runner, prompts, new_tokens)

        def timed(fn, device):
            wall, out = real_timed(fn, device)
            self.calls.append(self.last)
            given = self.walls.get(self.last)
            # round by round (a wall list of one: every run's)
            return (wall if given is None
                    else given[(self.calls.count(self.last) - 1) % len(given)]), out
        monkeypatch.setattr(EngineRunner, "run", run)
        monkeypatch.setattr(timing, "_timed", timed)

    def ran(self, call: tuple) -> None:
        self.last = call


def test_runs_interleave_the_systems_timed_calls(capsys, monkeypatch):
    """``--runs 3``: after their warm-up the systems' timed measurements (the decode
    difference's two runs, the whole run) take turns round by round, a, b, c, a, b, c, ...,
    the Engine's whole run cold every round."""
    import kvcache.bench.serving as serving
    from kvcache.bench.serving.runners import Runner
    clock = Clock(monkeypatch)

    def peer(key):
        class Peer(Runner):         # (b) and (c) stand-ins: the order is what is asked here
            name = key

            def __init__(self, *args):
                pass

            def run(self, prompts, new_tokens):
                clock.ran((key, len(prompts), new_tokens))
                return [[1] * new_tokens for _ in prompts]
        return Peer
    monkeypatch.setattr(serving, "GenerateBatchRunner", peer("b"))
    monkeypatch.setattr(serving, "StaticRunner", peer("c"))
    forgot = []
    monkeypatch.setattr(serving.EngineRunner, "forget", lambda self: forgot.append(1))
    assert main(TINY + ["--requests", "3", "--new-tokens", "3", "--runs", "3", "--json"]) == 0
    one = [(key, n, tokens) for key in "abc" for n, tokens in ((2, 1), (2, 3), (3, 3))]
    assert clock.calls == one * 3
    assert len(forgot) == 3             # before each of (a)'s timed whole runs
    res = json.loads(capsys.readouterr().out)
    assert res["runs"] == 3 and set(res["systems"]) == {"a", "b", "c"}
    assert len(res["ratio_runs"]["a_over_b_tokens_per_s"]) == 3


# (a)'s and (d)'s walls per round: their medians, their ratios' medians, the last round's and
# the means all differ, and the targets' verdicts with them
WALLS = {("a", 2, 1): [0.1] * 3, ("a", 2, 3): [0.3, 0.5, 0.2], ("a", 3, 3): [0.7, 1.44, 2.0],
         ("d", 2, 1): [0.1] * 3, ("d", 2, 3): [0.5, 0.3, 0.3], ("d", 3, 3): [1.0, 2.0, 1.0]}


def test_runs_report_the_medians_of_the_rounds(capsys, monkeypatch):
    """``--runs 3 --deterministic``: (a) and (d) interleaved; each system's value is the median
    of its rounds, each ratio the median of the per-round ratios (not the ratio of the medians,
    not the mean, not the last round's); JSON carries the rounds' lists; the targets are judged
    on the medians and say so."""
    from kvcache.bench.serving import print_result
    clock = Clock(monkeypatch, WALLS)
    assert main(RUNS + ["--runs", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert clock.calls == [(key, n, tokens) for key in "ad"
                           for n, tokens in ((2, 1), (2, 3), (3, 3))] * 3
    a, d = res["systems"]["a"], res["systems"]["d"]
    assert res["runs"] == 3
    assert a["runs"]["tokens_per_s"] == pytest.approx([9 / 0.7, 9 / 1.44, 9 / 2.0])
    assert a["tokens_per_s"] == pytest.approx(9 / 1.44) and a["wall_s"] == pytest.approx(1.44)
    assert a["runs"]["decode_step_ms"] == pytest.approx([100, 200, 50])
    assert a["decode_step_ms"] == pytest.approx(100) and d["decode_step_ms"] == pytest.approx(100)
    rr, rt = res["ratio_runs"], res["ratios"]
    assert rr["d_over_a_tokens_per_s"] == pytest.approx([0.7, 0.72, 2.0])
    assert rt["d_over_a_tokens_per_s"] == pytest.approx(0.72)      # the medians' ratio: 1.44
    assert rr["d_decode_step_over_a"] == pytest.approx([2.0, 0.5, 2.0])
    assert rt["d_decode_step_over_a"] == pytest.approx(2.0)        # the medians' ratio: 1.0
    assert len(rr["a_decode_step_over_roofline"]) == 3 and "a_gpu_busy" not in rr
    # the table: the medians, each round's values and ratios; a full run's targets on the medians
    res["workload"]["tiny"] = False
    print_result(res)
    out = capsys.readouterr().out
    assert "runs: 3, the systems interleaved round by round" in out
    assert "  (d) tokens/s / (a)'s: 0.70, 0.72, 2.00 (median 0.72)" in out
    assert "  (a) tokens/s 12.9, 6.2, 4.5; decode step ms 100.000, 200.000, 50.000" in out
    assert "(d) tokens/s / (a)'s: 0.72 (median of 3 runs, target >= 0.75) MISSED" in out
    assert "(d) decode step / (a)'s: 2.00 (median of 3 runs, target <= 1.3) MISSED" in out


def test_runs_1_output_is_unchanged(capsys, monkeypatch):
    """``--runs 1`` (the default) prints the table and JSON of a run without it: no rounds."""
    import time

    import kvcache.bench.serving as serving
    from kvcache.bench.serving import print_result
    monkeypatch.setattr(serving, "copy_rate", lambda device, nbytes: 1e10)
    monkeypatch.setattr(time, "strftime", lambda fmt: "2026-01-01 00:00:00")
    Clock(monkeypatch, {key: walls[:1] for key, walls in WALLS.items()})
    outs = []
    for extra in ([], ["--runs", "1"]):
        assert main(RUNS + extra + ["--json"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]           # the table is print_result's of this JSON
    res = json.loads(outs[1])
    assert "runs" not in res and "ratio_runs" not in res and "runs" not in res["systems"]["a"]
    assert res["systems"]["a"]["tokens_per_s"] == pytest.approx(9 / 0.7)
    assert res["ratios"]["d_over_a_tokens_per_s"] == pytest.approx(0.7)
    res["workload"]["tiny"] = False
    print_result(res)
    out = capsys.readouterr().out
    assert "runs" not in out and "median" not in out
    assert "(d) tokens/s / (a)'s: 0.70 (target >= 0.75) MISSED" in out


@pytest.mark.parametrize("workload", ["shared-prefix", "multi-turn", "window-budget", "tp"])
def test_runs_refused_where_a_workload_times_once(capsys, workload):
    assert main(TINY + ["--workload", workload, "--runs", "2"]) == 2
    err = capsys.readouterr().err
    assert f"--runs 2: --workload {workload} times each system once" in err
    assert "--workload random or kv-budget" in err


def test_kv_budget_runs_interleave_the_two_formats(capsys, monkeypatch):
    """``--workload kv-budget --runs 3``: the 16-bit and the quantized Engine's timed runs take
    turns after their warm-ups, each from an empty prefix cache; the ratio is the median of the
    rounds' ratios, judged as such."""
    from kvcache.bench.serving import print_kv_budget_result
    from kvcache.bench.serving.prefix import Online
    real = Online.run
    timed, walls = [], {"float32": [1.0, 2.0, 4.0], "int8": [3.0, 1.0, 1.0]}

    def run(self, groups, wait_for_group=False):
        tokens, ttft, wall = real(self, groups, wait_for_group)
        if len(groups) == 1 and groups[0] is prompts[0]:        # the measured run
            kv = self.engine.config.kv_dtype
            timed.append((kv, self.engine.cache.num_cached_pages))
            wall = walls[kv][sum(k == kv for k, _ in timed) - 1]
        return tokens, ttft, wall
    prompts = []
    import kvcache.bench.serving.kv_budget as kv_budget
    real_workload = kv_budget.workload
    monkeypatch.setattr(kv_budget, "workload", lambda *a: prompts.append(real_workload(*a))
                        or prompts[-1])
    monkeypatch.setattr(Online, "run", run)
    assert main(KV_BUDGET + ["--kv-dtype", "int8", "--runs", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [kv for kv, _ in timed] == ["float32", "int8"] * 3
    auto, quant = res["systems"]["auto"], res["systems"]["quantized"]
    new = res["workload"]["requests"] * res["workload"]["new_tokens"]
    assert auto["runs"]["tokens_per_s"] == pytest.approx([new, new / 2, new / 4])
    assert auto["tokens_per_s"] == pytest.approx(new / 2)
    assert res["ratio_runs"]["tokens_per_s_quantized_over_auto"] == pytest.approx([1 / 3, 2, 4])
    assert res["ratios"]["tokens_per_s_quantized_over_auto"] == pytest.approx(2)  # medians': 1
    assert len(res["ratio_runs"]["peak_running_quantized_over_auto"]) == 3
    res["targets_judged"] = True
    print_kv_budget_result(res)
    out = capsys.readouterr().out
    assert "quantized / auto tokens/s: 0.33, 2.00, 4.00 (median 2.00)" in out
    assert "tokens/s 2.00" in out and "(median of 3 runs)" in out and "PASS higher tokens/s" in out
