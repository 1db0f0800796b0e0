"""Tensor parallelism on the CPU: two processes over gloo (``kvcache.distributed.tp.spawn``),
each holding half of a random-weight Llama's heads, generate what one process generates and
what transformers' own ``generate`` does (shared prefixes, n > 1 forks, preemption, seeded
sampling), on the reference backend and the cuda backend's CPU test mode, with the model split
by transformers' plan (through the Engine, or before it as from_pretrained(tp_plan="auto")
does) and by the integration. Ranks that plan differently fail together, at the
same step; head counts the ranks cannot split are refused."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available in this torch build",
                allow_module_level=True)

import tp_cases  # noqa: E402

import kvcache  # noqa: E402
from kvcache.distributed import tp as dtp  # noqa: E402

WORLD = 2
METHODS = ("transformers", "integration", "preloaded")
LAYOUT = {"transformers": "transformers", "integration": "integration", "preloaded": "transformers"}


# One spawn per backend, 15-20 s each on 2 cores. The tensor-parallel code (head split, plan
# digests, gloo) is the same for every backend, so CI runs the whole scenario set on the cuda
# backend's CPU mode and `make test-all` on the reference backend too; tensor parallelism on the
# reference backend stays in CI through test_the_documented_torchrun_command_runs (--backend
# reference --check: TP=2 tokens equal TP=1) and the `errors` cases. The `errors` cases run in
# the cuda backend's spawn, after its scenarios (tp_cases.greedy_and_errors): a spawn of their
# own cost as much again, nearly all of it the two ranks starting.
_SPAWNS: dict = {}


def _spawn(backend: str) -> list:
    """Both ranks' {"greedy": tp_cases.greedy, "errors": tp_cases.errors} on ``backend`` (one
    spawn per backend in the session; the tests only read the results)."""
    if backend not in _SPAWNS:
        _SPAWNS[backend] = dtp.spawn(tp_cases.greedy_and_errors, WORLD, (backend, METHODS),
                                     timeout_s=600)
    return _SPAWNS[backend]


@pytest.fixture(scope="module", params=[pytest.param("reference", marks=pytest.mark.slow), "cuda"])
def run(request):
    """Both ranks' results of ``tp_cases.greedy`` on one backend."""
    ranks = [r["greedy"] for r in _spawn(request.param)]
    if "skip" in ranks[0]:
        pytest.skip(ranks[0]["skip"])
    return ranks


@pytest.fixture(scope="module")
def errors():
    """Both ranks' results of ``tp_cases.errors`` (backend-independent: they build their own
    reference-backend engines), from the cuda backend's spawn."""
    return [r["errors"] for r in _spawn("cuda")]


def test_tp2_greedy_tokens_equal_tp1_and_transformers(run):
    for rank, res in enumerate(run):
        want = res["hf"]
        assert res["tp1"]["greedy"] == [[w] for w in want]
        for method in METHODS:
            got = res[method]
            assert got["greedy"] == [[w] for w in want], (rank, method)
            # the last prompt started from the whole pages of a prefix shared with the second
            # one, in the prefix cache
            assert got["greedy_stats"] == res["tp1"]["greedy_stats"]
            assert got["greedy_stats"][0] >= got["greedy_stats"][1] > 0
            # n = 3 greedy samples fork from one prefill: all equal the single greedy answer
            assert got["fork"] == [[want[2]] * 3], (rank, method)


def test_whole_step_graphs_run_under_tp_and_every_replay_is_checked(run):
    if "graphs" not in run[0]:
        pytest.skip("graphs are the cuda backend's (static_decode)")
    for rank, res in enumerate(run):
        g = res["graphs"]
        assert g["greedy"] == [[w] for w in res["hf"]], rank
        assert g["graph_forwards"] > 0 and g["checked"] == g["forwards"]
        assert g["overlapped"] > 0 and g["device_picks"] and g["picks_read"]
        name, message = g["mismatch"]
        assert name == "PlanMismatchError" and "step" in message, (rank, message)
        assert g["after"], rank


def test_projection_biases_are_split_and_added_once(run):
    for rank, res in enumerate(run):
        assert res["hf_bias"] != res["hf"]                # the biases change the tokens
        for method in ("transformers", "integration"):
            assert res["bias_" + method] == [[w] for w in res["hf_bias"]], (rank, method)


def test_sampling_is_identical_on_every_rank(run):
    first = run[0]
    for res in run:
        for method in METHODS:
            assert res[method]["sampled"] == first[method]["sampled"]
            assert res[method]["sampled"] == first["tp1"]["sampled"]
    a, b = first["tp1"]["sampled"][0]
    assert a != b, "the two samples should differ"


def test_preemption_under_tp_recomputes_the_same_tokens(run):
    for rank, res in enumerate(run):
        want = [[w] for w in res["hf_preempt"]]
        out, preemptions, recomputed, empty = res["tp1_preempt"]
        assert out == want and preemptions > 0 and recomputed > 0 and empty
        for method in METHODS:
            got = res[method]["preempt"]
            # the same decisions as TP=1 (planning does not depend on the heads), same tokens
            assert got == res["tp1_preempt"], (rank, method)


def test_each_rank_caches_its_share_of_the_kv_heads(run):
    for rank, res in enumerate(run):
        for method in METHODS:
            got = res[method]
            assert got["layout"] == (WORLD, rank, LAYOUT[method], 4 // WORLD, 2 // WORLD)
            assert got["cache_heads"] == (4 // WORLD, 2 // WORLD)
            # get_kv of a 3-token sequence: (layers, tokens, this rank's KV heads, head_dim)
            assert got["kv_shape"] == (2, 3, 2 // WORLD, 32)
            assert got["steps"] > 0                      # the plan check ran every step


def test_deterministic_mode_holds_under_tp(run):
    """``deterministic=True`` on a model split over two ranks: a prompt's tokens and
    log-probabilities are the same bits alone and beside three others in 7-token chunks (without
    the flag they part), on both ranks (each rank's matmuls in row blocks; an all-reduce of two halves adds them in
    one order). Not the same bits as TP=1: the halves are added across ranks (docs/
    determinism.md)."""
    ranks = [res["deterministic"] for res in run]
    for res in ranks:
        assert res["alone"] == res["batched"]
        assert res["plain alone"][1] != res["plain batched"][1]     # without it they part
    assert ranks[0] == ranks[1]


def test_tp_not_dividing_the_heads_is_refused_naming_the_numbers(errors):
    for res in errors:
        kind, msg = res["kv_heads"]
        assert kind == "UnsupportedFeatureError"
        assert "tp=2" in msg and "num_kv_heads=1" in msg and "use tp in [1]" in msg
        kind, msg = res["qo_heads"]
        assert kind == "UnsupportedFeatureError"
        assert "num_kv_heads=3 and num_qo_heads=3" in msg and "use tp in [1, 3]" in msg


def test_a_plan_that_keeps_the_kv_heads_whole_is_refused(errors):
    for res in errors:
        kind, msg = res["phi3"]
        assert kind == "UnsupportedFeatureError"
        assert "phi3" in msg and "does not split the KV heads" in msg


def test_tp_must_be_the_group_size(errors):
    for res in errors:
        kind, msg = res["tp_size"]
        assert kind == "InvalidArgumentError" and "tp=4" in msg and "2 ranks" in msg


def test_ranks_that_plan_differently_fail_together_at_the_same_step(errors):
    r0, r1 = errors
    # a prompt token differs on rank 1 (in a later chunk): both ranks name the same step
    for key in ("prompt", "hook"):
        (k0, m0), (k1, m1) = r0[key], r1[key]
        assert k0 == k1 == "PlanMismatchError", key
        step = m0.split(":")[0]
        assert step.startswith("step ") and m1.startswith(step + ":"), (m0, m1)
        assert "ranks [0]: digest" in m0 and "ranks [1]: digest" in m0
        assert "rank 1 planned sequences" in m1
    assert r0["prompt"][1].split(":")[0] != "step 0"      # found where the token was run
    assert r0["hook"][1].startswith("step 2 of generate:")             # the step the hook changed
    # rank 1 wants one more token: rank 0 finishes while rank 1 plans another step
    (k0, m0), (k1, m1) = r0["max_new"], r1["max_new"]
    assert k0 == k1 == "PlanMismatchError"
    assert m0.startswith("the end of generate") and "ranks [0]: finished generate" in m0
    assert m1.startswith("step ") and "ranks [0]: finished generate" in m1
    # engines built differently are refused when built
    for res in errors:
        kind, msg = res["config"]
        assert kind == "PlanMismatchError" and msg.startswith("building the engine")
    # after each failure the engines are empty and work again
    for res in errors:
        assert res["prompt_empty"] and res["after_prompt"]
        assert res["after_max_new"] and res["after_hook"]


def test_tp_needs_torch_distributed_initialised():
    from kvcache.integrations.transformers import Engine
    assert not torch.distributed.is_initialized()
    with pytest.raises(kvcache.InvalidArgumentError, match=r"kvcache.distributed.tp.init\(\)"):
        Engine(tp_cases.make_model(), backend="reference", tp=2)


def test_local_heads():
    assert dtp.local_heads(32, 8, 4) == (8, 2)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="tp=3 does not divide num_kv_heads=8"):
        dtp.local_heads(24, 8, 3)
    with pytest.raises(kvcache.InvalidArgumentError, match="tp=0"):
        dtp.local_heads(4, 2, 0)


def test_plan_digest_follows_the_plan():
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_total_tokens=64, rope_mode="none")

    def digest(lengths, fork=False, extra=()):
        cache = kvcache.PagedKVCache(cfg, backend="reference")
        cache.add_sequence(0)
        with cache.forward([0], [5]):
            x = cache.from_numpy(np.zeros((5, 1, 8)))
            cache.attention(0, cache.from_numpy(np.zeros((5, 2, 8))), x, x)
        ids = [0]
        if fork:
            cache.fork_sequence(0, 1, 3)
            ids = [1]
        cache.begin_forward(ids, lengths)
        try:
            return dtp.plan_digest(cache.open_plan, *extra)
        finally:
            cache.abort_forward()

    base = digest([2])
    assert digest([2]) == base                           # the same plan, the same digest
    assert digest([3]) != base                           # another length
    assert digest([2], fork=True) != base                # another sequence / page table
    assert digest([2], extra=(np.array([1, 2]),)) != digest([2], extra=(np.array([1, 3]),))


def test_spawn_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match=r"rank 1 failed:(.|\n)*ValueError: rank 1 fails"):
        dtp.spawn(tp_cases.fail_on, WORLD, (1,), timeout_s=120)


# background_runs.py: the torchrun command starts when collection ends and runs beside the session
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

background_runs.register(
    "test_the_documented_torchrun_command_runs",
    [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
     "-m", "kvcache.integrations.tp", "--backend", "reference", "--check"],
    dict(os.environ), timeout=300)


def test_the_documented_torchrun_command_runs():
    """docs/distributed.md's command: torchrun, init() from its environment, the Engine split
    over 2 ranks, rank 0 comparing with the whole model."""
    # the command (registered above) started when collection ended, on the second core
    proc = background_runs.result("test_the_documented_torchrun_command_runs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each rank caches 2 of 4 KV heads" in proc.stdout
    assert "tokens identical to TP=1: yes" in proc.stdout
