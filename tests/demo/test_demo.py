"""``kvcache demo``: the synthetic workload through the one engine core (``Engine`` with the toy
adapter), its online API (arrivals over time, streamed outputs), preemption in the tight cache,
the replay check (it passes, and a planted wrong attention output or token makes it fail),
determinism, the CLI, the table, ``--json`` and the plot. Small workloads on the reference
backend."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kvcache.cli import main as cli_main
from kvcache.demo import build_parser, main, resolve, run_demo
from kvcache.demo.check import replay_toy
from kvcache.demo.model import ToyAdapter

# a small workload that still covers every kind of request (5 forced kinds + a burst of 2)
SMALL = ["--quiet", "--backend", "reference", "--requests", "12", "--long-prompt", "400",
         "--max-output", "10", "--max-total-tokens", "448", "--check-requests", "0"]


def opts(*extra):
    return build_parser().parse_args(SMALL + list(extra))


@pytest.fixture(scope="module")
def small():
    return run_demo(opts())


def test_every_feature_runs_and_the_check_passes(small):
    r = small
    assert r.mode == "synthetic" and r.backend == "reference" and r.dtype == "float32"
    assert all(v > 0 for v in r.workload.features().values()), r.workload.features()
    assert len(r.served.traces) == 12
    for req in r.workload.requests:         # every sample got exactly its tokens
        tr = r.served.traces[req.rid]
        assert [len(t) for t in tr.tokens] == [req.max_tokens] * req.n
        assert tr.reasons == ["length"] * req.n and tr.finished_step is not None
    # the check replayed every request (--check-requests 0): identical greedy tokens, and the
    # run's log-probabilities equal to the replay's up to float32 rounding of the attention
    assert r.check.ok, r.check.failures
    assert r.check.requests == 12 and r.check.samples == sum(q.n for q in r.workload.requests)
    assert r.check.near_ties == 0 and r.check.max_err < 1e-5
    s = r.stats
    assert s.forwards > 0 and s.forks > 0 and s.shared_prefix_tokens > 0 and s.preemptions > 0
    assert r.engine.cache.is_empty and not r.engine.has_unfinished()


def test_requests_are_added_while_others_decode(small):
    traces = list(small.served.traces.values())
    # some request was added after another had its first token and before that one finished
    pairs = [(a.rid, b.rid) for a in traces for b in traces
             if a.first_step is not None and a.first_step < b.added_step < a.finished_step]
    assert pairs
    assert small.served.interleaved > 0
    assert len({tr.added_step for tr in traces}) > 3       # arrivals spread over steps


def test_the_default_tight_cache_preempts():
    # default capacity (3072 tokens) and sizes: the burst (4 requests, each 4 samples x 120-160
    # tokens after a 190-375-token document) outgrows it; preempted sequences are parked in the
    # engine's host tier and restored (recomputation: test_the_same_seed_gives_the_same_run)
    r = run_demo(build_parser().parse_args(
        ["--quiet", "--backend", "reference", "--requests", "16", "--check-requests", "2"]))
    s = r.stats
    assert s.preemptions > 0 and s.offloaded_tokens > 0 and s.recompute_tokens_saved > 0, s
    assert r.served.peak_pages == r.engine.cache.num_total_pages
    assert r.check.ok, r.check.failures
    assert all(tr.finished_step is not None for tr in r.served.traces.values())


def test_a_planted_wrong_attention_output_fails_the_check():
    planted = {}

    def tamper(layer, out, tokens, positions):
        if layer == 1 and not planted and len(tokens) > 1 and positions.max() > 40:
            planted["forward"] = True
            out = out.copy()
            out += 0.25                     # every token of this forward, one layer
        return out

    r = run_demo(opts(), tamper=tamper)
    assert planted
    assert r.check.ok is False and r.check.failed >= 1
    assert any("log-probability" in f or "argmax" in f for f in r.check.failures)
    assert all(f.startswith("request ") for f in r.check.failures)


def test_a_planted_wrong_token_fails_the_check(small):
    greedy = next(q for q in small.workload.requests if not q.sampled and q.max_tokens > 3)
    trace = small.served.traces[greedy.rid]
    saved = list(trace.tokens[0])
    try:
        trace.tokens[0][2] = (trace.tokens[0][2] + 1) % small.workload.vocab
        adapter = ToyAdapter("tiny", 0, "float32")
        check = replay_toy(adapter, small.workload, small.served, [greedy.rid], "float32")
    finally:
        trace.tokens[0][:] = saved
    assert not check.ok
    assert f"request {greedy.rid}" in check.failures[0] and "new token 2" in check.failures[0]


def test_the_cli_exits_1_on_a_check_failure(capsys):
    def tamper(layer, out, tokens, positions):
        return out * 0.5 if layer == 0 else out

    assert main(SMALL, tamper=tamper) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "check failed: request" in captured.out
    assert "the check FAILED" in captured.err


def test_a_request_larger_than_the_cache_is_refused_before_the_run(capsys):
    assert cli_main(["demo"] + SMALL + ["--max-total-tokens", "128", "--no-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvcache demo: error: request ") and len(err.splitlines()) == 1
    assert "more than the whole cache holds" in err and "--max-total-tokens to at least" in err


def test_the_same_seed_gives_the_same_run():
    def run(seed):
        r = run_demo(opts("--seed", str(seed), "--no-check", "--requests", "8", "--no-offload"))
        assert r.stats.preemptions > 0 and r.stats.recomputed_tokens > 0
        assert r.stats.offloaded_tokens == 0
        tokens = {rid: tr.tokens for rid, tr in r.served.traces.items()}
        steps = [(h.running, h.waiting, h.pages_used, h.preemptions) for h in r.served.history]
        return tokens, steps

    a, b, c = run(0), run(0), run(2)
    assert a == b
    assert a[0] != c[0]


def test_the_synthetic_demo_needs_no_torch(small):
    assert small.distinct() and all(d == 3 for d in small.distinct())   # samples are drawn
    # the toy adapter, the engine, the sampler (host logits) and the check never import torch
    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvcache.demo import main\n"
            "sys.exit(main(['--quiet', '--backend', 'reference', '--requests', '8', "
            "'--long-prompt', '200', '--max-output', '6', '--max-total-tokens', '512', "
            "'--check-requests', '0']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "drawn at temperature 0.8" in out.stdout and "PASSED" in out.stdout


def test_the_model_defaults_to_llama_on_a_cuda_gpu(monkeypatch):
    import kvcache.demo as demo
    monkeypatch.setattr(demo, "_gpu_model_default", lambda backend, device: True)
    o = resolve(build_parser().parse_args([]))
    assert o.model == "llama" and o.mode == "model" and o.max_total_tokens == 1536
    o = resolve(build_parser().parse_args(["--model", "synthetic", "--scale", "2"]))
    assert o.mode == "synthetic" and o.max_total_tokens == 6144 and o.requests == 96
    monkeypatch.setattr(demo, "_gpu_model_default", lambda backend, device: False)
    assert resolve(build_parser().parse_args([])).model == "synthetic"
    # without a GPU (this machine's cuda backend runs on the CPU at most) it stays synthetic
    monkeypatch.undo()
    assert not demo._gpu_model_default("reference", None)


def test_the_table_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "demo.png"
    args = SMALL + ["--requests", "8", "--check-requests", "2"]
    assert main(args + ["--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for row in ("model:", "requests:", "new tokens:", "time to first token:", "forwards:",
                "shared pages:", "preemptions:", "pages:", "check:", "PASSED", "reference"):
        assert row in out, row
    assert not set("│┃━─┏") & set(out)         # capsys is no terminal: plain lines
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "synthetic" and data["check_ok"] is True and data["finished"] == 8
    assert data["stats"]["forwards"] > 0 and "preemptions" in data["stats"]
    assert data["check"]["near_ties"] == 0 and np.isfinite(data["tokens_per_s"])


def test_a_real_model_runs_online_with_plot_and_quiet(tmp_path, capsys):
    pytest.importorskip("transformers")
    png = tmp_path / "llama.png"
    argv = ["--model", "llama", "--backend", "reference", "--requests", "8", "--max-output", "12",
            "--long-prompt", "300", "--max-total-tokens", "512", "--max-batch-size", "6",
            "--prefill-chunk-size", "128", "--check-requests", "3", "--samples", "2", "--quiet",
            "--plot", str(png)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "llama, random weights" in out and "replayed alone on transformers" in out
    assert "PASSED" in out and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_judge_greedy_accepts_argmax_and_near_ties_and_names_the_first_real_miss():
    from kvcache.demo.check import TOLERANCES, judge_greedy
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 50)) * 4
    best = logits.argmax(axis=1).tolist()
    assert judge_greedy(best, logits, "bfloat16") == (0, None)
    tied = list(best)
    second = int(np.argsort(logits[2])[-2])
    logits[2, second] = logits[2, best[2]] - TOLERANCES["bfloat16"]     # within 2 * tol
    tied[2] = second
    assert judge_greedy(tied, logits, "bfloat16") == (1, None)
    assert judge_greedy(tied, logits, "float32")[1] is not None        # float32's margin is 2e-3
    far = list(best)
    far[4] = int(np.argmin(logits[4]))
    ties, problem = judge_greedy(far, logits, "bfloat16")
    assert ties == 0 and problem.startswith(f"new token 4 is {far[4]}, the re-score's argmax is {best[4]}")


def test_check_greedy_counts_identical_near_tie_and_failed_requests_against_generate():
    # the GPU family checks' loop (tools/gpu_*_check.py), on the CPU with a tiny random Llama
    transformers = pytest.importorskip("transformers")
    import torch
    from kvcache.demo.check import check_greedy, greedy_generate, teacher_forced_logits
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = [[3, 9, 27, 17], [5, 1, 44]]
    new = 4
    want = [greedy_generate(model, p, new) for p in prompts]
    assert all(len(w) == new for w in want)
    # the second request's last token another: one within bfloat16's near-tie margin (0.5
    # logits) but beyond float32's (2e-3), as the cache's bfloat16 state may part it
    last = teacher_forced_logits(model, prompts[1], want[1])[-1]
    gaps = last.max() - last
    near = [int(t) for t in np.flatnonzero((gaps > 0.01) & (gaps < 0.4))]
    assert near, "the tiny model has no near-tie token: choose another seed"
    parted = [want[0], want[1][:-1] + [near[0]]]
    said: list = []
    res = check_greedy(model, prompts, parted, new, "bfloat16", say=said.append)
    assert (res.requests, res.same, res.parted, res.ties, res.failed) == (2, 1, 1, 1, 0)
    assert not said and res.parted_text().startswith(", 1 parted at near-ties only (1 tokens")
    # float32's margin: the same tokens fail the re-score, named
    res = check_greedy(model, prompts, parted, new, "float32", control=True, say=said.append)
    assert (res.same, res.parted, res.failed) == (1, 0, 1) and res.parted_text() == ""
    assert res.own_failed == 0 and res.own_failed_of_failed == 0       # generate's own pass
    assert len(said) == 1 and said[0].startswith("  float32: a request's tokens fail the "
                                                 "re-score: new token 3 is")
    assert said[0].endswith("transformers' own generate on it: passes")
    # strict: any difference fails, without a re-score
    said.clear()
    res = check_greedy(model, prompts, parted, new, "float32", strict=True, say=said.append)
    assert (res.same, res.parted, res.failed) == (1, 0, 1)
    assert said == [f"  float32: a request's tokens differ from generate's: {parted[1]} vs "
                    f"{want[1]}"]
    # identical tokens pass in every mode
    res = check_greedy(model, prompts, want, new, "float32", strict=True, say=said.append)
    assert (res.same, res.failed) == (2, 0)
