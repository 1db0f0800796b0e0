"""Importing sequences whose KV comes from elsewhere (another cache, a host tier, a peer
process): the core's side, pages and page table only.

An import runs in two phases so that the KV can arrive asynchronously: ``reserve`` validates
every sequence and takes its pages off the free list (nothing else changes; the sequences do
not exist yet), the caller writes each token's K/V at the reservation's ``slots``, and
``commit`` makes the sequences appear (or ``cancel`` gives the pages back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class ImportSpec:
    """One sequence to import: ``num_tokens`` tokens that follow the first ``fork_pos`` tokens
    of ``parent_id`` (shared with it, as a fork), or that start a new sequence
    (``parent_id`` None, ``fork_pos`` 0). ``window_size`` -1: no sliding window; else the
    window and its ``sink_size`` are enabled once the tokens are in. ``skip``: tokens the
    source holds before these that are not written (the parent already has them); their
    slots are -1."""

    seq_id: int
    num_tokens: int
    window_size: int = -1
    sink_size: int = 0
    parent_id: Optional[int] = None
    fork_pos: int = 0
    skip: int = 0


@dataclass(eq=False)
class ImportReservation:
    """Pages held for imports not yet committed.

    ``specs``: the validated sequences, in order (an entry's parent may be an earlier entry);
    ``pages``: per spec, the pages of its own last block (int32); ``slots`` (sum of
    ``skip + num_tokens``,) int32: where each source token of each spec is written (-1 for
    the skipped ones), specs in order; ``offsets`` (len(specs)+1,): spec ``i``'s source
    tokens are ``slots[offsets[i]:offsets[i+1]]``.
    ``table``/``key``: the page table holding the pages and the reservation's key there;
    ``owner``: the cache state that made it (a reservation belongs to its cache: another
    cache refuses it and leaves it as it is); ``open`` is False once committed or cancelled.
    ``scales``: the owning cache's, not the core's: with fp8 pages, the scales (layer ->
    (2, Hkv) float32 host array, K's then V's) that the reservation's payloads bring for
    layers the cache had none of when it reserved; ``write_import`` stores the values with
    them and ``commit_import`` adopts them, so a cancelled or refused import leaves none."""

    specs: tuple
    pages: list
    slots: np.ndarray
    offsets: np.ndarray
    table: Any = field(repr=False, default=None)
    key: int = 0
    owner: Any = field(repr=False, default=None)
    open: bool = True
    scales: dict = field(repr=False, default_factory=dict)

    @property
    def num_tokens(self) -> int:
        """Source tokens over all specs (the rows ``write`` takes), skipped ones included."""
        return int(self.offsets[-1])

    @property
    def num_pages(self) -> int:
        return int(sum(len(p) for p in self.pages))

    @property
    def seq_ids(self) -> list:
        return [s.seq_id for s in self.specs]


def pages_needed(spec: ImportSpec, page_size: int) -> int:
    """Pages of the spec's own block: a fork's partial page (copied) plus its tokens."""
    offset = spec.fork_pos % page_size if spec.parent_id is not None else 0
    return -(-(offset + spec.num_tokens) // page_size)


def token_slots(pages: np.ndarray, offset: int, count: int, page_size: int) -> np.ndarray:
    """Slots of ``count`` tokens laid out from row ``offset`` of ``pages[0]`` on."""
    j = np.arange(offset, offset + count, dtype=np.int64)
    return (pages[j // page_size].astype(np.int64) * page_size + j % page_size).astype(np.int32)
