"""The forward planner's index arrays: the decode fast path equals the general path, and the
general path's arrays follow the documented layout."""

import copy

import numpy as np
import pytest

import kvcache
from kvcache.core.forward import ForwardBuilder


def make_cache(page_size=4, tokens=400):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                              page_size=page_size, max_batch_size=16, max_total_tokens=tokens,
                              prefill_chunk_size=64, dtype="float32", rope_mode="none")
    return kvcache.PagedKVCache(cfg, backend="reference")


def grow(cache, sid, n):
    cache._builder.begin([sid], [n])


@pytest.mark.parametrize("seed", range(6))
def test_decode_fast_path_equals_general_path(seed):
    rng = np.random.default_rng(seed)
    cache = make_cache(page_size=int(rng.choice([1, 4, 16])), tokens=2000)
    ids = []
    for i in range(int(rng.integers(1, 12))):
        cache.add_sequence(i)
        if rng.random() < 0.3 and i:
            cache.remove_sequence(i)
            cache.add_sequence(i)
        grow(cache, i, int(rng.integers(1, 60)))
        ids.append(i)
    rng.shuffle(ids)
    for step in range(int(rng.integers(1, 20))):
        general = copy.deepcopy(cache._builder)
        general.fast_path = False
        fast_plan = cache._builder.begin(ids, [1] * len(ids))
        slow_plan = general.begin(ids, [1] * len(ids))
        assert set(fast_plan.arrays) == set(slow_plan.arrays)
        for key in fast_plan.arrays:
            np.testing.assert_array_equal(fast_plan.arrays[key], slow_plan.arrays[key], err_msg=key)
            assert fast_plan.arrays[key].dtype == np.int32, key
        assert fast_plan.append_first and slow_plan.append_first
        assert [vars(d) for d in fast_plan.depths] == [vars(d) for d in slow_plan.depths]
        np.testing.assert_array_equal(cache.state.pt.free_pages[:cache.state.pt.num_free],
                                      general.state.pt.free_pages[:general.state.pt.num_free])


def test_shared_prefix_is_coalesced_into_one_entry():
    cache = make_cache(page_size=4)
    cache.add_sequence(0)
    grow(cache, 0, 16)                      # 4 full pages
    for child in (1, 2, 3):
        cache.fork_sequence(0, child)
    plan = cache._builder.begin([1, 2, 3], [3, 2, 5])   # prefill: not decode, coalesce allowed
    a = plan.arrays
    assert len(plan.depths) == 2
    # depth 0: the shared 16-token block once, read by all 10 queries
    np.testing.assert_array_equal(a["d0.qo_indptr"], [0, 10])
    np.testing.assert_array_equal(a["d0.kv_len"], [16])
    np.testing.assert_array_equal(a["d0.page_indices"], [0, 1, 2, 3])
    # depth 1: each child's own (empty before this forward) block
    np.testing.assert_array_equal(a["d1.qo_indptr"], [0, 3, 5, 10])
    np.testing.assert_array_equal(a["d1.kv_len"], [0, 0, 0])
    np.testing.assert_array_equal(a["q_positions"], [16, 17, 18, 16, 17, 16, 17, 18, 19, 20])


def test_decode_over_shared_prefix_uses_uncoalesced_decode_entries():
    cache = make_cache(page_size=4)
    cache.add_sequence(0)
    grow(cache, 0, 8)
    cache.fork_sequence(0, 1)
    plan = cache._builder.begin([0, 1], [1, 1])
    # decode with a 2-way share of 2 pages: coalescing saves 2x < threshold? no: 4/2 = 2 >= 1.1
    assert not plan.depths[0].use_decode
    np.testing.assert_array_equal(plan.arrays["d0.qo_indptr"], [0, 2])
    np.testing.assert_array_equal(plan.arrays["d1.kv_len"], [1, 1])      # append-first: includes new token


def test_deep_fork_chain_folds_into_last_depth():
    cache = make_cache(page_size=2)
    cache.add_sequence(0)
    parent = 0
    for child in range(1, 7):                 # depth 7 chain of 2-token blocks
        grow(cache, parent, 2)
        cache.fork_sequence(parent, child)
        parent = child
    plan = cache._builder.begin([parent], [1])
    assert len(plan.depths) == 2
    np.testing.assert_array_equal(plan.arrays["d0.kv_len"], [2])
    np.testing.assert_array_equal(plan.arrays["d1.kv_len"], [11])          # 5 folded blocks + new token
    assert cache.sequence_length(parent) == 13
