"""Importing sequences into ``CacheState`` (``ImportOps``), the page-table side of
``imports``' two phases: ``check_imports`` validates specs against the cache and each other,
``reserve_import`` takes their pages, ``commit_import`` makes the sequences appear (a fork of
its parent where a spec names one, with the window enabled where it asks for one) and
``cancel_import`` gives the pages back.
"""

from __future__ import annotations

import numpy as np

from ..errors import (CacheFullError, ForwardStateError, InvalidArgumentError, SequenceExistsError,
                      UnsupportedFeatureError)
from ..errors import pages as n_pages
from .epoch import query
from .imports import ImportReservation, ImportSpec, pages_needed, token_slots
from .sequences import PageCopy
from .validate import INT32_MAX, seq_id_arg
from .validate import int_arg as as_int
from .window import WindowOps


class ImportOps(WindowOps):
    """Validating, reserving, committing and cancelling imports (see the module docstring)."""

    @query
    def check_imports(self, specs, reserved: bool = False) -> list[int]:
        """Validate ``ImportSpec``s (in order; a parent may be an earlier spec) against the cache
        and each other; returns the pages each needs. ``reserved``: the pages are already held
        (a commit re-checks), so free pages are not counted. Raises typed errors naming the
        sequence, the value and the limit."""
        pt, ps = self.pt, self.page_size
        if pt.groups is not None:
            raise UnsupportedFeatureError(
                "importing sequences into a cache with window groups (CacheConfig.layer_kinds): "
                "not composed with window groups yet (docs/hybrid.md)")
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
                f"importing sequences {[s.seq_id for s in specs]} needs {n_pages(sum(needs))} but "
                f"{pt.num_free} of {pt.num_pages} are free (sequence {specs[worst].seq_id} alone "
                f"needs {needs[worst]} for {n_pages(specs[worst].num_tokens, 'token')})")
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
