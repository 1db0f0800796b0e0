"""Steady-state decode allocates no numpy arrays: a repeated decode step of the same batch
writes its plan into buffers reused across steps (two alternating sets, grown only)."""

import tracemalloc

import numpy as np
import pytest

import kvcache
from kvcache.core.plan import walk

BATCH = 32


def make_cache(page_size, shared_prefix):
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                              page_size=page_size, max_batch_size=BATCH, max_total_tokens=40000,
                              prefill_chunk_size=4096, dtype="float32", rope_mode="none")
    cache = kvcache.PagedKVCache(cfg, backend="reference")
    if shared_prefix:
        cache.add_sequence(-1)
        forward(cache, [-1], [2 * page_size])
    for i in range(BATCH):
        if shared_prefix:
            cache.fork_sequence(-1, i)
        else:
            cache.add_sequence(i)
    # lengths 1 mod page_size after the prefill: the next page_size - 1 steps take no page
    forward(cache, list(range(BATCH)), [page_size + 1 + (i % 3) * page_size for i in range(BATCH)])
    return cache


def forward(cache, ids, lengths):
    cfg = cache.config
    total = sum(lengths)
    q = np.ones((total, cfg.num_qo_heads, cfg.head_dim), np.float32)
    kv = np.ones((total, cfg.num_kv_heads, cfg.head_dim), np.float32)
    with cache.forward(ids, lengths):
        for layer in range(cfg.num_layers):
            cache.attention(layer, q, kv, kv)
        plan = cache.open_plan
    return plan


def decode_steps(cache, n):
    """``n`` decode steps of the whole batch; every step's plan is kept alive."""
    ids = list(range(BATCH))
    return [forward(cache, ids, [1] * BATCH) for _ in range(n)]


def numpy_bytes(snapshot) -> int:
    numpy_only = snapshot.filter_traces(
        [tracemalloc.DomainFilter(True, np.lib.tracemalloc_domain)])
    return sum(stat.size for stat in numpy_only.statistics("filename"))


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_steady_decode_steps_keep_no_new_numpy_memory(shared_prefix):
    page_size = 64
    cache = make_cache(page_size, shared_prefix)
    decode_steps(cache, 4)                      # warm-up: the reuse buffers exist now
    tracemalloc.start()
    try:
        plans = decode_steps(cache, 32)         # no sequence needs a page in these steps
        held = numpy_bytes(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    assert len({id(p) for p in plans}) == 32 and all(p.paged_only for p in plans)
    # holding 32 plans: an allocating step would keep at least its own B-int32 arrays per plan
    # (32 plans x 5 arrays x 128 bytes); what may remain is the open aux copy of one step
    one_step = sum(a.nbytes for _, _, a in walk(plans[-1]))
    assert held <= 2 * one_step, (held, one_step)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_decode_plans_reuse_a_bounded_set_of_buffers(shared_prefix):
    page_size = 4                               # a page every 4 steps: the page lists grow
    cache = make_cache(page_size, shared_prefix)
    decode_steps(cache, 4)
    plans = decode_steps(cache, 64)

    def buffer(a):
        while a.base is not None:
            a = a.base
        return a.__array_interface__["data"][0]

    # the arrays that change every step (the page list of shared prefixes never changes)
    changing = {(d, name) for d, name, _ in walk(plans[0])
                if name not in ("qo_indptr", "sink_size", "window_offset")}
    buffers = {buffer(a) for p in plans for d, name, a in walk(p) if (d, name) in changing}
    # two alternating sets of per-step arrays plus two page lists (grown a few times)
    assert len(buffers) <= 2 * len(changing) + 8, (len(buffers), len(changing))
    # the step before the last is still intact (its buffers are the other set): each new
    # token's slot is its sequence's last page at its last row, and one step later every
    # key count and position is one higher
    for plan in plans[-2:]:
        depth = plan.depths[-1]
        np.testing.assert_array_equal(
            plan.tokens.append_slots,
            depth.page_indices[depth.page_indptr[1:] - 1] * page_size + depth.last_page_len - 1)
    np.testing.assert_array_equal(plans[-2].depths[-1].kv_len + 1, plans[-1].depths[-1].kv_len)
    np.testing.assert_array_equal(plans[-2].tokens.q_positions + 1, plans[-1].tokens.q_positions)
