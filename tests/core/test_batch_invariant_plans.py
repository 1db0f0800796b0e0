"""``CacheConfig(batch_invariant=True)``: the plans behind the bit-identical outputs that the
conformance class ``TestBatchInvariance`` checks. Every prompt chunk is one paged pass over its
sequence's whole page list (no ragged pass, no merge), a decode batch of forks reads each
sequence as one entry (no shared-prefix depth, which the same batch gets without the flag), a
static-shape cache pads the one pass to its token bucket, and token trees are refused with
nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache.errors import UnsupportedFeatureError


def _cache(**kw):
    cfg = dict(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
               max_batch_size=8, max_total_tokens=256, prefill_chunk_size=64, dtype="float32",
               rope_mode="none")
    cfg.update(kw)
    return kvcache.PagedKVCache(kvcache.CacheConfig(**cfg), backend="reference")


def _prefill(cache, sid, n):
    c = cache.config
    rng = np.random.default_rng(n)
    with cache.forward([sid], [n]):
        cache.attention(0, *(rng.standard_normal((n, h, c.head_dim)).astype(np.float32)
                             for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)))


def _plan(cache, sids, lens):
    plan = cache.planner.begin(sids, lens)
    cache.planner.rollback(plan.undo)
    return plan


@pytest.mark.parametrize("invariant", [False, True])
def test_chunks_and_forked_decode_batches(invariant):
    c = _cache(batch_invariant=invariant)
    c.add_sequence(0)
    _prefill(c, 0, 10)
    chunk = _plan(c, [0], [6])                       # a second chunk over a history
    assert chunk.paged_only == invariant and len(chunk.depths) == 1
    for sid in (1, 2, 3):
        c.fork_sequence(0, sid)
    decode = _plan(c, [0, 1, 2, 3], [1, 1, 1, 1])    # four sequences over one shared prefix
    # without the flag the shared pages are read once (a depth of their own); with it, each
    # sequence is one entry over its whole page list
    assert len(decode.depths) == (1 if invariant else 2)
    assert decode.depths[-1].num_entries == 4


def test_static_mixed_pads_the_one_pass():
    """A static-shape cache (a backend with graphs; the planner alone here) pads the one pass
    to its token bucket, so such steps are captured too."""
    import dataclasses

    from kvcache.core.planner import Planner
    from kvcache.core.state import CacheState
    from kvcache.reference import ReferenceBackend
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                              page_size=4, max_batch_size=8, max_total_tokens=256,
                              prefill_chunk_size=64, dtype="float32", rope_mode="none",
                              static_decode=True, static_mixed=True, batch_invariant=True)
    caps = dataclasses.replace(ReferenceBackend.capabilities, static_decode=True)
    planner = Planner(CacheState(cfg.num_pages, cfg.page_size, False), cfg, caps)
    planner.static_mixed = True           # (the cache sets it once its fp8 scales, if any, are set)
    for sid in (0, 1):
        planner.state.add_sequence(sid)
    plan = planner.begin([0, 1], [5, 3])
    assert plan.paged_only and plan.static_mixed and plan.static_bucket == 16
    assert len(plan.depths) == 1


def test_token_trees_are_refused_and_nothing_changes():
    c = _cache(batch_invariant=True)
    c.add_sequence(0)
    free = c.num_available_pages
    with pytest.raises(UnsupportedFeatureError, match="batch_invariant=True"):
        c.begin_forward([0], [3], [-1, 0, 0])
    assert c.sequence_length(0) == 0 and c.num_available_pages == free
