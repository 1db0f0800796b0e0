"""The KV storage formats: one ``KVFormat`` per name ``CacheConfig.kv_dtype`` takes, in one table
(``FORMAT_TABLE``). The rest of the package asks a config's format (``CacheConfig.kv_format``)
what it is (``scaled``, ``packed``, ``quantized``, its bytes per row) instead of testing names:
adding a format touches this table, ``kvcache.kv_quant`` (its rule) and the kernels storing it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgumentError


@dataclass(frozen=True)
class KVFormat:
    """One storage format of the pages. ``name``: the ``kv_dtype`` string; ``storage``: the
    dtype name of what the pages hold (``"float8_e4m3"`` codes, ``"uint8"`` bytes of packed
    affine rows, else the float dtype itself); ``bits``: bits per value stored (of a code, for
    the quantized formats); ``scaled``: fp8 codes with one float32 scale per (layer, KV head),
    kept outside the pages (``KVScales``); ``packed``: affine codes per group of
    ``kv_quant_group`` values with a scale and a bias in the compute dtype, packed into one
    ``uint8`` row (``kv_quant.affine_pack``)."""

    name: str
    storage: str
    bits: int
    scaled: bool = False
    packed: bool = False

    @property
    def quantized(self) -> bool:
        """Whether the pages hold codes rather than the values (fp8 or affine)."""
        return self.scaled or self.packed

    def payload_dtype(self, dtype: str) -> str:
        """The dtype of a payload's arrays for a cache of compute ``dtype``: the values in
        ``dtype`` for fp8 (the scales travel in the header), ``"uint8"`` packed rows for the
        affine formats, the storage dtype otherwise."""
        return "uint8" if self.packed else dtype if self.scaled else self.storage

    def row_bytes(self, dim: int, dtype: str, group: int) -> int:
        """Bytes of one stored row of ``dim`` values, for compute ``dtype`` and ``group``
        values per affine scale and bias (``affine_row_bytes`` for the packed formats; fp8's
        scales are outside the pages)."""
        if self.packed:
            return affine_row_bytes(dim, self.bits, group, dtype)
        return dim * self.bits // 8


FORMAT_TABLE: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("float16", "float16", 16),
    KVFormat("bfloat16", "bfloat16", 16),
    KVFormat("float32", "float32", 32),
    KVFormat("float8_e4m3", "float8_e4m3", 8, scaled=True),
    KVFormat("int8", "uint8", 8, packed=True),
    KVFormat("int4", "uint8", 4, packed=True),
)}
"""Every storage format by name, the one place the names are listed: the compute dtypes (pages
stored as computed) and the quantized formats (``kvcache.config.KV_FORMATS`` lists those; a
backend declares the ones it stores in ``Capabilities.kv_dtypes``)."""


def kv_format(name) -> KVFormat:
    """The ``KVFormat`` named ``name``; InvalidArgumentError listing the names for another."""
    fmt = FORMAT_TABLE.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise InvalidArgumentError(f"kv_dtype={name!r:.80} is not one of {tuple(FORMAT_TABLE)}")
    return fmt


def quantized_names() -> tuple:
    """The names of the quantized formats in ``FORMAT_TABLE``, in table order."""
    return tuple(name for name, fmt in FORMAT_TABLE.items() if fmt.quantized)


def affine_row_bytes(dim: int, bits: int, group: int, dtype: str) -> int:
    """Bytes of one packed row of ``dim`` values (``kv_quant.affine_pack``): the ``bits``-bit
    codes, then a scale and a bias in ``dtype`` (a compute dtype) per ``group`` values."""
    return dim * bits // 8 + 2 * (dim // group) * (FORMAT_TABLE[dtype].bits // 8)
