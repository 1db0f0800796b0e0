"""MLX-ops implementations of every kernel of the ``kvcache.Backend`` contract.

These run on any MLX device (the Apple GPU or MLX's CPU device) and are the path exercised by the
tests on machines without an Apple GPU. Math is float32 (RoPE angles in float64 where the device
supports it, i.e. on the CPU), rounded once to the cache dtype.

Attention is vectorised over entries: entries are grouped into a few *buckets* (host-side, from the
small qo_indptr / kv_len index arrays) whose padded size stays close to their real size; each
bucket gathers its queries and its keys (through the page table, on the device) into padded
``(m, Lq, ...)`` / ``(m, Lk, ...)`` arrays and runs one masked softmax attention. Query rows are
tiled so that one logits tensor stays under ``LOGITS_BUDGET`` elements.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
             "int32": mx.int32, "uint8": mx.uint8}
LOGITS_BUDGET = 1 << 24
"""Max elements of one logits tensor (m * Hq * Lq_tile * Lk); bounds peak memory."""
NEG_INF = float("-inf")


def host(array) -> np.ndarray:
    """A host numpy view/copy of a small int32 index array."""
    return np.asarray(array)


# ---------------------------------------------------------------------------------------- RoPE
def rope_cos_sin(positions, head_dim: int, rope, precise: bool):
    """cos, sin of shape positions.shape + (R/2,) in float32 (R: the rotary dims of the
    ``RopeSpec``), angle_i = p * scale * inv_freq_i (``rope.frequencies``).

    Angles are reduced modulo 2*pi before the float32 cos/sin (MLX's float64 cos/sin is only
    float32-accurate). ``precise`` (MLX's CPU device, which has float64): the reduction is done in
    float64. Otherwise (Apple GPU, no float64): the position is split into base-64 digits
    ``p = d2*4096 + d1*64 + d0`` and ``angle = sum_k d_k * (64^k * f mod 2pi)`` (constants reduced
    in float64 on the host), each term reduced again, so float32 error stays ~1e-5 rad instead of
    growing with the position."""
    inv_freq = rope.frequencies(head_dim)
    half = len(inv_freq)
    two_pi = 2.0 * np.pi
    if precise:
        angles = positions.astype(mx.float64)[..., None] * mx.array(inv_freq, dtype=mx.float64)
        angles = angles - two_pi * mx.floor(angles / two_pi)
        angles = angles.astype(mx.float32)
    else:
        p = positions.astype(mx.int32)
        sign = mx.where(p < 0, -1.0, 1.0)[..., None]
        p = mx.abs(p)
        angles = mx.zeros(p.shape + (half,), dtype=mx.float32)
        for k in range(4):                       # |p| < 64^4 = 16.7M
            digit = ((p // (64 ** k)) % 64).astype(mx.float32)[..., None]
            c = mx.array(np.mod((64.0 ** k) * inv_freq, two_pi), dtype=mx.float32)
            term = digit * c
            angles = angles + (term - two_pi * mx.floor(term / two_pi))
        angles = sign * (angles - two_pi * mx.floor(angles / two_pi))
    return mx.cos(angles), mx.sin(angles)


def rotate(x, cos, sin):
    """Rotate-half RoPE of float32 ``x`` (..., H, D) with cos/sin (..., R/2) (broadcast over H)
    over its first R dims; the rest pass through (partial rotary)."""
    half = cos.shape[-1]
    c, s = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return mx.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, x[..., 2 * half:]], axis=-1)


# ----------------------------------------------------------------------------------- bucketing
def buckets(qlens: np.ndarray, klens: np.ndarray, slack: int = 4096) -> list[np.ndarray]:
    """Group entries with work (qlen > 0 and klen > 0) so that each group's padded size
    ``count * max_q * max_k`` stays within twice its real size (plus ``slack``)."""
    work = np.nonzero((qlens > 0) & (klens > 0))[0]
    if len(work) == 0:
        return []
    order = work[np.lexsort((-klens[work], -qlens[work]))]
    groups: list = []
    cur: list = []
    real, mq, mk = 0, 0, 0
    for e in order:
        q, k = int(qlens[e]), int(klens[e])
        nq, nk, nreal = max(mq, q), max(mk, k), real + q * k
        if cur and (len(cur) + 1) * nq * nk > 2 * nreal + slack:
            groups.append(np.asarray(cur, np.int64))
            cur, real, mq, mk = [], 0, 0, 0
            nq, nk, nreal = q, k, q * k
        cur.append(e)
        real, mq, mk = nreal, nq, nk
    groups.append(np.asarray(cur, np.int64))
    return groups


# ------------------------------------------------------------------------------- attention core
def softmax_attend(q, k, v, visible, sm_scale: float, group: int, masked: bool = True,
                   softcap: float = 0.0, sinks=None):
    """q (m, Lq, Hq, D), k (m, Lk, Hkv, D), v (m, Lk, Hkv, Dv) float32, visible (m, Lq, Lk) bool
    -> o (m, Lq, Hq, Dv) float32, lse (m, Lq, Hq) float32 (rows seeing nothing: o = 0,
    lse = -inf, or the head's sink logit with ``sinks``).
    ``masked=False``: the caller zeroed every key that some valid row does not see (padding), so
    a non-finite V is seen and the plain matmul is exact.
    ``softcap`` > 0: each scaled score s becomes ``softcap * tanh(s / softcap)``; ``sinks``
    (Hq,) float32: one logit per query head added to every row's denominator, with no value."""
    m, lq, hq, d = q.shape
    lk, hkv, dv = k.shape[1], k.shape[2], v.shape[-1]
    qh = q.reshape(m, lq, hkv, group, d).transpose(0, 2, 3, 1, 4).reshape(m, hkv, group * lq, d)
    kh = k.transpose(0, 2, 3, 1)                                   # (m, Hkv, D, Lk)
    vh = v.transpose(0, 2, 1, 3)                                   # (m, Hkv, Lk, Dv)
    logits = (qh @ kh).reshape(m, hkv, group, lq, lk) * sm_scale
    if softcap:
        logits = softcap * mx.tanh(logits * (1.0 / softcap))
    logits = mx.where(visible[:, None, None], logits, NEG_INF)
    peak = logits.max(axis=-1, keepdims=True)
    sink = None
    if sinks is not None:                  # (Hq,) -> (1, Hkv, G, 1, 1): head h = kvh * G + g
        sink = sinks.astype(mx.float32).reshape(1, hkv, group, 1, 1)
        peak = mx.maximum(peak, sink)
    peak = mx.where(mx.isinf(peak), 0.0, peak)
    w = mx.exp(logits - peak)
    denom = w.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + mx.exp(sink - peak)
    if masked:
        # a masked key's weight is 0 but its V may hold NaN/inf (a later token, a sibling
        # branch), and 0 * NaN = NaN: non-finite V values stay out of the matmul (added back to
        # the rows that see them); the host check is one reduction of V
        bad = ~mx.isfinite(vh)
        o = w.reshape(m, hkv, group * lq, lk) @ mx.where(bad, 0.0, vh)
        o = o.reshape(m, hkv, group, lq, dv)
        if mx.any(bad).item():
            o = o + _nonfinite_values(w, visible, vh, bad)
    else:
        o = (w.reshape(m, hkv, group * lq, lk) @ vh).reshape(m, hkv, group, lq, dv)
    empty = denom == 0                          # sees no key; a NaN denom (a NaN K seen) stays NaN
    o = o / mx.where(empty, 1.0, denom)
    lse = mx.where(empty, NEG_INF, mx.log(mx.maximum(denom, 1e-38)) + peak)[..., 0]
    o = o.transpose(0, 3, 1, 2, 4).reshape(m, lq, hq, dv)
    lse = lse.transpose(0, 3, 1, 2).reshape(m, lq, hq)
    return o, lse


def _nonfinite_values(w, visible, vh, bad):
    """The NaN/inf that non-finite V values add to the rows that see them, one key at a time:
    w (m, Hkv, G, Lq, Lk), visible (m, Lq, Lk), vh/bad (m, Hkv, Lk, D) -> (m, Hkv, G, Lq, D)."""
    extra = mx.zeros(w.shape[:-1] + (vh.shape[-1],), dtype=mx.float32)
    for j in np.flatnonzero(np.asarray(mx.any(bad, axis=(0, 1, 3)))).tolist():
        vj = mx.where(bad[:, :, j], vh[:, :, j], 0.0)[:, :, None, None, :]
        extra = extra + mx.where(visible[:, None, None, :, j, None], w[..., j, None] * vj, 0.0)
    return extra


class Output:
    """Accumulates (o, lse) rows of a kernel into (T, Hq, Dv) / (T, Hq); uncovered rows stay
    o = 0, lse = -inf (``sinks[h]`` with sinks). Row ``T`` is a dump row for padding and is
    sliced off."""

    def __init__(self, t: int, hq: int, dv: int, sinks=None):
        self.t = t
        self.o = mx.zeros((t + 1, hq, dv), dtype=mx.float32)
        if sinks is None:
            self.lse = mx.full((t + 1, hq), NEG_INF, dtype=mx.float32)
        else:
            self.lse = mx.broadcast_to(sinks.astype(mx.float32)[None, :], (t + 1, hq)) * 1.0

    def put(self, rows, valid, o, lse):
        """rows/valid (m, L); o (m, L, Hq, D); lse (m, L, Hq)."""
        idx = mx.where(valid, rows, self.t).reshape(-1)
        self.o[idx] = o.reshape(-1, *o.shape[2:])
        self.lse[idx] = lse.reshape(-1, lse.shape[-1])

    def result(self, dtype):
        return self.o[: self.t].astype(dtype), self.lse[: self.t]


def tree_visible(tree_indptr, tree_mask, ent, q_node, k_node, q_valid, k_in_tree):
    """Visibility inside the token tree: key node m is visible to query node n iff
    order[m] <= order[n] < upper[m]. ent (m,), q_node (m, Lq), k_node (m, Lk) -> (m, Lq, Lk)."""
    size = tree_mask.shape[0] // 2
    base = tree_indptr[ent][:, None]
    qi = mx.clip(base + q_node, 0, size - 1)
    ki = mx.clip(base + k_node, 0, size - 1)
    q_order = tree_mask[2 * qi]
    k_order, k_upper = tree_mask[2 * ki], tree_mask[2 * ki + 1]
    vis = (k_order[:, None, :] <= q_order[:, :, None]) & (q_order[:, :, None] < k_upper[:, None, :])
    return mx.where(k_in_tree[:, None, :] & q_valid[:, :, None], vis, True)


def _tiles(m: int, hq: int, lq: int, lk: int):
    tile = max(1, LOGITS_BUDGET // max(1, m * hq * lk))
    return [(r0, min(lq, r0 + tile)) for r0 in range(0, lq, tile)]
