"""``Engine.warm_up()``: every kind of step the engine's whole-step graphs hold runs once before
serving (on the cuda backend's CPU test mode, where a capture re-runs the step on the graph's
static buffers), so a workload served afterwards captures nothing, gives the tokens of an engine
that was not warmed up (transformers' own greedy ones), and finds the cache as it was: every page
free, no prefix-cache entry, the engine's counters at zero. Refused while requests run; a kind
of step the free pages cannot hold is skipped and named, not an error."""

from __future__ import annotations

import pytest

from conftest import backend_or_skip, family_case

from kvcache.errors import InvalidArgumentError
from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine
from kvcache.serving import EngineStats


def _engine(model, monkeypatch, **kw):
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    opts = dict(backend=backend, device=device, graphs=True, mixed_graphs=True, max_batch_size=4,
                max_total_tokens=2048, prefill_chunk_size=64)
    return Engine(model, **{**opts, **kw})


def _serve(engine, prompts, new):
    """Greedy requests and, on the first prompt, two sampled samples (forked: steps over a
    shared prefix), through the online API; the tokens of every sample."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=new)) for p in prompts]
    ids.append(engine.add_request(prompts[0], SamplingParams(max_tokens=new, n=2,
                                                             temperature=0.9, seed=5)))
    got: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return [got[(i, k)] for i in ids for k in range(2) if (i, k) in got]


def test_warm_up_captures_every_kind_of_step_before_serving(monkeypatch):
    model, prompts, greedy, _ = family_case("llama")
    new = 10
    warm = _engine(model, monkeypatch, offload=True)
    free = warm.cache.num_available_pages
    result = warm.warm_up()
    cfg = warm.cache.config
    kinds = set(warm.decode_graphs.buckets)
    want = ({((False, 1), b) for b in cfg.static_buckets}
            | {((True, depths), t) for t in cfg.static_mixed_buckets for depths in (1, 2)})
    assert kinds == want, sorted(want - kinds)
    assert result.captures == len(want) and not result.skipped
    assert ("host tier", 32) in result.steps and len(warm.host_tier) == 0
    assert ("fork", 24) in result.steps
    assert result.forwards >= len(want) and result.seconds > 0
    # nothing left behind: pages, sequences, prefix-cache entries, counters
    assert warm.cache.num_available_pages == free and warm.stats == EngineStats()
    assert not warm.has_unfinished()
    cold = _engine(model, monkeypatch)
    got, want_tokens = _serve(warm, prompts, new), _serve(cold, prompts, new)
    assert got == want_tokens
    assert got[:len(prompts)] == [g[:new] for g in greedy]           # transformers' own greedy
    assert warm.stats.graph_captures == 0 < cold.stats.graph_captures
    assert warm.stats.graph_forwards == warm.stats.forwards
    assert warm.stats.prefix_hit_tokens == cold.stats.prefix_hit_tokens   # no zeros cached


def test_warm_up_is_refused_while_requests_run_and_skips_what_does_not_fit(monkeypatch):
    model, prompts, _, _ = family_case("llama")
    eng = _engine(model, monkeypatch)
    eng.add_request(prompts[0], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidArgumentError, match="unfinished requests"):
        eng.warm_up()
    assert eng.stats.forwards == 0 and not eng.decode_graphs.buckets      # nothing ran
    while eng.has_unfinished():
        eng.step()
    small = _engine(model, monkeypatch, max_total_tokens=80, prefill_chunk_size=64)
    free = small.cache.num_available_pages
    result = small.warm_up()
    # 80 tokens (5 pages of 16, one kept spare): a prompt of 4 pages and two forks' own pages,
    # or 64 new tokens, do not fit beside each other; those steps are named, the rest ran
    assert result.skipped and result.steps
    assert ("decode", 1) in result.steps and ("shared prefix", 64) in result.skipped
    assert small.cache.num_available_pages == free and small.stats == EngineStats()


@pytest.mark.parametrize("graphs", [True, False])
def test_warm_up_with_chunks_smaller_than_its_steps(monkeypatch, graphs):
    """A ``prefill_chunk_size`` below the warm-up's own prompts (a fork inside the second page,
    a prompt of four pages): they prefill in chunks of it (the old warm-up's first forward
    longer than a chunk was refused with InvalidArgumentError)."""
    model, prompts, _, _ = family_case("llama")
    eng = _engine(model, monkeypatch, graphs=graphs, mixed_graphs=graphs, page_size=16,
                  prefill_chunk_size=16)
    result = eng.warm_up()
    assert ("fork", 24) in result.steps and not result.skipped
    if graphs:
        assert ("shared prefix", 16) in result.steps
    assert eng.stats == EngineStats() and eng.cache.num_available_pages == \
        eng.cache.num_total_pages


def test_warm_up_waits_for_the_fp8_scales(monkeypatch):
    """fp8 pages without scales: the warm-up's dummy tokens must not calibrate them (and a
    captured step cannot), so it is refused, naming the fix; after a first request calibrated
    them it runs (the old warm-up died in its first captured decode step)."""
    model, prompts, _, _ = family_case("llama")
    eng = _engine(model, monkeypatch, kv_dtype="float8_e4m3")
    with pytest.raises(InvalidArgumentError, match="fp8 scales .* not calibrated"):
        eng.warm_up()
    assert eng.stats == EngineStats()
    eng.generate(prompts[:1], max_new_tokens=2)
    assert eng.warm_up().steps
