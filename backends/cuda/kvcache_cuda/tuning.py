"""Kernel tuning as data, not branches.

A backend class carries one ``Tuning`` table; the ROCm package subclasses ``CudaBackend`` and only
swaps this table (wavefront 64, other tile sizes) and its availability check. Per-head-dim
overrides live in ``by_head_dim`` so one table covers 64/128/256; they are keyed by the padded
head_dim the kernels run at (the next power of two: 80 and 96 use the 128 tiles).

Per architecture: ``tuning_table.json`` beside this module holds, per ``device_arch`` name
(``"sm_90"``, ``"sm_80"``, ``"gfx942"``), the entries a sweep on that GPU found best
(``python -m kvcache_cuda.tune --write``); ``for_arch`` lays them over a backend's base table
when it opens a GPU. An architecture without an entry runs the base table.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional


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
    # per head_dim overrides of the tile tables: {head_dim: {"prefill": AttnTiles, ...}}; a
    # "ragged" entry gives the ragged kernel other tiles than the paged prefill's (16-bit
    # caches only: float32 and fp8 keep their prefill tiles, sized for their bytes)
    by_head_dim: dict = field(default_factory=lambda: {
        64: {"prefill": AttnTiles(128, 64, 4, 2), "decode": AttnTiles(16, 128, 4, 2)},
        256: {"prefill": AttnTiles(64, 32, 8, 2), "decode": AttnTiles(16, 32, 4, 2)},
    })
    # split-K decode: aim for this many programs per SM, never split below min_keys_per_split
    split_programs_per_sm: int = 2
    split_min_keys: int = 256
    split_max: int = 64
    force_splits: int = 0            # >0: always use this many splits (tests, benchmarks)
    # paged prefill over a shared prefix (``DepthAux.shared``: an entry's rows of many
    # sequences over one block's keys): split each entry's keys this many ways, fewer where a
    # split would hold under split_min_keys keys; force_prefill_splits > 0: always (tests)
    shared_splits: int = 4
    force_prefill_splits: int = 0
    # splits whose partials the decode launch's merge loads at once; 0: as many as fit in
    # about 32 registers a thread (>0: tests, sweeps)
    split_merge_chunk: int = 0
    # append / rope / copy kernels: heads per inner step and warps
    elementwise_heads: int = 8
    elementwise_warps: int = 4
    merge_rows: int = 16             # (token, head) rows per program of the merge kernels
    min_dot_rows: int = 16           # tl.dot needs M >= 16
    # CacheConfig(batch_invariant=True): a decode step's entries (one query each) go through
    # the paged prefill kernel with at most this many rows a tile and at most 4 warps, the
    # prefill tiles' key step kept: a row's arithmetic is the prefill tile's (one warpgroup's
    # MMA rows; conformance's TestBatchInvariance checks the bits), the work wasted on rows of
    # no query a fraction of the prefill tile's. 0: the prefill tiles
    invariant_decode_rows: int = 64
    # and the keys of a row fall in segments of this many keys from key 0 (rounded up to whole
    # key steps), each its own softmax, folded in key order: a decode step can run one program
    # per (entry, segment), a prompt chunk folds them in its program, and the bits are the
    # same. Fixed per architecture and cache: a split size, not a split count chosen by the
    # batch (H200, tools/invariant_attention_lab.py: 1,024 was the best of 512 / 1,024 / 2,048
    # over B=1-64; docs/determinism.md)
    invariant_segment_keys: int = 1024
    # a batch-invariant step of one query an entry runs a program per (entry, segment) while
    # entries x KV heads are under this many programs, else one program an entry (no partials
    # to write and read); 0: always split (on the H200 as fast or faster at every batch).
    # Either gives the same bits (the tests force both)
    invariant_split_programs: int = 0

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
    # the paged prefill kernel broadcasts its per-entry scalars (bounds, offsets, the start of
    # the page list: loaded by every thread) from lane 0 (``shfl.sync``), so ptxas knows them
    # warp-uniform and keeps the key loops' addresses and pipeline-stage descriptors in
    # uniform registers (sm_90, bf16 D 128: 794 -> 736 instructions a lean key tile, 1707 ->
    # 1442 a masked one, no spills; docs/performance.md). NVIDIA PTX: never on ROCm or under
    # Triton's interpreter. Off in the base tables; the sweep times it per architecture and
    # the shipped sm_90 entry turns it on (paged prefill B=8 L=2048 11% faster on an H100).
    warp_uniform_scalars: bool = False
    # prefill of one sequence through torch's attention kernels (``kvcache_cuda.flash``) from
    # this many rows of a ragged call / queries of a paged call's entry (its page gather costs
    # per key); 0: never. Off in the base tables; ``python -m kvcache_cuda.tune`` times both
    # paths per architecture and writes the crossover it found
    flash_ragged_min_rows: int = 0
    flash_paged_min_rows: int = 0
    # several sequences of one shape (a ragged call's rows num_seqs * max_len, a paged depth's
    # ``uniform``) through cuDNN's batch from this many rows a sequence (queries an entry) and
    # this many rows in all; 0: never. Written by the tuner's batch sweep as above
    flash_batch_min_len: int = 0
    flash_batch_min_rows: int = 0

    def tiles(self, kind: str, head_dim: int, float32: bool = False,
              fp8: bool = False) -> AttnTiles:
        """The tiles of ``kind`` ("prefill" | "ragged" | "decode") for ``head_dim``, looked up
        at the padded head_dim the kernels run at (80 and 96 share the 128 tiles); ``fp8``:
        over fp8 pages (their table first, then the 16-bit one). "ragged": the ragged
        kernel's, a 16-bit cache's ``by_head_dim`` "ragged" entry where there is one, else
        the "prefill" tiles."""
        head_dim = 1 << (max(1, head_dim) - 1).bit_length()
        if kind == "ragged":
            own = self.by_head_dim.get(head_dim, {}).get("ragged")
            if own is not None and not float32 and not fp8:
                return own
            kind = "prefill"
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


def prefill_splits(tuning: Tuning, shared: bool, max_kv_len: int) -> int:
    """Key splits of the paged prefill kernel for a depth: 1 unless its entries are shared
    prefixes (``shared``), whose few row tiles over many keys would fill a few SMs; then
    ``shared_splits``, fewer where ``max_kv_len`` (a static-shape plan's bound, or the real
    longest) gives a split under ``split_min_keys`` keys."""
    if tuning.force_prefill_splits > 0:
        return tuning.force_prefill_splits
    if not shared:
        return 1
    return int(max(1, min(tuning.shared_splits, max_kv_len // tuning.split_min_keys)))


# ------------------------------------------------------------------ per-architecture entries
TABLE_PATH = Path(__file__).with_name("tuning_table.json")
"""The per-architecture table (``python -m kvcache_cuda.tune --write`` on a GPU writes its
architecture's entry): ``{arch: entry}``, an entry overriding a backend's base ``Tuning``."""
_TILE_TABLES = ("by_head_dim", "float32_by_head_dim", "fp8_by_head_dim")
_SCALARS = ("split_programs_per_sm", "split_min_keys", "split_max", "fp8_min_splits",
            "flash_ragged_min_rows", "flash_paged_min_rows", "flash_batch_min_len",
            "flash_batch_min_rows", "invariant_segment_keys", "invariant_split_programs")
_FLAGS = ("warp_uniform_scalars",)
_KINDS = ("prefill", "ragged", "decode")


def device_arch(torch, device) -> Optional[str]:
    """The architecture name a table entry is keyed by: ``"sm_90"`` (CUDA compute capability
    9.0), ``"gfx942"`` (ROCm: the gcnArchName before its feature flags); None off a GPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(dev)
    gcn = getattr(props, "gcnArchName", "") or ""
    if getattr(torch.version, "hip", None) and gcn:
        return gcn.split(":")[0]
    return f"sm_{props.major}{props.minor}"


@functools.lru_cache(maxsize=None)
def _read(path: str, mtime: float) -> dict:
    with open(path) as fh:
        return json.load(fh)


def read_table(path: Path = TABLE_PATH) -> dict:
    """The table at ``path`` (``{}`` when there is none)."""
    path = Path(path)
    if not path.exists():
        return {}
    return _read(str(path), path.stat().st_mtime)


def for_arch(base: Tuning, arch: Optional[str], table: Optional[dict] = None,
             where: str = str(TABLE_PATH)) -> Tuning:
    """``base`` with ``arch``'s entry of ``table`` (None: ``read_table()``) applied: its tile
    tables (``{"by_head_dim": {"128": {"decode": [block_rows, block_n, warps, stages]}}}``,
    likewise ``float32_by_head_dim`` / ``fp8_by_head_dim``) merged per head_dim and kind over
    the base's, its split-K numbers (``split_programs_per_sm``, ``split_min_keys``,
    ``split_max``, ``fp8_min_splits``, ``invariant_segment_keys``,
    ``invariant_split_programs``), library thresholds (``flash_ragged_min_rows``,
    ``flash_paged_min_rows``) and flags (``warp_uniform_scalars``) replacing the
    base's. No entry: ``base``. Raises
    ValueError naming ``where``, the architecture and the key for an entry it cannot read."""
    if arch is None:
        return base
    entry = (read_table() if table is None else table).get(arch)
    if entry is None:
        return base
    changes: dict = {}
    for key, value in entry.items():
        if key in ("source", "measured"):
            continue
        if key in _SCALARS:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {arch}.{key}={value!r} must be an int >= 1")
            changes[key] = value
        elif key in _FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"{where}: {arch}.{key}={value!r} must be true or false")
            changes[key] = value
        elif key in _TILE_TABLES:
            merged = {d: dict(kinds) for d, kinds in getattr(base, key).items()}
            for dim, kinds in value.items():
                for kind, tiles in kinds.items():
                    if (kind not in _KINDS or not str(dim).isdigit() or not isinstance(tiles, list)
                            or len(tiles) != 4 or not all(isinstance(x, int) and x > 0
                                                          for x in tiles)):
                        raise ValueError(
                            f"{where}: {arch}.{key}[{dim!r}][{kind!r}]={tiles!r}: want a head "
                            f"dim, 'prefill', 'ragged' or 'decode', and [block_rows, block_n, "
                            f"warps, stages]")
                    merged.setdefault(int(dim), {})[kind] = AttnTiles(*tiles)
            changes[key] = merged
        else:
            raise ValueError(f"{where}: {arch} has an unknown key {key!r} (known: "
                             f"{', '.join(_SCALARS + _FLAGS + _TILE_TABLES)}, source, measured)")
    return base.with_(**changes)


def write_entry(arch: str, entry: dict, path: Path = TABLE_PATH) -> None:
    """Set ``arch``'s entry of the table at ``path`` (the others kept), checked first."""
    for_arch(Tuning(), arch, {arch: entry}, str(path))
    table = dict(read_table(path))
    table[arch] = entry
    Path(path).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
