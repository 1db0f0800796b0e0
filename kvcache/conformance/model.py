"""The dense model: what a paged KV cache computes, written without pages.

``dense_attention`` is softmax attention spelled out and ``rope`` is RoPE as the spec states it
(neither shares code with the reference backend, whose kernels they judge: a sign error there must
not be copied here); ``DenseModel`` keeps each sequence as the plain list of its tokens. Both are
the oracle for the core: the suite checks the reference backend against them, and unit tests of
the core may use them directly.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from kvcache.config import CacheConfig
from .tolerance import round_to


def rope(x: np.ndarray, positions, config: CacheConfig) -> np.ndarray:
    """``x`` (n, H, D) rotated at ``positions`` (n,), float64, from the configuration alone
    (SPEC section 3, Llama's rotate-half): over the first ``R`` dims (``rope_rotary_dim``, 0:
    all), pair ``i < R/2`` turns by ``angle_i = position * rope_scale * inv_freq_i`` with
    ``inv_freq_i = rope_theta ** (-2i / R)`` (or the model's ``rope_inv_freq``): ``x_i cos -
    x_{i+R/2} sin`` and ``x_{i+R/2} cos + x_i sin``; dims from ``R`` on pass through."""
    x = np.asarray(x, np.float64)
    r = config.rope_rotary_dim or x.shape[-1]
    half = r // 2
    if config.rope_inv_freq:
        inv_freq = np.asarray(config.rope_inv_freq, np.float64)
    else:
        inv_freq = float(config.rope_theta) ** (-2.0 * np.arange(half, dtype=np.float64) / r)
    angle = np.asarray(positions, np.float64).reshape(-1, 1) * (config.rope_scale * inv_freq)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.copy()
    first, second = x[..., :half], x[..., half:r]
    out[..., :half] = first * cos - second * sin
    out[..., half:r] = second * cos + first * sin
    return out


def dense_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray,
                    sm_scale: float, group: int, softcap: float = 0.0,
                    sinks: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of ``q`` (n, num_qo_heads, D) over ``keys`` (m, num_kv_heads, D) and
    ``values`` (m, num_kv_heads, Dv), all float64; ``visible`` (n, m) bool says which keys each
    query sees; query head ``h`` reads KV head ``h // group``. ``softcap`` > 0: each logit
    ``x`` becomes ``softcap * tanh(x / softcap)``; ``sinks`` (num_qo_heads,): a logit per head
    added to every row's denominator with no value. Returns ``o`` (n, num_qo_heads, Dv) and
    ``lse`` (n, num_qo_heads), the natural log of the softmax denominator; a row that sees no
    key has o = 0, lse = -inf (the sink with sinks); a NaN/inf V reaches only the rows that see
    its key."""
    n, hq, _ = q.shape
    dv = values.shape[-1]
    none = np.full((n, hq), -np.inf) if sinks is None else np.broadcast_to(sinks, (n, hq)).copy()
    if keys.shape[0] == 0:
        return np.zeros((n, hq, dv)), none
    kv_head = np.arange(hq) // group
    logits = np.einsum("nhd,mhd->nhm", q, keys[:, kv_head]) * sm_scale
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(visible[:, None, :], logits, -np.inf)
    with np.errstate(invalid="ignore"):    # a NaN/inf K a row sees: its lse is NaN, on purpose
        lse: np.ndarray = np.logaddexp(np.logaddexp.reduce(logits, axis=-1), none)
    empty = np.isneginf(lse)[..., None]              # sees no key; a NaN lse (a NaN K seen) stays NaN
    with np.errstate(invalid="ignore"):
        probs = np.where(empty, 0.0, np.exp(logits - np.where(empty, 0.0, lse[..., None])))
    # a key a row does not see adds nothing, even a NaN/inf V (0 * NaN would be NaN): non-finite
    # values stay out of the sum and are added back, key by key, to the rows that see them
    vals = values[:, kv_head]
    bad = ~np.isfinite(vals)
    o = np.einsum("nhm,mhd->nhd", probs, np.where(bad, 0.0, vals))
    for m in np.flatnonzero(bad.any(axis=(1, 2))):
        with np.errstate(invalid="ignore"):
            add = probs[:, :, m, None] * np.where(bad[m], vals[m], 0.0)[None]
        o = o + np.where(visible[:, m, None, None], add, 0.0)
    return o, lse


class _Seq:
    def __init__(self, num_layers, hkv, d, dv):
        self.k = np.zeros((num_layers, 0, hkv, d))   # as the cache stores K (rotated in "normal")
        self.v = np.zeros((num_layers, 0, hkv, dv))
        self.tree_parent: list = []                  # uncommitted tree (the last len() tokens)
        self.tree_depth: list = []
        self.window: Optional[tuple] = None          # (window, sink)

    def copy_prefix(self, n):
        s = _Seq(self.k.shape[0], self.k.shape[2], self.k.shape[3], self.v.shape[3])
        s.k, s.v = self.k[:, :n].copy(), self.v[:, :n].copy()
        return s

    @property
    def committed(self):
        return self.k.shape[1] - len(self.tree_parent)


class DenseModel:
    """The cache's behaviour without pages: each sequence is the list of its tokens' K/V (K as
    the cache stores it), a token tree the list of its parents. ``CachePair`` checks the reference
    backend + core against it on every forward, so a core bug is reported as such.

    Sequence operations mirror the cache's (``add``, ``remove``, ``fork``, ``popn``,
    ``enable_window``, ``clear``, ``commit``); a forward is ``begin`` (returns the expected query
    positions), ``attention`` per layer (returns the expected o and lse), then ``end`` or
    ``abort``."""

    def __init__(self, config: CacheConfig):
        self.c = config
        self.seqs: dict = {}
        self.pending: Optional[tuple] = None
        self._new_kv: dict = {}         # layer -> (k, v) of the open forward

    def _rope(self, x, pos):
        return rope(x, pos, self.c)

    def add(self, sid):
        """A new empty sequence."""
        c = self.c
        self.seqs[sid] = _Seq(c.num_layers, c.num_kv_heads, c.head_dim, c.head_dim_v)

    def remove(self, sid):
        """Forget a sequence."""
        del self.seqs[sid]

    def fork(self, parent, child, pos):
        """``child`` holds the first ``pos`` tokens of ``parent`` (-1: all of them)."""
        p = self.seqs[parent]
        n = p.k.shape[1] if pos == -1 else pos
        self.seqs[child] = p.copy_prefix(n)

    def popn(self, sid, n):
        """Drop the last ``n`` tokens."""
        s = self.seqs[sid]
        keep = s.k.shape[1] - n
        s.k, s.v = s.k[:, :keep], s.v[:, :keep]

    def enable_window(self, sid, w, s):
        """Keep ``s`` sink tokens and the last ``w - s`` tokens from the next forward on."""
        self.seqs[sid].window = (w, s)

    def clear(self):
        """Forget every sequence."""
        self.seqs.clear()

    def commit(self, sids, leaves):
        """Keep each tree's path from a root to its leaf (-1: none) after the committed tokens."""
        for sid, leaf in zip(sids, leaves):
            s = self.seqs[sid]
            base = s.committed
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = s.tree_parent[node]
            keep = [base + n for n in reversed(path)]
            idx = list(range(base)) + keep
            s.k, s.v = s.k[:, idx], s.v[:, idx]
            s.tree_parent, s.tree_depth = [], []

    def begin(self, sids, lens, tree):
        """Positions of the new tokens; records what each new token sees."""
        positions: list = []
        plan: list[tuple] = []
        t = 0
        for sid, n in zip(sids, lens):
            s = self.seqs[sid]
            before = s.k.shape[1]
            committed = s.committed
            if tree is None:
                pos = before + np.arange(n)
                plan.append((sid, before, None, committed))
            else:
                parents = [int(p) for p in tree[t:t + n]]
                first = len(s.tree_parent)
                for p in parents:
                    s.tree_parent.append(p)
                    s.tree_depth.append(0 if p < 0 else s.tree_depth[p] + 1)
                pos = committed + np.asarray(s.tree_depth[first:], np.int64)
                plan.append((sid, before, first, committed))
            positions.append(pos)
            t += n
        self.pending = (list(sids), list(lens), plan, np.concatenate(positions))
        return self.pending[3]

    def attention(self, layer, q, k, v, sm_scale, window_left: int = -1, softcap: float = 0.0,
                  sinks: Optional[np.ndarray] = None):
        """q, k, v float64 (already rounded to the cache dtype). ``window_left`` >= 0: a query at
        position p sees no key at a position below p - window_left (key m of a sequence sits at
        position m); ``softcap``, ``sinks``: as ``dense_attention``. Returns o (rounded), lse."""
        c = self.c
        assert self.pending is not None, "attention before begin_forward"
        sids, lens, plan, positions = self.pending
        mode = c.effective_rope_mode
        sm_scale = c.head_dim ** -0.5 if sm_scale is None else sm_scale
        o = np.zeros((q.shape[0], c.num_qo_heads, c.head_dim_v))
        lse = np.full((q.shape[0], c.num_qo_heads), -np.inf)
        t = 0
        for (sid, before, tree_first, committed), n in zip(plan, lens):
            s = self.seqs[sid]
            qi, ki, vi = q[t:t + n], k[t:t + n], v[t:t + n]
            pos = positions[t:t + n]
            if mode == "normal":
                qi = round_to(self._rope(qi, pos), c.dtype)
                ki = round_to(self._rope(ki, pos), c.dtype)
            keys = np.concatenate([s.k[layer, :before], ki])
            vals = np.concatenate([s.v[layer, :before], vi])
            total = before + n
            if tree_first is None:
                visible = np.zeros((n, total), bool)
                visible[:, :before] = True
                visible[:, before:] = np.tril(np.ones((n, n), bool))
            else:
                visible = np.zeros((n, total), bool)
                visible[:, :committed] = True
                for r in range(n):
                    node = tree_first + r
                    while node != -1:
                        visible[r, committed + node] = True
                        node = s.tree_parent[node]
            if window_left >= 0:
                visible &= np.arange(total)[None, :] >= (pos - window_left)[:, None]
            if mode == "inline":
                qi = self._rope(qi, pos)
                keys = self._rope(keys, np.arange(total))
            o[t:t + n], lse[t:t + n] = dense_attention(qi, keys, vals, visible, sm_scale,
                                                       c.group_size, softcap, sinks)
            t += n
        self._new_kv[layer] = (k, v)
        return round_to(o, c.dtype), lse

    def end(self):
        """Store the new tokens (K as the cache stores it) and slide windows."""
        c = self.c
        assert self.pending is not None, "end before begin_forward"
        sids, lens, plan, positions = self.pending
        new = self._new_kv
        t = 0
        for (sid, before, _, _), n in zip(plan, lens):
            s = self.seqs[sid]
            ks, vs = [], []
            for layer in range(c.num_layers):
                if layer in new:
                    kl, vl = new[layer][0][t:t + n], new[layer][1][t:t + n]
                    if c.effective_rope_mode == "normal":
                        kl = round_to(self._rope(kl, positions[t:t + n]), c.dtype)
                else:   # a layer that ran no attention: its K/V were never written
                    kl = np.full((n, c.num_kv_heads, c.head_dim), np.nan)
                    vl = np.full((n, c.num_kv_heads, c.head_dim_v), np.nan)
                ks.append(kl)
                vs.append(vl)
            s.k = np.concatenate([s.k, np.stack(ks)], axis=1)
            s.v = np.concatenate([s.v, np.stack(vs)], axis=1)
            if s.window is not None:
                w, sink = s.window
                length = s.k.shape[1]
                if length > w:   # exactly ``sink`` sinks and the last ``w - sink`` tokens
                    idx = list(range(sink)) + list(range(length - (w - sink), length))
                    s.k, s.v = s.k[:, idx], s.v[:, idx]
            t += n
        self.pending, self._new_kv = None, {}

    def abort(self):
        """Forget the pending forward (its tree tokens too)."""
        assert self.pending is not None, "abort before begin_forward"
        for sid, _, tree_first, _ in self.pending[2]:
            s = self.seqs[sid]
            if tree_first is not None:
                del s.tree_parent[tree_first:], s.tree_depth[tree_first:]
        self.pending, self._new_kv = None, {}

    def get_kv(self, sid, start, end):
        """K, V of tokens ``start:end`` of a sequence, each (num_layers, n, num_kv_heads, head_dim)."""
        s = self.seqs[sid]
        return s.k[:, start:end], s.v[:, start:end]
