"""The Engine's host tier: preempted requests are parked in host memory and restored instead of
recomputed; the tokens are those of the recomputing engine (and of transformers), with fewer
forward tokens; a full tier falls back to recomputing."""

from __future__ import annotations

import pytest

from conftest import hf_greedy, make_model, make_prompts

import kvcache
from kvcache.integrations.transformers import Engine

SMALL = dict(backend="reference", max_total_tokens=640, prefill_chunk_size=64, max_batch_size=8)


@pytest.fixture(scope="module")
def llama():
    return make_model("llama", seed=3)


@pytest.fixture(scope="module")
def recompute(llama):
    """The recomputing engine's run of the preempting workload (offload is off by default on
    a CPU cache)."""
    engine = Engine(llama, **SMALL)
    assert engine.host_tier is None
    prompts = make_prompts(seed=13)[:6]
    out = engine.generate(prompts, max_new_tokens=40)
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    return prompts, out, engine.stats


def test_offload_restores_preempted_requests_instead_of_recomputing(llama, recompute):
    prompts, want, plain = recompute
    engine = Engine(llama, offload=True, **SMALL)
    assert isinstance(engine.host_tier, kvcache.HostTier)
    out = engine.generate(prompts, max_new_tokens=40)
    s = engine.stats
    assert out == want
    assert [o[0] for o in out[:2]] == [hf_greedy(llama, p, 40) for p in prompts[:2]]
    assert s.preemptions > 0 and s.offloaded_tokens > 0 and s.recompute_tokens_saved > 0
    assert s.recomputed_tokens < plain.recomputed_tokens
    assert s.forward_tokens < plain.forward_tokens
    assert s.forward_tokens + s.recompute_tokens_saved >= plain.forward_tokens - plain.recomputed_tokens
    assert engine.cache.is_empty and len(engine.host_tier) == 0


def test_parked_samples_come_back_onto_their_shared_prefix(llama):
    """Prompts 1 and 7 share a 120-token prefix sequence; two samples each: a preempted
    sample is restored onto the prefix while that is still in the cache."""
    prompts = [make_prompts(seed=13)[i] for i in (1, 7, 2)]
    kw = dict(backend="reference", max_total_tokens=480, prefill_chunk_size=64, max_batch_size=8)
    args = dict(max_new_tokens=16, n=2, temperature=1.0, seed=5)
    plain = Engine(llama, offload=False, **kw)
    want = plain.generate(prompts, **args)
    engine = Engine(llama, offload=True, **kw)
    shared = []
    restore = engine.host_tier.restore

    def counting(seq_id, **options):
        shared.append(options.get("parent_id") is not None)
        return restore(seq_id, **options)

    engine.host_tier.restore = counting
    assert engine.generate(prompts, **args) == want
    assert plain.stats.preemptions > 0 and plain.stats.recomputed_tokens > 0
    assert engine.stats.recompute_tokens_saved > 0 and any(shared)
    assert engine.stats.recomputed_tokens == 0
    assert engine.stats.forward_tokens < plain.stats.forward_tokens


def test_a_full_tier_falls_back_to_recomputing(llama, recompute):
    prompts, want, plain = recompute
    engine = Engine(llama, offload=True, offload_tokens=1, **SMALL)
    assert engine.generate(prompts, max_new_tokens=40) == want
    assert engine.stats.offloaded_tokens == 0 and engine.stats.recompute_tokens_saved == 0
    assert engine.stats.recomputed_tokens == plain.recomputed_tokens


def test_offload_must_be_a_bool_or_none(llama):
    with pytest.raises(kvcache.InvalidArgumentError, match="offload='yes' must be None, True or False"):
        Engine(llama, offload="yes", backend="reference")
