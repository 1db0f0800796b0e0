"""The GPU path of ``BatchInvariantMode`` (``kvcache.integrations.invariant_triton``): its Triton
matmul and row kernels, run where Triton runs (under ``TRITON_INTERPRET=1`` on CPU tensors in
the interpreter child of test_cuda_triton_interpreter.py, which checks the indexing in CI; on
the GPU with ``KVCACHE_CUDA_TEST_DEVICE=cuda``, which checks the bits). In the plain CPU mode
there is no Triton to run, so they skip there (the CPU path of the mode is
tests/integrations/test_torch_invariant.py's).

* every op is close to torch's (shapes off every tile edge: rows past a 64-row tile, columns
  past a 128-column tile, K past a 512-column chunk; 1-D and 2-D bias; a transposed weight);
* the split-K order and the in-program order give the same bits;
* a row's result is the same bits alone and at any place among 2 to 300 rows (2 and 65 under
  the interpreter, whose float32 dot is slow), for every op.
"""

from __future__ import annotations

import pytest

import cuda_cases as cc

pytestmark = pytest.mark.skipif(not (cc.INTERPRET or cc.ON_GPU),
                                reason="Triton runs under the interpreter or on a GPU only")

torch = pytest.importorskip("torch")
if cc.INTERPRET:
    # the cuda plugin's kernel module mends Triton 3.6's interpreter under numpy >= 2.4 on import
    import kvcache_cuda.triton_kernels  # noqa: F401

TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _mode():
    from kvcache.integrations.torch_invariant import BatchInvariantMode
    return BatchInvariantMode(kernels="triton")


def _ops():
    f = torch.nn.functional
    return {
        "linear": lambda x, w, b: f.linear(x, w),
        "linear+bias": lambda x, w, b: f.linear(x, w, b),
        "linear 3-D": lambda x, w, b: f.linear(x[None], w, b)[0],
        "matmul": lambda x, w, b: x @ w.T,
        "addmm": lambda x, w, b: torch.addmm(b, x, w.T),
        "mean": lambda x, w, b: x.pow(2).mean(-1, keepdim=True),
        "sum": lambda x, w, b: x.sum(dim=1),
        "logsumexp": lambda x, w, b: torch.logsumexp(x, dim=-1),
        "log_softmax": lambda x, w, b: torch.log_softmax(x, dim=1),
        "softmax": lambda x, w, b: torch.softmax(x, dim=-1),
        "cumsum": lambda x, w, b: torch.cumsum(x, dim=-1),
    }


def _inputs(dtype, m=None, k=None, n=130, seed=0):
    # the interpreter's float32 dot is slow: 300 columns there (9 float32 K tiles, one chunk;
    # test_split_and_unsplit_orders_give_the_same_bits keeps 600 columns: two chunks)
    m, k = m or (300 if cc.ON_GPU else 70), k or (600 if cc.ON_GPU else 300)
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    mk = lambda *s: (torch.randn(*s, generator=g) / 8).to(cc.DEVICE, dt)  # noqa: E731
    return mk(m, k), mk(n, k), mk(n)


@pytest.mark.parametrize("dtype", cc.interpreter_sample(cc.DTYPES, keep=["float32"]))
def test_every_op_is_close_to_torch(dtype):
    x, w, b = _inputs(dtype)
    with _mode():
        got = {name: op(x, w, b) for name, op in _ops().items()}
    for name, op in _ops().items():
        want = op(x.double(), w.double(), b.double())
        assert got[name].dtype == op(x, w, b).dtype, name
        assert got[name].shape == want.shape, name
        err = (got[name].double() - want).abs().max().item()
        scale = want.abs().max().item() + 1
        assert err <= TOL[dtype] * scale * (8 if name == "cumsum" else 1), (name, err)
    # a per-row (M, N) bias, and a weight that is not a transposed view
    full = (b[None] + torch.arange(x.shape[0], device=cc.DEVICE, dtype=x.dtype)[:, None] / 64)
    from kvcache.integrations.invariant_triton import matmul
    wt = w.T.contiguous()
    out = matmul(x, wt, full)
    want = x.double() @ wt.double() + full.double()
    assert (out.double() - want).abs().max().item() <= TOL[dtype] * (want.abs().max().item() + 1)


@pytest.mark.parametrize("dtype", cc.interpreter_sample(cc.DTYPES, keep=["float32", "bfloat16"]))
def test_split_and_unsplit_orders_give_the_same_bits(dtype):
    from kvcache.integrations.invariant_triton import matmul
    mid = (70, 1030, 130) if cc.ON_GPU else (70, 600, 130)
    for m, k, n in ((1, 600, 200), mid, (5, 64, 16)):
        x, w, b = _inputs(dtype, m, k, n, seed=m)
        for bias in (None, b):
            a = matmul(x, w.T, bias, split=True)
            c = matmul(x, w.T, bias, split=False)
            assert torch.equal(a, c), (m, k, n, bias is None)


@pytest.mark.parametrize("dtype", cc.interpreter_sample(cc.DTYPES, keep=["float32", "bfloat16"]))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(dtype):
    x, w, b = _inputs(dtype)
    row = x[:1]
    with _mode():
        want = {name: op(row, w, b)[0] for name, op in _ops().items()}
        for m in ((2, 65) if cc.INTERPRET else (2, 7, 65, 70, 300)):
            batch = x[:m].clone()
            at = m // 2
            batch[[0, at]] = batch[[at, 0]]          # the row somewhere in the middle
            for name, op in _ops().items():
                assert torch.equal(op(batch, w, b)[at], want[name]), (name, m)


def test_what_the_kernels_do_not_take_runs_as_it_is():
    x = torch.randn(5, 6, 7).to(cc.DEVICE)
    ints = torch.arange(12).reshape(3, 4).to(cc.DEVICE)
    wide = torch.randn(3, 4, dtype=torch.float64).to(cc.DEVICE)     # no float64 kernels

    def ops():
        return (x.sum(0), x.mean(dim=(0, 2)), torch.softmax(x, dim=0), x.sum(), ints.sum(-1),
                wide @ wide.T, torch.cumsum(ints, -1))
    with _mode():
        got = ops()
    assert all(torch.equal(a, b) for a, b in zip(got, ops()))


@pytest.mark.parametrize("dtype", [d for d in cc.DTYPES if d != "float32"])
def test_wide_tiles_give_the_narrow_tiles_bits(dtype):
    """A prompt chunk's many output tiles take ``WIDE`` tiles (the same chunk, larger M and N):
    every output the same partials added in the same order, so on the GPU the bits equal the
    narrow tiles' split and unsplit, and a row among 2,048 (wide by the tile count) equals the
    row alone (split-K). Under the interpreter the indexing is checked (close to the narrow
    result: its float32 dot is numpy's, whose blocking may follow the tile)."""
    from kvcache.integrations.invariant_triton import matmul
    shapes = ((300, 1030, 130), (5, 64, 16)) if cc.ON_GPU else ((70, 600, 130), (5, 64, 16))
    for m, k, n in shapes:
        x, w, b = _inputs(dtype, m, k, n, seed=m + 1)
        for bias in (None, b):
            wide = matmul(x, w.T, bias, split=False, wide=True)
            for split in (False, True):
                narrow = matmul(x, w.T, bias, split=split, wide=False)
                if cc.ON_GPU:
                    assert torch.equal(wide, narrow), (m, k, n, split, bias is None)
                else:
                    err = (wide.double() - narrow.double()).abs().max().item()
                    assert err <= TOL[dtype] * (narrow.double().abs().max().item() + 1)
    if cc.ON_GPU:       # by the tile count: 2,048 x 4,096 outputs are wide, one row is split
        x, w, b = _inputs(dtype, 2048, 1024, 4096, seed=9)
        assert torch.equal(matmul(x, w.T, b)[700], matmul(x[700:701], w.T, b)[0])
