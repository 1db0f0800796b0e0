"""Random kernel inputs with real page tables, and comparisons against the reference backend."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import pytest

import kvcache
from kvcache.backend import DepthAux, RopeSpec, TreeMask
from kvcache.conformance import assert_close as close, random_tree
from kvcache.reference import ReferenceBackend

DEVICE = os.environ.get("KVCACHE_CUDA_TEST_DEVICE", "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_GPU = DEVICE.startswith("cuda")
if ON_GPU:
    IMPLS = ["torch", "triton"]
    DTYPES = ["float32", "float16", "bfloat16"]
elif INTERPRET:
    IMPLS = ["triton"]
    DTYPES = ["float32", "float16"]      # the interpreter (numpy) has no bfloat16
else:
    IMPLS = ["torch"]
    DTYPES = ["float32", "float16", "bfloat16"]

SLOW_IN_INTERPRETER = [pytest.mark.slow] if INTERPRET else []
"""The marks of a case `make test` leaves out under Triton's interpreter (each costs 10-30 s
there): a sample of each matrix stays in CI, and `make test-all`, the CPU torch mode and a GPU
run take every case."""


slow_in_interpreter = pytest.mark.slow if INTERPRET else (lambda test: test)
"""A test decorator: the whole test ``SLOW_IN_INTERPRETER``."""


def cpu_sample(cases: list, keep_torch: list, keep_interpreter: list) -> list:
    """``cases`` as ``pytest.param``s: on the CPU those not in the mode's keep list (the torch
    kernels', the interpreter's) marked slow, so `make test` runs a sample of the matrix; on a
    GPU every case (its runs do not pass `-m`)."""
    keep = keep_interpreter if INTERPRET else keep_torch
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                         marks=[] if ON_GPU or c in keep else [pytest.mark.slow]) for c in cases]


def interpreter_sample(cases: list, keep: list) -> list:
    """``cases`` (parameter values or tuples) as ``pytest.param``s, those not in ``keep``
    marked slow under the interpreter (``SLOW_IN_INTERPRETER``)."""
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)),
                         marks=[] if c in keep else SLOW_IN_INTERPRETER) for c in cases]


def config(hq=4, hkv=2, d=64, ps=16, dtype="float32", layers=1, **kw):
    kw.setdefault("rope_mode", "none")
    return kvcache.CacheConfig(num_layers=layers, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                               page_size=ps, dtype=dtype, max_total_tokens=4096,
                               prefill_chunk_size=1024, **kw)


def pair(cfg, impl):
    """(reference backend, cuda backend forced to ``impl``)."""
    from kvcache_cuda.backend import CudaBackend
    mine = CudaBackend(cfg, DEVICE)
    mine.impl = impl
    return ReferenceBackend(cfg), mine


def to_ref(ref, mine, x, dtype=None):
    """The same values as a reference (numpy) array; floats keep the cache dtype exactly."""
    arr = mine.to_numpy(x)
    if dtype is None:
        dtype = "int32" if arr.dtype.kind in "iu" else ref.config.dtype
    return ref.from_numpy(arr, dtype)


def rand(mine, rng, shape, dtype=None):
    return mine.from_numpy(rng.standard_normal(shape).astype(np.float32), dtype)


def ints(mine, values):
    return mine.from_numpy(np.asarray(values, np.int32), "int32")


def assert_close(mine, ref_backend, got, want, what="o"):
    """A cuda-backend array against a reference one, within the suite's dtype tolerance."""
    close(what, ref_backend.to_numpy(want), mine.to_numpy(got), ref_backend.config.dtype)


def assert_lse(mine, ref_backend, got, want, what="lse"):
    """A cuda-backend lse against the reference's (-inf rows must match)."""
    close(what, np.asarray(want), mine.to_numpy(got), ref_backend.config.dtype, lse=True)


@dataclass
class Entry:
    nq: int
    kv_len: int
    sink: int = 0
    gap: int = 0          # window_offset; sink == gap == 0: no sliding window
    tree: int = 0         # tree size (the last ``tree`` keys), 0: none

    @property
    def span(self):
        return self.gap + self.kv_len - self.sink if self.kv_len > self.sink else self.kv_len


@dataclass
class PagedCase:
    q: object
    pages: object
    depth: DepthAux
    q_positions: object
    ref_q: object
    ref_pages: object
    ref_depth: DepthAux
    ref_q_positions: object
    extra: dict = field(default_factory=dict)


def paged_case(rng, ref, mine, entries, *, use_decode=False, row_offset=0, tail_rows=0,
               spare_pages=5):
    """Entries over pages drawn from a random permutation of a pool bigger than needed (stale
    random data in unused pages catches wrong reads). Rows ``[0, row_offset)`` and the last
    ``tail_rows`` rows belong to no entry."""
    c = ref.config
    ps = c.page_size
    npages = [-(-e.span // ps) for e in entries]
    pool = sum(npages) + spare_pages
    perm = rng.permutation(pool).astype(np.int32)
    page_indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    page_indices = perm[: page_indptr[-1]]
    nq = np.array([e.nq for e in entries], np.int32)
    qo = (row_offset + np.concatenate([[0], np.cumsum(nq)])).astype(np.int32)
    total = int(qo[-1]) + tail_rows
    spans = np.array([e.span for e in entries], np.int64)
    arrays = dict(
        qo_indptr=qo, page_indptr=page_indptr, page_indices=page_indices,
        last_page_len=np.where(spans > 0, (spans - 1) % ps + 1, 0).astype(np.int32),
        kv_len=np.array([e.kv_len for e in entries], np.int32),
        sink_size=np.array([e.sink for e in entries], np.int32),
        window_offset=np.array([e.gap for e in entries], np.int32),
        k_rope_offset=rng.integers(0, 40, len(entries)).astype(np.int32))
    tree_np = None
    if any(e.tree for e in entries):
        sizes = np.array([e.tree for e in entries], np.int32)
        masks = [random_tree(rng, e.tree) for e in entries if e.tree]
        tree_np = (np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32), np.concatenate(masks))
    # every row no key of any entry maps to is NaN: a kernel that reads it, or lets a masked
    # padding key's value leak into the output (0 * NaN), fails
    used = np.zeros((pool, ps), bool)
    for i, e in enumerate(entries):
        j = np.arange(e.kv_len)
        off = np.where(j < e.sink, j, j - e.sink + e.gap)
        used[page_indices[page_indptr[i] + off // ps], off % ps] = True
    pool_np = rng.standard_normal(mine.page_shape(pool)).astype(np.float32)
    pool_np.transpose(0, 3, 1, 2, 4)[~used] = np.nan      # (page, row) are axes 0 and 3
    assert np.isnan(pool_np).any() or used.all()
    pages = mine.from_numpy(pool_np)
    q = rand(mine, rng, (total, c.num_qo_heads, c.head_dim))
    qpos = rng.integers(0, 200, total).astype(np.int32)

    def depth_for(conv):
        tree = TreeMask(conv(tree_np[0]), conv(tree_np[1])) if tree_np is not None else None
        return DepthAux(**{k: conv(v) for k, v in arrays.items()}, num_entries=len(entries),
                        use_decode=use_decode, tree=tree,
                        max_kv_len=int(max([e.kv_len for e in entries], default=0)),
                        covers_rows=row_offset == 0 and tail_rows == 0)

    return PagedCase(q, pages, depth_for(lambda a: ints(mine, a)), ints(mine, qpos),
                     to_ref(ref, mine, q), to_ref(ref, mine, pages), depth_for(np.asarray), qpos)


def ragged_case(rng, ref, mine, lengths, *, tree=False):
    c = ref.config
    qo = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(qo[-1])
    q = rand(mine, rng, (total, c.num_qo_heads, c.head_dim))
    k = rand(mine, rng, (total, c.num_kv_heads, c.head_dim))
    v = rand(mine, rng, (total, c.num_kv_heads, c.head_dim))
    qpos = rng.integers(0, 300, total).astype(np.int32)
    krope = rng.integers(0, 300, len(lengths)).astype(np.int32)
    tree_np = None
    if tree:
        masks = [random_tree(rng, n) for n in lengths if n]
        tree_np = (qo.copy(), np.concatenate(masks) if masks else np.zeros(0, np.int32))
    return dict(q=q, k=k, v=v, qo=qo, qpos=qpos, krope=krope, tree=tree_np, total=total)


ROPE = RopeSpec(theta=10000.0, scale=1.0)
ROPE_SCALED = RopeSpec(theta=500000.0, scale=0.5)


def llama3_inv_freq(head_dim=64, theta=500000.0, factor=8.0, low=1.0, high=4.0, original=8192):
    """Llama 3's scaled inverse frequencies (its published formula, written out here)."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > low_wl, inv / factor, inv)
    return np.where((wavelen >= high_wl) & (wavelen <= low_wl), mid, out)


ROPE_FREQ = RopeSpec(inv_freq=tuple(llama3_inv_freq().tolist()))          # the model's own table
ROPE_PARTIAL = RopeSpec(theta=10000.0, rotary_dim=32)                      # half of d=64 rotates
