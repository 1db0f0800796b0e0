"""Sliding windows combined with forks and popn: which tokens each sequence keeps, and the windows
the cache refuses (pages shared with another sequence cannot slide out)."""

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError

PS = 4


@pytest.fixture
def cache():
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                              page_size=PS, max_batch_size=4, max_total_tokens=128,
                              prefill_chunk_size=32, dtype="float32", rope_mode="normal",
                              support_sliding_window=True)
    return kvcache.PagedKVCache(cfg, backend="reference")


class Tokens:
    """Runs forwards with random q/k/v and remembers each sequence's V rows in order, so a test
    names kept tokens by their index in the sequence's history."""

    def __init__(self, cache):
        self.cache, self.rng, self.v = cache, np.random.default_rng(0), {}

    def fwd(self, ids, lens):
        c = self.cache.config
        total = sum(lens)
        vs = [self.rng.standard_normal((total, c.num_kv_heads, c.head_dim)).astype(np.float32)
              for _ in range(c.num_layers)]
        with self.cache.forward(ids, lens):
            for layer in range(c.num_layers):
                q = self.rng.standard_normal((total, c.num_qo_heads, c.head_dim))
                k = self.rng.standard_normal((total, c.num_kv_heads, c.head_dim))
                self.cache.attention(layer, *(self.cache.from_numpy(x) for x in (q, k, vs[layer])))
        off = 0
        for sid, n in zip(ids, lens):
            self.v.setdefault(sid, []).extend(np.stack([v[off + r] for v in vs]) for r in range(n))
            off += n

    def fork(self, parent, child, pos=-1):
        self.cache.fork_sequence(parent, child, pos)
        self.v[child] = self.v[parent][:len(self.v[parent]) if pos == -1 else pos]

    def expect(self, sid, kept):
        """``kept``: indices into the sequence's history (every token it was ever given)."""
        self.cache.state.pt.check_invariants()
        assert self.cache.sequence_length(sid) == len(kept)
        _, v = self.cache.get_kv(sid)
        want = np.stack([self.v[sid][i] for i in kept], axis=1)
        np.testing.assert_array_equal(kvcache.to_numpy(v), want)


def snapshot(cache):
    return (cache.num_available_pages, {s: cache.sequence_length(s) for s in cache.sequence_ids},
            {s: [kvcache.to_numpy(a).copy() for a in cache.get_kv(s)] for s in cache.sequence_ids})


def assert_same(a, b):
    assert a[:2] == b[:2]
    for s in a[2]:
        for x, y in zip(a[2][s], b[2][s]):
            np.testing.assert_array_equal(x, y)


def test_fork_of_windowed_sequence_keeps_newest(cache):
    """A fork at the parent's (page-aligned) end moves the parent to a fresh block; the sinks
    must then count from the shared prefix, or the window keeps the oldest tokens."""
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [12])
    cache.enable_sliding_window(0, 16, 14)
    t.fork(0, 1)
    for _ in range(10):
        t.fwd([0], [1])
    t.expect(0, list(range(14)) + [20, 21])
    t.expect(1, list(range(12)))


def test_window_smaller_than_shared_prefix_is_refused(cache):
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [16])
    t.fork(0, 1)
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError, match=r"sequence 1 .*16 tokens.*sink_size.* 2\b"):
        cache.enable_sliding_window(1, 8, 2)
    assert_same(before, snapshot(cache))
    t.fwd([1], [4])                      # no window: nothing slides
    t.expect(1, list(range(20)))
    t.fwd([1, 0], [2, 1])
    t.expect(0, list(range(17)))


@pytest.mark.parametrize("fork_pos", [8, 10, 16])
def test_shared_prefix_longer_than_sinks_is_refused(cache, fork_pos):
    """Sinks 6 < the 8 or 16 tokens shared with the parent: the window as specified (drop tokens 6..)
    would free shared pages."""
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [16])
    t.fork(0, 1, fork_pos)
    shared = fork_pos // PS * PS
    with pytest.raises(InvalidArgumentError, match=rf"sequence 1 .*{shared} tokens"):
        cache.enable_sliding_window(1, 24, 6)


@pytest.mark.parametrize("fork_pos", [4, 6, 8])
def test_shared_prefix_within_sinks(cache, fork_pos):
    """The child shares 4 or 8 tokens (a partial page is copied), all inside its 8 sinks."""
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [16])
    t.fork(0, 1, fork_pos)
    cache.enable_sliding_window(1, 12, 8)
    t.fwd([1], [5])
    t.fwd([1, 0], [3, 2])
    n = fork_pos + 8
    t.expect(1, list(range(8)) + list(range(n - 4, n)))
    t.expect(0, list(range(18)))
    for _ in range(3):
        t.fwd([1], [1])
    t.expect(1, list(range(8)) + list(range(n - 1, n + 3)))


def test_prefix_of_a_removed_fork_can_slide(cache):
    """Once the other sharer is gone, the sequence holds its whole prefix alone: any window."""
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [16])
    t.fork(0, 1, 9)
    t.fork(1, 2)
    cache.remove_sequence(0)
    with pytest.raises(InvalidArgumentError, match="sequence 1 .*8 tokens"):
        cache.enable_sliding_window(1, 6, 2)     # still shares 8 with sequence 2
    cache.remove_sequence(2)
    cache.enable_sliding_window(1, 6, 2)
    t.fwd([1], [3])
    t.expect(1, [0, 1, 8, 9, 10, 11])
    cache.popn(1, 5)                          # the window and a sink
    t.v[1] = t.v[1][:1]
    t.fwd([1], [7])
    t.expect(1, [0, 1, 4, 5, 6, 7])


def test_fork_at_end_after_popn_to_the_sinks(cache):
    """popn of a slid sequence down to its sinks, then a fork at its (page-aligned) end: the
    shared block must hold just the sinks, and the parent keeps sliding from there."""
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [12])
    cache.enable_sliding_window(0, 10, 4)
    t.fwd([0], [1])
    t.expect(0, [0, 1, 2, 3] + list(range(7, 13)))
    cache.popn(0, 6)
    t.v[0] = t.v[0][:4]
    t.fork(0, 1)
    t.fwd([0, 1], [9, 2])
    t.expect(0, [0, 1, 2, 3] + list(range(7, 13)))
    t.expect(1, list(range(6)))


def test_popn_into_the_sinks_of_a_slid_sequence(cache):
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [14])
    cache.enable_sliding_window(0, 9, 6)
    t.fwd([0], [1])
    t.expect(0, list(range(6)) + [12, 13, 14])
    cache.popn(0, 5)
    t.v[0] = t.v[0][:4]
    t.expect(0, [0, 1, 2, 3])
    t.fwd([0], [7])
    t.expect(0, list(range(6)) + [8, 9, 10])


def test_windowed_parent_forks_only_within_its_sinks(cache):
    t = Tokens(cache)
    cache.add_sequence(0)
    t.fwd([0], [10])
    cache.enable_sliding_window(0, 16, 5)
    before = snapshot(cache)
    with pytest.raises(InvalidArgumentError, match=r"sequence 0 .*5 sink.*6"):
        cache.fork_sequence(0, 1, 6)
    assert_same(before, snapshot(cache))
    t.fork(0, 1, 5)
    t.fork(0, 2, 4)
    t.fwd([0, 1, 2], [8, 1, 1])
    t.expect(0, list(range(5)) + list(range(7, 18)))
    t.expect(1, list(range(6)))
    t.expect(2, list(range(5)))
