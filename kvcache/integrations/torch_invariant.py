"""Batch-invariant model ops for a torch model: a row's result depends on that row alone.

A GEMM library picks its kernel (and with it the order in which a row's products are summed)
by the matrix shape: a decode step of 1 row takes a matrix-vector kernel, a prompt chunk of 300
rows a tiled one, and the same row gets other last bits. Reductions along a row (RMSNorm's mean,
log-softmax, log-sum-exp) can likewise split a row differently by the number of rows.
``BatchInvariantMode`` (a ``TorchDispatchMode``, active around each engine step of an
``Engine(deterministic=True)``) replaces those ops, by the tensors' device:

* CPU tensors (``"blocks"``): the op runs on blocks of exactly ``ROWS`` rows, the last one
  padded with zeros: every call has one shape, so one kernel and one summation order, whatever
  the batch; a row's result does not depend on the other rows of its block (each output row of
  a GEMM or a row-wise reduction reads its own input row only).
* GPU tensors (``"triton"``): Triton kernels whose summation order is fixed by the dtype and the
  row length, never by the row count (``invariant_triton``): blocks of rows would re-read a
  layer's weights once per block, several times the cost of a prompt chunk on a GPU.

Elementwise ops, gathers and argmax are exact and pass through.

Intercepted (rows: every leading dimension; reductions only over the last one):
``aten.linear`` (which inference mode dispatches whole), ``aten.matmul`` by a 2-D weight,
``aten.mm``, ``aten.addmm``,
``aten.mean.dim``, ``aten.sum.dim_IntList``, ``aten.logsumexp``, ``aten._log_softmax``,
``aten._softmax``, ``aten.cumsum`` (floating inputs). Anything else runs as it is; a reduction
over another dimension too. On the CPU the cost is the padding (a 1-row step computes ``ROWS``
rows) and one call per block; inside a captured CUDA graph only the kernels remain.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["BatchInvariantMode", "ROWS", "KERNELS"]

ROWS = 32
"""Rows per block of the CPU path: every intercepted op runs on ``ROWS`` rows at a time."""

KERNELS = ("blocks", "triton")
"""The two implementations (module doc); ``BatchInvariantMode(kernels=None)`` picks by device."""

aten = torch.ops.aten


def _blocks(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x`` (M, ...) in blocks of ``ROWS`` rows (the last padded with zeros), the
    results' first M rows."""
    m = x.shape[0]
    pad = (-m) % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))])
    outs = [fn(x[i:i + ROWS]) for i in range(0, m + pad, ROWS)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:m] if pad else out


def _last_dim_only(x: torch.Tensor, dims) -> bool:
    if dims is None:
        return False
    dims = [dims] if isinstance(dims, int) else list(dims)
    return x.dim() >= 2 and len(dims) == 1 and dims[0] % x.dim() == x.dim() - 1


def _rowwise(func, x: torch.Tensor, rest: tuple, kwargs: dict, keepdim_index=None):
    """A reduction / row op over the last dim of ``x`` (any leading dims), in row blocks."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = _blocks(lambda blk: func(blk, *rest, **kwargs), rows)
    return out.reshape(tuple(lead) + tuple(out.shape[1:]))


def _mm(func, args, kwargs):
    a, b = args[0], args[1]
    return _blocks(lambda blk: func(blk, b, **kwargs), a)


def _linear(func, args, kwargs):
    x, rest = args[0], tuple(args[1:])
    if x.dim() < 2:
        return func(*args, **kwargs)
    return _rowwise(func, x, rest, kwargs)


def _matmul(func, args, kwargs):
    x, w = args[0], args[1]
    if x.dim() < 2 or w.dim() != 2:         # a batched product: not a layer's weights
        return func(*args, **kwargs)
    return _rowwise(func, x, (w,), kwargs)


def _addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    if bias.dim() == 2 and bias.shape[0] == a.shape[0] and a.shape[0] > 1:
        both = torch.cat([bias.expand(a.shape[0], b.shape[1]), a], dim=1)
        n = b.shape[1]
        return _blocks(lambda blk: func(blk[:, :n], blk[:, n:], b, **kwargs), both)
    return _blocks(lambda blk: func(bias, blk, b, **kwargs), a)


def _reduce(func, args, kwargs):
    x, dims = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if len(args) < 2 or not _last_dim_only(x, dims):
        return func(*args, **kwargs)
    # the rows are 2-D blocks: the dimension is named from the end
    return _rowwise(func, x, ([-1],) + tuple(args[2:]), kwargs)


def _softmax_like(func, args, kwargs):
    x, dim = args[0], args[1]
    if not _last_dim_only(x, dim):
        return func(*args, **kwargs)
    return _rowwise(func, x, (-1,) + tuple(args[2:]), kwargs)


_HANDLERS = {
    aten.linear.default: _linear,
    aten.matmul.default: _matmul,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.mean.dim: _reduce,
    aten.sum.dim_IntList: _reduce,
    aten.logsumexp.default: _reduce,
    aten._log_softmax.default: _softmax_like,
    aten._softmax.default: _softmax_like,
    aten.cumsum.default: _softmax_like,
}


# ------------------------------------------------------------------ the GPU path: Triton
def _kernels():
    from . import invariant_triton
    return invariant_triton


def _floating(x: torch.Tensor) -> bool:
    return x.is_floating_point()


def _t_linear(func, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    rows = x.reshape(-1, x.shape[-1])
    out = _kernels().matmul(rows, w.T, bias)
    return out.reshape(tuple(x.shape[:-1]) + (w.shape[0],))


def _t_matmul(func, args, kwargs):
    x, w = args[0], args[1]
    if x.dim() < 2 or w.dim() != 2:
        return func(*args, **kwargs)
    out = _kernels().matmul(x.reshape(-1, x.shape[-1]), w)
    return out.reshape(tuple(x.shape[:-1]) + (w.shape[1],))


def _t_mm(func, args, kwargs):
    return _kernels().matmul(args[0], args[1])


def _t_addmm(func, args, kwargs):
    bias, a, b = args[0], args[1], args[2]
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    full = bias.expand(a.shape[0], b.shape[1])
    if beta == 1 and alpha == 1:
        return _kernels().matmul(a, b, full)
    return _kernels().matmul(a, b) * alpha + full * beta     # (elementwise: exact per row)


def _t_reduce(op):
    def handler(func, args, kwargs):
        x = args[0]
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        if not _floating(x) or not _last_dim_only(x, dims):
            return func(*args, **kwargs)
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dtype = kwargs.get("dtype") or x.dtype
        out = _kernels().row_reduce(x.to(dtype), op, dtype)
        return out.unsqueeze(-1) if keepdim else out
    return handler


def _t_softmax(log):
    def handler(func, args, kwargs):
        x, dim, half_to_float = args[0], args[1], args[2]
        if not _floating(x) or not _last_dim_only(x, dim):
            return func(*args, **kwargs)
        dtype = torch.float32 if half_to_float else x.dtype
        return _kernels().row_softmax(x, log, dtype)
    return handler


def _t_cumsum(func, args, kwargs):
    x, dim = args[0], args[1]
    dtype = kwargs.get("dtype") or x.dtype
    if not _floating(x) or not dtype.is_floating_point or not _last_dim_only(x, dim):
        return func(*args, **kwargs)
    return _kernels().row_cumsum(x.to(dtype), dtype)


_TRITON = {
    aten.linear.default: _t_linear,
    aten.matmul.default: _t_matmul,
    aten.mm.default: _t_mm,
    aten.addmm.default: _t_addmm,
    aten.mean.dim: _t_reduce("mean"),
    aten.sum.dim_IntList: _t_reduce("sum"),
    aten.logsumexp.default: _t_reduce("logsumexp"),
    aten._log_softmax.default: _t_softmax(True),
    aten._softmax.default: _t_softmax(False),
    aten.cumsum.default: _t_cumsum,
}


class BatchInvariantMode(TorchDispatchMode):
    """While active, the intercepted ops (module doc) compute each row's result in the same
    bits whatever the other rows. Enter it around a step (``with BatchInvariantMode(): ...``);
    it may be entered again after it is left.

    kernels: None (default): ``"triton"`` for GPU tensors, ``"blocks"`` for the others;
    ``"blocks"`` or ``"triton"``: that implementation for every tensor (``"triton"`` on CPU
    tensors needs ``TRITON_INTERPRET=1``: the tests check the kernels' indexing that way)."""

    def __init__(self, kernels: str | None = None):
        super().__init__()
        if kernels is not None and kernels not in KERNELS:
            raise ValueError(f"kernels={kernels!r}: one of {', '.join(KERNELS)} or None")
        self.kernels = kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _HANDLERS or not args or not torch.is_tensor(args[0]):
            return func(*args, **kwargs)
        first = args[1] if func in (aten.addmm.default,) else args[0]
        if first.dim() < 1 or first.shape[0] == 0:
            return func(*args, **kwargs)
        kernels = self.kernels or ("triton" if first.is_cuda else "blocks")
        if kernels == "triton" and func in _MATMULS and not _triton_dtypes(func, args):
            return func(*args, **kwargs)
        return (_TRITON if kernels == "triton" else _HANDLERS)[func](func, args, kwargs)


_MATMULS = (aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default)


def _triton_dtypes(func, args) -> bool:
    """The matmul's operands share one dtype the kernels take; else it runs as it is (an
    integer product is exact; the adapter refuses a float64 model on a GPU)."""
    from .invariant_triton import CONFIG
    ops = args[1:3] if func == aten.addmm.default else args[:2]
    return ops[0].dtype in CONFIG and all(t.dtype == ops[0].dtype for t in ops)
