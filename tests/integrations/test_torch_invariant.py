"""``BatchInvariantMode``: under it a row's result is the same bits whatever the other rows and
wherever it sits among them, for every op it intercepts (a linear layer with and without bias,
3-D inputs, a matmul by a weight, the row reductions with the dimension named either way);
without it torch's CPU matmul gives a 1-row product other bits than the same row among 2 to 300
(the reason the mode exists); other reductions pass through unchanged."""

from __future__ import annotations

import torch

from kvcache.integrations.torch_invariant import ROWS, BatchInvariantMode

OPS = {
    "linear": lambda x, w, b: torch.nn.functional.linear(x, w),
    "linear+bias": lambda x, w, b: torch.nn.functional.linear(x, w, b),
    "linear 3-D": lambda x, w, b: torch.nn.functional.linear(x[None], w, b)[0],
    "matmul": lambda x, w, b: x @ w.T,
    "addmm": lambda x, w, b: torch.addmm(b, x, w.T),
    "mean": lambda x, w, b: x.pow(2).mean(-1, keepdim=True),
    "mean 3-D, dim 2": lambda x, w, b: x[None].mean(2)[0],
    "sum": lambda x, w, b: x.sum(dim=1),
    "logsumexp": lambda x, w, b: torch.logsumexp(x, dim=-1),
    "log_softmax": lambda x, w, b: torch.log_softmax(x, dim=1),
    "softmax": lambda x, w, b: torch.softmax(x, dim=-1),
    "cumsum": lambda x, w, b: torch.cumsum(x, dim=-1),
}


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    w, b, rows = torch.randn(384, 256), torch.randn(384), torch.randn(300, 256)
    row = rows[:1]
    with BatchInvariantMode():
        want = {name: op(row, w, b)[0] for name, op in OPS.items()}
        for m in (1, 2, 3, 7, ROWS - 1, ROWS, ROWS + 1, 100, 300):
            batch = rows[:m].clone()
            at = m // 2
            batch[[0, at]] = batch[[at, 0]]          # the row somewhere in the middle
            for name, op in OPS.items():
                assert torch.equal(op(batch, w, b)[at], want[name]), (name, m)
    # without the mode the product parts from the 1-row one in the last bits
    alone = torch.nn.functional.linear(row, w)[0]
    assert any(not torch.equal(torch.nn.functional.linear(rows[:m], w)[0], alone)
               for m in (2, 7, 100, 300))


def test_other_reductions_pass_through():
    x = torch.randn(5, 6, 7)
    with BatchInvariantMode():
        got = (x.sum(0), x.mean(dim=(0, 2)), torch.softmax(x, dim=0), x.sum())
    want = (x.sum(0), x.mean(dim=(0, 2)), torch.softmax(x, dim=0), x.sum())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
