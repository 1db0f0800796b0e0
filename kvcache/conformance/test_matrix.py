"""The shape matrix: dtype x GQA ratio x head_dim x page size, each running a mixed workload
(prefill, decode, mixed batch, fork mid-page, popn, fused qkv) with RoPE on.

The quick matrix (default) covers every value of every axis at least once; ``--kvcache-full``
runs the whole cross product.
"""

from __future__ import annotations

from .base import Conformance


class TestMatrix(Conformance):
    """One mixed workload (prefill, decode, a mid-page fork, fused qkv, popn) with RoPE on, at
    each ``shape`` = (dtype, GQA ratio, head_dim, page_size) of the matrix: the quick matrix
    covers every value of each axis, ``--kvcache-full`` the whole cross product. Catches kernels
    specialised per shape that the other classes, which use one shape, never reach."""

    def test_workload(self, make_pair, shape):
        dtype, gqa, head_dim, page_size = shape
        p = make_pair(dtype=dtype, gqa=gqa, head_dim=head_dim, page_size=page_size,
                      rope_mode="normal")
        ps = page_size
        p.add(0, 1, 2)
        p.forward([0, 1, 2], [2 * ps + 3, 5, 1])
        p.decode([0, 1, 2], steps=2)
        p.fork(0, 3, ps + (ps // 2 if ps > 1 else 0) + 1)
        p.forward([3, 0, 1, 2], [1, 1, 4, 2], fused=True)
        p.popn(3, 2)
        p.decode([3, 2, 1, 0], steps=1)
