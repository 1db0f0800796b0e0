"""Model-based test of automatic prefix caching: random programs of add (with tokens) / forward /
extend_tokens / fork / popn / remove / commit of token trees on a small cache (evictions happen
all the time), against a plain token-list model.

Each token's K and V rows are a fixed function of (token id, position), so the model knows what
every row of every sequence must hold from its token list alone: a cached prefix attached from
the wrong pages, a page evicted while a sequence still reads it, or a page reused under a stale
index entry shows up as a wrong ``get_kv`` row or a wrong attention output. The model also keeps
every page-aligned prefix that was ever cached, so a match can never claim tokens that were not.
"""

import copy
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache
from kvcache.conformance import dense_attention

L, HQ, HKV, D, PS = 2, 2, 1, 8, 4
VOCAB = 5
WORDS = [(1, 2, 3, 4), (1, 2, 3, 0), (4, 4, 0, 1)]     # page-sized words: prompts share pages
_rows = np.random.default_rng(7).standard_normal((2, L, VOCAB, 128, HKV, D)).astype(np.float32)


def kv_row(token, pos):
    """(k, v) of a token at a position: (L, HKV, D) each."""
    return _rows[0, :, token, pos], _rows[1, :, token, pos]


class PSeq:
    def __init__(self, tokens=(), known=()):
        self.tokens = list(tokens)     # the ids whose KV the sequence holds (its content)
        self.known = list(known)       # the ids recorded with the cache (a prefix or an extension)
        self.tree = []                 # uncommitted token-tree tokens: (token, parent, depth)


class PrefixMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.cfg = kvcache.CacheConfig(
            num_layers=L, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
            max_batch_size=4, max_total_tokens=48, prefill_chunk_size=24, dtype="float32",
            rope_mode="none", prefix_cache=True)
        self.cache = kvcache.PagedKVCache(self.cfg, backend="reference")
        self.model: dict = {}
        self.cached: set = set()        # every page-aligned token prefix ever indexed
        self.next_id = 0
        self.rng = np.random.default_rng(0)

    def note_indexed(self, m: PSeq):
        """The pages the cache indexes for ``m``: full pages of recorded ids it holds."""
        if m.tree:
            return
        n = min(len(m.tokens), len(m.known))
        for d in range(1, n // PS + 1):
            if m.known[:d * PS] == m.tokens[:d * PS]:
                self.cached.add(tuple(m.tokens[:d * PS]))

    def prompt(self, data):
        words = data.draw(st.lists(st.sampled_from(WORDS), max_size=4))
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        return [t for w in words for t in w] + tail

    @rule(data=st.data())
    def add(self, data):
        sid = self.next_id
        self.next_id += 1
        tokens = self.prompt(data)
        got = self.cache.add_sequence(sid, tokens)
        assert got % PS == 0 and 0 <= got <= len(tokens) - 1
        assert got == 0 or tuple(tokens[:got]) in self.cached, (tokens, got)
        assert self.cache.sequence_length(sid) == got
        self.model[sid] = PSeq(tokens[:got], tokens)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def forward(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3,
                                 unique=True))
        ids = [s for s in ids if not self.model[s].tree] or ids[:1]
        tree = bool(self.model[ids[0]].tree) or data.draw(st.booleans()) and len(ids) == 1
        if tree:
            ids = ids[:1]
        lens = [data.draw(st.integers(1, 8)) for _ in ids]
        parents = None
        if tree:
            base = len(self.model[ids[0]].tree)
            parents = [data.draw(st.integers(-1, base + r - 1)) for r in range(lens[0])]
        new = []
        for s, n in zip(ids, lens):
            m = self.model[s]
            have = len(m.tokens) + len(m.tree)
            fut = m.known[have:have + n] if not tree else []
            new.append(fut + [int(x) for x in self.rng.integers(0, VOCAB, n - len(fut))])
        try:
            self.cache.begin_forward(ids, lens, parents)
        except kvcache.CacheFullError:
            assert self.cache.pages_needed(ids, lens, parents) > self.cache.num_available_pages
            return
        total = sum(lens)
        q = self.rng.standard_normal((total, HQ, D)).astype(np.float32)
        k = np.zeros((L, total, HKV, D), np.float32)
        v = np.zeros((L, total, HKV, D), np.float32)
        pos = []
        off = 0
        for s, toks in zip(ids, new):
            m = self.model[s]
            depths = [d for _, _, d in m.tree]
            for r, t in enumerate(toks):
                if tree:
                    p = parents[r]
                    depths.append(0 if p < 0 else depths[p] + 1)
                    at = len(m.tokens) + depths[-1]
                else:
                    at = len(m.tokens) + r
                pos.append(at)
                k[:, off + r], v[:, off + r] = kv_row(t, at)
            off += len(toks)
        outs = [kvcache.to_numpy(self.cache.attention(layer, q, k[layer], v[layer]))
                for layer in range(L)]
        self.cache.end_forward()
        off = 0
        for s, toks in zip(ids, new):
            m = self.model[s]
            if tree:
                for t, p in zip(toks, parents):
                    m.tree.append((t, p, 0 if p < 0 else m.tree[p][2] + 1))
                off += len(toks)
                continue
            hist = len(m.tokens)
            m.tokens += toks
            keys = np.stack([kv_row(t, i)[0] for i, t in enumerate(m.tokens)], 1)
            vals = np.stack([kv_row(t, i)[1] for i, t in enumerate(m.tokens)], 1)
            vis = np.arange(len(m.tokens))[None, :] <= (hist + np.arange(len(toks)))[:, None]
            for layer in range(L):
                want = dense_attention(q[off:off + len(toks)].astype(np.float64), keys[layer],
                                       vals[layer], vis, D ** -0.5, HQ // HKV)[0]
                np.testing.assert_allclose(outs[layer][off:off + len(toks)], want, atol=2e-5,
                                           rtol=1e-4)
            self.note_indexed(m)
            off += len(toks)

    @rule(data=st.data())
    def request(self, data):
        """A whole request as an engine runs it: add with the prompt, prefill the rest in
        chunks, decode a few tokens, record them, remove (its pages stay cached)."""
        sid = self.next_id
        self.next_id += 1
        tokens = self.prompt(data)
        got = self.cache.add_sequence(sid, tokens)
        assert got == 0 or tuple(tokens[:got]) in self.cached, (tokens, got)
        m = self.model[sid] = PSeq(tokens[:got], tokens)
        chunk = data.draw(st.sampled_from([PS, 2 * PS, 7, 24]))
        while len(m.tokens) < len(m.known):
            if not self._forward_one(sid, min(chunk, len(m.known) - len(m.tokens))):
                break
        for _ in range(data.draw(st.integers(0, 6))):
            if not self._forward_one(sid, 1):
                break
        if len(m.known) < len(m.tokens):
            self.cache.extend_tokens(sid, m.tokens[len(m.known):])
            m.known = list(m.tokens)
            self.note_indexed(m)
        if data.draw(st.booleans()):
            self.cache.remove_sequence(sid)
            del self.model[sid]

    def _forward_one(self, sid, n) -> bool:
        m = self.model[sid]
        have = len(m.tokens)
        toks = m.known[have:have + n]
        toks += [int(x) for x in self.rng.integers(0, VOCAB, n - len(toks))]
        try:
            self.cache.begin_forward([sid], [n])
        except kvcache.CacheFullError:
            assert self.cache.pages_needed([sid], [n]) > self.cache.num_available_pages
            return False
        q = self.rng.standard_normal((n, HQ, D)).astype(np.float32)
        kv = [kv_row(t, have + r) for r, t in enumerate(toks)]
        outs = [kvcache.to_numpy(self.cache.attention(
            layer, q, np.stack([x[0][layer] for x in kv]), np.stack([x[1][layer] for x in kv])))
            for layer in range(L)]
        self.cache.end_forward()
        m.tokens += toks
        keys = np.stack([kv_row(t, i)[0] for i, t in enumerate(m.tokens)], 1)
        vals = np.stack([kv_row(t, i)[1] for i, t in enumerate(m.tokens)], 1)
        vis = np.arange(len(m.tokens))[None, :] <= (have + np.arange(n))[:, None]
        for layer in range(L):
            want = dense_attention(q.astype(np.float64), keys[layer], vals[layer], vis,
                                   D ** -0.5, HQ // HKV)[0]
            np.testing.assert_allclose(outs[layer], want, atol=2e-5, rtol=1e-4)
        self.note_indexed(m)
        return True

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend(self, data):
        """Record ids: truthfully the ones a sequence holds past its record, or future ones."""
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        if len(m.known) < len(m.tokens):
            ids = m.tokens[len(m.known):]
            if data.draw(st.booleans()):
                ids = ids[:data.draw(st.integers(1, len(ids)))]
        else:
            ids = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
        self.cache.extend_tokens(sid, ids)
        m.known += ids
        self.note_indexed(m)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.remove_sequence(sid)
        del self.model[sid]

    @precondition(lambda self: any(not m.tree for m in self.model.values()))
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(s for s, m in self.model.items() if not m.tree)))
        m = self.model[parent]
        pos = data.draw(st.integers(0, len(m.tokens)))
        child = self.next_id
        try:
            self.cache.fork_sequence(parent, child, pos)
        except kvcache.CacheFullError:
            assert pos % PS and self.cache.num_available_pages == 0
            return
        self.next_id += 1
        self.model[child] = PSeq(m.tokens[:pos], m.known[:pos])

    @precondition(lambda self: any(not m.tree for m in self.model.values()))
    @rule(data=st.data())
    def popn(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.model.items() if not m.tree)))
        m = self.model[sid]
        n = data.draw(st.integers(0, len(m.tokens)))
        try:
            self.cache.popn(sid, n)
        except kvcache.CacheFullError:
            assert self.cache.num_available_pages == 0
            return
        del m.tokens[len(m.tokens) - n:]
        del m.known[len(m.tokens):]

    @precondition(lambda self: any(m.tree for m in self.model.values()))
    @rule(data=st.data())
    def commit(self, data):
        sid = data.draw(st.sampled_from(sorted(s for s, m in self.model.items() if m.tree)))
        m = self.model[sid]
        leaf = data.draw(st.integers(-1, len(m.tree) - 1))
        self.cache.commit_accepted_token_tree_nodes([sid], [leaf])
        path = []
        while leaf != -1:
            path.append(m.tree[leaf][0])
            leaf = m.tree[leaf][1]
        m.tree = []
        del m.known[len(m.tokens):]          # ids recorded past the tree's root are dropped
        m.tokens += path[::-1]
        self.note_indexed(m)

    @rule()
    def clear_cached(self):
        """Every page that only the index holds can be evicted (none is stranded)."""
        cached = self.cache.num_cached_pages
        free = self.cache.num_available_pages
        assert self.cache.clear_prefix_cache() == cached
        assert self.cache.num_cached_pages == 0 and self.cache.num_available_pages == free

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def match(self, data):
        tokens = self.prompt(data)
        got = self.cache.match_prefix(tokens)
        assert got % PS == 0 and got <= len(tokens) - 1
        assert got == 0 or tuple(tokens[:got]) in self.cached

    @invariant()
    def contents(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        c.state.pt.check_invariants()
        c.manager.prefix.check()
        twin = copy.deepcopy(c.manager.prefix)             # every cached page can be evicted, now
        assert twin.clear() == c.num_cached_pages
        assert sorted(c.sequence_ids) == sorted(self.model)
        assert 0 <= c.num_cached_pages <= c.num_available_pages <= c.num_total_pages
        for s, m in self.model.items():
            assert c.sequence_length(s) == len(m.tokens) + len(m.tree)
            if m.tokens:
                k, v = (kvcache.to_numpy(x) for x in c.get_kv(s, 0, len(m.tokens)))
                want = [np.stack([kv_row(t, i)[j] for i, t in enumerate(m.tokens)], 1) for j in (0, 1)]
                np.testing.assert_array_equal(k, want[0])
                np.testing.assert_array_equal(v, want[1])


# 60 programs of 40 steps take ~16 s on 2 cores (30 over the shared keys ~8 s): CI runs a third
# of them, of the same rules and length (fresh random ones every run), `make test-all` the full
# counts as well (the ...Full classes); KVCACHE_FUZZ_EXAMPLES sets every count
FUZZ_EXAMPLES = os.environ.get("KVCACHE_FUZZ_EXAMPLES")
SETTINGS = settings(stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(SETTINGS, max_examples=int(FUZZ_EXAMPLES or 20))


@pytest.mark.slow
class TestPrefixMachineFull(TestPrefixMachine):
    settings = settings(SETTINGS, max_examples=int(FUZZ_EXAMPLES or 60))


class SharedKeyPrefixMachine(PrefixMachine):
    """The same programs over prompts of ids {0, 1} built from two page-sized words: most pages
    are alike at their depth after other prefixes, so the index's keys (a depth and one page)
    are shared all the time and only the prefix tells nodes apart."""

    def prompt(self, data):
        words = data.draw(st.lists(st.sampled_from([(0, 1, 0, 1), (1, 1, 0, 0)]), max_size=4))
        tail = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=6))
        return [t for w in words for t in w] + tail


TestSharedKeyPrefixMachine = SharedKeyPrefixMachine.TestCase
TestSharedKeyPrefixMachine.settings = settings(SETTINGS, max_examples=int(FUZZ_EXAMPLES or 10))


@pytest.mark.slow
class TestSharedKeyPrefixMachineFull(TestSharedKeyPrefixMachine):
    settings = settings(SETTINGS, max_examples=int(FUZZ_EXAMPLES or 30))
