"""Model-based test: random programs of add / fork / popn / remove / forward / token tree +
commit / sliding window run on the cache and on a plain token-list model.

The model knows nothing of pages or blocks: each sequence is a list of per-layer K/V rows and
attention is dense softmax over that list. It catches page-table bugs that the reference backend
(which reads through the page table) would share with the core. For sliding windows next to forks
it also tracks how many tokens two sequences hold in the same pages (whole pages up to a fork
point), which decides the windows the cache must refuse.
"""

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

import kvcache
from kvcache.backend import RopeSpec
from kvcache.conformance import dense_attention
from kvcache.conformance.model import rope as oracle_rope

L, HQ, HKV, D, PS = 2, 4, 2, 8, 4
ROPE = RopeSpec(10000.0, 1.0)
# the judge rotates with the oracle's RoPE, written from the SPEC, never the reference
# backend's own (a sign error there would otherwise agree with itself)
_ROPE_CONFIG = types.SimpleNamespace(rope_rotary_dim=0, rope_inv_freq=None,
                                     rope_theta=ROPE.theta, rope_scale=ROPE.scale)


def rotate(x, positions, spec):
    assert spec is ROPE
    return oracle_rope(x, positions, _ROPE_CONFIG)


class _ModelFailed(Exception):
    """Raised inside a forward by the aborted_forward rule."""


def dense(q, keys, vals, visible):
    """q (n,HQ,D), keys/vals (m,HKV,D), visible (n,m) -> o (n,HQ,D) in float64."""
    return dense_attention(q, keys, vals, visible, D ** -0.5, HQ // HKV)[0]


class Seq:
    """Model sequence: committed rows (unrotated k, v, position) per layer plus the uncommitted
    tree (rows and parents)."""

    def __init__(self):
        self.k = [[] for _ in range(L)]
        self.v = [[] for _ in range(L)]
        self.pos = []                 # RoPE position each committed K was stored with
        self.tree_k = [[] for _ in range(L)]
        self.tree_v = [[] for _ in range(L)]
        self.tree_parent = []
        self.tree_depth = []
        self.window = None            # (w, s)
        self.share = {}               # other sequence -> tokens both hold in the same pages

    def copy(self, n):
        c = Seq()
        c.k = [x[:n] for x in self.k]
        c.v = [x[:n] for x in self.v]
        c.pos = self.pos[:n]
        return c

    def __len__(self):
        return len(self.pos) + len(self.tree_parent)


class CacheMachine(RuleBasedStateMachine):
    rope_mode = "normal"
    sliding = False
    one_pass = False        # CacheConfig(batch_invariant=True): one pass a sequence, no trees

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.next_id = 0

    @initialize(dtype=st.just("float32"))
    def setup(self, dtype):
        self.cfg = kvcache.CacheConfig(
            num_layers=L, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
            max_batch_size=4, max_total_tokens=96, prefill_chunk_size=24, dtype=dtype,
            rope_mode=self.rope_mode, support_sliding_window=self.sliding,
            batch_invariant=self.one_pass)
        self.cache = kvcache.PagedKVCache(self.cfg, backend="reference")
        self.model: dict[int, Seq] = {}

    def cut_share(self, sid, length):
        """Sequence ``sid`` now holds ``length`` tokens: pages are shared whole (a fork copies a
        partial page), so it shares at most the whole pages of them with anyone."""
        m = self.model[sid]
        for other in m.share:
            m.share[other] = min(m.share[other], length // PS * PS)
            self.model[other].share[sid] = m.share[other]

    # ------------------------------------------------------------------ helpers
    def snapshot(self):
        c = self.cache
        return (c.num_available_pages, {s: c.sequence_length(s) for s in self.model},
                {s: [a.copy() for a in c.get_kv(s)] for s in self.model if c.sequence_length(s)})

    def expect_unchanged(self, before):
        after = self.snapshot()
        assert before[0] == after[0] and before[1] == after[1]
        for s, (k, v) in before[2].items():
            np.testing.assert_array_equal(k, after[2][s][0])
            np.testing.assert_array_equal(v, after[2][s][1])

    def stored_k(self, seq, layer):
        """K as the cache stores it: rotated at its position in 'normal' mode."""
        k = np.array(seq.k[layer]).reshape(-1, HKV, D)
        if self.cfg.effective_rope_mode == "normal" and len(k):
            k = rotate(k, np.array(seq.pos), ROPE)
        return k

    def keys_for_attention(self, seq, layer):
        """History keys as attention sees them (rotated; inline mode rotates by kept index)."""
        k = np.array(seq.k[layer]).reshape(-1, HKV, D)
        mode = self.cfg.effective_rope_mode
        if mode == "normal" and len(k):
            k = rotate(k, np.array(seq.pos), ROPE)
        elif mode == "inline" and len(k):
            k = rotate(k, np.arange(len(k)), ROPE)
        return k, np.array(seq.v[layer]).reshape(-1, HKV, D)

    # ------------------------------------------------------------------ rules
    @rule()
    def add(self):
        sid = self.next_id
        self.next_id += 1
        self.cache.add_sequence(sid)
        self.model[sid] = Seq()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.remove_sequence(sid)
        for other in self.model.pop(sid).share:
            del self.model[other].share[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data)

    def _fork(self, data, parent=None):
        """Returns the new child's id, or None."""
        if parent is None:
            parent = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[parent]
        special = list(range(0, len(m) + 1, PS)) + ([min(m.window[1], len(m))] if m.window else [])
        pos = data.draw(st.integers(0, len(m)) | st.just(-1) | st.sampled_from(special))
        n = len(m) if pos == -1 else pos
        before = self.snapshot()
        child = self.next_id
        try:
            self.cache.fork_sequence(parent, child, pos)
        except kvcache.KVCacheError as exc:
            self.expect_unchanged(before)
            ok = (m.tree_parent and isinstance(exc, kvcache.ForwardStateError)) or \
                 (isinstance(exc, kvcache.CacheFullError)) or \
                 (m.window is not None and n > m.window[1] and isinstance(exc, kvcache.InvalidArgumentError))
            assert ok, exc
            return None
        assert not m.tree_parent
        assert m.window is None or n <= m.window[1], "a windowed sequence forked past its sinks"
        self.next_id += 1
        c = self.model[child] = m.copy(n)
        c.share = {o: min(k, n // PS * PS) for o, k in m.share.items()}
        c.share[parent] = n // PS * PS
        for o, k in c.share.items():
            self.model[o].share[child] = k
        return child

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def popn(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        n = data.draw(st.integers(0, len(m)))
        before = self.snapshot()
        try:
            self.cache.popn(sid, n)
        except kvcache.KVCacheError as exc:
            self.expect_unchanged(before)
            assert (m.tree_parent and isinstance(exc, kvcache.ForwardStateError)) or \
                   isinstance(exc, kvcache.CacheFullError), exc
            return
        assert not m.tree_parent
        if n:
            for layer in range(L):
                m.k[layer] = m.k[layer][:-n]
                m.v[layer] = m.v[layer][:-n]
            m.pos = m.pos[:-n]
        self.cut_share(sid, len(m))

    @precondition(lambda self: self.sliding and self.model)
    @rule(data=st.data())
    def enable_window(self, data):
        candidates = [s for s, m in sorted(self.model.items()) if m.window is None]
        if not candidates:
            return
        self._enable(data.draw(st.sampled_from(candidates)), data)

    @precondition(lambda self: self.sliding and self.model)
    @rule(data=st.data())
    def window_fork(self, data):
        """A fork next to sliding windows, then forwards on both sides: a windowed parent forked
        within its sinks or past them, at its page-aligned end or not; a window on the child (its
        shared prefix longer or shorter than the window and the sinks)."""
        parent = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.sampled_from([0, PS, 2 * PS, 3 * PS]) | st.integers(0, 16))
        if n:
            self._plain_forward([parent], [n])
        if self.model[parent].window is None:
            self._enable(parent, data)
        child = self._fork(data, parent)
        if child is None:
            return
        if data.draw(st.booleans()):
            self._enable(child, data)
        for _ in range(data.draw(st.integers(0, 4))):
            ids = data.draw(st.lists(st.sampled_from([parent, child]), min_size=1, unique=True))
            self._plain_forward(ids, [data.draw(st.integers(1, 7)) for _ in ids])

    def _plain_forward(self, ids, lens):
        before = self.snapshot()
        try:
            self.cache.begin_forward(ids, lens)
        except kvcache.CacheFullError:
            self.expect_unchanged(before)
            return
        self._run_forward(ids, lens, None)

    def _enable(self, sid, data):
        m = self.model[sid]
        shared = max(m.share.values(), default=0)
        w = data.draw(st.integers(2, 20) | st.integers(len(m) + 1, len(m) + 8))
        s = data.draw(st.integers(0, w - 1) | st.sampled_from([min(x, w - 1) for x in (shared, len(m))]))
        before = self.snapshot()
        if shared > s:      # pages shared with another sequence cannot slide out
            with pytest.raises(kvcache.InvalidArgumentError, match=f"sequence {sid} .*{shared}"):
                self.cache.enable_sliding_window(sid, w, s)
            self.expect_unchanged(before)
            return
        self.cache.enable_sliding_window(sid, w, s)
        self.model[sid].window = (w, s)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def forward(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        use_tree = (not self.sliding and not self.one_pass and self.rope_mode != "inline"
                    and (data.draw(st.booleans()) or any(self.model[s].tree_parent for s in ids)))
        lens = [data.draw(st.integers(1, 1 if data.draw(st.booleans()) else 7)) for _ in ids]
        parents = None
        if use_tree:
            parents = []
            for s, n in zip(ids, lens):
                base = len(self.model[s].tree_parent)
                parents += [data.draw(st.integers(-1, base + r - 1)) for r in range(n)]
        before = self.snapshot()
        if sum(lens) > self.cfg.prefill_chunk_size:      # too many tokens for one forward
            with pytest.raises(kvcache.InvalidArgumentError, match="prefill_chunk_size"):
                self.cache.begin_forward(ids, lens, parents)
            self.expect_unchanged(before)
            return
        try:
            self.cache.begin_forward(ids, lens, parents)
        except kvcache.CacheFullError:
            self.expect_unchanged(before)
            return
        self._run_forward(ids, lens, parents)

    def _run_forward(self, ids, lens, parents):
        total = sum(lens)
        positions = kvcache.to_numpy(self.cache.query_positions())
        qkv = [(self.rng.standard_normal((total, HQ, D)), self.rng.standard_normal((total, HKV, D)),
                self.rng.standard_normal((total, HKV, D))) for _ in range(L)]
        outs = []
        for layer in range(L):
            q, k, v = (self.cache.from_numpy(x.astype(np.float32)) for x in qkv[layer])
            outs.append(kvcache.to_numpy(self.cache.attention(layer, q, k, v)))
        self.cache.end_forward()
        mode = self.cfg.effective_rope_mode
        off = 0
        for i, (s, n) in enumerate(zip(ids, lens)):
            m = self.model[s]
            rows = slice(off, off + n)
            if parents is not None:
                self._tree_forward(m, qkv, outs, positions, rows, parents[off:off + n])
            else:
                hist = len(m.pos)
                exp_pos = hist + np.arange(n)
                np.testing.assert_array_equal(positions[rows], exp_pos)
                for layer in range(L):
                    q, k, v = (x[rows].astype(np.float32).astype(np.float64) for x in qkv[layer])
                    hk, hv = self.keys_for_attention(m, layer)
                    if mode != "none":
                        q = rotate(q, exp_pos, ROPE)
                        kr = rotate(k, exp_pos, ROPE)
                    else:
                        kr = k
                    keys = np.concatenate([hk, kr]) if len(hk) else kr
                    vals = np.concatenate([hv, v]) if len(hv) else v
                    vis = np.arange(hist + n)[None, :] <= (hist + np.arange(n))[:, None]
                    np.testing.assert_allclose(outs[layer][rows], dense(q, keys, vals, vis),
                                               atol=2e-5, rtol=1e-4)
                    m.k[layer] += list(k)
                    m.v[layer] += list(v)
                m.pos += list(exp_pos)
                if m.window is not None and len(m.pos) > m.window[0]:
                    w, sink = m.window
                    keep = list(range(sink)) + list(range(len(m.pos) - (w - sink), len(m.pos)))
                    for layer in range(L):
                        m.k[layer] = [m.k[layer][j] for j in keep]
                        m.v[layer] = [m.v[layer][j] for j in keep]
                    m.pos = list(range(w))   # inline RoPE: kept tokens renumbered
                elif m.window is not None and mode == "inline":
                    m.pos = list(range(len(m.pos)))
            off += n

    def _tree_forward(self, m, qkv, outs, positions, rows, parents):
        n = rows.stop - rows.start
        hist = len(m.pos)
        for p in parents:
            m.tree_parent.append(int(p))
            m.tree_depth.append(0 if p < 0 else m.tree_depth[p] + 1)
        size = len(m.tree_parent)
        depth = np.array(m.tree_depth[size - n:])
        exp_pos = hist + depth
        np.testing.assert_array_equal(positions[rows], exp_pos)
        mode = self.cfg.effective_rope_mode
        for layer in range(L):
            q, k, v = (x[rows].astype(np.float32).astype(np.float64) for x in qkv[layer])
            m.tree_k[layer] += list(k)
            m.tree_v[layer] += list(v)
            hk, hv = self.keys_for_attention(m, layer)
            tree_k = np.array(m.tree_k[layer])
            tree_pos = hist + np.array(m.tree_depth)
            if mode == "normal":
                q = rotate(q, exp_pos, ROPE)
                tree_k = rotate(tree_k, tree_pos, ROPE)
            keys = np.concatenate([hk, tree_k]) if len(hk) else tree_k
            vals = np.concatenate([hv, np.array(m.tree_v[layer])]) if len(hv) else np.array(m.tree_v[layer])
            vis = np.zeros((n, hist + size), bool)
            vis[:, :hist] = True
            for r in range(n):
                node = size - n + r
                while node != -1:
                    vis[r, hist + node] = True
                    node = m.tree_parent[node]
            np.testing.assert_allclose(outs[layer][rows], dense(q, keys, vals, vis), atol=2e-5, rtol=1e-4)

    @precondition(lambda self: any(m.tree_parent for m in self.model.values()))
    @rule(data=st.data())
    def commit(self, data):
        pending = [s for s, m in sorted(self.model.items()) if m.tree_parent]
        ids = data.draw(st.lists(st.sampled_from(pending), min_size=1, unique=True))
        leaves = [data.draw(st.integers(-1, len(self.model[s].tree_parent) - 1)) for s in ids]
        self.cache.commit_accepted_token_tree_nodes(ids, leaves)
        for s, leaf in zip(ids, leaves):
            m = self.model[s]
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = m.tree_parent[node]
            for node in reversed(path):
                for layer in range(L):
                    m.k[layer].append(m.tree_k[layer][node])
                    m.v[layer].append(m.tree_v[layer][node])
                m.pos.append(len(m.pos))
            m.tree_k = [[] for _ in range(L)]
            m.tree_v = [[] for _ in range(L)]
            m.tree_parent, m.tree_depth = [], []
            self.cut_share(s, len(m))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["raise", "abort"]))
    def aborted_forward(self, data, how):
        """A forward undone after some layers (an exception inside ``with cache.forward``, or
        abort_forward): the model does not change, so the cache must not either."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=4, unique=True))
        use_tree = (not self.sliding and not self.one_pass and self.rope_mode != "inline"
                    and (data.draw(st.booleans()) or any(self.model[s].tree_parent for s in ids)))
        lens = [data.draw(st.integers(1, 1 if data.draw(st.booleans()) else 7)) for _ in ids]
        parents = None
        if use_tree:
            parents = []
            for s, n in zip(ids, lens):
                base = len(self.model[s].tree_parent)
                parents += [data.draw(st.integers(-1, base + r - 1)) for r in range(n)]
        if sum(lens) > self.cfg.prefill_chunk_size:
            return
        layers = data.draw(st.integers(0, L))
        before = self.snapshot()
        total = sum(lens)
        try:
            if how == "raise":
                with pytest.raises(_ModelFailed):
                    with self.cache.forward(ids, lens, parents):
                        self._run_layers(total, layers)
                        raise _ModelFailed
            else:
                self.cache.begin_forward(ids, lens, parents)
                self._run_layers(total, layers)
                self.cache.abort_forward()
        except kvcache.CacheFullError:
            pass
        self.expect_unchanged(before)
        for s, m in self.model.items():
            assert self.cache.state.pt.seqs[s].tree_parent == m.tree_parent, s

    def _run_layers(self, total, layers):
        for layer in range(layers):
            q, k, v = (self.cache.from_numpy(self.rng.standard_normal((total, h, D)).astype(np.float32))
                       for h in (HQ, HKV, HKV))
            self.cache.attention(layer, q, k, v)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting(self):
        if not hasattr(self, "cache"):
            return
        self.cache.state.pt.check_invariants()
        assert self.cache.num_sequences == len(self.model)
        for s, m in self.model.items():
            assert self.cache.sequence_length(s) == len(m), s
        assert self.cache.total_sequence_length == sum(len(m) for m in self.model.values())

    @invariant()
    def stored_kv(self):
        if not hasattr(self, "cache"):
            return
        for s, m in self.model.items():
            if not len(m.pos) or m.tree_parent:
                continue
            k, v = (kvcache.to_numpy(a) for a in self.cache.get_kv(s, 0, len(m.pos)))
            for layer in range(L):
                np.testing.assert_allclose(k[layer], self.stored_k(m, layer), atol=2e-6)
                np.testing.assert_allclose(v[layer], np.array(m.v[layer]).reshape(-1, HKV, D), atol=2e-6)


class SlidingMachine(CacheMachine):
    rope_mode = "normal"      # forced to inline by the sliding window
    sliding = True


class NoRopeMachine(CacheMachine):
    rope_mode = "none"


class InvariantMachine(CacheMachine):
    one_pass = True


SETTINGS = settings(max_examples=40, stateful_step_count=25, deadline=None,
                    suppress_health_check=list(HealthCheck))

TestCacheModel = CacheMachine.TestCase
TestCacheModel.settings = SETTINGS
TestSlidingModel = SlidingMachine.TestCase
# 100 programs of 30 steps take ~6 s on 2 cores: CI runs 25 programs of the same rules and
# length (fresh random ones every run), `make test-all` the full 100 as well
TestSlidingModel.settings = settings(SETTINGS, max_examples=25, stateful_step_count=30)


@pytest.mark.slow
class TestSlidingModelFull(TestSlidingModel):
    settings = settings(SETTINGS, max_examples=100, stateful_step_count=30)


TestNoRopeModel = NoRopeMachine.TestCase
TestNoRopeModel.settings = settings(SETTINGS, max_examples=15)
# the batch-invariant plans (one paged pass per sequence, no shared-prefix depth) judged by the
# same token-list model
TestInvariantModel = InvariantMachine.TestCase
TestInvariantModel.settings = settings(SETTINGS, max_examples=15)
