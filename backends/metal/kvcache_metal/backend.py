"""``MetalBackend``: kvcache on MLX (Apple GPU through Metal; MLX's CPU device elsewhere).

Memory: one ``mx.array`` per layer, of the base class's ``page_shape``. Writes into pages use
MLX slice/scatter assignment (``pages[idx] = rows``): it rebinds the *same Python array object*
to the scatter's result (so the core's ``cache.pages[layer]`` sees every write) and, because the
old buffer has no other reference, MLX donates it to the scatter, which then writes only the
touched rows in place: no per-append copy of the cache (see ``bench_append.py`` and
``tests/metal/test_inplace.py``). Kernels that copy between rows of the same array first
materialise the source rows into a fresh buffer so that the destination buffer stays donatable.

Kernels: MLX ops (``ops.py``), verified on MLX's CPU device against the reference backend. On an
Apple GPU the decode attention uses a ``mx.fast.metal_kernel`` (``metal_kernels.py``) and ragged
attention without masks uses ``mx.fast.scaled_dot_product_attention``: both UNVERIFIED here (no
Apple GPU on the CI machines); set ``KVCACHE_METAL_OPS_ONLY=1`` to force the ops path.
Calls with ``logit_softcap``, ``sinks`` or a value head dim other than ``head_dim`` always take
the ops path (the Metal kernel and the fused-SDPA call implement none of them).

Pages: the base class's ``page_shape``, rows ``config.page_row_dim = max(D, Dv)`` wide, K in the
first ``D`` entries of ``[:, 0]`` rows and V in the first ``Dv`` of ``[:, 1]`` rows. With
``kv_dtype`` int8 / int4 the rows are bytes of codes, scales and biases (``affine.py``); the
attention decodes the rows it gathers.
"""

from __future__ import annotations

import abc
import os
import sys
import threading
from typing import Optional

import numpy as np

from kvcache.backend import Backend, Capabilities

try:  # importing the plugin must work without MLX; availability() says why it cannot run
    import mlx.core as mx
    _MLX_ERROR: Optional[str] = None
except Exception as exc:  # pragma: no cover - exercised by monkeypatching _MLX_ERROR
    mx = None  # type: ignore[assignment]
    _MLX_ERROR = f"{type(exc).__name__}: {exc}"

PRIORITY_APPLE_GPU = 50
PRIORITY_ELSEWHERE = -10
NO_METAL_REASON = "no Metal device; MLX CPU device available with device='cpu'"
GPU_NAMES = ("gpu", "metal", "mps")


def _mlx_version() -> str:
    """MLX's version string (read with getattr: mlx.core's type stubs leave ``__version__``
    out)."""
    return getattr(mx, "__version__")


def _metal_available() -> bool:
    if sys.platform != "darwin":
        return False        # known without MLX: backend='auto' need not import it to rank us
    try:
        return bool(mx is not None and mx.metal.is_available())
    except Exception:
        return False


def _mlx_cuda_available() -> bool:
    """MLX's CUDA build on an NVIDIA GPU (``mlx-cuda-*``): the same lazy, asynchronous GPU
    execution, without Metal's kernels (the backend then runs its MLX-ops kernels)."""
    try:
        return bool(mx is not None and getattr(mx, "cuda", None) is not None
                    and mx.cuda.is_available())
    except Exception:
        return False


class _PriorityMeta(abc.ABCMeta):
    """``priority`` is a class attribute in the contract, but the right value depends on the
    machine: above the reference backend only where an Apple GPU is present, below it otherwise
    (so ``backend='auto', device='cpu'`` still picks the reference backend)."""

    @property
    def priority(cls) -> int:
        return PRIORITY_APPLE_GPU if _metal_available() else PRIORITY_ELSEWHERE


class MetalBackend(Backend, metaclass=_PriorityMeta):
    name = "metal"
    description = "MLX arrays and streams; Metal kernels on Apple GPUs, MLX ops on MLX's CPU device"
    capabilities = Capabilities(
        dtypes=("float16", "bfloat16", "float32"),
        # the affine formats as mlx-lm's quantized cache makes them (affine.py)
        kv_dtypes=("float16", "bfloat16", "float32", "int8", "int4"),
        copy_stream=False, merged_aux=False, static_decode=False,
        tree_attention=True, sliding_window=True, fused_rope_append=False, inline_rope=True,
        window_left=True, rope_frequencies=True, logit_softcap=True, attention_sinks=True,
        # batch_invariant: each row alone through the ops path (_rows_alone)
        batch_invariant=True, window_groups=True, state_slots=True,
        head_dims=tuple(range(2, 1025, 2)), head_dims_v=tuple(range(2, 1025, 2)),
    )

    # ------------------------------------------------------------------ discovery
    @classmethod
    def _mlx_error(cls) -> Optional[str]:
        return _MLX_ERROR

    @classmethod
    def availability(cls, device=None):
        err = cls._mlx_error()
        if err is not None:
            return False, f"MLX not installed (pip install mlx, or 'mlx[cpu]' off Apple silicon): {err}"
        if device is None:
            if _metal_available():
                return True, f"Apple GPU through Metal (MLX {_mlx_version()})"
            return False, NO_METAL_REASON
        dev = str(device).lower()
        if dev == "cpu":
            return True, f"MLX CPU device (MLX {_mlx_version()}; MLX-ops kernels)"
        if dev in GPU_NAMES or dev.startswith("gpu:"):
            if _metal_available():
                return True, f"Apple GPU through Metal (MLX {_mlx_version()})"
            if dev == "gpu" and _mlx_cuda_available():
                return True, (f"NVIDIA GPU through MLX's CUDA build (MLX {_mlx_version()}; "
                              f"MLX-ops kernels: Metal's are Apple-only)")
            return False, f"device {device!r} needs an Apple GPU: {NO_METAL_REASON}"
        return False, f"the metal backend runs on 'gpu' (Apple GPU) or 'cpu' (MLX CPU), not {device!r}"

    @classmethod
    def devices(cls):
        if cls._mlx_error() is not None:
            return []
        return (["gpu"] if _metal_available() or _mlx_cuda_available() else []) + ["cpu"]

    @classmethod
    def platform(cls):
        info: dict[str, object] = {"vendor": "apple", "runtime": "metal/mlx"}
        if cls._mlx_error() is None:
            info["mlx"] = _mlx_version()
            info["metal"] = _metal_available()
        return info

    def __init__(self, config, device=None):
        dev = "gpu" if device is None else str(device).lower()
        if dev in GPU_NAMES or dev.startswith("gpu"):
            dev = "gpu"
        super().__init__(config, dev)
        from . import ops
        self._ops = ops
        self.mx_device = mx.gpu if dev == "gpu" else mx.cpu
        self.on_gpu = dev == "gpu"
        self._streams = threading.local()
        self._streams.stream = mx.new_stream(self.mx_device)
        self.dtype = ops.MX_DTYPES[config.dtype]
        self.precise_rope = not self.on_gpu          # float64 exists on MLX's CPU device only
        # Metal's own kernels on an Apple GPU only (MLX's CUDA build runs the MLX-ops kernels)
        ops_only = (os.environ.get("KVCACHE_METAL_OPS_ONLY", "") not in ("", "0")
                    or (self.on_gpu and not _metal_available()))
        self.use_metal_kernels = self.on_gpu and not ops_only   # UNVERIFIED path
        self.use_fast_sdpa = self.on_gpu and not ops_only       # UNVERIFIED path on GPU
        self.stats = {"metal_decode": 0, "sdpa_ragged": 0}
        self.affine = self._affine_rows()

    def __getstate__(self):
        """A copy (``copy.deepcopy``, ``pickle``) keeps the settings and leaves out what MLX
        cannot copy (streams, dtype objects) or what is a module; ``__setstate__`` makes them
        again. The page arrays are the cache's and copy as MLX arrays do."""
        state = dict(self.__dict__)
        for name in ("_ops", "_streams", "dtype", "affine"):
            state.pop(name, None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        from . import ops
        self._ops = ops
        self._streams = threading.local()           # each thread's stream, made on first use
        self.dtype = ops.MX_DTYPES[self.config.dtype]
        self.affine = self._affine_rows()

    def _affine_rows(self):
        """int8 / int4 pages: the rows' codec (rows of codes, scales and biases); else None."""
        c = self.config
        if not c.kv_format.packed:
            return None
        from .affine import AffineRows
        return AffineRows(c.kv_format.bits, c.kv_quant_group, c.dtype, c.page_row_dim,
                          fused=self.on_gpu and _metal_available())

    @property
    def stream(self):
        """The calling thread's stream: MLX streams belong to the thread that made them, so a
        cache built on one thread and used on another (one at a time) runs there on that
        thread's default stream; arrays carry their dependencies across streams."""
        try:
            return self._streams.stream
        except AttributeError:
            self._streams.stream = stream = mx.default_stream(self.mx_device)
            return stream

    # ------------------------------------------------------------------ memory
    def page_shape(self, num_pages):
        """The base layout; with int8 / int4 pages each row is ``affine.row_bytes`` bytes of
        codes, scales and biases (``affine.py``)."""
        shape = super().page_shape(num_pages)
        if self.affine is None:
            return shape
        return shape[:-1] + (self.affine.row_bytes,)

    def allocate_pages(self, num_pages):
        shape = self.page_shape(num_pages)
        kv_dtype = mx.uint8 if self.affine else self._ops.MX_DTYPES[self.config.kv_dtype]
        pages = []
        with mx.stream(self.stream):
            for _ in range(self.config.num_layers):
                p = mx.zeros(shape, dtype=kv_dtype)
                mx.eval(p)
                pages.append(p)
        return pages

    def from_numpy(self, array, dtype=None):
        array = np.asarray(array)
        if dtype is None:
            dtype = "int32" if array.dtype.kind in "iub" else self.config.dtype
        target = self._ops.MX_DTYPES[dtype]
        if array.dtype.kind == "f" and dtype == "float16" and array.dtype.itemsize > 4:
            # rounded once, on the host: MLX reads float64 as float32, and rounding that to
            # float16 again differs from one rounding in rare ties (which can move an int8 code)
            array = array.astype(np.float16)
        if array.dtype.kind == "f" and (array.dtype.itemsize < 4 or array.dtype.name == "bfloat16"):
            array = array.astype(np.float32)        # ml_dtypes bfloat16 / float16 via float32
        if dtype == "int32":
            array = array.astype(np.int32)
        with mx.stream(self.stream):
            out = mx.array(np.ascontiguousarray(array)).astype(target)
            mx.eval(out)
        return out

    def to_numpy(self, array):
        if array.dtype in (mx.float16, mx.bfloat16):
            array = array.astype(mx.float32)
        return np.array(array, copy=True)

    def is_native(self, array):
        return mx is not None and isinstance(array, mx.array)

    def dtype_name(self, array):
        for name, dt in self._ops.MX_DTYPES.items():
            if array.dtype == dt:
                return name
        return str(array.dtype).replace("mlx.core.", "")

    def aux_to_device(self, host_array):
        with mx.stream(self.stream):
            out = mx.array(np.ascontiguousarray(host_array, dtype=np.int32))
            mx.eval(out)
        return out

    # ------------------------------------------------------------------ streams
    def create_stream(self):
        return mx.new_stream(self.mx_device)

    def current_stream(self):
        return self.stream

    def synchronize(self) -> None:
        mx.synchronize(self.stream)

    # ------------------------------------------------------------------ kernels
    def rope(self, x, positions, rope):
        ops = self._ops
        with mx.stream(self.stream):
            cos, sin = ops.rope_cos_sin(positions, x.shape[-1], rope,
                                        self.precise_rope)
            return ops.rotate(x.astype(mx.float32), cos, sin).astype(self.dtype)

    def _sinks(self, sinks):
        """The (Hq,) sink logits as a float32 MLX array (any float dtype in; None stays None)."""
        if sinks is None:
            return None
        with mx.stream(self.stream):
            if not isinstance(sinks, mx.array):
                sinks = mx.array(np.asarray(sinks, dtype=np.float32))
            return sinks.astype(mx.float32)

    def _slot_index(self, slots):
        ps = self.config.page_size
        return slots // ps, slots % ps

    def append_kv(self, pages, k, v, slots, positions=None, rope=None, kv_scale=None,
                  packed=False):
        if packed:
            return self._append_packed(pages, k, v, slots)
        ops = self._ops
        with mx.stream(self.stream):
            s_host = ops.host(slots)
            keep = s_host >= 0
            if not keep.all():                      # sliding window: tokens that slid out
                idx = np.nonzero(keep)[0]
                if len(idx) == 0:
                    return
                sel = mx.array(idx.astype(np.int32))
                k, v, slots = k[sel], v[sel], slots[sel]
                if positions is not None:
                    positions = positions[sel]
            if rope is not None:
                cos, sin = ops.rope_cos_sin(positions, k.shape[-1], rope,
                                            self.precise_rope)
                k = ops.rotate(k.astype(mx.float32), cos, sin)
            page, row = self._slot_index(slots)
            c = self.config
            heads = mx.arange(c.num_kv_heads)
            if self.affine is not None:             # rows of codes, scales, biases (T, 2, Hkv, B)
                kv = mx.stack([self.affine.encode(k), self.affine.encode(v)], axis=1)
                pages[page[:, None, None], mx.arange(2)[None, :, None],
                      heads[None, None, :], row[:, None, None]] = kv
            elif c.head_dim == c.head_dim_v:        # K and V rows in one scatter (T, 2, Hkv, D)
                kv = mx.stack([k.astype(self.dtype), v.astype(self.dtype)], axis=1)
                pages[page[:, None, None], mx.arange(2)[None, :, None],
                      heads[None, None, :], row[:, None, None]] = kv
            else:   # rows max(D, Dv) wide: K into the first D entries, V into the first Dv
                pages[page[:, None], 0, heads[None, :], row[:, None], :c.head_dim] = \
                    k.astype(self.dtype)
                pages[page[:, None], 1, heads[None, :], row[:, None], :c.head_dim_v] = \
                    v.astype(self.dtype)
            mx.async_eval(pages)

    # -------------------------------------------------------------- ragged (new tokens only)
    def ragged_attention(self, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                         rope=None, q_positions=None, k_rope_offset=None, window_left=-1,
                         logit_softcap=0.0, sinks=None, kv_scale=None):
        # kv_scale: a scaled format's, which this backend does not store (never passed)
        ops = self._ops
        c = self.config
        t, hq, d = q.shape
        dv = v.shape[-1]
        softcap = float(logit_softcap or 0.0)
        sinks = self._sinks(sinks)
        with mx.stream(self.stream):
            qo = ops.host(qo_indptr)[: num_seqs + 1].astype(np.int64)
            qlens = np.diff(qo)
            if self.affine is not None:     # the new rows as the pages give them back
                k, v = self.affine.roundtrip(k, d), self.affine.roundtrip(v, dv)
            # fused SDPA: no softcap / sinks / Dv != D / quantized rows there (the ops path)
            if (self.use_fast_sdpa and tree is None and rope is None and num_seqs == 1
                    and qlens[0] == t and t > 0 and window_left < 0 and not softcap
                    and sinks is None and dv == d and self.affine is None):
                return self._ragged_sdpa(q, k, v, sm_scale)
            out = ops.Output(t, hq, dv, sinks)
            for ent in ops.buckets(qlens, qlens):
                lq = int(qlens[ent].max())
                e = mx.array(ent.astype(np.int32))
                r = mx.arange(lq)
                lens = mx.array(qlens[ent].astype(np.int32))
                rows = mx.array(qo[ent].astype(np.int32))[:, None] + r[None, :]
                valid = r[None, :] < lens[:, None]
                rows_c = mx.where(valid, rows, 0)
                qg = q[rows_c].astype(mx.float32)
                pad = valid[:, :, None, None]
                kg = mx.where(pad, k[rows_c].astype(mx.float32), 0.0)
                vg = mx.where(pad, v[rows_c].astype(mx.float32), 0.0)
                if rope is not None:
                    cq, sq = ops.rope_cos_sin(q_positions[rows_c], d, rope,
                                              self.precise_rope)
                    qg = ops.rotate(qg, cq, sq)
                    kpos = k_rope_offset[e][:, None] + r[None, :]
                    ck, sk = ops.rope_cos_sin(kpos, d, rope, self.precise_rope)
                    kg = ops.rotate(kg, ck, sk)
                causal = r[None, :, None] >= r[None, None, :]
                visible = causal & valid[:, :, None] & valid[:, None, :]
                if window_left >= 0:     # new tokens sit at consecutive positions
                    visible = visible & (r[None, None, :] >= r[None, :, None] - window_left)
                if tree is not None and tree.mask.shape[0] > 0:
                    tsize = tree.indptr[e + 1] - tree.indptr[e]
                    base = lens - tsize                  # keys before the tree (0 per contract)
                    q_node = r[None, :] - base[:, None]
                    k_node = r[None, :] - base[:, None]
                    in_tree = (k_node >= 0) & valid
                    vis_t = ops.tree_visible(tree.indptr, tree.mask, e, q_node, k_node,
                                             (q_node >= 0) & valid, in_tree)
                    visible = visible & vis_t
                for r0, r1 in ops._tiles(len(ent), hq, lq, lq):
                    o, lse = ops.softmax_attend(qg[:, r0:r1], kg[:, :r1], vg[:, :r1],
                                                visible[:, r0:r1, :r1], sm_scale, c.group_size,
                                                softcap=softcap, sinks=sinks)
                    out.put(rows[:, r0:r1], valid[:, r0:r1], o, lse)
            return out.result(self.dtype)

    def _ragged_sdpa(self, q, k, v, sm_scale):
        """One causal sequence without tree / inline RoPE: MLX's fused attention for o; the lse is
        a separate lazy expression (computed only if the caller uses it, e.g. to merge).
        Used on the Apple GPU only by default (UNVERIFIED there); exercised on CPU by a test."""
        self.stats["sdpa_ragged"] += 1
        g = self.config.group_size
        qh = q.transpose(1, 0, 2)[None]                     # (1, Hq, T, D)
        kh = k.transpose(1, 0, 2)[None]
        vh = v.transpose(1, 0, 2)[None]
        o = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=sm_scale, mask="causal")
        o = o[0].transpose(1, 0, 2).astype(self.dtype)
        t, hq, d = q.shape
        hkv = hq // g
        qf = q.astype(mx.float32).reshape(t, hkv, g, d).transpose(1, 2, 0, 3)     # (Hkv, G, T, D)
        kf = k.astype(mx.float32).transpose(1, 2, 0)[:, None]                      # (Hkv, 1, D, T)
        logits = (qf @ kf) * sm_scale
        tri = mx.arange(t)[:, None] >= mx.arange(t)[None, :]
        logits = mx.where(tri, logits, self._ops.NEG_INF)
        lse = mx.logsumexp(logits, axis=-1).reshape(hq, t).transpose(1, 0)
        return o, lse

    # -------------------------------------------------------------------- paged (history)
    def paged_attention(self, q, pages, depth, sm_scale, *, rope=None, q_positions=None,
                        window_left=-1, logit_softcap=0.0, sinks=None, kv_scale=None):
        ops = self._ops
        c = self.config
        t, hq, d = q.shape
        dv = c.head_dim_v
        softcap = float(logit_softcap or 0.0)
        sinks = self._sinks(sinks)
        n = int(depth.num_entries)
        with mx.stream(self.stream):
            # the Metal decode kernel implements neither softcap, sinks nor Dv != D: those
            # calls take the ops path below (which runs on the GPU as well)
            if (self.use_metal_kernels and depth.use_decode and depth.tree is None
                    and not c.batch_invariant
                    and rope is None and window_left < 0 and d % 32 == 0 and d <= 256
                    and not softcap and sinks is None and dv == d and self.affine is None):
                from .metal_kernels import paged_decode
                self.stats["metal_decode"] += 1
                o, lse = paged_decode(self, q, pages, depth, sm_scale)
                mx.eval(o, lse)                      # release the page buffer (see below)
                return o, lse
            qo = ops.host(depth.qo_indptr)[: n + 1].astype(np.int64)
            qlens = np.diff(qo)
            klens = ops.host(depth.kv_len)[:n].astype(np.int64)
            out = ops.Output(t, hq, dv, sinks)
            n_idx = depth.page_indices.shape[0]
            ps, hkv = c.page_size, c.num_kv_heads
            for ent in ops.buckets(qlens, klens):
                lq, lk = int(qlens[ent].max()), int(klens[ent].max())
                e = mx.array(ent.astype(np.int32))
                rq, j = mx.arange(lq), mx.arange(lk)
                qlen = mx.array(qlens[ent].astype(np.int32))
                kvlen = depth.kv_len[e]
                rows = mx.array(qo[ent].astype(np.int32))[:, None] + rq[None, :]
                valid_q = rq[None, :] < qlen[:, None]
                rows_c = mx.where(valid_q, rows, 0)
                valid_k = j[None, :] < kvlen[:, None]
                # key j -> in-entry offset (sinks, then the window after a gap) -> page, row
                sink = depth.sink_size[e][:, None]
                gap = depth.window_offset[e][:, None]
                off = mx.where(j[None, :] < sink, j[None, :], j[None, :] - sink + gap)
                off = mx.where(valid_k, off, 0)
                pidx = mx.clip(depth.page_indptr[e][:, None] + off // ps, 0, max(n_idx - 1, 0))
                page = depth.page_indices[pidx]
                row = off % ps
                kv = pages[page[:, :, None, None], mx.arange(2)[None, None, :, None],
                           mx.arange(hkv)[None, None, None, :], row[:, :, None, None]]
                # materialise the gathered rows now: a lazy gather would keep a reference to
                # the page buffer and make the next write into it (sliding windows write after
                # attention) copy the whole buffer instead of updating it in place
                mx.eval(kv)
                # padding keys read some row of the entry's first page, which may be stale or
                # poisoned (NaN): zero them, since 0 * NaN would leak through the softmax matmul
                kg, vg = self._values(kv[:, :, 0], d), self._values(kv[:, :, 1], dv)
                kg = mx.where(valid_k[:, :, None, None], kg, 0.0)   # (m, Lk, Hkv, D)
                vg = mx.where(valid_k[:, :, None, None], vg, 0.0)   # (m, Lk, Hkv, Dv)
                qg = q[rows_c].astype(mx.float32)                       # (m, Lq, Hq, D)
                if rope is not None:
                    cq, sq = ops.rope_cos_sin(q_positions[rows_c], d, rope,
                                              self.precise_rope)
                    qg = ops.rotate(qg, cq, sq)
                    kpos = depth.k_rope_offset[e][:, None] + j[None, :]
                    ck, sk = ops.rope_cos_sin(kpos, d, rope, self.precise_rope)
                    kg = ops.rotate(kg, ck, sk)
                visible = valid_q[:, :, None] & valid_k[:, None, :]
                if depth.tree is not None and depth.tree.mask.shape[0] > 0:
                    tr = depth.tree
                    tsize = tr.indptr[e + 1] - tr.indptr[e]
                    base = kvlen - tsize
                    q_node = (tsize - qlen)[:, None] + rq[None, :]
                    k_node = j[None, :] - base[:, None]
                    in_tree = (k_node >= 0) & valid_k & (tsize > 0)[:, None]
                    vis_t = ops.tree_visible(tr.indptr, tr.mask, e, q_node, k_node,
                                             valid_q & (tsize > 0)[:, None], in_tree)
                    visible = visible & vis_t
                if window_left >= 0:     # key j of entry e sits at k_rope_offset[e] + j
                    kpos = depth.k_rope_offset[e][:, None] + j[None, :]
                    floor = q_positions[rows_c] - window_left
                    visible = visible & (kpos[:, None, :] >= floor[:, :, None])
                if c.batch_invariant:
                    self._rows_alone(out, qg, kg, vg, visible, rows, valid_q, sm_scale,
                                     softcap, sinks)
                    continue
                for r0, r1 in ops._tiles(len(ent), hq, lq, lk):
                    o, lse = ops.softmax_attend(qg[:, r0:r1], kg, vg, visible[:, r0:r1],
                                                sm_scale, c.group_size,
                                                masked=depth.tree is not None or window_left >= 0,
                                                softcap=softcap, sinks=sinks)
                    out.put(rows[:, r0:r1], valid_q[:, r0:r1], o, lse)
            return out.result(self.dtype)

    def _rows_alone(self, out, qg, kg, vg, visible, rows, valid_q, sm_scale, softcap, sinks):
        """Batch-invariant attention (``CacheConfig(batch_invariant=True)``): each query row by
        itself over its keys up to the last it sees, always through the masked path, so every
        reduction's length and order are the row's own (not its entry's, its group's or its
        neighbours')."""
        seen = np.array(visible)
        ok = np.array(valid_q)
        for i in range(seen.shape[0]):
            for r in range(seen.shape[1]):
                keys = np.flatnonzero(seen[i, r])
                if not ok[i, r] or not len(keys):
                    continue
                m = int(keys[-1]) + 1
                o, lse = self._ops.softmax_attend(
                    qg[i:i + 1, r:r + 1], kg[i:i + 1, :m], vg[i:i + 1, :m],
                    visible[i:i + 1, r:r + 1, :m], sm_scale, self.config.group_size,
                    masked=True, softcap=softcap, sinks=sinks)
                out.put(rows[i:i + 1, r:r + 1], valid_q[i:i + 1, r:r + 1], o, lse)

    def _values(self, rows, dim):
        """float32 ``(..., dim)`` values of gathered page rows (decoded from int8 / int4)."""
        if self.affine is not None:
            return self.affine.decode(rows, dim)
        return rows[..., :dim].astype(mx.float32)

    def merge_attention(self, o_a, lse_a, o_b, lse_b):
        with mx.stream(self.stream):
            la, lb = lse_a.astype(mx.float32), lse_b.astype(mx.float32)
            peak = mx.maximum(la, lb)
            safe = mx.where(mx.isinf(peak), 0.0, peak)
            wa, wb = mx.exp(la - safe), mx.exp(lb - safe)       # exp(-inf) = 0
            s = wa + wb
            empty = s == 0                       # a NaN lse (a NaN key was seen) stays NaN
            lse = mx.where(empty, self._ops.NEG_INF, mx.log(mx.maximum(s, 1e-38)) + safe)
            o = (o_a.astype(mx.float32) * wa[..., None] + o_b.astype(mx.float32) * wb[..., None])
            o = o / mx.where(empty, 1.0, s)[..., None]
            return o.astype(self.dtype), lse

    def copy_page_prefix(self, pages_per_layer, src_page, dst_page, length):
        if length <= 0:
            return
        with mx.stream(self.stream):
            src = mx.array([src_page], dtype=mx.int32)
            for pages in pages_per_layer:
                rows = pages[src][0, :, :, :length]      # gather: a fresh buffer, not a view
                mx.eval(rows)                            # release the read before the write
                pages[dst_page, :, :, :length] = rows
                mx.eval(pages)

    def compact_kv(self, pages_per_layer, src_slots, dst_slots):
        if src_slots.shape[0] == 0:
            return
        hkv = self.config.num_kv_heads
        with mx.stream(self.stream):
            sp, sr = self._slot_index(src_slots)
            dp, dr = self._slot_index(dst_slots)
            two, heads = mx.arange(2)[None, :, None], mx.arange(hkv)[None, None, :]
            for pages in pages_per_layer:
                rows = pages[sp[:, None, None], two, heads, sr[:, None, None]]   # (N, 2, Hkv, D)
                mx.eval(rows)                            # every source read before any write
                pages[dp[:, None, None], two, heads, dr[:, None, None]] = rows
                mx.eval(pages)

    def _gather_packed(self, pages_per_layer, slots):
        """``gather_kv(..., packed=True)``: each row's packed bytes as the page holds them."""
        c = self.config
        with mx.stream(self.stream):
            page, row = self._slot_index(slots)
            rows = mx.stack([pages[page[:, None, None], mx.arange(2)[None, :, None],
                                   mx.arange(c.num_kv_heads)[None, None, :], row[:, None, None]]
                             for pages in pages_per_layer])            # (L, n, 2, Hkv, bytes)
            k = rows[:, :, 0, :, :self.affine.bytes_of(c.head_dim)]
            v = rows[:, :, 1, :, :self.affine.bytes_of(c.head_dim_v)]
            mx.eval(k, v)
            return k, v

    def _append_packed(self, pages, k, v, slots):
        """``append_kv(..., packed=True)``: packed rows into the pages unchanged."""
        c = self.config
        with mx.stream(self.stream):
            keep = self._ops.host(slots) >= 0
            if not keep.all():
                sel = mx.array(np.nonzero(keep)[0].astype(np.int32))
                k, v, slots = k[sel], v[sel], slots[sel]
            page, row = self._slot_index(slots)
            width = self.affine.row_bytes
            kv = mx.stack([mx.pad(x, [(0, 0), (0, 0), (0, width - x.shape[-1])])
                           for x in (k, v)], axis=1)                    # (T, 2, Hkv, bytes)
            pages[page[:, None, None], mx.arange(2)[None, :, None],
                  mx.arange(c.num_kv_heads)[None, None, :], row[:, None, None]] = kv
            mx.async_eval(pages)

    def gather_kv(self, pages_per_layer, slots, kv_scale=None, packed=False):
        if packed:
            return self._gather_packed(pages_per_layer, slots)
        with mx.stream(self.stream):
            page, row = self._slot_index(slots)
            ks, vs = [], []
            for pages in pages_per_layer:
                kv = pages[page[:, None, None], mx.arange(2)[None, :, None],
                           mx.arange(pages.shape[2])[None, None, :], row[:, None, None]]
                if self.affine is None:
                    ks.append(kv[:, 0, :, :self.config.head_dim])
                    vs.append(kv[:, 1, :, :self.config.head_dim_v])
                else:            # dequantized, in the compute dtype
                    ks.append(self._values(kv[:, 0], self.config.head_dim).astype(self.dtype))
                    vs.append(self._values(kv[:, 1], self.config.head_dim_v).astype(self.dtype))
            k, v = mx.stack(ks), mx.stack(vs)
            mx.eval(k, v)
            return k, v

    # ------------------------------------------------------------------ state slots
    def allocate_state(self, num_slots, shape, dtype=None):
        with mx.stream(self.stream):
            states = mx.zeros((num_slots,) + tuple(shape),
                              dtype=self.dtype if dtype is None else self._ops.MX_DTYPES[dtype])
            mx.eval(states)
        return states

    def gather_state(self, states, slots):
        # lazy, no wait (run-ahead): the gather holds the states it read, so a later
        # scatter cannot change it (MLX copies instead of donating a buffer still read)
        with mx.stream(self.stream):
            out = states[slots]
            mx.async_eval(out)
        return out

    def scatter_state(self, states, slots, values):
        # slice assignment rebinds this same Python object to the scatter's result (see the
        # module docstring), so the cache's reference sees the write
        with mx.stream(self.stream):
            states[slots] = values.astype(states.dtype)
            mx.async_eval(states)
