"""Sequence operations on the page table, each validate-then-mutate.

Operations that need device work (copying a partial page on fork, compacting a token tree on
commit) return the work as plain data; ``PagedKVCache`` hands it to the backend.

Every public method of ``CacheState`` (and of a subclass) bumps ``epoch`` before it runs unless
it is marked ``@query``: the planner reuses a decode batch's plan only while the epoch is
unchanged, so an operation added here cannot forget to invalidate it.
"""

from __future__ import annotations

import functools
from typing import Any, Optional
from dataclasses import dataclass

import numpy as np

from ..errors import (CacheFullError, ForwardStateError, InvalidArgumentError,
                      SequenceExistsError, SequenceNotFoundError)
from .imports import ImportReservation, ImportSpec, pages_needed, token_slots
from .pagetable import PageTable, SeqState
from .plan import ForwardUndo
from .sliding import plan_slide
from .validate import INT32_MAX, int_values, seq_id_arg, seq_id_list
from .validate import int_arg as as_int     # the shared int check, under its old name here


@dataclass(frozen=True)
class PageCopy:
    src_page: int
    dst_page: int
    length: int


def query(method):
    """Mark a ``CacheState`` method that changes no state: it leaves the plan epoch alone."""
    method.is_query = True
    return method


def _bumps_epoch(method):
    @functools.wraps(method)
    def mutator(self, *args, **kwargs):
        self.epoch += 1
        return method(self, *args, **kwargs)
    setattr(mutator, "is_query", False)     # (a function attribute mypy does not know)
    return mutator


def _bump_epoch_in_mutators(cls) -> None:
    """Wrap every public method of ``cls`` not marked ``@query`` so it bumps the epoch."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not callable(member) or hasattr(member, "is_query"):
            continue
        setattr(cls, name, _bumps_epoch(member))


class CacheState:
    """The cache's sequences, blocks and pages (``pt``) and the operations on them.

    ``epoch`` counts structural changes: every public method not marked ``@query`` bumps it
    (see the module docstring). Only a decode step changes the page table without a bump: it
    grows each sequence's last block by one token, which the reused plan accounts for.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _bump_epoch_in_mutators(cls)

    def __init__(self, num_pages: int, page_size: int, support_sliding_window: bool):
        self.page_size = page_size
        self.support_sliding_window = support_sliding_window
        self.pt = PageTable(num_pages, page_size)
        self.epoch = 0

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
        self.pt.add_sequence(seq_id, self.pt.new_block())

    def remove_sequence(self, seq_id) -> None:
        seq = self.seq(seq_id)
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
        return self._fork(parent, child_id, fork_pos)

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

    def popn(self, seq_id, n) -> list[PageCopy]:
        seq, n = self.check_popn(seq_id, n)
        return self._popn(seq, n)

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
        # drop the old sequence's own reference (its last block is shared here)
        b = int(pt.s_last[slot])
        while b != -1 and pt.b_ref[b] == 1:
            parent = int(pt.b_parent[b])
            pt.free_block(b)
            b = parent
        if b != -1:
            pt.b_ref[b] -= 1
        pt.drop_sequence(seq_id)
        del pt.seqs[temp_id]
        child.seq_id = seq_id
        child.prefix = seq.prefix       # the same sequence: its recorded token ids stay
        pt.seqs[seq_id] = child
        if seq.window != -1:   # keep the window
            child.window, child.sink_request = seq.window, seq.sink_request
            pt.s_window[child.slot] = seq.window
        return copies

    # ------------------------------------------------------------------ sliding window
    def enable_sliding_window(self, seq_id, window_size, sink_size) -> None:
        seq = self.seq(seq_id)
        window_size, sink_size = self._window_args(seq.seq_id, window_size, sink_size)
        if seq.window != -1:
            raise InvalidArgumentError(f"sequence {seq.seq_id} already has a sliding window ({seq.window})")
        if not seq.committed:
            raise ForwardStateError(f"sequence {seq.seq_id} has an uncommitted token tree")
        trace = self.pt.trace(seq)
        own = self._own_blocks(trace)
        self._check_shared(seq.seq_id, int(self.pt.b_start[trace[own]]), sink_size)
        self._merge_blocks(trace[own:])
        seq.window, seq.sink_request = window_size, sink_size
        self.pt.s_window[seq.slot] = window_size

    @query
    def _window_args(self, seq_id: int, window_size, sink_size) -> tuple[int, int]:
        # stored as int32: bounded like every other length
        window_size = as_int(window_size, f"sequence {seq_id}: window_size", hi=INT32_MAX)
        sink_size = as_int(sink_size, f"sequence {seq_id}: sink_size", hi=INT32_MAX)
        if not self.support_sliding_window:
            raise InvalidArgumentError(
                f"sequence {seq_id}: this cache was built with support_sliding_window=False")
        if window_size <= 0 or not 0 <= sink_size < window_size:
            raise InvalidArgumentError(
                f"sequence {seq_id}: need window_size > 0 and 0 <= sink_size < window_size, "
                f"got window_size={window_size}, sink_size={sink_size}")
        return window_size, sink_size

    @staticmethod
    def _check_shared(seq_id: int, shared: int, sink_size: int) -> None:
        if shared > sink_size:
            raise InvalidArgumentError(
                f"sequence {seq_id} shares its first {shared} tokens with other sequences "
                f"and shared pages cannot slide out: sink_size must be at least {shared}, "
                f"got {sink_size}")

    def _own_blocks(self, trace) -> int:
        """Index in ``trace`` of the first block that no other sequence reaches."""
        own = len(trace) - 1
        while own > 0 and self.pt.b_ref[trace[own - 1]] == 1:
            own -= 1
        return own

    def _merge_blocks(self, chain) -> None:
        """Fold a chain of blocks held by one sequence (what a removed fork leaves behind) into
        its last block, so the window can slide over all of it."""
        if len(chain) < 2:
            return
        pt, last = self.pt, chain[-1]
        pages = np.concatenate([pt.pages_of(b) for b in chain])
        pt.b_len[last] = sum(int(pt.b_len[b]) for b in chain)
        pt.b_start[last], pt.b_parent[last] = pt.b_start[chain[0]], pt.b_parent[chain[0]]
        for b in chain[:-1]:
            pt.b_npages[b] = 0     # its pages move to ``last``
            pt.free_block(b)
        pt.set_pages(last, pages)

    @query
    def block_sinks(self, seq: SeqState) -> int:
        """Sink tokens of a windowed sequence inside its last block (the tokens before it, at
        most ``sink_request`` of them, are all sinks)."""
        last = int(self.pt.s_last[seq.slot])
        return max(seq.sink_request - (self.pt.length(seq) - int(self.pt.b_len[last])), 0)

    @query
    def slide_plan(self, seq: SeqState, append: int):
        pt = self.pt
        b = int(pt.s_last[seq.slot])
        return plan_slide(seq_len=int(pt.s_len[seq.slot]), block_len=int(pt.b_len[b]),
                          sink=int(pt.b_sink[b]), window_offset=int(pt.b_window_offset[b]),
                          npages=int(pt.b_npages[b]), window=seq.window,
                          last_block_sink=self.block_sinks(seq), append=append,
                          page_size=self.page_size)

    def _slide(self, seq: SeqState, append: int, fresh) -> None:
        """Reserve ``append`` tokens in a sliding sequence's last block (``fresh``: its new
        pages, taken before any slide of the forward freed one), then slide: the pages that
        slide out go back to the free list."""
        pt = self.pt
        b = int(pt.s_last[seq.slot])
        plan = self.slide_plan(seq, append)
        pt.push_pages(b, fresh)
        if plan.erase_count:
            pages = pt.pages_of(b).copy()
            lo, hi = plan.erase_at, plan.erase_at + plan.erase_count
            pt.give_pages(pages[lo:hi])
            pt.set_pages(b, np.concatenate([pages[:lo], pages[hi:]]))
        pt.b_len[b], pt.b_sink[b] = plan.block_len, plan.sink
        pt.b_window_offset[b] = plan.window_offset
        pt.s_len[seq.slot] = plan.seq_len

    # ------------------------------------------------------------------ tree commit
    @query
    def check_commit(self, seq_ids, leaf_indices) -> list[tuple[SeqState, int]]:
        seq_ids = seq_id_list(seq_ids, "seq_ids")
        leaf_indices = int_values(leaf_indices, "leaf_indices")
        if len(seq_ids) != len(leaf_indices):
            raise InvalidArgumentError(
                f"commit got {len(seq_ids)} seq_ids but {len(leaf_indices)} leaf_indices")
        out, seen = [], set()
        for sid, leaf in zip(seq_ids, leaf_indices):
            seq = self.seq(sid)
            if seq.seq_id in seen:
                raise InvalidArgumentError(f"sequence {seq.seq_id} appears twice in the commit")
            seen.add(seq.seq_id)
            leaf = as_int(leaf, "leaf index")
            size = len(seq.tree_parent)
            if not -1 <= leaf < size:
                raise InvalidArgumentError(
                    f"leaf index {leaf} of sequence {seq.seq_id} must be in [-1, {size}) "
                    f"(its uncommitted tree has {size} tokens)")
            out.append((seq, leaf))
        return out

    @query
    def commit_plan(self, items) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination slots of the KV rows that move so each accepted path becomes
        contiguous right after the committed history."""
        src: list[int] = []
        dst: list[int] = []
        for seq, leaf in items:
            if leaf < 0:
                continue
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = seq.tree_parent[node]
            path.reverse()
            moves = [(node, p) for p, node in enumerate(path) if node != p]
            if not moves:
                continue
            length = self.pt.length(seq)
            base = length - len(seq.tree_parent)
            slots = self.pt.position_slots(seq, base, length)
            src.extend(int(slots[node]) for node, _ in moves)
            dst.extend(int(slots[p]) for _, p in moves)
        return np.asarray(src, np.int32), np.asarray(dst, np.int32)

    def commit(self, items) -> None:
        for seq, leaf in items:
            size = len(seq.tree_parent)
            keep = seq.tree_depth[leaf] + 1 if leaf >= 0 else 0
            seq.tree_parent, seq.tree_depth = [], []
            self.pt.s_tree[seq.slot] = 0
            self._popn(seq, size - keep)

    # ------------------------------------------------------------------ import
    @query
    def check_imports(self, specs, reserved: bool = False) -> list[int]:
        """Validate ``ImportSpec``s (in order; a parent may be an earlier spec) against the cache
        and each other; returns the pages each needs. ``reserved``: the pages are already held
        (a commit re-checks), so free pages are not counted. Raises typed errors naming the
        sequence, the value and the limit."""
        pt, ps = self.pt, self.page_size
        pending: dict = {}
        needs = []
        for spec in specs:
            sid = seq_id_arg(spec.seq_id)
            if sid in pt.seqs:
                raise SequenceExistsError(f"cannot import sequence {sid}: it is already in the cache")
            if sid in pending:
                raise SequenceExistsError(f"sequence {sid} appears twice in one import")
            as_int(spec.num_tokens, f"sequence {sid}: num_tokens", 0, INT32_MAX)
            as_int(spec.skip, f"sequence {sid}: skip", 0, INT32_MAX)
            if spec.window_size != -1:
                self._window_args(sid, spec.window_size, spec.sink_size)
            if spec.parent_id is not None:
                self._check_import_parent(spec, sid, pending)
            elif spec.fork_pos != 0:
                raise InvalidArgumentError(
                    f"sequence {sid}: fork_pos {spec.fork_pos} needs a parent_id (the tokens "
                    f"before it come from the parent)")
            pending[sid] = spec
            needs.append(pages_needed(spec, ps))
        if not reserved and sum(needs) > pt.num_free:
            worst = int(np.argmax(needs))
            raise CacheFullError(
                f"importing sequences {[s.seq_id for s in specs]} needs {sum(needs)} pages but "
                f"{pt.num_free} of {pt.num_pages} are free (sequence {specs[worst].seq_id} alone "
                f"needs {needs[worst]} for {specs[worst].num_tokens} tokens)")
        return needs

    def _check_import_parent(self, spec: ImportSpec, sid: int, pending: dict) -> None:
        pid = seq_id_arg(spec.parent_id, "parent_id")
        fork_pos = as_int(spec.fork_pos, f"sequence {sid}: fork_pos", 0, INT32_MAX)
        if pid in pending:
            p = pending[pid]
            length, window, sinks = p.fork_pos + p.num_tokens, p.window_size, p.sink_size
        else:
            parent = self.seq(pid)
            if not parent.committed:
                raise ForwardStateError(
                    f"parent sequence {pid} of sequence {sid} has {len(parent.tree_parent)} "
                    f"uncommitted token-tree tokens; commit them first")
            length, window, sinks = self.pt.length(parent), parent.window, parent.sink_request
        if fork_pos > length:
            raise InvalidArgumentError(
                f"sequence {sid}: fork_pos {fork_pos} must be in [0, {length}] (the length of "
                f"its parent sequence {pid})")
        if window != -1 and fork_pos > sinks:
            raise InvalidArgumentError(
                f"sequence {pid} has a sliding window; it can be forked only within its "
                f"{sinks} sink tokens, not at {fork_pos} (import of sequence {sid})")
        if spec.window_size != -1:
            if fork_pos > spec.sink_size:
                # past its sinks a windowed sequence's kept tokens may have slid: its first
                # fork_pos kept tokens need not be its parent's any more
                raise InvalidArgumentError(
                    f"sequence {sid} has a sliding window with {spec.sink_size} sink tokens; it "
                    f"can share only sink tokens with parent {pid}, not {fork_pos} (import it "
                    f"whole instead)")
            self._check_shared(sid, fork_pos - fork_pos % self.page_size, spec.sink_size)

    def reserve_import(self, specs) -> ImportReservation:
        """Validate ``specs`` (see ``check_imports``) and take their pages; the sequences appear
        at ``commit_import``. Nothing changes on error."""
        needs = self.check_imports(specs)
        specs = tuple(ImportSpec(int(s.seq_id), int(s.num_tokens), int(s.window_size),
                                 int(s.sink_size), None if s.parent_id is None else int(s.parent_id),
                                 int(s.fork_pos), int(s.skip)) for s in specs)
        pt, ps = self.pt, self.page_size
        pages = [pt.take_pages(n) for n in needs]
        slots, offsets = [], [0]
        for spec, own in zip(specs, pages):
            offset = spec.fork_pos % ps if spec.parent_id is not None else 0
            slots.append(np.full(spec.skip, -1, np.int32))
            slots.append(token_slots(own, offset, spec.num_tokens, ps))
            offsets.append(offsets[-1] + spec.skip + spec.num_tokens)
        res = ImportReservation(specs, pages,
                                np.concatenate(slots) if slots else np.zeros(0, np.int32),
                                np.asarray(offsets, np.int64), table=pt, key=pt.next_key(),
                                owner=self)
        pt.reserved[res.key] = np.concatenate(pages) if pages else np.zeros(0, np.int32)
        return res

    @query
    def check_reservation(self, res: ImportReservation, what: str) -> None:
        """ForwardStateError unless ``res`` is open on this page table."""
        self._held(res, what)

    def _mine(self, res, what: str) -> None:
        """InvalidArgumentError, touching nothing, unless ``res`` is a reservation of this
        cache (another cache's stays usable there)."""
        if not isinstance(res, ImportReservation):
            raise InvalidArgumentError(
                f"{what}: expected an ImportReservation (from reserve_import), got "
                f"{type(res).__name__}")
        if res.owner is not self:
            raise InvalidArgumentError(
                f"{what}: the import of sequences {res.seq_ids} was reserved on another cache; "
                f"a reservation is committed, written or cancelled on the cache that made it")

    def _held(self, res: ImportReservation, what: str) -> None:
        self._mine(res, what)
        if not res.open:
            raise ForwardStateError(
                f"{what}: the import of sequences {res.seq_ids} was already committed or cancelled")
        if res.table is not self.pt or res.key not in self.pt.reserved:
            res.open = False
            raise ForwardStateError(
                f"{what}: the cache was cleared after the import of sequences {res.seq_ids} was "
                f"reserved; its pages are gone")

    def commit_import(self, res: ImportReservation) -> list[PageCopy]:
        """Make the reserved sequences appear, holding the reserved pages (their K/V written
        at ``res.slots`` by then); returns the partial-page copies of forks for the backend.
        Re-validates first (the cache may have changed since the reservation): on error nothing
        changes and the reservation stays open."""
        self._held(res, "commit_import")
        self.check_imports(res.specs, reserved=True)
        pt, ps = self.pt, self.page_size
        copies: list[PageCopy] = []
        for spec, pages in zip(res.specs, res.pages):
            if spec.parent_id is not None:
                in_page = spec.fork_pos % ps
                copies += self._fork(pt.seqs[spec.parent_id], spec.seq_id, spec.fork_pos,
                                     page=int(pages[0]) if in_page else None)
                seq = pt.seqs[spec.seq_id]
                rest = pages[1:] if in_page else pages
            else:
                seq = pt.add_sequence(spec.seq_id, pt.new_block())
                rest = pages
            b = int(pt.s_last[seq.slot])
            if len(rest):
                pt.push_pages(b, rest)
            pt.b_len[b] += spec.num_tokens
            pt.s_len[seq.slot] += spec.num_tokens
            if spec.window_size != -1:
                trace = pt.trace(seq)
                self._merge_blocks(trace[self._own_blocks(trace):])
                seq.window, seq.sink_request = spec.window_size, spec.sink_size
                pt.s_window[seq.slot] = spec.window_size
        del pt.reserved[res.key]
        res.open = False
        return copies

    def cancel_import(self, res: ImportReservation) -> None:
        """Give a reservation's pages back (nothing else was changed by it)."""
        self._mine(res, "cancel_import")
        if not res.open:
            return
        if res.table is self.pt and res.key in self.pt.reserved:
            self.pt.give_pages(self.pt.reserved.pop(res.key))
        res.open = False

    # ------------------------------------------------------------------ misc
    def clear(self) -> None:
        self.pt = PageTable(self.pt.num_pages, self.page_size)


    # ------------------------------------------------------------------ forwards
    def reserve_forward(self, seqs, last, append, need, slides: dict,
                        slots=None, before=None) -> ForwardUndo:
        """Reserve a forward's tokens: ``need[i]`` new pages for sequence ``seqs[i]`` (last block
        ``last[i]``) and ``append[i]`` tokens; ``slides`` maps the index of each sliding
        sequence to its ``SlidePlan``; ``slots``: the sequences' slots (B,) when known;
        ``before``: (last block lengths, their page counts, sequence lengths) as gathered
        before this call (copies, kept by the undo record), when known. Every
        new page is taken first, then windows slide: a page that slides out goes back to the
        free list but is never handed to this same forward, so an aborted forward has written
        nothing into the rows its sequences keep again. Returns the ``ForwardUndo`` that
        ``rollback_forward`` restores."""
        pt = self.pt
        if slots is None:
            slots = np.array([s.slot for s in seqs], np.int64)
        if before is None:
            before = (pt.b_len[last], pt.b_npages[last], pt.s_len[slots])
        undo = ForwardUndo(pt.num_free, slots, last, before[2], before[0], before[1])
        offsets = np.zeros(len(need) + 1, np.int64)
        np.cumsum(need, out=offsets[1:])
        fresh = pt.take_pages(int(offsets[-1]))
        if not slides:
            grow = np.flatnonzero(need)
            if len(grow):
                blocks, count = last[grow], need[grow]
                have = before[1][grow]
                total = have + count
                room = total <= pt.b_pcap[blocks]
                if not room.all():              # a full region moves first (amortised rare)
                    for j in (~room).nonzero()[0]:
                        pt.ensure_capacity(int(blocks[j]), int(total[j]))
                # sequence i's pages fresh[offsets[i]:offsets[i+1]] follow its last page
                at = np.repeat(pt.b_pstart[blocks] + have - offsets[grow], count)
                at += np.arange(len(fresh))
                pt.page_store[at] = fresh
                pt.b_npages[blocks] = total
            pt.b_len[last] = before[0] + append
            pt.s_len[slots] = before[2] + append
            return undo
        sliding = np.zeros(len(seqs), bool)
        sliding[list(slides)] = True
        for i in np.flatnonzero(need > 0):
            if not sliding[i]:
                pt.push_pages(int(last[i]), fresh[offsets[i]:offsets[i + 1]])
        undo.free_top = pt.free_pages[pt.num_free:undo.num_free].copy()
        slid: list[tuple[int, np.ndarray, int, int]] = []
        undo.slid = slid
        for i in slides:
            b = int(last[i])
            slid.append((b, pt.pages_of(b).copy(), int(pt.b_sink[b]),
                         int(pt.b_window_offset[b])))
            self._slide(seqs[i], int(append[i]), fresh[offsets[i]:offsets[i + 1]])
        plain = np.flatnonzero(~sliding)
        pt.b_len[last[plain]] += append[plain].astype(np.int32)
        pt.s_len[slots[plain]] += append[plain].astype(np.int32)
        return undo

    def extend_trees(self, undo: ForwardUndo, seqs, parents, qo_indptr) -> None:
        """Append each sequence's new token-tree nodes (``parents[qo_indptr[i]:qo_indptr[i+1]]``
        for ``seqs[i]``) to its uncommitted tree; ``undo`` records the sizes before."""
        undo.trees = [(seq, len(seq.tree_parent)) for seq in seqs]
        for i, seq in enumerate(seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            seq.tree_parent.extend(int(p) for p in parents[lo:hi])
            for node in range(len(seq.tree_depth), len(seq.tree_parent)):
                p = seq.tree_parent[node]
                seq.tree_depth.append(0 if p < 0 else seq.tree_depth[p] + 1)
            self.pt.s_tree[seq.slot] = len(seq.tree_parent)

    def rollback_forward(self, undo: ForwardUndo) -> None:
        """Undo a reserved forward: the page table, the free pages and the token trees as they
        were before ``reserve_forward``."""
        pt = self.pt
        pt.b_len[undo.last] = undo.block_len
        pt.b_npages[undo.last] = undo.npages
        pt.s_len[undo.slots] = undo.seq_len
        for b, pages, sink, window_offset in undo.slid:
            pt.set_pages(b, pages)
            pt.b_sink[b], pt.b_window_offset[b] = sink, window_offset
        if undo.free_top is not None:
            pt.free_pages[undo.num_free - len(undo.free_top):undo.num_free] = undo.free_top
        pt.num_free = undo.num_free
        for seq, size in undo.trees:
            del seq.tree_parent[size:], seq.tree_depth[size:]
            pt.s_tree[seq.slot] = size


_bump_epoch_in_mutators(CacheState)
