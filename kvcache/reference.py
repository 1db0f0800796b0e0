"""The reference backend: numpy, float64 math, obviously correct.

It reads every key through the page table and the core's index arrays, so that it checks those
arrays rather than taking a shortcut. It is the conformance oracle and the default backend where
no accelerator exists. Readability beats speed here; loops are per entry, math is vectorised
inside an entry.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import kv_quant
from .backend import Backend, Capabilities, DepthAux, RopeSpec, TreeMask
from .config import DTYPES
from .formats import FORMAT_TABLE

from .arrays import BFLOAT16_MISSING, NP_DTYPES, np_dtype  # noqa: F401  (re-exported)

_NARROW = tuple(NP_DTYPES[name] for name in ("float16", "bfloat16") if name in NP_DTYPES)


def rope_angles(positions: np.ndarray, head_dim: int, rope: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (T, 1, R/2) in float64 for ``positions`` (T,) and heads of
    ``head_dim`` dims as ``rope`` specifies (rotate-half convention, R the rotary dims)."""
    angles = positions.astype(np.float64)[:, None] * rope.frequencies(head_dim)[None, :]
    return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]


def rotate(x: np.ndarray, positions: np.ndarray, rope: RopeSpec) -> np.ndarray:
    """Rotate-half RoPE of x (T, H, D) at ``positions`` (T,) as ``rope`` specifies, in float64
    (dims from R on pass through)."""
    x = x.astype(np.float64)
    rot = rope.rotary(x.shape[-1])
    half = rot // 2
    cos, sin = rope_angles(positions, x.shape[-1], rope)
    x1, x2 = x[..., :half], x[..., half:rot]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rot:]], axis=-1)


def tree_visible(tree: TreeMask, entry: int, n_q: int) -> np.ndarray:
    """(n_q, tree_size) bool: which tree keys each of the entry's last n_q tree nodes sees."""
    lo, hi = int(tree.indptr[entry]), int(tree.indptr[entry + 1])
    pairs = np.asarray(tree.mask[2 * lo:2 * hi]).reshape(-1, 2)
    order, upper = pairs[:, 0], pairs[:, 1]
    q_order = order[hi - lo - n_q:]
    return (order[None, :] <= q_order[:, None]) & (q_order[:, None] < upper[None, :])


def weighted_values(w: np.ndarray, visible: np.ndarray, v: np.ndarray) -> np.ndarray:
    """sum over the keys m that row n sees of w[h, n, m] * v[m, h]: w (H, n, m), visible (n, m),
    v (m, H, D) -> (n, H, D). A masked key's weight is 0, but its V may hold NaN/inf and
    0 * NaN = NaN, so such V rows stay out of the einsum and are added back, key by key, only
    to the rows that see them."""
    bad = ~np.isfinite(v)
    out = np.einsum("hnm,mhd->nhd", w, np.where(bad, 0.0, v))
    for m in np.flatnonzero(bad.any(axis=(1, 2))):
        with np.errstate(invalid="ignore"):     # 0 * inf where masked: dropped below
            add = w[:, :, m].T[:, :, None] * np.where(bad[m], v[m], 0.0)[None]
        out += np.where(visible[:, m, None, None], add, 0.0)
    return out


def softmax_attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray,
                   sm_scale: float, group: int, softcap: float = 0.0,
                   sinks: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
    """q (n, Hq, D), k (m, Hkv, D), v (m, Hkv, Dv) float64, visible (n, m) bool -> o (n, Hq, Dv),
    lse (n, Hq). Keys a row does not see add nothing to it, whatever their K/V hold (NaN, inf).
    ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``; ``sinks`` (Hq,): one
    logit per head in every row's denominator, with no value. ``sm_scale`` multiplies every
    score; ``group``: query heads per KV head (``Hq // Hkv``)."""
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)
    with np.errstate(invalid="ignore"):     # a NaN/inf K gives NaN logits (masked ones dropped)
        logits = np.einsum("nhd,mhd->hnm", q, k) * sm_scale
        if softcap:
            logits = softcap * np.tanh(logits / softcap)
    logits = np.where(visible[None, :, :], logits, -np.inf)
    if sinks is not None:      # the sink as one more key every row sees, with a zero value
        sink_col = np.broadcast_to(sinks[:, None, None], (logits.shape[0], logits.shape[1], 1))
        logits = np.concatenate([logits, sink_col], axis=-1)
        visible = np.concatenate([visible, np.ones((visible.shape[0], 1), dtype=bool)], axis=1)
        v = np.concatenate([v, np.zeros((1,) + v.shape[1:])], axis=0)
    peak = logits.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(logits - peak)
    denom = weights.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = weighted_values(weights / np.where(denom > 0, denom, 1.0), visible, v)
        lse = (np.log(denom) + peak)[..., 0].T
    return out, lse


class ReferenceBackend(Backend):
    """The ``"reference"`` backend: pages are numpy arrays on the host, every kernel is the
    plain float64 formula of its ``Backend`` docstring (rounded once to the cache dtype), and it
    declares every capability but the device-side ones (copy stream, merged aux, static decode,
    fused RoPE append). The conformance suite compares every backend with it; ``backend="auto"``
    falls back to it where no accelerator backend is available (priority 0)."""

    name = "reference"
    priority = 0
    description = "numpy, float64 math; the conformance oracle"
    capabilities = Capabilities(
        # bfloat16 only with ml_dtypes: PagedKVCache then raises UnsupportedFeatureError for it
        dtypes=tuple(name for name in DTYPES if name in NP_DTYPES),
        # the quantized formats emulated exactly (kvcache.kv_quant; fp8 needs ml_dtypes)
        kv_dtypes=tuple(name for name, fmt in FORMAT_TABLE.items()
                        if ("bfloat16" if fmt.quantized else name) in NP_DTYPES),
        tree_attention=True, sliding_window=True, inline_rope=True, window_left=True,
        rope_frequencies=True, logit_softcap=True, attention_sinks=True, batch_invariant=True,
        window_groups=True, state_slots=True,
        head_dims=tuple(range(2, 1025, 2)), head_dims_v=tuple(range(1, 1025)),
    )

    @classmethod
    def availability(cls, device=None):
        if device not in (None, "cpu"):
            return False, f"the reference backend runs on the host CPU only, not {device!r}"
        if BFLOAT16_MISSING:
            return True, f"numpy on the host CPU (always available; {BFLOAT16_MISSING})"
        return True, "numpy on the host CPU (always available)"

    @classmethod
    def devices(cls):
        return ["cpu"]

    @classmethod
    def platform(cls):
        return {"vendor": "any", "runtime": "numpy"}

    def __init__(self, config, device=None):
        super().__init__(config, device or "cpu")
        self.dtype = np_dtype(config.dtype)
        # quantized formats: pages hold the values read back (float32, exact); the affine ones
        # also their codes, scales and biases (page_shape), which a move carries unchanged
        fmt = config.kv_format
        self.kv_dtype = np.dtype(np.float32) if fmt.quantized else np_dtype(config.kv_dtype)
        self.bits = fmt.bits if fmt.packed else None

    def page_shape(self, num_pages):
        """The base layout; with int8 / int4 each row of ``R = page_row_dim`` values is
        followed by its ``R`` codes, ``R / group`` scales and ``R / group`` biases (all float32:
        exact), which only ``gather_kv(..., packed=True)`` reads."""
        shape = super().page_shape(num_pages)
        if self.bits is None:
            return shape
        r = self.config.page_row_dim
        return shape[:-1] + (2 * r + 2 * (r // self.config.kv_quant_group),)

    # ------------------------------------------------------------------ memory
    def allocate_pages(self, num_pages):
        return [np.zeros(self.page_shape(num_pages), dtype=self.kv_dtype)
                for _ in range(self.config.num_layers)]

    def from_numpy(self, array, dtype=None):
        array = np.asarray(array)
        if dtype is None:
            dtype = "int32" if array.dtype.kind in "iu" else self.config.dtype
        bf16 = "bfloat16" in NP_DTYPES and array.dtype == NP_DTYPES["bfloat16"]
        return np.array(array.astype(np.float64) if bf16 else array, dtype=np_dtype(dtype), copy=True)

    def to_numpy(self, array):
        array = np.asarray(array)
        if array.dtype in _NARROW:
            return array.astype(np.float32)
        return array.copy()

    def is_native(self, array):
        return isinstance(array, np.ndarray)

    def dtype_name(self, array):
        for name, dt in NP_DTYPES.items():
            if array.dtype == dt:
                return name
        return str(array.dtype)

    # ------------------------------------------------------------------ kernels
    def _store(self, x):
        return np.asarray(x).astype(self.dtype)

    def rope(self, x, positions, rope):
        return self._store(rotate(x, np.asarray(positions), rope))

    def _as_stored(self, x, which: int, kv_scale=None):
        """``x`` as quantized pages give it back (K: ``which`` 0, V: 1), float32; ``x`` itself
        for plain pages. The format quantizes values of the compute dtype."""
        c = self.config
        if not c.kv_format.quantized:
            return x
        x = np.asarray(x).astype(self.dtype).astype(np.float32)
        scale = np.ones(x.shape[1], np.float32) if kv_scale is None \
            else np.asarray(kv_scale, np.float32)[which]       # fp8 only; 1.0 when not given
        return kv_quant.roundtrip(x, c.kv_dtype, c.dtype, c.kv_quant_group, scale)

    def append_kv(self, pages, k, v, slots, positions=None, rope=None, kv_scale=None,
                  packed=False):
        slots = np.asarray(slots)
        c = self.config
        if packed:                  # rows as stored: their values, codes, scales and biases
            self._put_affine(pages, slots, *(
                kv_quant.affine_unpack(x, dim, c.kv_format.bits, c.kv_quant_group, c.dtype)
                for x, dim in ((k, c.head_dim), (v, c.head_dim_v))))
            return
        keep = slots >= 0
        if rope is not None:
            k = rotate(k, np.asarray(positions), rope)
        if self.bits is not None:
            group, dt = c.kv_quant_group, c.dtype
            self._put_affine(pages, slots, *(kv_quant.affine_quantize(
                np.asarray(x).astype(self.dtype).astype(np.float32), self.bits, group, dt)
                for x in (k, v)))
            return
        k, v = self._as_stored(k, 0, kv_scale), self._as_stored(v, 1, kv_scale)
        page, row = slots[keep] // c.page_size, slots[keep] % c.page_size
        pages[page, 0, :, row, :c.head_dim] = np.asarray(k)[keep].astype(self.kv_dtype)
        pages[page, 1, :, row, :c.head_dim_v] = np.asarray(v)[keep].astype(self.kv_dtype)

    def _put_affine(self, pages, slots, k_parts, v_parts):
        """Write affine rows given as (codes, scales, biases) for K and V: the values they read
        back, then the parts themselves (``page_shape``); slot -1 skipped."""
        c = self.config
        keep = slots >= 0
        page, row = slots[keep] // c.page_size, slots[keep] % c.page_size
        r, g = c.page_row_dim, c.page_row_dim // c.kv_quant_group
        for which, (codes, scales, biases) in ((0, k_parts), (1, v_parts)):
            values = kv_quant.affine_dequantize(codes, scales, biases, c.kv_quant_group)
            for lo, part in ((0, values), (r, codes), (2 * r, scales), (2 * r + g, biases)):
                width = part.shape[-1]
                pages[page, which, :, row, lo:lo + width] = \
                    np.asarray(part)[keep].astype(np.float32)

    def _gather_packed(self, pages_per_layer, slots):
        """``gather_kv(..., packed=True)``: the rows' codes, scales and biases, packed."""
        c = self.config
        ps, slots = c.page_size, np.asarray(slots)
        r, g = c.page_row_dim, c.page_row_dim // c.kv_quant_group
        out = []
        for which, dim in ((0, c.head_dim), (1, c.head_dim_v)):
            n = dim // c.kv_quant_group
            per_layer = []
            for p in pages_per_layer:
                rows = p[slots // ps, which, :, slots % ps, :]          # (n, Hkv, width)
                per_layer.append(kv_quant.affine_pack(
                    rows[..., r:r + dim].astype(np.uint8),
                    rows[..., 2 * r:2 * r + n].astype(self.dtype),
                    rows[..., 2 * r + g:2 * r + g + n].astype(self.dtype),
                    c.kv_format.bits))
            out.append(np.stack(per_layer))
        return out[0], out[1]

    def _output(self, t, sinks=None):
        """Rows that see no key: o = 0, lse = -inf (the sink's logit with sinks)."""
        c = self.config
        lse = np.full((t, c.num_qo_heads), -np.inf)
        if sinks is not None:
            lse[:] = sinks[None, :]
        return np.zeros((t, c.num_qo_heads, c.head_dim_v)), lse

    @staticmethod
    def _sinks(sinks):
        return None if sinks is None else np.asarray(sinks).astype(np.float64)

    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                         rope=None, q_positions=None, k_rope_offset=None, window_left=-1,
                         logit_softcap=0.0, sinks=None, kv_scale=None):
        qo_indptr = np.asarray(qo_indptr)
        k, v = self._as_stored(k, 0, kv_scale), self._as_stored(v, 1, kv_scale)
        sinks = self._sinks(sinks)
        o, lse = self._output(q.shape[0], sinks)
        for i in range(num_seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            n = hi - lo
            if n == 0:
                continue
            qi, ki = q[lo:hi].astype(np.float64), k[lo:hi].astype(np.float64)
            if rope is not None:
                qi = rotate(qi, np.asarray(q_positions)[lo:hi], rope)
                ki = rotate(ki, int(k_rope_offset[i]) + np.arange(n), rope)
            if tree is not None:
                visible = tree_visible(tree, i, n)
            else:
                visible = np.tril(np.ones((n, n), dtype=bool))
                if window_left >= 0:
                    visible &= np.triu(np.ones((n, n), dtype=bool), -window_left)
            o[lo:hi], lse[lo:hi] = softmax_attend(qi, ki, v[lo:hi].astype(np.float64), visible,
                                                  sm_scale, self.config.group_size,
                                                  logit_softcap, sinks)
        return self._store(o), lse.astype(np.float32)

    def _entry_keys(self, pages, depth: DepthAux, i: int):
        """Rows of entry i's keys and values, read through the page table."""
        ps = self.config.page_size
        kv_len, sink, gap = int(depth.kv_len[i]), int(depth.sink_size[i]), int(depth.window_offset[i])
        j = np.arange(kv_len)
        off = np.where(j < sink, j, j - sink + gap)
        page_ids = np.asarray(depth.page_indices)[int(depth.page_indptr[i]) + off // ps]
        rows = off % ps
        c = self.config
        return (pages[page_ids, 0, :, rows, :c.head_dim], pages[page_ids, 1, :, rows, :c.head_dim_v])

    def paged_attention(self, q, pages, depth, sm_scale, *, rope=None, q_positions=None,
                        window_left=-1, logit_softcap=0.0, sinks=None, kv_scale=None):
        # quantized pages hold the values read back already: kv_scale is not needed here
        sinks = self._sinks(sinks)
        o, lse = self._output(q.shape[0], sinks)
        qo_indptr = np.asarray(depth.qo_indptr)
        for i in range(depth.num_entries):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            kv_len = int(depth.kv_len[i])
            if hi == lo or kv_len == 0:
                continue
            keys, values = self._entry_keys(pages, depth, i)
            qi, keys = q[lo:hi].astype(np.float64), keys.astype(np.float64)
            if rope is not None:
                qi = rotate(qi, np.asarray(q_positions)[lo:hi], rope)
                keys = rotate(keys, int(depth.k_rope_offset[i]) + np.arange(kv_len), rope)
            visible = np.ones((hi - lo, kv_len), dtype=bool)
            if depth.tree is not None:
                t = int(depth.tree.indptr[i + 1]) - int(depth.tree.indptr[i])
                if t:
                    visible[:, kv_len - t:] = tree_visible(depth.tree, i, hi - lo)
            if window_left >= 0:
                k_pos = int(depth.k_rope_offset[i]) + np.arange(kv_len)
                q_pos = np.asarray(q_positions)[lo:hi].astype(np.int64)
                visible &= k_pos[None, :] >= (q_pos - window_left)[:, None]
            values = values.astype(np.float64)
            # batch-invariant: one query row at a time, so numpy's reductions run in an order
            # set by the row's keys alone, not by how many rows share the entry
            rows = [(lo, hi)] if not self.config.batch_invariant else \
                [(r, r + 1) for r in range(lo, hi)]
            for a, b in rows:
                o[a:b], lse[a:b] = softmax_attend(qi[a - lo:b - lo], keys, values,
                                                  visible[a - lo:b - lo], sm_scale,
                                                  self.config.group_size, logit_softcap, sinks)
        return self._store(o), lse.astype(np.float32)

    def merge_attention(self, o_a, lse_a, o_b, lse_b):
        la, lb = np.asarray(lse_a, np.float64), np.asarray(lse_b, np.float64)
        with np.errstate(invalid="ignore"):     # a NaN lse (a NaN key was seen) stays NaN
            lse = np.logaddexp(la, lb)
        safe = np.where(np.isfinite(lse), lse, 0.0)
        wa = np.where(np.isfinite(la), np.exp(la - safe), 0.0)[..., None]
        wb = np.where(np.isfinite(lb), np.exp(lb - safe), 0.0)[..., None]
        o = o_a.astype(np.float64) * wa + o_b.astype(np.float64) * wb
        return self._store(o), lse.astype(np.float32)

    def copy_page_prefix(self, pages_per_layer, src_page, dst_page, length):
        for pages in pages_per_layer:
            pages[dst_page, :, :, :length, :] = pages[src_page, :, :, :length, :]

    def compact_kv(self, pages_per_layer, src_slots, dst_slots):
        ps = self.config.page_size
        src, dst = np.asarray(src_slots), np.asarray(dst_slots)
        for pages in pages_per_layer:
            rows = pages[src // ps, :, :, src % ps, :].copy()
            pages[dst // ps, :, :, dst % ps, :] = rows

    def gather_kv(self, pages_per_layer, slots, kv_scale=None, packed=False):
        if packed:
            return self._gather_packed(pages_per_layer, slots)
        if self.config.kv_format.quantized:        # dequantized (held as float32), in the cache dtype
            k, v = self._gather(pages_per_layer, slots)
            return k.astype(self.dtype), v.astype(self.dtype)
        return self._gather(pages_per_layer, slots)

    def gather_kv_into(self, pages_per_layer, slots, k_out, v_out):
        if self.config.kv_format.quantized or k_out.dtype != self.dtype \
                or v_out.dtype != self.dtype:
            return False
        ps = self.config.page_size
        slots = np.asarray(slots)
        d, dv = self.config.head_dim, self.config.head_dim_v
        # the tokens that fill whole pages in order (a sequence's, but for its last page) are
        # copied a page run at a time; the rest row by row
        full = len(slots) // ps * ps
        pages = slots[:full:ps] // ps
        if full and not np.array_equal(slots[:full].reshape(-1, ps),
                                       pages[:, None] * ps + np.arange(ps)):
            full, pages = 0, pages[:0]
        run = len(pages) and pages[-1] - pages[0] + 1 == len(pages) \
            and bool(np.all(np.diff(pages) == 1))
        rest = slots[full:]
        for layer, p in enumerate(pages_per_layer):
            for which, out, dim in ((0, k_out, d), (1, v_out, dv)):
                if full:
                    # (pages, heads, page_size, dim) as (pages, page_size, heads, dim): one copy
                    src = p[pages[0]:pages[-1] + 1, which] if run else p[pages, which]
                    np.copyto(out[layer, :full].reshape((len(pages), ps) + out.shape[2:]),
                              src[..., :dim].transpose(0, 2, 1, 3))
                if len(rest):
                    out[layer, full:] = p[rest // ps, which, :, rest % ps, :dim]
        return True

    def allocate_state(self, num_slots, shape, dtype=None):
        return np.zeros((num_slots,) + tuple(shape),
                        dtype=self.dtype if dtype is None else np_dtype(dtype))

    def gather_state(self, states, slots):
        return states[np.asarray(slots, np.int64)]          # fancy indexing: a copy

    def scatter_state(self, states, slots, values):
        states[np.asarray(slots, np.int64)] = np.asarray(values).astype(states.dtype)

    def _gather(self, pages_per_layer, slots):
        ps = self.config.page_size
        slots = np.asarray(slots)
        d, dv = self.config.head_dim, self.config.head_dim_v
        k = np.stack([p[slots // ps, 0, :, slots % ps, :d] for p in pages_per_layer])
        v = np.stack([p[slots // ps, 1, :, slots % ps, :dv] for p in pages_per_layer])
        return k, v
