"""Sequences, blocks and pages (no array library beyond host numpy).

A *block* is a run of tokens stored in whole pages; blocks form a tree through ``parent``
(shared prefixes). A sequence points at its last block; its tokens are the concatenation of the
blocks from the root to that block (its *trace*). ``ref`` counts the sequences and child blocks
that point at a block; only a block with ``ref == 1`` that ends a sequence may grow. Every
block but a sequence's last is page-aligned, so a partially filled page is never shared.

State lives in growable numpy arrays indexed by block id / sequence slot, and each block's page
ids live in one region of a flat ``page_store``; this keeps ``begin_forward`` vectorised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CacheFullError
from ..errors import pages as n_pages


def _grow(array: np.ndarray, size: int, fill) -> np.ndarray:
    if size <= len(array):
        return array
    new = np.full(max(size, 2 * len(array)), fill, dtype=array.dtype)
    new[:len(array)] = array
    return new


@dataclass
class SeqState:
    """Per-sequence state that is not needed vectorised."""

    seq_id: int
    slot: int
    window: int = -1            # sliding window size, -1: off
    sink_request: int = 0       # sink size asked for in enable_sliding_window
    tree_parent: list = field(default_factory=list)   # uncommitted tree, parent per node
    tree_depth: list = field(default_factory=list)
    prefix: Any = None          # the prefix cache's token record (``core.prefix.Track``)

    @property
    def committed(self) -> bool:
        return not self.tree_parent


class PageTable:
    def __init__(self, num_pages: int, page_size: int, groups=None):
        self.page_size = page_size
        self.num_pages = num_pages
        # window groups (``core.groups.WindowGroups``, CacheConfig.layer_kinds): each windowed
        # group's own pool and live lists, keyed by sequence id; None without window groups
        self.groups = groups
        # free pages: a stack, popped from the end; initial order hands out 0, 1, 2, ...
        self.free_pages = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self.num_free = num_pages
        # blocks
        cap = 64
        self.b_len = np.zeros(cap, np.int32)        # tokens in the block
        self.b_start = np.zeros(cap, np.int32)      # position of the block's first token in the sequence
        self.b_parent = np.full(cap, -1, np.int32)
        self.b_ref = np.zeros(cap, np.int32)
        self.b_sink = np.zeros(cap, np.int32)       # attention-sink tokens kept at the block front
        self.b_window_offset = np.zeros(cap, np.int32)        # in-block offset where the sliding window starts
        self.b_pstart = np.zeros(cap, np.int64)     # region of the block's page ids in page_store
        self.b_npages = np.zeros(cap, np.int32)
        self.b_pcap = np.zeros(cap, np.int32)
        self.b_live = np.zeros(cap, bool)
        self.free_blocks: list[int] = []
        self.num_blocks = 0
        self.page_store = np.zeros(max(1024, 2 * num_pages), np.int32)
        self.store_top = 0
        # sequences
        self.seqs: dict[int, SeqState] = {}
        self.free_slots: list[int] = []
        self.num_slots = 0
        self.s_len = np.zeros(64, np.int32)
        self.s_last = np.full(64, -1, np.int32)
        self.s_window = np.full(64, -1, np.int32)
        self.s_tree = np.zeros(64, np.int32)        # uncommitted tree size
        # pages taken for imports not yet committed: {reservation key: page ids}
        self.reserved: dict[int, np.ndarray] = {}
        self._reservations = 0

    # ------------------------------------------------------------------ pages
    def take_pages(self, n: int) -> np.ndarray:
        if n > self.num_free:
            raise CacheFullError(
                f"need {n_pages(n, 'free page')}, {self.num_free} of {self.num_pages} are free")
        self.num_free -= n
        return self.free_pages[self.num_free:self.num_free + n][::-1].copy()

    def give_pages(self, pages) -> None:
        pages = np.asarray(pages, np.int32)
        n = len(pages)
        self.free_pages[self.num_free:self.num_free + n] = pages[::-1]
        self.num_free += n

    def next_key(self) -> int:
        """A fresh key for ``reserved``."""
        self._reservations += 1
        return self._reservations

    # ------------------------------------------------------------------ blocks
    def new_block(self) -> int:
        if self.free_blocks:
            b = self.free_blocks.pop()
        else:
            b = self.num_blocks
            self.num_blocks += 1
            for name in ("b_len", "b_start", "b_ref", "b_sink", "b_window_offset", "b_npages", "b_pcap"):
                setattr(self, name, _grow(getattr(self, name), self.num_blocks, 0))
            self.b_parent = _grow(self.b_parent, self.num_blocks, -1)
            self.b_pstart = _grow(self.b_pstart, self.num_blocks, 0)
            self.b_live = _grow(self.b_live, self.num_blocks, False)
        self.b_len[b] = self.b_start[b] = self.b_sink[b] = self.b_window_offset[b] = 0
        self.b_parent[b] = -1
        self.b_ref[b] = 1
        self.b_npages[b] = self.b_pcap[b] = 0
        self.b_pstart[b] = 0
        self.b_live[b] = True
        return b

    def free_block(self, b: int) -> None:
        self.give_pages(self.pages_of(b))
        self.b_npages[b] = self.b_pcap[b] = 0
        self.b_live[b] = False
        self.free_blocks.append(b)

    def pages_of(self, b: int) -> np.ndarray:
        s = int(self.b_pstart[b])
        return self.page_store[s:s + int(self.b_npages[b])]

    def _region(self, cap: int) -> int:
        if self.store_top + cap > len(self.page_store):
            self._compact_store(cap)
        start = self.store_top
        self.store_top += cap
        return start

    def _compact_store(self, extra: int) -> None:
        live = np.nonzero(self.b_live[:self.num_blocks])[0]
        need = int(self.b_pcap[live].sum()) + extra
        store = np.zeros(max(len(self.page_store), 2 * need), np.int32)
        top = 0
        for b in live:
            n, cap = int(self.b_npages[b]), int(self.b_pcap[b])
            s = int(self.b_pstart[b])
            store[top:top + n] = self.page_store[s:s + n]
            self.b_pstart[b] = top
            top += cap
        self.page_store, self.store_top = store, top

    def ensure_capacity(self, b: int, npages: int) -> None:
        if npages <= self.b_pcap[b]:
            return
        cap = max(npages, 2 * int(self.b_pcap[b]), 4)
        old = self.pages_of(b).copy()
        start = self._region(cap)
        self.page_store[start:start + len(old)] = old
        self.b_pstart[b], self.b_pcap[b] = start, cap

    def push_pages(self, b: int, pages) -> None:
        n = int(self.b_npages[b])
        self.ensure_capacity(b, n + len(pages))
        s = int(self.b_pstart[b])
        self.page_store[s + n:s + n + len(pages)] = pages
        self.b_npages[b] = n + len(pages)

    def set_pages(self, b: int, pages) -> None:
        self.b_npages[b] = 0
        self.push_pages(b, np.asarray(pages, np.int32))

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: int, block: int) -> SeqState:
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = self.num_slots
            self.num_slots += 1
            self.s_len = _grow(self.s_len, self.num_slots, 0)
            self.s_last = _grow(self.s_last, self.num_slots, -1)
            self.s_window = _grow(self.s_window, self.num_slots, -1)
            self.s_tree = _grow(self.s_tree, self.num_slots, 0)
        seq = SeqState(seq_id, slot)
        self.s_last[slot], self.s_window[slot], self.s_tree[slot] = block, -1, 0
        self.s_len[slot] = self.trace_length(block)
        self.seqs[seq_id] = seq
        return seq

    def drop_sequence(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        self.s_last[seq.slot] = -1
        self.free_slots.append(seq.slot)

    def trace_length(self, block: int) -> int:
        total = 0
        while block != -1:
            total += int(self.b_len[block])
            block = int(self.b_parent[block])
        return total

    def trace(self, seq: SeqState) -> list:
        """Blocks from the root to the sequence's last block."""
        chain = []
        b = int(self.s_last[seq.slot])
        while b != -1:
            chain.append(b)
            b = int(self.b_parent[b])
        return chain[::-1]

    def length(self, seq: SeqState) -> int:
        return int(self.s_len[seq.slot])

    def position_slots(self, seq: SeqState, start: int, end: int) -> np.ndarray:
        """Slots of the kept tokens ``start:end`` of a sequence (index into its kept tokens)."""
        ps = self.page_size
        out = []
        for b in self.trace(seq):
            n = int(self.b_len[b])
            if n == 0:
                continue
            j = np.arange(n)
            sink, window_offset = int(self.b_sink[b]), int(self.b_window_offset[b])
            off = np.where(j < sink, j, j - sink + window_offset)
            pages = self.pages_of(b)
            out.append(pages[off // ps].astype(np.int64) * ps + off % ps)
        slots = np.concatenate(out) if out else np.zeros(0, np.int64)
        return slots[start:end].astype(np.int32)

    # ------------------------------------------------------------------ accounting
    def used_pages(self) -> np.ndarray:
        """Page ids referenced by live blocks (each once per block that holds it)."""
        live = np.nonzero(self.b_live[:self.num_blocks])[0]
        parts = [self.pages_of(int(b)) for b in live]
        return np.concatenate(parts) if parts else np.zeros(0, np.int32)

    def check_invariants(self) -> None:
        """Raise AssertionError if page or reference accounting is broken (tests call this)."""
        self._check_regions()
        used = np.concatenate([self.used_pages(), *self.reserved.values()]).astype(np.int32)
        free = self.free_pages[:self.num_free]
        assert len(np.unique(used)) == len(used), "a page is held by two blocks"
        assert len(np.unique(free)) == len(free), "a page is free twice"
        assert not np.intersect1d(used, free).size, "a page is both free and used"
        assert len(used) + len(free) == self.num_pages, (
            f"free {len(free)} + used {len(used)} != total {self.num_pages}")
        refs = np.zeros(self.num_blocks, np.int64)
        for seq in self.seqs.values():
            refs[self.s_last[seq.slot]] += 1
        live = np.nonzero(self.b_live[:self.num_blocks])[0]
        for b in live:
            p = self.b_parent[b]
            if p != -1:
                assert self.b_live[p], f"block {b} has a dead parent {p}"
                refs[p] += 1
        for b in live:
            assert refs[b] == self.b_ref[b], f"block {b}: ref {self.b_ref[b]} != counted {refs[b]}"
            assert refs[b] >= 1, f"live block {b} is unreferenced"
            span = int(self.b_window_offset[b]) + int(self.b_len[b]) - int(self.b_sink[b])
            assert int(self.b_npages[b]) == -(-span // self.page_size), (
                f"block {b}: {self.b_npages[b]} pages for {span} rows")
        for seq in self.seqs.values():
            assert self.s_len[seq.slot] == self.trace_length(int(self.s_last[seq.slot])), (
                f"sequence {seq.seq_id}: length {self.s_len[seq.slot]} != blocks' total")
        self._check_windows(live)
        if self.groups is not None:
            self.groups.check_invariants({sid: int(self.s_len[seq.slot])
                                          for sid, seq in self.seqs.items()})

    def _check_regions(self) -> None:
        """Each live block's page-list region ``[pstart, pstart + pcap)`` lies below
        ``store_top`` and overlaps no other: a block grows in place into its region, so an
        overlap (e.g. a compaction that packed regions by their length, not their capacity)
        lets one block's growth overwrite another's page list."""
        live = np.nonzero(self.b_live[:self.num_blocks])[0]
        live = live[self.b_pcap[live] > 0]
        start = self.b_pstart[live]
        order = np.argsort(start, kind="stable")
        start, end, blocks = start[order], start[order] + self.b_pcap[live][order], live[order]
        assert (self.b_npages[blocks] <= self.b_pcap[blocks]).all(), "a block outgrew its region"
        assert not len(end) or int(end[-1]) <= self.store_top <= len(self.page_store), (
            f"regions end at {int(end[-1]) if len(end) else 0}, store top {self.store_top}")
        bad = np.flatnonzero(end[:-1] > start[1:])
        assert not len(bad), (
            f"page-list regions overlap: block {int(blocks[bad[0]])} "
            f"[{int(start[bad[0]])}, {int(end[bad[0]])}) and block {int(blocks[bad[0] + 1])} "
            f"from {int(start[bad[0] + 1])}")

    def _check_windows(self, live) -> None:
        """Only a windowed sequence's last block slides; the tokens before it are all sinks."""
        lasts = {int(self.s_last[seq.slot]): seq for seq in self.seqs.values()}
        for b in live:
            seq = lasts.get(int(b))
            if seq is None:
                assert not self.b_window_offset[b] and not self.b_sink[b] and self.b_len[b] % self.page_size == 0, (
                    f"shared block {b}: len {self.b_len[b]}, sink {self.b_sink[b]}, window offset {self.b_window_offset[b]}")
            elif seq.window == -1:
                assert not self.b_window_offset[b] and not self.b_sink[b], f"sequence {seq.seq_id} has no window"
            else:
                prefix = int(self.s_len[seq.slot]) - int(self.b_len[b])
                assert prefix <= seq.sink_request, (
                    f"sequence {seq.seq_id}: {prefix} tokens before its last block > {seq.sink_request} sinks")
                if self.b_window_offset[b]:
                    assert self.b_sink[b] == seq.sink_request - prefix < self.b_len[b], (
                        f"sequence {seq.seq_id}: block sinks {self.b_sink[b]}, prefix {prefix}, "
                        f"len {self.b_len[b]}, sinks {seq.sink_request}")
