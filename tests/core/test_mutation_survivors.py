"""Tests for one-line bugs that once survived the whole CPU suite (issue 28, item 10). Each test
names the change it catches; each was seen to fail with that change applied.

* ``core/depths.py``: ``full = d < lo_depth`` made ``<=``: in a mixed-depth batch the shallow
  sequences read "block -1" at the depth they lack, i.e. the last slot of the block arrays:
  zero padding, unless that slot is a live block (exactly 64, 128, ... blocks made).
* ``core/tokens.py`` ``sliding_slots``: ``block_len_before + r < sink`` made ``<=``: a token
  that slides out within its own forward still got a write slot, which may be a kept token's
  (two writes to one slot: on a GPU either may win; on the CPU the later one does, so only the
  slots themselves show it).
* ``core/pagetable.py`` compaction advancing ``top`` by ``n`` instead of ``cap``: regions
  overlap, and a block that grows in place overwrites its neighbour's page list.
  ``PageTable.check_invariants`` now checks the regions too.
"""

import numpy as np
import pytest

import kvcache


def make_cache(**kw):
    base = dict(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                max_batch_size=4, max_total_tokens=1024, prefill_chunk_size=64, dtype="float32",
                rope_mode="none")
    base.update(kw)
    return kvcache.PagedKVCache(kvcache.CacheConfig(**base), backend="reference")


def fill(cache, seq_ids, lens, value=None, rng=None):
    """One forward; K = V = ``value`` (or random); returns the output as numpy."""
    c, t = cache.config, sum(lens)
    if value is None:
        kv = rng.standard_normal((t, c.num_kv_heads, c.head_dim))
        q = rng.standard_normal((t, c.num_qo_heads, c.head_dim))
    else:
        kv = np.full((t, c.num_kv_heads, c.head_dim), float(value))
        q = np.ones((t, c.num_qo_heads, c.head_dim))
    with cache.forward(seq_ids, lens):
        o = cache.attention(0, cache.from_numpy(q), cache.from_numpy(kv), cache.from_numpy(kv))
    return kvcache.to_numpy(o)


# ---------------------------------------------------------------------- depths.py: full = d < lo_depth
@pytest.mark.parametrize("lens", [[1, 1], [3, 2]], ids=["decode", "prefill"])
def test_a_shallow_sequence_reads_nothing_at_a_depth_it_lacks(lens):
    """Sequence 0 is two blocks deep (a fork), sequence 2 one block; the block arrays are
    filled to their last slot with a live block of large K/V, the one that "block -1" would
    read. Sequence 2's output in the mixed batch equals its output alone."""
    cache = make_cache()
    rng = np.random.default_rng(0)
    pt = cache.state.pt
    cache.add_sequence(0)
    fill(cache, [0], [8], rng=rng)
    cache.fork_sequence(0, 1)               # 0's first 8 tokens become a shared parent block
    cache.add_sequence(2)
    fill(cache, [2], [3], rng=rng)
    filler = 100
    while pt.num_blocks < len(pt.b_len):    # make blocks up to the arrays' last slot
        cache.add_sequence(filler)
        fill(cache, [filler], [2], value=40.0)
        filler += 1
    last = len(pt.b_len) - 1
    assert pt.b_live[last] and pt.b_npages[last] > 0, "the setup must make the last slot live"
    q_rng = np.random.default_rng(1)
    c, t = cache.config, sum(lens)
    q = q_rng.standard_normal((t, c.num_qo_heads, c.head_dim))
    kv = q_rng.standard_normal((t, c.num_kv_heads, c.head_dim))

    def attend(seq_ids, rows):
        cache.begin_forward(seq_ids, [lens[i] for i in rows])
        sel = np.concatenate([np.arange(sum(lens[:i]), sum(lens[:i + 1])) for i in rows])
        o = cache.attention(0, cache.from_numpy(q[sel]), cache.from_numpy(kv[sel]),
                            cache.from_numpy(kv[sel]))
        cache.abort_forward()
        return kvcache.to_numpy(o)

    mixed = attend([0, 2], [0, 1])
    alone = attend([2], [1])
    np.testing.assert_allclose(mixed[lens[0]:], alone, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mixed[:lens[0]], attend([0], [0]), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- tokens.py: sliding_slots
def kept_after(length_before, append, window, sink):
    """Which of a forward's new tokens a window keeps (the token-list model)."""
    total = length_before + append
    keep = set(range(total)) if total <= window else \
        set(range(sink)) | set(range(total - (window - sink), total))
    return [length_before + r in keep for r in range(append)]


CASES = [(8, 4, 0, 12), (8, 4, 0, 9), (8, 2, 0, 12), (8, 4, 3, 9), (9, 4, 5, 7), (12, 4, 0, 30),
         (8, 0, 0, 12), (5, 4, 2, 9), (16, 8, 7, 20), (6, 1, 0, 11)]


@pytest.mark.parametrize("window,sink,before,append", CASES)
def test_a_token_that_slides_out_in_its_own_forward_gets_no_slot(window, sink, before, append):
    """Every new token's append slot is -1 exactly when the window drops it within this forward;
    the kept ones have distinct slots, those the sequence then reads them from."""
    cache = make_cache(support_sliding_window=True)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, window, sink)
    if before:
        fill(cache, [0], [before], value=-1.0)
    expect_before = min(before, window)
    assert cache.sequence_length(0) == expect_before
    # the model keeps a window over the tokens since the start: re-derive what it holds now
    cache.begin_forward([0], [append])
    slots = np.asarray(cache.open_plan.tokens.append_slots)
    cache.abort_forward()
    # what the window keeps, in kept-token numbering (the sequence holds expect_before now)
    kept = kept_after(expect_before, append, window, sink)
    assert [s != -1 for s in slots] == kept, (slots.tolist(), kept)
    live = slots[slots != -1]
    assert len(set(live.tolist())) == len(live), f"two tokens on one slot: {slots.tolist()}"
    # the kept tokens' slots are where the sequence reads its last tokens from
    values = np.arange(append, dtype=np.float64) + 1.0
    c = cache.config
    kv = np.repeat(values[:, None, None], c.head_dim, axis=2).repeat(c.num_kv_heads, axis=1)
    with cache.forward([0], [append]):
        cache.attention(0, cache.from_numpy(np.ones((append, 2, c.head_dim))),
                        cache.from_numpy(kv), cache.from_numpy(kv))
    k = kvcache.to_numpy(cache.get_kv(0)[0])[0, :, 0, 0]
    seq = cache.state.seq(0)
    new_kept = int(np.count_nonzero(kept))
    np.testing.assert_array_equal(k[len(k) - new_kept:], values[np.asarray(kept)])
    np.testing.assert_array_equal(
        cache.state.pt.position_slots(seq, len(k) - new_kept, len(k)), live)
    cache.state.pt.check_invariants()


# ---------------------------------------------------------------------- pagetable.py: compaction
def test_blocks_grow_in_place_after_the_page_store_is_compacted():
    """Long-lived sequences whose regions have room (n < cap) survive a compaction of the page
    store (forced by many short-lived sequences), then grow in place: every page list, and
    every sequence's K, stays its own."""
    cache = make_cache(max_total_tokens=512, max_batch_size=8)
    pt = cache.state.pt
    keep = [0, 1, 2, 3]
    for sid in keep:
        cache.add_sequence(sid)
        fill(cache, [sid], [21], value=sid)           # 6 pages: a region of 6
        fill(cache, [sid], [4], value=sid)            # 7 pages: the region moves, room for 12
        assert pt.b_npages[pt.s_last[cache.state.seq(sid).slot]] < \
            pt.b_pcap[pt.s_last[cache.state.seq(sid).slot]]
    store, compacted = pt.page_store, 0
    sid = 10
    while compacted < 2:
        cache.add_sequence(sid)
        fill(cache, [sid], [1], value=99.0)
        cache.remove_sequence(sid)
        sid += 1
        if pt.page_store is not store:
            store, compacted = pt.page_store, compacted + 1
            pt.check_invariants()
    # grow every kept sequence in place, page by page, checking as we go
    for step in range(9):
        fill(cache, keep, [4] * len(keep), value=step + 10.0)
        pt.check_invariants()
    for s in keep:
        k = kvcache.to_numpy(cache.get_kv(s)[0])[0, :, 0, 0]
        want = np.concatenate([np.full(25, float(s)), np.repeat(np.arange(9) + 10.0, 4)])
        np.testing.assert_array_equal(k, want)


def test_check_invariants_sees_overlapping_regions():
    cache = make_cache()
    for sid in (0, 1):
        cache.add_sequence(sid)
        fill(cache, [sid], [9], value=1.0)
    pt = cache.state.pt
    pt.check_invariants()
    b0, b1 = (int(pt.s_last[cache.state.seq(s).slot]) for s in (0, 1))
    saved = int(pt.b_pstart[b1])
    pt.b_pstart[b1] = pt.b_pstart[b0] + 1           # b1's region now starts inside b0's
    with pytest.raises(AssertionError, match="overlap"):
        pt.check_invariants()
    pt.b_pstart[b1] = saved
    pt.check_invariants()
