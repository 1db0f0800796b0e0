"""``BatchInvariantMode``'s ops on a GPU: Triton kernels whose arithmetic for a row does not
depend on the number of rows.

A GPU GEMM library chooses its kernel, tile and split-K by the whole shape, so the same row gets
other bits beside other rows; cutting the rows into blocks of a fixed count (the CPU path of
``torch_invariant``) would fix the shape but re-read the weights once per block, which makes a
prompt chunk several times slower. These kernels fix the arithmetic instead:

* ``matmul`` (``a @ b + bias``): a row's output is, per column, the float32 sum over ``K`` in
  chunks of ``CHUNK`` columns, each chunk a fresh ``tl.dot`` accumulation over ``BLOCK_K``
  tiles, the chunks added in order to a zero accumulator, then the bias. The chunk size depends
  on the dtype only, never on ``M``; the output tiles may (``WIDE`` for a prompt chunk's many:
  the same partials added in the same order). Few output tiles (a decode step) compute
  the chunks in separate programs (split-K) and a second kernel adds them in the same order;
  many tiles (a prompt chunk) add them in the program. Both orders are the same additions of
  the same partials, so the choice, which does depend on ``M``, does not change a bit (the
  tests check it on the device).
* row ops over the last dimension (``sum``/``mean``, ``logsumexp``, ``log_softmax``,
  ``softmax``, ``cumsum``): one program per row, blocks of a width chosen by the row length, a
  float32 (float64 for float64) accumulator.

Imported lazily (a GPU tensor under the mode, or a test under ``TRITON_INTERPRET=1`` with CPU
tensors, which checks the indexing in CI).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["matmul", "row_reduce", "row_softmax", "row_cumsum", "CONFIG", "WIDE"]

CONFIG = {
    # dtype: (BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, num_warps, num_stages); CHUNK = BLOCK_K * KSTEPS
    torch.float16: (64, 128, 64, 8, 4, 4),
    torch.bfloat16: (64, 128, 64, 8, 4, 4),
    torch.float32: (64, 64, 32, 16, 4, 3),
}
"""The fixed tiles of ``matmul`` per input dtype: the chunk (``BLOCK_K``, ``KSTEPS``) never
depends on the shape, which is the invariance."""

WIDE = {
    torch.float16: (128, 128, 64, 8, 8, 3),
    torch.bfloat16: (128, 128, 64, 8, 8, 3),
}
"""Larger output tiles for a product with many of them (a prompt chunk): the same ``BLOCK_K``
and ``KSTEPS`` as ``CONFIG``'s row, so each output is the same sums of the same partials in the
same order and the bits are ``CONFIG``'s (every 64-column-step, 512-column-chunk variant gave
equal bits on the H200: tools/invariant_gemm_lab.py --equal); only the weights are read fewer
times. Taken when the wide tiles alone fill a wave of the GPU (see ``matmul``)."""

_SPLIT_BELOW: int | None = None
"""``matmul`` computes the chunks in separate programs while the output has fewer tiles than
this (None: the GPU's SM count, one wave): a decode step's handful of rows would otherwise leave
most of the GPU idle, while a prompt chunk's partials would only add traffic (on the H200,
splitting below 264 tiles made the k/v projections of 2,048 rows 3.2x cuBLAS's time, below 132
1.7x). The bits are the same either way."""


@triton.jit
def _chunk(a_ptr, b_ptr, rm, rn, k0, M, N, K, sam, sak, sbk, sbn,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           KSTEPS: tl.constexpr, IEEE: tl.constexpr):
    """The float32 partial of the columns [k0, k0 + BLOCK_K * KSTEPS) for rows ``rm``, columns
    ``rn``: a fresh accumulator, ``KSTEPS`` dots in order (rows >= M and columns >= K read 0)."""
    p = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm[:, None] < M
    n_ok = rn[None, :] < N
    for s in range(KSTEPS):
        k = k0 + s * BLOCK_K + rk
        a = tl.load(a_ptr + rm[:, None] * sam + k[None, :] * sak,
                    mask=m_ok & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * sbk + rn[None, :] * sbn,
                    mask=(k[:, None] < K) & n_ok, other=0.0)
        if IEEE:
            p = tl.dot(a, b, p, input_precision="ieee")
        else:
            p = tl.dot(a, b, p)
    return p


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(a_ptr, b_ptr, bias_ptr, c_ptr, ws_ptr, M, N, K,
                   sam, sak, sbk, sbn, sbias_m, sbias_n, scm, scn,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   KSTEPS: tl.constexpr, IEEE: tl.constexpr):
    """``c = a @ b (+ bias)`` per (BLOCK_M, BLOCK_N) tile (program axis 0). ``SPLIT``: axis 1
    is the chunk, whose partial goes to ``ws`` (chunks, M, N); else the program adds every
    chunk's partial in order and writes ``c``."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    rm = ((pid // n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = ((pid % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ok = (rm[:, None] < M) & (rn[None, :] < N)
    CHUNK: tl.constexpr = BLOCK_K * KSTEPS
    if SPLIT:
        c = tl.program_id(1)
        p = _chunk(a_ptr, b_ptr, rm, rn, c * CHUNK, M, N, K, sam, sak, sbk, sbn,
                   BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, IEEE)
        tl.store(ws_ptr + c.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], p, mask=ok)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for c in range(0, tl.cdiv(K, CHUNK)):
            acc += _chunk(a_ptr, b_ptr, rm, rn, c * CHUNK, M, N, K, sam, sak, sbk, sbn,
                          BLOCK_M, BLOCK_N, BLOCK_K, KSTEPS, IEEE)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rm[:, None] * sbias_m + rn[None, :] * sbias_n,
                           mask=ok, other=0.0).to(tl.float32)
        tl.store(c_ptr + rm[:, None] * scm + rn[None, :] * scn, acc.to(c_ptr.dtype.element_ty),
                 mask=ok)


@triton.jit(do_not_specialize=["M"])
def _sum_chunks_kernel(ws_ptr, bias_ptr, c_ptr, M, N, CHUNKS, sbias_m, sbias_n, scm, scn,
                       HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``c = sum of ws's chunks in order (+ bias)``: the additions of the unsplit path."""
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < M * N
    m = idx // N
    n = idx % N
    acc = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, CHUNKS):
        acc += tl.load(ws_ptr + c * M * N + idx, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + m * sbias_m + n * sbias_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(c_ptr + m * scm + n * scn, acc.to(c_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           split: bool | None = None, wide: bool | None = None) -> torch.Tensor:
    """``a @ b (+ bias)`` with the fixed arithmetic of the module doc.

    a: (M, K); b: (K, N) (any strides: a linear layer's weight ``w`` (N, K) passes ``w.T``);
    bias: None, (N,) or (M, N), added after the sum. Inputs of one dtype (float16, bfloat16,
    float32; float32 without TF32). Returns (M, N) in that dtype. ``split`` forces the split-K
    or the in-program order, ``wide`` the ``WIDE`` tiles or ``CONFIG``'s (tests; None: by the
    tile count: split-K below a wave of ``CONFIG`` tiles, ``WIDE`` tiles from a wave of
    them on)."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bm, bn, bk, ksteps, warps, stages = CONFIG[a.dtype]
    chunks = triton.cdiv(k, bk * ksteps)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    below = 0
    if a.is_cuda and (split is None or wide is None):
        index = a.device.index if a.device.index is not None else torch.cuda.current_device()
        below = _SPLIT_BELOW or _sm_count(index)
    if split is None:
        split = chunks > 1 and tiles < below
    if wide is None:
        # (not below a wide tile's rows: a decode step's LM head has a wave of wide tiles
        # but would compute half of each for nothing, 1.42x cuBLAS against 0.92x narrow)
        wide = (not split and a.dtype in WIDE and below > 0 and m >= WIDE[a.dtype][0]
                and triton.cdiv(m, WIDE[a.dtype][0]) * triton.cdiv(n, WIDE[a.dtype][1]) >= below)
    if wide and not split and a.dtype in WIDE:
        bm, bn, bk, ksteps, warps, stages = WIDE[a.dtype]
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if bias is None:
        bias_t, sbias = out, (0, 0)
    else:
        bias_t = bias
        sbias = (0, bias.stride(0)) if bias.dim() == 1 else (bias.stride(0), bias.stride(1))
    args = (a.stride(0), a.stride(1), b.stride(0), b.stride(1), sbias[0], sbias[1],
            out.stride(0), out.stride(1))
    ieee = a.dtype == torch.float32
    if split:
        ws = torch.empty((chunks, m, n), dtype=torch.float32, device=a.device)
        _matmul_kernel[(tiles, chunks)](a, b, bias_t, out, ws, m, n, k, *args,
                                        HAS_BIAS=False, SPLIT=True, BLOCK_M=bm, BLOCK_N=bn,
                                        BLOCK_K=bk, KSTEPS=ksteps, IEEE=ieee,
                                        num_warps=warps, num_stages=stages)
        block = 1024
        _sum_chunks_kernel[(triton.cdiv(m * n, block),)](
            ws, bias_t, out, m, n, chunks, sbias[0], sbias[1], out.stride(0), out.stride(1),
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    else:
        _matmul_kernel[(tiles, 1)](a, b, bias_t, out, out, m, n, k, *args,
                                   HAS_BIAS=bias is not None, SPLIT=False, BLOCK_M=bm,
                                   BLOCK_N=bn, BLOCK_K=bk, KSTEPS=ksteps, IEEE=ieee,
                                   num_warps=warps, num_stages=stages)
    return out


# ---------------------------------------------------------------------------------- row ops
def _row_block(d: int) -> int:
    return max(16, min(triton.next_power_of_2(d), 4096))


@triton.jit
def _row_shift_total(x_row, D, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """(the row's max, 0 where it is -inf; the sum of exp(x - that)) over x_row[0:D]."""
    cols = tl.arange(0, BLOCK)
    top = tl.full((BLOCK,), float("-inf"), ACC)
    for d0 in range(0, D, BLOCK):
        v = tl.load(x_row + d0 + cols, mask=d0 + cols < D, other=float("-inf")).to(ACC)
        top = tl.maximum(top, v)
    mx = tl.max(top, 0)
    shift = tl.where(mx == float("-inf"), 0.0, mx)
    acc = tl.zeros((BLOCK,), ACC)
    for d0 in range(0, D, BLOCK):
        v = tl.load(x_row + d0 + cols, mask=d0 + cols < D, other=float("-inf")).to(ACC)
        acc += tl.exp(v - shift)
    return shift, tl.sum(acc, 0)


@triton.jit
def _row_reduce_kernel(x_ptr, out_ptr, D, scale, OP: tl.constexpr, BLOCK: tl.constexpr,
                       ACC: tl.constexpr):
    """Row ``program_id`` of x (rows, D), contiguous: OP 0 the sum times ``scale`` (sum,
    mean), OP 1 the log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    if OP == 0:
        cols = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), ACC)
        for d0 in range(0, D, BLOCK):
            acc += tl.load(x_row + d0 + cols, mask=d0 + cols < D, other=0.0).to(ACC)
        res = tl.sum(acc, 0) * scale
    else:
        shift, total = _row_shift_total(x_row, D, BLOCK, ACC)
        res = tl.log(total) + shift
    tl.store(out_ptr + row, res.to(out_ptr.dtype.element_ty))


@triton.jit
def _row_softmax_kernel(x_ptr, out_ptr, D, LOG: tl.constexpr, BLOCK: tl.constexpr,
                        ACC: tl.constexpr):
    """Row ``program_id``: softmax (``LOG``: log_softmax) of x (rows, D), contiguous."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * D
    cols = tl.arange(0, BLOCK)
    shift, total = _row_shift_total(x_row, D, BLOCK, ACC)
    for d0 in range(0, D, BLOCK):
        ok = d0 + cols < D
        v = tl.load(x_row + d0 + cols, mask=ok, other=0.0).to(ACC)
        if LOG:
            y = v - shift - tl.log(total)
        else:
            y = tl.exp(v - shift) / total
        tl.store(out_ptr + row * D + d0 + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _row_cumsum_kernel(x_ptr, out_ptr, D, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """Row ``program_id``: the running sum of x (rows, D), contiguous, block by block with the
    last block's final value carried."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    carry = tl.zeros((1,), ACC)
    for d0 in range(0, D, BLOCK):
        ok = d0 + cols < D
        v = tl.load(x_ptr + row * D + d0 + cols, mask=ok, other=0.0).to(ACC)
        run = tl.cumsum(v, 0) + carry
        tl.store(out_ptr + row * D + d0 + cols, run.to(out_ptr.dtype.element_ty), mask=ok)
        carry = tl.sum(tl.where(cols == BLOCK - 1, run, 0.0), 0, keep_dims=True)


def _acc(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def row_reduce(x: torch.Tensor, op: str, out_dtype: torch.dtype) -> torch.Tensor:
    """``op`` ("sum", "mean", "logsumexp") of x over its last dimension, one value per row:
    shape ``x.shape[:-1]``, dtype ``out_dtype``."""
    rows = _rows(x)
    d = rows.shape[1]
    out = torch.empty(rows.shape[0], dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        scale = 1.0 / d if op == "mean" else 1.0
        _row_reduce_kernel[(rows.shape[0],)](rows, out, d, scale, OP=0 if op != "logsumexp" else 1,
                                             BLOCK=_row_block(d), ACC=_acc(rows.dtype),
                                             num_warps=4)
    return out.reshape(x.shape[:-1])


def row_softmax(x: torch.Tensor, log: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """softmax (``log``: log_softmax) of x over its last dimension, in ``out_dtype``."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.numel():
        _row_softmax_kernel[(rows.shape[0],)](rows, out, rows.shape[1], LOG=log,
                                              BLOCK=_row_block(rows.shape[1]),
                                              ACC=_acc(rows.dtype), num_warps=4)
    return out.reshape(x.shape)


def row_cumsum(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The running sum of x over its last dimension, in ``out_dtype``."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.numel():
        _row_cumsum_kernel[(rows.shape[0],)](rows, out, rows.shape[1],
                                             BLOCK=_row_block(rows.shape[1]),
                                             ACC=_acc(rows.dtype), num_warps=4)
    return out.reshape(x.shape)
