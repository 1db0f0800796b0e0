"""Model-based test of window groups (``CacheConfig.layer_kinds``, docs/hybrid.md increment 1):
random programs of add / fork / popn / remove / forward / aborted forward run on a cache with
two window groups (layers 0 and 2, each its own window; layer 1 full attention), on the same
cache without groups, and on a plain token-list model.

The judges:
* every forward's output of every layer equals the cache without groups given the same
  ``window_left`` (a windowed layer's default -1 is its group's window), and the dense
  token-list model's attention with that window;
* the model knows the freeing rule only as docs/hybrid.md states it (after a forward a
  sequence of length ``L`` keeps, per group, the pages from the one holding position
  ``max(0, L - w)`` on; a fork keeps them from ``fork_pos - w``; popn keeps them): each
  sequence's held pages (``window_pages``) are exactly those, so at most ``ceil(w /
  page_size) + 1`` between forwards, the keys still held read back (``get_kv(layer=)``) as
  stored, and forks and pops that would need a freed key are refused (InvalidArgumentError,
  UnsupportedFeatureError) with nothing changed;
* page accounting (``check_invariants``: every group's reference counts, free list, live
  lists) after every step; an aborted forward or a refused call changes nothing.
"""

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcache
from kvcache.conformance import dense_attention
from kvcache.conformance.model import rope as oracle_rope

L, HQ, HKV, D, PS = 3, 4, 2, 8, 4
WINDOWED = (0, 2)
_ROPE = types.SimpleNamespace(rope_rotary_dim=0, rope_inv_freq=None, rope_theta=10000.0,
                              rope_scale=1.0)


def rotate(x, positions):
    return oracle_rope(x, np.asarray(positions), _ROPE)


class _ModelFailed(Exception):
    """Raised inside a forward by the aborted_forward rule."""


class Seq:
    """A model sequence: unrotated K and V rows per layer (position = index) and, per windowed
    layer, the first page its group still holds."""

    def __init__(self):
        self.k = [[] for _ in range(L)]
        self.v = [[] for _ in range(L)]
        self.first = {layer: 0 for layer in WINDOWED}

    def __len__(self):
        return len(self.k[0])


class GroupMachine(RuleBasedStateMachine):
    rope_mode = "normal"

    def __init__(self):
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.next_id = 0

    @initialize(w0=st.integers(0, 10), w2=st.integers(0, 13), chunk=st.sampled_from([10, 24]))
    def setup(self, w0, w2, chunk):
        self.w = {0: w0, 2: w2}
        base = dict(num_layers=L, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
                    max_batch_size=3, max_total_tokens=96, prefill_chunk_size=chunk,
                    dtype="float32", rope_mode=self.rope_mode)
        self.cfg = kvcache.CacheConfig(**base, layer_kinds={
            layer: kvcache.Window(w) for layer, w in self.w.items()})
        self.cache = kvcache.PagedKVCache(self.cfg, backend="reference")
        self.plain = kvcache.PagedKVCache(kvcache.CacheConfig(**base), backend="reference")
        self.model: dict[int, Seq] = {}

    def name(self, layer):
        return f"window={self.w[layer]}"

    def first_kept(self, layer, length):
        """The rule: the page holding position max(0, length - w)."""
        return max(0, length - self.w[layer]) // PS

    # ------------------------------------------------------------------ helpers
    def snapshot(self):
        c = self.cache
        kv = {}
        for s in self.model:
            for layer in range(L):
                start = c.window_pages(s)[self.name(layer)][0] if layer in WINDOWED else 0
                kv[s, layer] = [kvcache.to_numpy(a).copy()
                                for a in c.get_kv(s, start, None, layer=layer)]
        return (c.num_available_pages_by_group, {s: c.sequence_length(s) for s in self.model},
                {s: c.window_pages(s) for s in self.model}, kv)

    def expect_unchanged(self, before):
        after = self.snapshot()
        assert before[:3] == after[:3]
        for key, (k, v) in before[3].items():
            np.testing.assert_array_equal(k, after[3][key][0])
            np.testing.assert_array_equal(v, after[3][key][1])

    def keys(self, m, layer, positions=None):
        k = np.array(m.k[layer]).reshape(-1, HKV, D)
        if self.rope_mode != "none" and len(k):
            k = rotate(k, np.arange(len(k)) if positions is None else positions)
        return k

    # ------------------------------------------------------------------ rules
    @rule()
    def add(self):
        sid = self.next_id
        self.next_id += 1
        self.cache.add_sequence(sid)
        self.plain.add_sequence(sid)
        self.model[sid] = Seq()

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        self.cache.remove_sequence(sid)
        self.plain.remove_sequence(sid)
        del self.model[sid]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[parent]
        # where the windows allow a fork, and around it
        edge = [min(len(m), m.first[layer] * PS + self.w[layer]) for layer in WINDOWED]
        pos = data.draw(st.integers(0, len(m)) | st.just(-1) | st.sampled_from(edge)
                        | st.sampled_from([max(0, e - 1) for e in edge]))
        n = len(m) if pos == -1 else pos
        below = [layer for layer in WINDOWED if m.first[layer] > self.first_kept(layer, n)]
        before = self.snapshot()
        child = self.next_id
        try:
            self.cache.fork_sequence(parent, child, pos)
        except kvcache.InvalidArgumentError as exc:
            assert below, exc
            assert any(f"window group '{self.name(layer)}'" in str(exc) for layer in below), exc
            self.expect_unchanged(before)
            return
        except kvcache.CacheFullError:
            self.expect_unchanged(before)
            return
        assert not below, f"forked at {n} below the window of layers {below}"
        self.plain.fork_sequence(parent, child, pos)
        self.next_id += 1
        c = self.model[child] = Seq()
        c.k = [x[:n] for x in m.k]
        c.v = [x[:n] for x in m.v]
        c.first = {layer: self.first_kept(layer, n) for layer in WINDOWED}

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def popn(self, data):
        sid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[sid]
        allowed = min(len(m) - max(m.first[layer] * PS + self.w[layer], 0)
                      for layer in WINDOWED)
        n = data.draw(st.integers(0, len(m)) | st.sampled_from(
            [x for x in (allowed, allowed + 1) if 0 <= x <= len(m)] or [0]))
        below = n and any(m.first[layer] > self.first_kept(layer, len(m) - n)
                          for layer in WINDOWED)
        before = self.snapshot()
        try:
            self.cache.popn(sid, n)
        except kvcache.UnsupportedFeatureError as exc:
            assert below and "below the window" in str(exc), exc
            self.expect_unchanged(before)
            return
        except kvcache.CacheFullError:
            self.expect_unchanged(before)
            return
        assert not below, f"popn {n} of {len(m)} below a window {m.first}"
        self.plain.popn(sid, n)
        if n:
            for layer in range(L):
                m.k[layer] = m.k[layer][:-n]
                m.v[layer] = m.v[layer][:-n]

    def _inputs(self, total):
        return [tuple(self.rng.standard_normal((total, h, D)).astype(np.float32)
                      for h in (HQ, HKV, HKV)) for _ in range(L)]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def forward(self, data):
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3,
                                 unique=True))
        lens = [data.draw(st.integers(1, 1 if data.draw(st.booleans()) else 9)) for _ in ids]
        if sum(lens) > self.cfg.prefill_chunk_size:
            return
        # per layer: the window the call passes to the grouped cache (-1: the group's) and
        # the one the plain cache and the model then use
        calls = {}
        for layer in range(L):
            w = self.w.get(layer)
            if w is None:
                passed = data.draw(st.sampled_from([-1, -1, 3]))
                calls[layer] = (passed, passed)
            else:
                passed = data.draw(st.sampled_from([-1, w, max(0, w - 2)]))
                calls[layer] = (passed, w if passed == -1 else passed)
        before = self.snapshot()
        need = self.cache.pages_needed(ids, lens, by_group=True)
        fits = self.cache.can_append(ids, lens)
        try:
            self.cache.begin_forward(ids, lens)
        except kvcache.CacheFullError as exc:
            assert not fits
            short = [g for g, n in need.items() if n > before[0][g]]
            # the window groups are counted before the full pool
            named = [g for g in short if g != "full"] or short
            assert named and (named[0] == "full" or f"'{named[0]}'" in str(exc)), (short, exc)
            self.expect_unchanged(before)
            return
        assert fits, (need, before[0])
        self.plain.begin_forward(ids, lens)
        inputs = self._inputs(sum(lens))
        outs = []
        for layer in range(L):
            q, k, v = inputs[layer]
            passed, used = calls[layer]
            o = self.cache.attention(layer, *map(self.cache.from_numpy, (q, k, v)),
                                     window_left=passed)
            o_plain = self.plain.attention(layer, *map(self.plain.from_numpy, (q, k, v)),
                                           window_left=used)
            np.testing.assert_allclose(kvcache.to_numpy(o), kvcache.to_numpy(o_plain),
                                       atol=1e-5, rtol=1e-5)
            outs.append(kvcache.to_numpy(o))
        self.cache.end_forward()
        self.plain.end_forward()
        off = 0
        for s, n in zip(ids, lens):
            m = self.model[s]
            hist = len(m)
            pos = hist + np.arange(n)
            for layer in range(L):
                q, k, v = (x[off:off + n].astype(np.float64) for x in inputs[layer])
                m.k[layer] += list(k)
                m.v[layer] += list(v)
                keys = self.keys(m, layer)
                qr = rotate(q, pos) if self.rope_mode != "none" else q
                used = calls[layer][1]
                j = np.arange(hist + n)[None, :]
                vis = j <= pos[:, None]
                if used >= 0:
                    vis &= j >= (pos - used)[:, None]
                expect = dense_attention(qr, keys, np.array(m.v[layer]), vis, D ** -0.5,
                                         HQ // HKV)[0]
                np.testing.assert_allclose(outs[layer][off:off + n], expect, atol=2e-5,
                                           rtol=1e-4)
            for layer in WINDOWED:            # freed at end_forward: the rule
                m.first[layer] = max(m.first[layer], self.first_kept(layer, len(m)))
            off += n

    @precondition(lambda self: self.model)
    @rule(data=st.data(), how=st.sampled_from(["raise", "abort", "window"]))
    def aborted_forward(self, data, how):
        """A forward undone after some layers (an exception in ``with cache.forward``,
        ``abort_forward``, or a window_left above a group's window, refused): nothing of it
        stays, no page is freed."""
        ids = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, max_size=3,
                                 unique=True))
        lens = [data.draw(st.integers(1, 6)) for _ in ids]
        if sum(lens) > self.cfg.prefill_chunk_size:
            return
        layers = data.draw(st.integers(0, L))
        before = self.snapshot()
        total = sum(lens)
        inputs = self._inputs(total)

        def run_layers():
            for layer, (q, k, v) in enumerate(inputs[:layers]):
                self.cache.attention(layer, *map(self.cache.from_numpy, (q, k, v)))
        try:
            if how == "raise":
                with pytest.raises(_ModelFailed):
                    with self.cache.forward(ids, lens):
                        run_layers()
                        raise _ModelFailed
            else:
                self.cache.begin_forward(ids, lens)
                run_layers()
                if how == "window":
                    layer = data.draw(st.sampled_from(WINDOWED))
                    if layer not in self.cache.layers_run:
                        q, k, v = inputs[layer]
                        with pytest.raises(kvcache.InvalidArgumentError, match=f"layer {layer}"):
                            self.cache.attention(layer, *map(self.cache.from_numpy, (q, k, v)),
                                                 window_left=self.w[layer] + 1)
                if layers < L:
                    with pytest.raises(kvcache.ForwardStateError):
                        self.cache.end_forward()
                self.cache.abort_forward()
        except kvcache.CacheFullError:
            pass
        self.expect_unchanged(before)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def refused(self, data):
        """What window groups do not compose with yet: refused, nothing changed."""
        sid = data.draw(st.sampled_from(sorted(self.model)))
        before = self.snapshot()
        for call in (lambda: self.cache.begin_forward([sid], [1], [-1]),
                     lambda: self.cache.pages_needed([sid], [1], [-1]),
                     lambda: self.cache.export_sequence(sid),
                     lambda: self.cache.get_kv(sid),
                     lambda: self.cache.enable_sliding_window(sid, 8, 0)):
            with pytest.raises(kvcache.UnsupportedFeatureError):
                call()
        self.expect_unchanged(before)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def accounting(self):
        if not hasattr(self, "cache"):
            return
        self.cache.state.pt.check_invariants()
        self.plain.state.pt.check_invariants()
        assert self.cache.num_available_pages == self.plain.num_available_pages
        for s, m in self.model.items():
            assert self.cache.sequence_length(s) == len(m)
            held = self.cache.window_pages(s)
            for layer in WINDOWED:
                first, pages = held[self.name(layer)]
                assert first == m.first[layer] * PS, (s, layer, first, m.first)
                assert pages == -(-len(m) // PS) - m.first[layer]
                assert pages <= -(-self.w[layer] // PS) + 1, (s, layer, pages)

    @invariant()
    def stored_kv(self):
        if not hasattr(self, "cache"):
            return
        for s, m in self.model.items():
            for layer in range(L):
                start = m.first.get(layer, 0) * PS
                if start >= len(m):
                    continue
                k, v = (kvcache.to_numpy(a) for a in self.cache.get_kv(s, start, None,
                                                                       layer=layer))
                stored = self.keys(m, layer) if self.rope_mode == "normal" else \
                    np.array(m.k[layer]).reshape(-1, HKV, D)
                np.testing.assert_allclose(k, stored[start:], atol=2e-6)
                np.testing.assert_allclose(v, np.array(m.v[layer])[start:], atol=2e-6)


class InlineGroupMachine(GroupMachine):
    """Inline RoPE: the kernels rotate a windowed entry's key j at k_rope_offset + j, so the
    offset of its first live page must be exact."""
    rope_mode = "inline"


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=list(HealthCheck))

# 40 programs of 30 steps take ~7 s on 2 cores: CI runs 15 of the same rules and length (fresh
# random ones every run), `make test-all` the 150 of TestWindowGroupsModelFull as well
TestWindowGroupsModel = GroupMachine.TestCase
TestWindowGroupsModel.settings = settings(SETTINGS, max_examples=15)
TestInlineWindowGroupsModel = InlineGroupMachine.TestCase
TestInlineWindowGroupsModel.settings = settings(SETTINGS, max_examples=20)


@pytest.mark.slow
class TestWindowGroupsModelFull(TestWindowGroupsModel):
    settings = settings(SETTINGS, max_examples=150, stateful_step_count=40)
