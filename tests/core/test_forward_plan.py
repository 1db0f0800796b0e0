"""The forward planner's index arrays: the decode fast path equals the general path, and the
general path's arrays follow the documented layout."""

import copy

import numpy as np
import pytest

import kvcache
from kvcache.core.plan import DEPTH_SIZES, walk


def make_cache(page_size=4, tokens=400):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                              page_size=page_size, max_batch_size=16, max_total_tokens=tokens,
                              prefill_chunk_size=64, dtype="float32", rope_mode="none")
    return kvcache.PagedKVCache(cfg, backend="reference")


def grow(cache, sid, n):
    cache.planner.begin([sid], [n])


def arrays(plan) -> dict:
    """Every array of a plan by (depth or None, field name)."""
    return {(d, name): a for d, name, a in walk(plan)}


def sizes(plan) -> list:
    return [{name: getattr(d, name) for name in DEPTH_SIZES} for d in plan.depths]


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
        general = copy.deepcopy(cache.planner)
        general.fast_path = False
        fast_plan = cache.planner.begin(ids, [1] * len(ids))
        slow_plan = general.begin(ids, [1] * len(ids))
        fast_a, slow_a = arrays(fast_plan), arrays(slow_plan)
        assert set(fast_a) == set(slow_a)
        for key in fast_a:
            np.testing.assert_array_equal(fast_a[key], slow_a[key], err_msg=str(key))
            assert fast_a[key].dtype == np.int32, key
        assert fast_plan.paged_only and slow_plan.paged_only
        assert sizes(fast_plan) == sizes(slow_plan)
        np.testing.assert_array_equal(cache.state.pt.free_pages[:cache.state.pt.num_free],
                                      general.state.pt.free_pages[:general.state.pt.num_free])


def test_shared_prefix_is_coalesced_into_one_entry():
    cache = make_cache(page_size=4)
    cache.add_sequence(0)
    grow(cache, 0, 16)                      # 4 full pages
    for child in (1, 2, 3):
        cache.fork_sequence(0, child)
    plan = cache.planner.begin([1, 2, 3], [3, 2, 5])   # prefill: not decode, coalesce allowed
    assert len(plan.depths) == 2
    # depth 0: the shared 16-token block once, read by all 10 queries
    np.testing.assert_array_equal(plan.depths[0].qo_indptr, [0, 10])
    np.testing.assert_array_equal(plan.depths[0].kv_len, [16])
    np.testing.assert_array_equal(plan.depths[0].page_indices, [0, 1, 2, 3])
    # depth 1: each child's own (empty before this forward) block
    np.testing.assert_array_equal(plan.depths[1].qo_indptr, [0, 3, 5, 10])
    np.testing.assert_array_equal(plan.depths[1].kv_len, [0, 0, 0])
    np.testing.assert_array_equal(plan.tokens.q_positions, [16, 17, 18, 16, 17, 16, 17, 18, 19, 20])
    # both depths' entries hold every row (an entry of no keys still holds its rows)
    assert [d.covers_rows for d in plan.depths] == [True, True]


@pytest.mark.parametrize("seed", range(4))
def test_depths_say_truly_whether_their_entries_cover_every_row(seed):
    """``covers_rows`` lets a kernel skip filling rows no entry holds: it may be True only
    where the entries' rows are exactly 0..T-1 (prefill and decode, forks, empty blocks)."""
    rng = np.random.default_rng(seed)
    cache = make_cache(page_size=4, tokens=2000)
    cache.add_sequence(0)
    grow(cache, 0, int(rng.integers(1, 30)))
    for sid in range(1, 6):
        if rng.random() < 0.5:
            cache.fork_sequence(int(rng.integers(0, sid)), sid)
        else:
            cache.add_sequence(sid)
        grow(cache, sid, int(rng.integers(1, 20)))
    for _ in range(4):
        ids = sorted(rng.choice(6, int(rng.integers(1, 7)), replace=False).tolist())
        lens = [1] * len(ids) if rng.random() < 0.5 else rng.integers(1, 9, len(ids)).tolist()
        plan = cache.planner.begin(ids, lens)
        for d in plan.depths:
            assert d.covers_rows
            assert d.qo_indptr[0] == 0 and d.qo_indptr[d.num_entries] == plan.total_tokens


def test_decode_over_shared_prefix_uses_uncoalesced_decode_entries():
    cache = make_cache(page_size=4)
    cache.add_sequence(0)
    grow(cache, 0, 8)
    cache.fork_sequence(0, 1)
    plan = cache.planner.begin([0, 1], [1, 1])
    # decode with a 2-way share of 2 pages: coalescing saves 2x < threshold? no: 4/2 = 2 >= 1.1
    assert not plan.depths[0].use_decode
    np.testing.assert_array_equal(plan.depths[0].qo_indptr, [0, 2])
    np.testing.assert_array_equal(plan.depths[1].kv_len, [1, 1])      # append-first: includes new token


def test_deep_fork_chain_folds_into_last_depth():
    cache = make_cache(page_size=2)
    cache.add_sequence(0)
    parent = 0
    for child in range(1, 7):                 # depth 7 chain of 2-token blocks
        grow(cache, parent, 2)
        cache.fork_sequence(parent, child)
        parent = child
    cache.fork_sequence(parent, 7)            # a sibling: the decode batch shares the chain
    plan = cache.planner.begin([parent, 7], [1, 1])
    assert len(plan.depths) == 2
    np.testing.assert_array_equal(plan.depths[0].kv_len, [2])           # coalesced: one entry
    np.testing.assert_array_equal(plan.depths[1].kv_len, [11, 11])      # 5 folded blocks + new token
    assert cache.sequence_length(parent) == 13


def test_a_decode_batch_sharing_nothing_reads_each_forked_sequence_as_one_entry():
    """A fork chain read by one sequence alone (e.g. one started from a cached prefix): no
    coalescing pays, so its whole page list is one entry of one depth, as for a sequence
    that never forked (one launch, the same arithmetic)."""
    cache = make_cache(page_size=2)
    cache.add_sequence(0)
    parent = 0
    for child in range(1, 7):
        grow(cache, parent, 2)
        cache.fork_sequence(parent, child)
        parent = child
    plan = cache.planner.begin([parent], [1])
    assert len(plan.depths) == 1 and plan.depths[0].use_decode
    np.testing.assert_array_equal(plan.depths[0].kv_len, [13])
    np.testing.assert_array_equal(plan.depths[0].page_indptr, [0, 7])


def _assert_same_plan(fast_plan, slow_plan, fast_pt, slow_pt):
    fast_a, slow_a = arrays(fast_plan), arrays(slow_plan)
    assert set(fast_a) == set(slow_a)
    for key in fast_a:
        np.testing.assert_array_equal(fast_a[key], slow_a[key], err_msg=str(key))
        assert fast_a[key].dtype == np.int32, key
    assert sizes(fast_plan) == sizes(slow_plan)
    np.testing.assert_array_equal(fast_pt.free_pages[:fast_pt.num_free],
                                  slow_pt.free_pages[:slow_pt.num_free])


@pytest.mark.parametrize("seed", range(12))
def test_repeated_decode_batches_update_their_layout_like_a_rebuild(seed):
    """Decode steps of the same batch reuse and update the previous plan (shared prefixes,
    several depths, page growth); any structural change in between must invalidate it. A twin
    builder with the fast paths off rebuilds every plan from scratch."""
    rng = np.random.default_rng(seed)
    ps = int(rng.choice([1, 2, 4, 16]))
    fast = make_cache(page_size=ps, tokens=6000)
    fast.config.__class__  # noqa: B018
    slow = copy.deepcopy(fast)
    slow.planner.fast_path = False

    def both(op, *args):
        getattr(fast, op)(*args)
        getattr(slow, op)(*args)

    both("add_sequence", 0)
    n0 = int(rng.integers(1, 40))
    fast.planner.begin([0], [n0])
    slow.planner.begin([0], [n0])
    live = [0]
    next_id = 1
    for _ in range(int(rng.integers(3, 9))):          # a forked family: up to 3 levels
        parent = int(rng.choice(live))
        pos = int(rng.integers(0, fast.sequence_length(parent) + 1))
        both("fork_sequence", parent, next_id, pos)
        n = int(rng.integers(1, 20))
        fast.planner.begin([next_id], [n])
        slow.planner.begin([next_id], [n])
        live.append(next_id)
        next_id += 1
    batch = [int(x) for x in rng.permutation(live)[:int(rng.integers(1, len(live) + 1))]]
    for step in range(40):
        if rng.random() < 0.15:                         # a structural change between steps
            op = rng.choice(["popn", "fork", "add", "remove"])
            victim = int(rng.choice(batch))
            if op == "popn" and fast.sequence_length(victim) > 1:
                both("popn", victim, int(rng.integers(1, fast.sequence_length(victim))))
            elif op == "fork":
                both("fork_sequence", victim, next_id, -1)
                batch.append(next_id)
                next_id += 1
            elif op == "add":
                both("add_sequence", next_id)
                fast.planner.begin([next_id], [3])
                slow.planner.begin([next_id], [3])
                batch.append(next_id)
                next_id += 1
            elif op == "remove" and len(batch) > 1:
                both("remove_sequence", victim)
                batch.remove(victim)
        fast_plan = fast.planner.begin(batch, [1] * len(batch))
        slow_plan = slow.planner.begin(batch, [1] * len(batch))
        _assert_same_plan(fast_plan, slow_plan, fast.state.pt, slow.state.pt)
        assert fast.sequence_length(batch[0]) == slow.sequence_length(batch[0])
    fast.state.pt.check_invariants()


def test_repeated_decode_reuses_the_layout():
    """The update path is taken (not a rebuild that happens to match)."""
    cache = make_cache(page_size=4, tokens=2000)
    cache.add_sequence(0)
    grow(cache, 0, 16)
    for child in (1, 2, 3):
        cache.fork_sequence(0, child)
    first = cache.planner.begin([1, 2, 3], [1, 1, 1])
    layout = cache.planner.decode_reuse
    assert layout is not None and len(first.depths) == 2
    second = cache.planner.begin([1, 2, 3], [1, 1, 1])
    assert cache.planner.decode_reuse is layout
    np.testing.assert_array_equal(second.depths[1].kv_len, first.depths[1].kv_len + 1)
    cache.add_sequence(9)                              # any structural change: rebuild
    cache.planner.begin([1, 2, 3], [1, 1, 1])
    assert cache.planner.decode_reuse is not layout
