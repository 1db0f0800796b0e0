"""The sequences of ``CacheState`` and their pages: lookups, add / remove, fork and popn
(``SequenceOps``), and the block surgery they share (``PageCopy``: the partial-page copy a fork
leaves to the backend).

Each operation validates (``check_*``, a ``@query``) before it mutates, so an error leaves the
page table as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import (CacheFullError, ForwardStateError, InvalidArgumentError,
                      SequenceExistsError, SequenceNotFoundError)
from .epoch import EpochCounted, query
from .pagetable import PageTable, SeqState
from .slots import StateSlots
from .validate import int_arg as as_int     # the shared int check, under its old name here
from .validate import seq_id_arg


@dataclass(frozen=True)
class PageCopy:
    """Copy rows ``0 .. length-1`` of page ``src_page`` into ``dst_page`` (a fork's or a
    pop's partial page) in the page arrays of the full-attention layers, or with ``group >=
    0`` in those of window group ``group`` (``CacheConfig.window_groups``)."""

    src_page: int
    dst_page: int
    length: int
    group: int = -1


class SequenceOps(EpochCounted):
    """The root of ``CacheState``'s operations: the fields the others read and the sequence
    operations (see the module docstring)."""

    # set by ``CacheState.__init__``
    page_size: int
    support_sliding_window: bool
    pt: PageTable
    slots: Optional[StateSlots]

    # ------------------------------------------------------------------ lookups
    @query
    def seq(self, seq_id) -> SeqState:
        seq_id = seq_id_arg(seq_id)     # a bool or 1.0 would find sequence 1 by hash
        try:
            return self.pt.seqs[seq_id]
        except KeyError:
            raise SequenceNotFoundError(
                f"sequence {seq_id!r} is not in the cache ({len(self.pt.seqs)} sequences held)") from None

    @query
    def length(self, seq_id) -> int:
        return self.pt.length(self.seq(seq_id))

    # ------------------------------------------------------------------ add / remove
    def add_sequence(self, seq_id) -> None:
        seq_id = seq_id_arg(seq_id)
        if seq_id in self.pt.seqs:
            raise SequenceExistsError(f"sequence {seq_id} is already in the cache")
        if self.slots is not None:
            self.slots.check_take(f"add_sequence({seq_id})")
        self.pt.add_sequence(seq_id, self.pt.new_block())
        if self.pt.groups is not None:
            self.pt.groups.add(seq_id)
        if self.slots is not None:
            self.slots.take(seq_id)

    def remove_sequence(self, seq_id) -> None:
        seq = self.seq(seq_id)
        self._release(seq)
        if self.pt.groups is not None:
            self.pt.groups.remove(seq.seq_id)
        if self.slots is not None:
            self.slots.release(seq.seq_id)

    def _release(self, seq: SeqState) -> None:
        """Drop ``seq``: free the blocks only it reaches, unshare the first shared one."""
        pt = self.pt
        b = int(pt.s_last[seq.slot])
        while b != -1 and pt.b_ref[b] == 1:
            parent = int(pt.b_parent[b])
            pt.free_block(b)
            b = parent
        if b != -1:
            pt.b_ref[b] -= 1
        pt.drop_sequence(seq.seq_id)

    # ------------------------------------------------------------------ fork
    @query
    def check_fork(self, parent_id, child_id, fork_pos) -> tuple[SeqState, int, int]:
        parent = self.seq(parent_id)
        child_id = seq_id_arg(child_id, "child_id")
        fork_pos = as_int(fork_pos, "fork_pos")
        if child_id in self.pt.seqs:
            raise SequenceExistsError(f"cannot fork into sequence {child_id}: it is already in the cache")
        length = self.pt.length(parent)
        if fork_pos == -1:
            fork_pos = length
        if not 0 <= fork_pos <= length:
            raise InvalidArgumentError(
                f"fork_pos {fork_pos} of sequence {parent.seq_id} must be in [0, {length}] (or -1)")
        if not parent.committed:
            raise ForwardStateError(
                f"sequence {parent.seq_id} has {len(parent.tree_parent)} uncommitted token-tree "
                f"tokens; call commit_accepted_token_tree_nodes before forking it")
        if parent.window != -1 and fork_pos > parent.sink_request:
            # the child's prefix must be stored contiguously, and the parent may share no more
            # than its sinks (shared pages cannot slide out)
            raise InvalidArgumentError(
                f"sequence {parent.seq_id} has a sliding window; it can be forked only within "
                f"its {parent.sink_request} sink tokens, not at {fork_pos}")
        if fork_pos % self.page_size and self.pt.num_free < 1:
            raise CacheFullError(
                f"forking sequence {parent.seq_id} at {fork_pos} copies a partial page; 0 of "
                f"{self.pt.num_pages} pages are free")
        return parent, child_id, fork_pos

    def fork_sequence(self, parent_id, child_id, fork_pos=-1) -> list[PageCopy]:
        parent, child_id, fork_pos = self.check_fork(parent_id, child_id, fork_pos)
        slots = self.slots
        if slots is not None:
            # the child's state is the parent's now: the state after the parent's last token
            if fork_pos != self.pt.length(parent):
                slots.refuse_rewind(f"fork_sequence({parent.seq_id}, {child_id}, fork_pos="
                                    f"{fork_pos}) below the parent's length "
                                    f"{self.pt.length(parent)}")
            slots.check_take(f"fork_sequence({parent.seq_id}, {child_id})")
        copies = self._fork_groups(parent, child_id, fork_pos)
        if slots is not None:
            slots.take(child_id)
        return copies

    def _fork_groups(self, parent: SeqState, child_id: int, fork_pos: int) -> list[PageCopy]:
        """``_fork`` and every window group's fork (checked first)."""
        groups = self.pt.groups
        if groups is None:
            return self._fork(parent, child_id, fork_pos)
        groups.check_fork(parent.seq_id, fork_pos)
        copies = self._fork(parent, child_id, fork_pos)
        return copies + [PageCopy(src, dst, rows, g)
                         for g, src, dst, rows in groups.fork(parent.seq_id, child_id, fork_pos)]

    def _fork(self, parent: SeqState, child_id: int, fork_pos: int,
              page: Optional[int] = None) -> list[PageCopy]:
        """Fork ``child_id`` from ``parent`` at ``fork_pos``; ``page``: the page that takes a
        partial page's copy (None: a free one)."""
        pt, ps = self.pt, self.page_size
        copies = []
        last = int(pt.s_last[parent.slot])
        if fork_pos == pt.length(parent) and fork_pos % ps == 0 and pt.b_len[last] > 0:
            # the parent keeps decoding into a fresh block; its old last block becomes shared
            nb = pt.new_block()
            pt.b_start[nb] = fork_pos
            pt.b_parent[nb] = last
            pt.s_last[parent.slot] = nb
        child = pt.new_block()
        trace = pt.trace(parent)
        offset = fork_pos
        for b in trace:
            if b != trace[-1] and pt.b_len[b] <= offset:
                offset -= int(pt.b_len[b])
                continue
            in_page = offset % ps
            moved = offset - in_page
            if moved == 0:
                up = int(pt.b_parent[b])
                if up != -1:
                    pt.b_ref[up] += 1
                pt.b_parent[child] = up
            else:
                # split b: its first `moved` tokens become a new shared parent block
                up = pt.new_block()
                pt.b_parent[up] = pt.b_parent[b]
                pt.b_parent[b] = up
                pt.b_parent[child] = up
                pt.b_ref[up] = 2
                pages = pt.pages_of(b)
                npm = moved // ps
                pt.set_pages(up, pages[:npm].copy())
                rest = pages[npm:].copy()
                pt.set_pages(b, rest)
                pt.b_start[up] = pt.b_start[b]
                pt.b_start[b] += moved
                pt.b_len[up] = moved
                pt.b_len[b] -= moved
                if pt.b_window_offset[b]:
                    pt.b_sink[b] -= moved
                    pt.b_window_offset[b] -= moved
            pt.b_start[child] = fork_pos - in_page
            pt.b_len[child] = in_page
            if in_page:
                src = int(pt.pages_of(b)[0])
                dst = int(pt.take_pages(1)[0]) if page is None else int(page)
                pt.set_pages(child, [dst])
                copies.append(PageCopy(src, dst, in_page))
            break
        pt.add_sequence(child_id, child)
        return copies

    # ------------------------------------------------------------------ popn
    @query
    def check_popn(self, seq_id, n) -> tuple[SeqState, int]:
        seq = self.seq(seq_id)
        n = as_int(n, "n")
        length = self.pt.length(seq)
        if not 0 <= n <= length:
            raise InvalidArgumentError(f"cannot pop {n} tokens from sequence {seq.seq_id} of length {length}")
        if not seq.committed:
            raise ForwardStateError(
                f"sequence {seq.seq_id} has an uncommitted token tree; commit it before popn")
        if n and self._popn_needs_fork(seq, n) and (length - n) % self.page_size and self.pt.num_free < 1:
            raise CacheFullError(f"popn {n} on sequence {seq.seq_id} copies a partial page; no page is free")
        return seq, n

    def _popn_needs_fork(self, seq: SeqState, n: int) -> bool:
        pt = self.pt
        b = int(pt.s_last[seq.slot])
        while b != -1 and pt.b_ref[b] == 1:
            if n <= pt.b_len[b]:
                return False
            n -= int(pt.b_len[b])
            b = int(pt.b_parent[b])
        return n > 0

    def popn(self, seq_id, n, rewound: bool = False) -> list[PageCopy]:
        """``rewound``: the caller found the states at the new end (a checkpoint, or zeros at
        0; ``KVManager.popn``), so a cache with state layers may pop."""
        seq, n = self.check_popn(seq_id, n)
        if self.slots is not None and n and not rewound:
            self.slots.refuse_rewind(f"popn({seq.seq_id}, {n})")
        groups = self.pt.groups
        if groups is None:
            return self._popn(seq, n)
        sid, length = seq.seq_id, self.pt.length(seq)
        groups.check_popn(sid, length, n)
        copies = self._popn(seq, n)
        return copies + [PageCopy(src, dst, rows, g)
                         for g, src, dst, rows in groups.popn(sid, length, n)]

    def _popn(self, seq: SeqState, n: int) -> list[PageCopy]:
        if n == 0:
            return []
        pt, ps = self.pt, self.page_size
        b = int(pt.s_last[seq.slot])
        while b != -1 and pt.b_ref[b] == 1:
            blen = int(pt.b_len[b])
            if n > blen:
                n -= blen
                pt.s_len[seq.slot] -= blen
                parent = int(pt.b_parent[b])
                pt.free_block(b)
                b = parent
                pt.s_last[seq.slot] = b
                continue
            if pt.b_window_offset[b] and blen - n <= pt.b_sink[b]:
                pt.b_sink[b] = pt.b_window_offset[b] = 0   # the window is gone: the sinks are a plain block
            span = int(pt.b_window_offset[b]) + blen - n - int(pt.b_sink[b])
            keep = -(-span // ps)
            pages = pt.pages_of(b)
            pt.give_pages(pages[keep:].copy())
            pt.b_npages[b] = keep
            pt.b_len[b] -= n
            pt.s_len[seq.slot] -= n
            n = 0
            break
        if n == 0:
            return []
        # the rest lies in a shared prefix: fork at the new length, then drop the old sequence
        seq_id, slot = seq.seq_id, seq.slot
        temp_id: Any = object()     # a key no caller can pass
        new_len = int(pt.s_len[slot]) - n
        copies = self._fork(seq, temp_id, new_len)
        child = pt.seqs[temp_id]
        self._release(seq)      # the old sequence's own reference (its last block is shared here)
        del pt.seqs[temp_id]
        child.seq_id = seq_id
        child.prefix = seq.prefix       # the same sequence: its recorded token ids stay
        pt.seqs[seq_id] = child
        if seq.window != -1:   # keep the window
            child.window, child.sink_request = seq.window, seq.sink_request
            pt.s_window[child.slot] = seq.window
        return copies
