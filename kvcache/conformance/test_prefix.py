"""Automatic prefix caching (``CacheConfig(prefix_cache=True)``) on the backend under test.

The index and eviction are the core's, but what a backend must get right is real: attention
over pages a sequence shares with the cache (one page table walk over pages another forward
wrote), bit-identical output whether a prefix came from the cache or was computed in the same
run, and the run-ahead rule when an evicted page is written again while forwards that read it
are still queued. Each token's K and V rows are a fixed function of (token id, position), so
the reference runs the same program and is the judge.
"""

from __future__ import annotations

import numpy as np

from .base import Conformance
from .tolerance import assert_close


class _Program:
    """Forwards on one cache with K/V rows a function of (token, position); outputs kept as
    native arrays until ``read`` (so a backend may run ahead)."""

    def __init__(self, cache, seed: int = 0):
        c = self.config = cache.config
        self.cache = cache
        rng = np.random.default_rng(seed)
        self.kv = rng.standard_normal((2, c.num_layers, 16, 256, c.num_kv_heads, c.head_dim))
        self.q_rng = np.random.default_rng(seed + 1)
        self.outs: list = []

    def run(self, seq_ids, tokens, starts):
        """One forward: sequence ``seq_ids[i]`` appends ``tokens[i]`` from position
        ``starts[i]``; returns the index of its outputs for ``read``."""
        c, cache = self.config, self.cache
        rows = [(t % 16, starts[i] + j) for i, toks in enumerate(tokens) for j, t in enumerate(toks)]
        tok = np.array([r[0] for r in rows])
        pos = np.array([r[1] for r in rows])
        q = self.q_rng.standard_normal((len(rows), c.num_qo_heads, c.head_dim))
        outs = []
        with cache.forward(list(seq_ids), [len(t) for t in tokens]):
            for layer in range(c.num_layers):
                k = self.kv[0, layer, tok, pos]
                v = self.kv[1, layer, tok, pos]
                outs.append(cache.attention(layer, *(cache.from_numpy(x) for x in (q, k, v))))
        self.outs.append(outs)
        return len(self.outs) - 1

    def read(self, index):
        from kvcache import to_numpy
        return np.stack([to_numpy(o).astype(np.float64) for o in self.outs[index]])


class TestPrefixCache(Conformance):
    """Prefix caching: warm equals cold bit for bit, many sequences decoding over one cached
    prefix, and eviction under the run-ahead rule; the reference runs the same program."""

    def _both(self, make_pair, **kw):
        p = make_pair(prefix_cache=True, **kw)
        return p, _Program(p.ref), _Program(p.dut)

    def test_warm_equals_cold_bitwise(self, make_pair):
        """A prompt started from a cached prefix of two pages, and the same prompt computed
        afresh as two forwards, the first ending at that page boundary: the second forward's
        outputs are identical, bit for bit, on the backend; the reference agrees within
        tolerance."""
        p, ref, dut = self._both(make_pair)
        ps = p.config.page_size
        head = [(3 * i + 1) % 16 for i in range(2 * ps)]
        rest = [7, 8, 9, 10, 11]
        prompt = head + rest
        for prog in (ref, dut):
            cache = prog.cache
            assert cache.add_sequence(0, head + [2, 3]) == 0     # caches head, diverges after
            prog.run([0], [head + [2, 3]], [0])
            cache.remove_sequence(0)
            assert cache.match_prefix(prompt) == 2 * ps
            assert cache.add_sequence(1, prompt) == 2 * ps
            prog.q_rng = np.random.default_rng(99)      # the same queries for both runs
            warm = prog.run([1], [rest], [2 * ps])
            cache.remove_sequence(1)
            assert cache.clear_prefix_cache() > 0
            assert cache.add_sequence(3, prompt) == 0   # the cache forgot it: computed afresh
            prog.run([3], [head], [0])
            prog.q_rng = np.random.default_rng(99)
            cold = prog.run([3], [rest], [2 * ps])
            prog.cold_warm = (cold, warm)
        cold, warm = dut.cold_warm
        got_warm, got_again = dut.read(warm), dut.read(cold)
        assert np.array_equal(got_warm, got_again, equal_nan=True), (
            f"warm and cold outputs differ on {p.dut.backend.name}: max |diff| "
            f"{np.nanmax(np.abs(got_warm - got_again))}")
        assert_close("warm prefix output", ref.read(ref.cold_warm[1]), got_warm, p.tol)

    def test_many_sequences_decode_over_one_cached_prefix(self, make_pair):
        """Four sequences start from one cached prefix of three pages and decode side by side;
        every forward is queued before any output is read."""
        p, ref, dut = self._both(make_pair)
        ps = p.config.page_size
        shared = [(5 * i + 2) % 16 for i in range(3 * ps)]
        for prog in (ref, dut):
            cache = prog.cache
            cache.add_sequence(0, shared + [15])
            prog.run([0], [shared + [15]], [0])
            cache.remove_sequence(0)
            starts = []
            for sid in range(1, 5):
                prompt = shared + [sid, sid + 1]
                starts.append(cache.add_sequence(sid, prompt))
            assert starts == [3 * ps] * 4
            prog.run([1, 2, 3, 4], [[s, s + 1] for s in range(1, 5)], [3 * ps] * 4)
            for step in range(3):
                prog.run([1, 2, 3, 4], [[(s + step) % 16] for s in range(1, 5)],
                         [3 * ps + 2 + step] * 4)
        for i in range(len(dut.outs)):
            assert_close(f"forward {i}", ref.read(i), dut.read(i), p.tol)

    def test_eviction_rewrites_pages_only_after_queued_readers(self, make_pair):
        """A small cache: a sequence reads a cached prefix, leaves, and a sequence of other
        tokens then needs every page (the cached ones are evicted and written over); all
        forwards are queued before the first output is read."""
        p, ref, dut = self._both(make_pair, max_total_tokens=64)
        ps = p.config.page_size
        usable = p.dut.num_total_pages - 1
        shared = [(7 * i + 3) % 16 for i in range(2 * ps)]
        for prog in (ref, dut):
            cache = prog.cache
            cache.add_sequence(0, shared + [15])
            prog.run([0], [shared + [15]], [0])
            cache.remove_sequence(0)
            assert cache.num_cached_pages >= 2
            assert cache.add_sequence(1, shared + [4, 5]) == 2 * ps
            prog.run([1], [[4, 5]], [2 * ps])
            for step in range(2):
                prog.run([1], [[step]], [2 * ps + 2 + step])
            cache.remove_sequence(1)
            other = [(i * 11 + 6) % 16 for i in range(usable * ps)]
            assert cache.add_sequence(2, other) == 0
            assert cache.num_available_pages >= usable
            done = 0
            while done < len(other):
                n = min(p.config.prefill_chunk_size, len(other) - done)
                prog.run([2], [other[done:done + n]], [done])
                done += n
            assert cache.match_prefix(shared + [4, 5]) < 2 * ps   # evicted, written over
        for i in range(len(dut.outs)):
            assert_close(f"forward {i}", ref.read(i), dut.read(i), p.tol)
