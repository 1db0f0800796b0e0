"""Captured mixed steps in the Engine (``mixed_graphs=True``, ``CacheConfig.static_mixed``), on the
cuda backend's CPU test mode (a capture re-runs the step on the graph's static buffers): steps
that prefill go through their token bucket's graph too, one capture per bucket, and the tokens
are transformers' own greedy ones and the eager engine's, with the prefix cache on and off and
under preemption; a warm prefix gives the cold run's logits bit for bit; the switch and its
refusal."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import backend_or_skip, family_case, hf_greedy, make_model, make_prompts
from engine_cases import logit_rows
from test_engine_graphs import spy

from kvcache.errors import UnsupportedFeatureError
from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_mixed_steps_replay_their_token_bucket(prefix_cache, monkeypatch):
    model, prompts, greedy, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    new = 12
    kw = dict(backend=backend, device=device, graphs=True, max_batch_size=8,
              max_total_tokens=8192, prefill_chunk_size=64, prefix_cache=prefix_cache)
    on = Engine(model, mixed_graphs=True, **kw)
    off = Engine(model, mixed_graphs=False, **kw)
    assert on.cache.config.static_mixed and not off.cache.config.static_mixed
    log = spy(on)
    got, lp_on = on.generate(prompts, max_new_tokens=new, return_logprobs=True)
    want, lp_off = off.generate(prompts, max_new_tokens=new, return_logprobs=True)
    assert [g[0] for g in got] == [g[:new] for g in greedy]          # transformers' own greedy
    assert got == want
    np.testing.assert_allclose(np.array(lp_on, dtype=float), np.array(lp_off, dtype=float),
                               rtol=1e-4, atol=1e-4)
    assert all(e[0] == "graph" for e in log), f"eager forwards ran: {[e for e in log if e[0] != 'graph']}"
    mixed = [e for e in log if e[1] > e[2]]          # more tokens than sequences: a prompt chunk
    assert mixed and any(seqs > 1 for _, _, seqs, _ in mixed), "no mixed step ran"
    assert all(tokens <= bucket and bucket in on.cache.config.static_mixed_buckets
               for _, tokens, _, bucket in mixed)
    kinds = {(tokens > seqs, bucket) for _, tokens, seqs, bucket in log}
    assert on.stats.graph_captures == len(kinds) < len(log)          # one capture per bucket
    assert on.stats.graph_forwards == len(log) == on.stats.forwards
    # a mixed bucket's static logits hold at most max_batch_size rows, not one per token
    big = [slot for (mixed, bucket), slot in on.decode_graphs.buckets.items() if bucket > 8]
    assert big and all(slot.logits.shape[0] <= 8 for slot in big)


def test_mixed_graphs_survive_preemption_and_reuse(monkeypatch):
    model = make_model("llama", seed=3)
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    prompts = make_prompts(seed=13)[:6]
    new = 24
    want = [hf_greedy(model, p, new) for p in prompts]
    on = Engine(model, backend=backend, device=device, graphs=True, mixed_graphs=True,
                max_total_tokens=640, prefill_chunk_size=64, max_batch_size=8)
    out = on.generate(prompts, max_new_tokens=new)
    assert on.stats.preemptions > 0
    assert [o[0] for o in out] == want
    assert on.generate(prompts[:2], max_new_tokens=8) == [[w[:8]] for w in want[:2]]
    # every step of both calls replayed a graph; each (kind, bucket) was captured once
    assert on.stats.graph_forwards == on.stats.forwards
    assert on.stats.graph_captures == len(on.decode_graphs.buckets) < on.stats.forwards


def test_mixed_graph_switch(monkeypatch):
    model, _, _, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    with pytest.raises(UnsupportedFeatureError, match="mixed_graphs=True"):
        Engine(model, backend=backend, device=device, graphs=False, mixed_graphs=True,
               max_total_tokens=1024)
    eng = Engine(model, backend=backend, device=device, graphs=True, mixed_graphs=None,
                 max_total_tokens=1024)
    assert eng.mixed_graphs and eng.cache.config.static_mixed


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit(monkeypatch):
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary) with every step captured: the warm request's first step (its question over the
    cached system prompt) is the same padded one-pass plan as the cold run's second chunk."""
    model = make_model("llama", seed=5)
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    page = 16
    rng = np.random.default_rng(3)
    vocab = model.config.vocab_size
    system = rng.integers(1, vocab, 2 * page).tolist()
    question, other = rng.integers(1, vocab, 7).tolist(), rng.integers(1, vocab, 9).tolist()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    def engine():
        return Engine(model, backend=backend, device=device, graphs=True, mixed_graphs=True,
                      page_size=page, max_total_tokens=1024, prefill_chunk_size=2 * page,
                      overlap=False)

    cold = engine()
    cold_rows = logit_rows(cold)
    want = cold.generate([system + question], greedy)
    warm = engine()
    warm.generate([system + other], greedy)
    warm_rows = logit_rows(warm)
    got = warm.generate([system + question], greedy)
    assert warm.stats.prefix_hit_tokens == 2 * page and cold.stats.prefix_hit_tokens == 0
    assert got == want
    assert len(warm_rows) == len(cold_rows) == 6
    assert warm.stats.graph_forwards == warm.stats.forwards
    for step, (a, b) in enumerate(zip(cold_rows, warm_rows)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"
