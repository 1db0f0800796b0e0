"""Kernel tuning as data, not branches.

A backend class carries one ``Tuning`` table; the ROCm package subclasses ``CudaBackend`` and only
swaps this table (wavefront 64, other tile sizes) and its availability check. Per-head-dim
overrides live in ``by_head_dim`` so one table covers 64/128/256; they are keyed by the padded
head_dim the kernels run at (the next power of two: 80 and 96 use the 128 tiles).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class AttnTiles:
    """Tile shape of one attention kernel family."""

    block_rows: int      # query rows per program (tokens x group heads), a power of two
    block_n: int         # keys per inner-loop step
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Tuning:
    # ragged (causal self-attention over new tokens) and paged prefill; the head_dim 128
    # defaults are the H100 sweep's best (docs/performance.md, `kvcache bench --sweep`)
    prefill: AttnTiles = AttnTiles(block_rows=128, block_n=128, num_warps=8, num_stages=3)
    # paged decode: rows are one token's group of heads, padded to >= 16 for tl.dot
    decode: AttnTiles = AttnTiles(block_rows=16, block_n=128, num_warps=8, num_stages=3)
    # per head_dim overrides of the two tile tables: {head_dim: {"prefill": AttnTiles, ...}}
    by_head_dim: dict = field(default_factory=lambda: {
        64: {"prefill": AttnTiles(128, 64, 4, 2), "decode": AttnTiles(16, 128, 4, 2)},
        256: {"prefill": AttnTiles(64, 32, 8, 2), "decode": AttnTiles(16, 32, 4, 2)},
    })
    # split-K decode: aim for this many programs per SM, never split below min_keys_per_split
    split_programs_per_sm: int = 2
    split_min_keys: int = 256
    split_max: int = 64
    force_splits: int = 0            # >0: always use this many splits (tests, benchmarks)
    # splits whose partials the decode launch's merge loads at once; 0: as many as fit in
    # about 32 registers a thread (>0: tests, sweeps)
    split_merge_chunk: int = 0
    # append / rope / copy kernels: heads per inner step and warps
    elementwise_heads: int = 8
    elementwise_warps: int = 4
    merge_rows: int = 16             # (token, head) rows per program of the merge kernels
    min_dot_rows: int = 16           # tl.dot needs M >= 16

    # float32 caches: twice the bytes per tile, so the 2-byte defaults can exceed shared memory
    float32_by_head_dim: dict = field(default_factory=lambda: {
        128: {"prefill": AttnTiles(128, 64, 8, 2), "decode": AttnTiles(16, 64, 4, 2)},
    })
    # fp8 pages: half the bytes per tile and a widening per element; decode wants 4 warps (8
    # warps ran 1.7x slower: tools/fp8_decode_sweep.py on the H200, docs/performance.md) and
    # at least fp8_min_splits splits (B=64 L=4096: 2 splits 0.78x the time of 1)
    fp8_by_head_dim: dict = field(default_factory=lambda: {
        128: {"decode": AttnTiles(16, 128, 4, 3)},
    })
    fp8_min_splits: int = 2

    def tiles(self, kind: str, head_dim: int, float32: bool = False,
              fp8: bool = False) -> AttnTiles:
        """The tiles of ``kind`` ("prefill" | "decode") for ``head_dim``, looked up at the
        padded head_dim the kernels run at (80 and 96 share the 128 tiles); ``fp8``: over fp8
        pages (their table first, then the 16-bit one)."""
        head_dim = 1 << (max(1, head_dim) - 1).bit_length()
        if float32 and kind in self.float32_by_head_dim.get(head_dim, {}):
            return self.float32_by_head_dim[head_dim][kind]
        if fp8 and kind in self.fp8_by_head_dim.get(head_dim, {}):
            return self.fp8_by_head_dim[head_dim][kind]
        return self.by_head_dim.get(head_dim, {}).get(kind, getattr(self, kind))

    def with_(self, **changes) -> "Tuning":
        return replace(self, **changes)


CUDA_TUNING = Tuning()


def num_splits(tuning: Tuning, num_programs: int, max_kv_len: int, num_sms: int,
               fp8: bool = False) -> int:
    """Split-K factor of the decode kernel: enough (entry, kv-head, split) programs to fill the
    GPU, but each split keeps at least ``split_min_keys`` keys so the merge pass stays cheap
    (``fp8``: over fp8 pages, at least ``fp8_min_splits`` where the keys allow)."""
    if tuning.force_splits > 0:
        return tuning.force_splits
    if num_programs <= 0 or max_kv_len <= 0:
        return 1
    want = -(-tuning.split_programs_per_sm * num_sms // num_programs)
    if fp8:
        want = max(want, tuning.fp8_min_splits)
    cap = max(1, max_kv_len // tuning.split_min_keys)
    return int(max(1, min(want, cap, tuning.split_max)))
