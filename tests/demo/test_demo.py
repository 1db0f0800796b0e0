"""``kvcache demo``: the scheduler's preemption path, the replay check (a planted wrong output
must be reported), determinism, the CLI and the plot. Small workloads on the reference backend."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache.demo import build_parser, main, run_demo
from kvcache.demo.engine import Engine

# a small workload that still covers every feature (9 forced kinds + a burst of 4)
SMALL = ["--quiet", "--backend", "reference", "--requests", "16", "--max-prompt", "480",
         "--max-output", "10", "--check-requests", "0"]


def opts(*extra):
    return build_parser().parse_args(SMALL + list(extra))


def test_every_feature_runs_and_the_check_passes():
    result = run_demo(opts("--max-total-tokens", "4096"))
    assert result.backend == "reference"
    features = {f.split(" (")[0] for r in result.workload.requests for f in r.features}
    assert {"shared prefix", "parallel samples", "speculative", "sliding window"} <= features
    assert all(e.done for e in result.engines)
    assert sum(len(e.finished) for e in result.engines) == 16
    assert result.check_ok is True
    # every request was replayed (--check-requests 0)
    assert sum(c.requests for c in result.checks) == 16
    assert all(c.max_err < 1e-4 for c in result.checks)


def test_a_tiny_cache_preempts_and_every_request_finishes(monkeypatch):
    raised = []
    real = kvcache.PagedKVCache.begin_forward

    def spy(self, *args, **kwargs):
        try:
            return real(self, *args, **kwargs)
        except kvcache.CacheFullError as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(kvcache.PagedKVCache, "begin_forward", spy)
    # the burst's long generations (2 samples x 120-160 tokens each) outgrow a 48-page cache
    result = run_demo(opts("--max-output", "40", "--max-total-tokens", "768",
                           "--window-max-total-tokens", "512", "--max-batch-size", "12"))
    main_engine = result.engines[0]
    assert raised, "the tiny cache never raised CacheFullError"
    assert main_engine.preemptions > 0
    assert all(e.done for e in result.engines)
    finished = sorted(r.rid for e in result.engines for r in e.finished)
    assert finished == list(range(16)), "a request was lost"
    # each sequence generated exactly its output length, and the preempted requests' final runs
    # were replayed and matched the reference
    assert main_engine.preempted_rids <= set(main_engine.logs)
    assert result.check_ok is True
    assert main_engine.cache.num_sequences == 0 and main_engine.cache.is_empty


def test_the_youngest_running_request_is_preempted(monkeypatch):
    victims = []
    real = Engine._preempt_youngest

    def spy(self, why):
        orders = {id(r): r.order for r in self.running}
        youngest = max(orders.values())
        victim = real(self, why)
        victims.append((orders[id(victim)], youngest))
        return victim

    monkeypatch.setattr(Engine, "_preempt_youngest", spy)
    run_demo(opts("--max-output", "40", "--max-total-tokens", "640", "--max-batch-size", "12",
                  "--no-check"))
    assert victims
    assert all(order == youngest for order, youngest in victims)


def test_a_planted_wrong_output_is_reported():
    planted = {}

    def tamper(engine, layer, entries, out):
        if engine.name == "main" and layer == 1 and len(engine.history) == 6 and not planted:
            out = out.copy()
            out[0, 0, 0] += 0.05
            planted["sid"] = entries[0][0].sid
        return out

    result = run_demo(opts("--max-total-tokens", "4096"), tamper=tamper)
    assert planted
    assert result.check_ok is False
    main_check = result.checks[0]
    assert len(main_check.failures) == 1
    message = main_check.failures[0]
    rid = planted["sid"] // 8
    assert f"request {rid}" in message and "layer 1" in message and "reference" in message
    assert result.checks[1].ok                  # the sliding-window cache was not touched


def test_the_cli_exits_non_zero_on_a_check_failure(capsys):
    def tamper(engine, layer, entries, out):
        if engine.name == "sliding window" and layer == 0 and len(engine.history) == 3:
            out = out.copy()
            out[-1] = 0.0
        return out

    rc = main(SMALL + ["--max-total-tokens", "4096"], tamper=tamper)
    captured = capsys.readouterr()
    assert rc == 1
    assert "FAILED" in captured.out and "check failed" in captured.out
    assert "FAILED" in captured.err


def test_the_cli_reports_a_request_larger_than_the_cache(capsys):
    rc = main(SMALL + ["--max-total-tokens", "128", "--no-check"])
    assert rc == 2
    assert "needs more pages than the cache holds" in capsys.readouterr().err


def test_the_same_seed_gives_the_same_run():
    def run(seed):
        result = run_demo(opts("--seed", str(seed), "--max-total-tokens", "1024"))
        stats = [(h.batch, h.tokens, h.pages_used, h.preemptions) for e in result.engines for h in e.history]
        outs = {(e.name, rid): np.concatenate([np.asarray(o, np.float32).ravel() for f in log.outputs for o in f])
                for e in result.engines for rid, log in e.logs.items()}
        return stats, outs

    a_stats, a_outs = run(7)
    b_stats, b_outs = run(7)
    assert a_stats == b_stats
    assert a_outs.keys() == b_outs.keys()
    for key in a_outs:
        np.testing.assert_array_equal(a_outs[key], b_outs[key])
    c_stats, _ = run(8)
    assert c_stats != a_stats


def test_the_table_and_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    pytest.importorskip("rich")
    png = tmp_path / "demo.png"
    rc = main(SMALL + ["--requests", "13", "--plot", str(png), "--check-requests", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    for row in ("requests", "tokens prefilled", "tokens decoded", "tokens/s", "peak pages used",
                "preemptions", "begin_forward host time", "check", "PASSED", "reference"):
        assert row in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
