"""Affine int8 / int4 page rows (``CacheConfig(kv_dtype="int8" | "int4")``) on the metal backend.

A quantized page array is ``uint8`` ``(num_pages, 2, num_kv_heads, page_size, row_bytes)``: each
K or V row holds, in bytes, ``mx.quantize``'s packed codes (``dim * bits / 8`` bytes; int4 two
per byte, low nibble first, which is MLX's little-endian uint32 packing read byte by byte), then
the row's ``dim / group`` scales and ``dim / group`` biases in the compute dtype. One array per
layer keeps every row-moving kernel (page copies, compaction) unchanged: they move bytes. A row
narrower than the page's (``head_dim_v != head_dim``) leaves its tail zero.

Codes, scales and biases equal ``kvcache.kv_quant``'s bit for bit. On an Apple GPU they come from
``mx.quantize``'s Metal kernel; elsewhere from MLX ops that follow ``kv_quant``'s rule step by step,
because ``mx.quantize``'s CUDA kernel rounds a code half away from zero where the rule (and
``mx.round``) rounds half to even: float16 values that land on a code's midpoint went to the next
code on an H100. Reading back is ``float32(code) * float32(scale) + float32(bias)``, the same rule, so the pages
give back exactly what the reference backend's emulation gives.
"""

from __future__ import annotations

import mlx.core as mx

from kvcache.kv_quant import affine_row_bytes


class AffineRows:
    """Encode rows of values into a quantized page row and decode them back (float32).

    ``bits``: 8 or 4; ``group``: values per scale / bias along the head dim; ``dtype``: the
    compute dtype's name, which the scales and biases are stored in."""

    def __init__(self, bits: int, group: int, dtype_name: str, row_dim: int,
                 fused: bool = False):
        self.bits, self.group, self.dtype_name = bits, group, dtype_name
        self.fused = fused              # mx.quantize (Apple GPU) instead of the rule's own ops
        self.dtype = getattr(mx, dtype_name)
        self.row_bytes = self.bytes_of(row_dim)

    def bytes_of(self, dim: int) -> int:
        """Bytes of one row of ``dim`` values: codes, scales, biases."""
        return affine_row_bytes(dim, self.bits, self.group, self.dtype_name)

    def encode(self, x) -> mx.array:
        """``x`` ``(..., dim)`` (rounded to the compute dtype first, as the format quantizes
        values of that dtype) as ``uint8`` ``(..., row_bytes)``."""
        if self.fused:
            codes, scales, biases = mx.quantize(x.astype(self.dtype), group_size=self.group,
                                                bits=self.bits)
            codes = codes.view(mx.uint8)
        else:
            codes, scales, biases = self._quantize(x)
        parts = [codes, scales.view(mx.uint8), biases.view(mx.uint8)]
        pad = self.row_bytes - self.bytes_of(x.shape[-1])
        if pad:
            parts.append(mx.zeros((*x.shape[:-1], pad), dtype=mx.uint8))
        return mx.concatenate(parts, axis=-1)

    def _quantize(self, x) -> tuple:
        """``kv_quant.affine_quantize``'s rule in MLX ops (float32, rounding half to even):
        ``(packed codes uint8, scales, biases)`` of ``x`` ``(..., dim)``."""
        n_bins = float((1 << self.bits) - 1)
        xs = x.astype(self.dtype).astype(mx.float32)
        lead, dim = xs.shape[:-1], xs.shape[-1]
        xs = xs.reshape(*lead, dim // self.group, self.group)
        hi, lo = xs.max(-1, keepdims=True), xs.min(-1, keepdims=True)
        low_edge = mx.abs(lo) > mx.abs(hi)
        scale = mx.maximum((hi - lo) / n_bins, mx.array(1e-7, mx.float32))
        scale = mx.where(low_edge, scale, -scale)
        edge = mx.where(low_edge, lo, hi)
        q0 = mx.round(edge / scale)
        scale = mx.where(q0 != 0, edge / q0, scale)
        bias = mx.where(q0 == 0, mx.array(0.0, mx.float32), edge)
        codes = mx.clip(mx.round((xs - bias) / scale), 0, n_bins).astype(mx.uint8)
        codes = codes.reshape(*lead, dim)
        if self.bits == 4:                  # two codes a byte, low nibble first
            pairs = codes.reshape(*lead, dim // 2, 2)
            codes = pairs[..., 0] | (pairs[..., 1] << 4)
        return codes, scale[..., 0].astype(self.dtype), bias[..., 0].astype(self.dtype)

    def decode(self, rows, dim: int) -> mx.array:
        """float32 ``(..., dim)`` values of ``uint8`` page rows ``(..., row_bytes)`` holding
        ``dim``-wide rows."""
        n_code = dim * self.bits // 8
        n_group = dim // self.group
        n_par = n_group * self.dtype.size
        packed = rows[..., :n_code]
        if self.bits == 4:
            codes = mx.stack([packed & 15, packed >> 4], axis=-1)
        else:
            codes = packed
        lead = rows.shape[:-1]
        codes = codes.reshape(*lead, n_group, self.group).astype(mx.float32)
        scales = mx.contiguous(rows[..., n_code:n_code + n_par]).view(self.dtype)
        biases = mx.contiguous(rows[..., n_code + n_par:n_code + 2 * n_par]).view(self.dtype)
        values = codes * scales.astype(mx.float32)[..., None] \
            + biases.astype(mx.float32)[..., None]
        return values.reshape(*lead, dim)

    def roundtrip(self, x, dim: int) -> mx.array:
        """What pages give back for ``x`` ``(..., dim)``: float32."""
        return self.decode(self.encode(x), dim)
