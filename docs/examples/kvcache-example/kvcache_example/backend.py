"""``ExampleBackend``: a complete kvcache backend in about 200 lines of numpy.

It is written the way a GPU kernel library would structure the work, so that it is a useful
template rather than a copy of the reference backend:

* math in float32 (the reference uses float64), rounded once to the cache dtype;
* paged attention walks each entry's page table one page at a time with an *online softmax*
  (running max ``m``, running denominator ``l``, rescaled accumulator), the loop a
  FlashAttention / FlashInfer decode kernel runs per thread block;
* the core hands every index array in already (``DepthAux``, ``TreeMask``): the backend knows
  nothing about sequences.

Capabilities: all three dtypes, head dims 64/128/256, token trees; no sliding window and no
inline RoPE (the conformance suite skips those tests and says so).
"""

from __future__ import annotations

from typing import Optional

import ml_dtypes
import numpy as np

from kvcache import Backend, Capabilities, RopeSpec, TreeMask

_NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
       "bfloat16": np.dtype(ml_dtypes.bfloat16), "int32": np.dtype(np.int32)}


def _tree_visible(tree: TreeMask, entry: int, n_q: int) -> np.ndarray:
    """(n_q, tree_size) bool: key node m is visible to query node n iff
    order[m] <= order[n] < upper[m]; the entry's queries are its last n_q nodes."""
    lo, hi = int(tree.indptr[entry]), int(tree.indptr[entry + 1])
    pairs = np.asarray(tree.mask[2 * lo:2 * hi]).reshape(-1, 2)
    order, upper = pairs[:, 0], pairs[:, 1]
    q_order = order[hi - lo - n_q:]
    return (order[None, :] <= q_order[:, None]) & (q_order[:, None] < upper[None, :])


def _visible_sum(w, visible, v):
    """``einsum("kgnm,kmd->kgnd", w, v)`` over the keys each query row sees (``visible`` (n, m);
    None: all). A masked key's weight is 0 but its V may hold NaN/inf, and 0 * NaN = NaN: such
    values stay out of the einsum and are added back, key by key, to the rows that see them."""
    bad = ~np.isfinite(v)
    out = np.einsum("kgnm,kmd->kgnd", w, np.where(bad, np.float32(0), v))
    for m in np.flatnonzero(bad.any(axis=(0, 2))):           # rare: non-finite V values
        with np.errstate(invalid="ignore"):                   # 0 * inf where masked: dropped
            add = w[..., m, None] * np.where(bad[:, m], v[:, m], np.float32(0))[:, None, None, :]
        out += add if visible is None else np.where(visible[:, m, None], add, np.float32(0))
    return out


class ExampleBackend(Backend):
    name = "example"
    priority = -10          # below the reference: backend="auto" never picks an example
    description = "example third-party plugin: numpy, float32 online softmax over pages"
    capabilities = Capabilities(dtypes=("float32", "float16", "bfloat16"),
                                tree_attention=True, head_dims=(64, 128, 256))
    # Honest partial conformance: tests this backend is known to fail, {pattern: reason}.
    # The suite marks them strict xfail (a test listed here that passes fails the run).
    conformance_xfail: dict = {}

    # ------------------------------------------------------------------ discovery
    @classmethod
    def availability(cls, device: Optional[str] = None):
        if device not in (None, "cpu"):
            return False, f"the example backend runs on the host CPU only, not {device!r}"
        return True, "numpy on the host CPU (example plugin)"

    @classmethod
    def devices(cls):
        return ["cpu"]

    @classmethod
    def platform(cls):
        return {"vendor": "any", "runtime": f"numpy {np.__version__}"}

    def __init__(self, config, device=None):
        super().__init__(config, device or "cpu")
        self.dtype = _NP[config.dtype]              # q, k, v and outputs
        self.kv_dtype = _NP[config.kv_dtype]        # pages

    # ------------------------------------------------------------------ memory
    def allocate_pages(self, num_pages):
        # page_shape: the base class's layout, (num_pages, 2, Hkv, page_size, D)
        return [np.zeros(self.page_shape(num_pages), self.kv_dtype)
                for _ in range(self.config.num_layers)]

    def from_numpy(self, array, dtype=None):
        array = np.asarray(array)
        if dtype is None:
            dtype = "int32" if array.dtype.kind in "iu" else self.config.dtype
        if array.dtype == _NP["bfloat16"]:
            array = array.astype(np.float32)
        return np.array(array, dtype=_NP[dtype], copy=True)

    def to_numpy(self, array):
        array = np.asarray(array)
        return array.astype(np.float32) if array.dtype in (_NP["float16"], _NP["bfloat16"]) else array.copy()

    def is_native(self, array):
        return isinstance(array, np.ndarray)

    def dtype_name(self, array):
        for name, dt in _NP.items():
            if array.dtype == dt:
                return name
        return str(array.dtype)

    # ------------------------------------------------------------------ kernels
    def rope(self, x, positions, rope: RopeSpec):
        x = np.asarray(x, np.float32)
        d = x.shape[-1]
        half = d // 2
        inv_freq = rope.theta ** (-2.0 * np.arange(half) / d)
        angles = (np.asarray(positions, np.float64)[:, None] * rope.scale * inv_freq)[:, None, :]
        cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(self.dtype)

    def append_kv(self, pages, k, v, slots, positions=None, rope=None):
        slots = np.asarray(slots)
        keep = slots >= 0
        if rope is not None:
            k = self.rope(k, positions, rope)
        page, row = np.divmod(slots[keep], self.config.page_size)
        pages[page, 0, :, row, :] = np.asarray(k)[keep].astype(self.kv_dtype)
        pages[page, 1, :, row, :] = np.asarray(v)[keep].astype(self.kv_dtype)

    def _split_heads(self, q):
        """(n, Hq, D) -> (Hkv, G, n, D) float32: query head h = kv head h // G, member h % G."""
        c = self.config
        n = q.shape[0]
        return np.asarray(q, np.float32).reshape(n, c.num_kv_heads, c.group_size, c.head_dim).transpose(1, 2, 0, 3)

    def _join_heads(self, x):
        """(Hkv, G, n, ...) -> (n, Hq, ...)."""
        c = self.config
        x = np.moveaxis(x, 2, 0)
        return x.reshape((x.shape[0], c.num_qo_heads) + x.shape[3:])

    def _new_output(self, t):
        c = self.config
        return (np.zeros((t, c.num_qo_heads, c.head_dim), np.float32),
                np.full((t, c.num_qo_heads), -np.inf, np.float32))

    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                         rope=None, q_positions=None, k_rope_offset=None):
        assert rope is None, "inline RoPE is not a declared capability"
        qo_indptr = np.asarray(qo_indptr)
        o, lse = self._new_output(q.shape[0])
        for i in range(num_seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            n = hi - lo
            if n == 0:
                continue
            qi = self._split_heads(q[lo:hi])                               # (Hkv, G, n, D)
            ki = np.asarray(k[lo:hi], np.float32).transpose(1, 0, 2)        # (Hkv, n, D)
            vi = np.asarray(v[lo:hi], np.float32).transpose(1, 0, 2)
            s = np.einsum("kgnd,kmd->kgnm", qi, ki) * np.float32(sm_scale)
            visible = _tree_visible(tree, i, n) if tree is not None else np.tri(n, dtype=bool)
            s = np.where(visible, s, -np.inf)                              # drops masked NaN scores too
            m = s.max(axis=-1, keepdims=True)                              # the diagonal is always visible
            p = np.exp(s - m)
            den = p.sum(axis=-1, keepdims=True)
            o[lo:hi] = self._join_heads(_visible_sum(p / den, visible, vi))
            lse[lo:hi] = self._join_heads((m + np.log(den))[..., 0])
        return o.astype(self.dtype), lse

    def _entry_pages(self, depth, i):
        """Physical pages of entry i (its slice of the page table)."""
        lo, hi = int(depth.page_indptr[i]), int(depth.page_indptr[i + 1])
        return np.asarray(depth.page_indices)[lo:hi]

    def paged_attention(self, q, pages, depth, sm_scale, *, rope=None, q_positions=None):
        assert rope is None, "inline RoPE is not a declared capability"
        ps = self.config.page_size
        o, lse = self._new_output(q.shape[0])
        qo = np.asarray(depth.qo_indptr)
        for i in range(depth.num_entries):
            lo, hi = int(qo[i]), int(qo[i + 1])
            kv_len = int(depth.kv_len[i])
            n = hi - lo
            if n == 0 or kv_len == 0:
                continue                      # rows keep o = 0, lse = -inf
            qi = self._split_heads(q[lo:hi]) * np.float32(sm_scale)
            t = 0 if depth.tree is None else int(depth.tree.indptr[i + 1]) - int(depth.tree.indptr[i])
            tree_vis = _tree_visible(depth.tree, i, n) if t else None
            hkv, g = qi.shape[0], qi.shape[1]
            m = np.full((hkv, g, n), -np.inf, np.float32)                 # running max
            den = np.zeros((hkv, g, n), np.float32)                       # running denominator
            acc = np.zeros((hkv, g, n, qi.shape[-1]), np.float32)        # running numerator
            for p, page in enumerate(self._entry_pages(depth, i)):
                start = p * ps
                rows = min(ps, kv_len - start)
                if rows <= 0:
                    break
                kp = pages[page, 0, :, :rows, :].astype(np.float32)       # (Hkv, rows, D)
                vp = pages[page, 1, :, :rows, :].astype(np.float32)
                s = np.einsum("kgnd,krd->kgnr", qi, kp)
                vis = None
                if tree_vis is not None:                                  # the last t keys are tree nodes
                    j = start + np.arange(rows) - (kv_len - t)
                    in_tree = j >= 0
                    vis = np.ones((n, rows), bool)
                    vis[:, in_tree] = tree_vis[:, j[in_tree]]
                    s = np.where(vis, s, -np.inf)
                m_new = np.maximum(m, s.max(axis=-1))
                safe = np.where(np.isfinite(m_new), m_new, 0.0)
                alpha = np.where(np.isfinite(m), np.exp(m - safe), 0.0)
                w = np.exp(s - safe[..., None])
                den = den * alpha + w.sum(axis=-1)
                acc = acc * alpha[..., None] + _visible_sum(w, vis, vp)
                m = m_new
            empty = den == 0                  # saw no key (a NaN den, from a NaN key, stays NaN)
            out = np.where(empty[..., None], 0.0, acc / np.where(empty, 1, den)[..., None])
            o[lo:hi] = self._join_heads(out)
            with np.errstate(divide="ignore"):
                lse[lo:hi] = self._join_heads(np.where(empty, -np.inf, m + np.log(den)))
        return o.astype(self.dtype), lse

    def merge_attention(self, o_a, lse_a, o_b, lse_b):
        la, lb = np.asarray(lse_a, np.float32), np.asarray(lse_b, np.float32)
        with np.errstate(invalid="ignore"):                   # a NaN lse stays NaN
            lse = np.logaddexp(la, lb)
        safe = np.where(np.isfinite(lse), lse, 0.0)
        wa = np.where(np.isfinite(la), np.exp(la - safe), 0.0)[..., None]
        wb = np.where(np.isfinite(lb), np.exp(lb - safe), 0.0)[..., None]
        o = np.asarray(o_a, np.float32) * wa + np.asarray(o_b, np.float32) * wb
        return o.astype(self.dtype), lse.astype(np.float32)

    def copy_page_prefix(self, pages_per_layer, src_page, dst_page, length):
        for pages in pages_per_layer:
            pages[dst_page, :, :, :length, :] = pages[src_page, :, :, :length, :]

    def compact_kv(self, pages_per_layer, src_slots, dst_slots):
        ps = self.config.page_size
        src, dst = np.asarray(src_slots), np.asarray(dst_slots)
        for pages in pages_per_layer:
            rows = pages[src // ps, :, :, src % ps, :].copy()     # read every source first
            pages[dst // ps, :, :, dst % ps, :] = rows

    def gather_kv(self, pages_per_layer, slots):
        ps = self.config.page_size
        slots = np.asarray(slots)
        k = np.stack([p[slots // ps, 0, :, slots % ps, :] for p in pages_per_layer])
        v = np.stack([p[slots // ps, 1, :, slots % ps, :] for p in pages_per_layer])
        return k, v
