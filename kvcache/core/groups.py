"""Window groups (``CacheConfig.layer_kinds``): the page pool of each group of windowed layers
and each sequence's *live list* in it (docs/hybrid.md, "Windowed groups").

A window group of window ``w`` (a query at position ``p`` sees keys ``p - w .. p``) stores
position ``p`` of a sequence in the group page that holds positions ``p // page_size *
page_size ..`` (the same page numbering as the sequence's positions). A sequence keeps the
pages from its *first live page* ``first`` up to the page of its last token: ``live`` lists
them, ``len(live) == ceil(length / page_size) - first`` at all times. A page is freed when the
forward that makes the sequence ``length`` long ends and the page's last key lies below
``length - w``: every later query sits at ``length`` or after, so no query sees it again.

The rules, each the same as the full pool's:

* **reserve / rollback**: a forward takes its new pages at ``begin_forward`` (all groups
  counted first, ``CacheFullError`` naming the group before anything changes); an aborted
  forward gives them back in the same free-list order and frees nothing;
* **commit**: ``end_forward`` frees the pages below the window (``commit``); they go on the
  free list and are handed out to later forwards only (the run-ahead rule);
* **fork**: the child keeps the pages from ``max(0, fork_pos - w) // page_size`` on; whole
  pages are shared with a reference count, a partial last page is copied (``PageCopy`` with
  its ``group``); a fork below the parent's window is refused;
* **popn**: keeps ``first`` (refused, UnsupportedFeatureError, when a later query would need a
  key already freed); a partial last page still shared with a fork is copied before it is
  written again.

Host only (numpy and lists); ``WindowGroups.plan`` builds a forward's index arrays per group:
the append slots of its new tokens and one ``HostDepth`` over each sequence's live keys, with
``k_rope_offset`` the first live page's first position (RoPE and ``window_left`` stay exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from ..errors import CacheFullError, InvalidArgumentError, UnsupportedFeatureError
from ..errors import pages as n_pages
from .plan import HostDepth, build


@dataclass(frozen=True)
class GroupSpec:
    """One window group: its window ``w``, its layers and its pool's pages per layer."""

    window: int
    layers: tuple
    num_pages: int

    @property
    def name(self) -> str:
        """How errors and the page queries name the group: ``"window=<w>"``."""
        return f"window={self.window}"


@dataclass(frozen=True)
class GroupPlan:
    """A forward's index arrays of one window group: ``append_slots`` (T,) int32, the group
    slot each new token's K/V is written to, and ``depth``, one entry per sequence over its
    live keys (``HostDepth`` / ``DepthAux``)."""

    append_slots: Any
    depth: Any


class GroupUndo:
    """What a forward's reservation changed in the groups: per group, the live-list lengths
    of its sequences before (``rollback`` pops the pages after them back onto the free list)."""

    __slots__ = ("sids", "before")

    def __init__(self, sids, before):
        self.sids, self.before = sids, before


class WindowGroup:
    """The pool and live lists of one window group (see the module docstring)."""

    def __init__(self, spec: GroupSpec, page_size: int):
        self.spec = spec
        self.window = spec.window
        self.page_size = page_size
        self.num_pages = spec.num_pages
        # free pages: a stack, popped from the end; initial order hands out 0, 1, 2, ...
        self.free: list = list(range(spec.num_pages - 1, -1, -1))
        self.ref = np.zeros(spec.num_pages, np.int32)
        self.first: dict = {}       # sequence id -> index (position // page_size) of its first live page
        self.live: dict = {}        # sequence id -> its live pages, in position order
        # the prefix cache's holds (``core.prefix``): per page, how many index nodes hold it
        # (counted in ``ref`` too); a page only they hold is *cached*: available, reclaimed
        # least recently used through ``WindowGroups.reclaim`` when the free list runs short
        self.cref = np.zeros(spec.num_pages, np.int32)

    # ------------------------------------------------------------------ pages
    def _take(self) -> int:
        page = self.free.pop()
        self.ref[page] = 1
        return page

    def _drop(self, pages) -> None:
        for page in pages:
            self.ref[page] -= 1
            if self.ref[page] == 0:
                self.free.append(page)

    def cache_hold(self, page: int) -> None:
        """The prefix cache holds ``page`` (a sequence's live page) for an index node."""
        self.ref[page] += 1
        self.cref[page] += 1

    def cache_drop(self, page: int) -> None:
        """The prefix cache lets go of ``page`` (freed when nothing else holds it)."""
        self.cref[page] -= 1
        self._drop([page])

    def cached(self) -> int:
        """Pages only the prefix cache holds: available, freed when needed."""
        return int(((self.ref > 0) & (self.ref == self.cref)).sum())

    def available(self) -> int:
        """Free pages plus cached ones."""
        return len(self.free) + (self.cached() if self.cref.any() else 0)

    def first_kept(self, length: int) -> int:
        """The first page a sequence of ``length`` tokens must keep: the one holding position
        ``max(0, length - w)``."""
        return max(0, length - self.window) // self.page_size

    def need(self, sid, length: int, append: int) -> int:
        """New pages a forward appending ``append`` tokens to sequence ``sid`` (``length``
        tokens now) takes."""
        have = self.first[sid] + len(self.live[sid])
        return max(0, -(-(length + append) // self.page_size) - have)

    def full_error(self, need: int, what: str) -> CacheFullError:
        s = self.spec
        return CacheFullError(
            f"{what} needs {n_pages(need, 'new page')} of window group {s.name!r} (layers "
            f"{list(s.layers)}) but {len(self.free)} of its {s.num_pages} are free"
            + (f" and {cached} cached" if (cached := self.cached()) else ""))

    # ------------------------------------------------------------------ sequences
    def add(self, sid) -> None:
        self.first[sid], self.live[sid] = 0, []

    def adopt(self, sid, first: int, pages) -> None:
        """Add sequence ``sid`` holding ``pages`` (the prefix cache's, shared) from page index
        ``first`` on: a sequence attached to a cached prefix."""
        for page in pages:
            self.ref[page] += 1
        self.first[sid], self.live[sid] = first, list(pages)

    def remove(self, sid) -> None:
        self._drop(self.live.pop(sid))
        del self.first[sid]

    def check_fork(self, parent, fork_pos: int) -> int:
        """Pages the fork takes (0 or 1: a partial page's copy); refuses a fork whose child
        would need keys the parent freed."""
        first, ps = self.first[parent], self.page_size
        if first > self.first_kept(fork_pos):
            raise InvalidArgumentError(
                f"fork_pos {fork_pos} of sequence {parent}: window group {self.spec.name!r} "
                f"(layers {list(self.spec.layers)}) has freed its keys below position "
                f"{first * ps}, and a query at {fork_pos} sees keys from "
                f"{max(0, fork_pos - self.window)}; fork at {first * ps + self.window} or later")
        return 1 if fork_pos % ps else 0

    def fork(self, parent, child, fork_pos: int) -> list:
        """Share the parent's whole pages from the child's first kept page to ``fork_pos``;
        copy a partial last page: returns ``(src, dst, rows)`` of that copy, or nothing."""
        ps = self.page_size
        first_p, live_p = self.first[parent], self.live[parent]
        first_c = self.first_kept(fork_pos)
        whole = fork_pos // ps
        shared = live_p[first_c - first_p:whole - first_p]
        for page in shared:
            self.ref[page] += 1
        pages = list(shared)
        copies = []
        if fork_pos % ps:
            dst = self._take()
            copies.append((live_p[whole - first_p], dst, fork_pos % ps))
            pages.append(dst)
        self.first[child], self.live[child] = first_c, pages
        return copies

    def check_popn(self, sid, length: int, n: int) -> int:
        """Pages popn takes (0 or 1: a shared partial page's copy); refuses a popn below the
        window (UnsupportedFeatureError)."""
        new_len, ps = length - n, self.page_size
        first = self.first[sid]
        if n and first > self.first_kept(new_len):
            raise UnsupportedFeatureError(
                f"popn {n} on sequence {sid} (length {length}) below the window: window group "
                f"{self.spec.name!r} (layers {list(self.spec.layers)}) has freed its keys below "
                f"position {first * ps}, and a query at {new_len} would see keys from "
                f"{max(0, new_len - self.window)}; pop at most "
                f"{max(0, length - (first * ps + self.window))} tokens")
        if n and new_len % ps and self.ref[self.live[sid][new_len // ps - first]] > 1:
            return 1
        return 0

    def popn(self, sid, length: int, n: int) -> list:
        """Drop the pages past the new end; copy a shared partial last page (returns the copy
        as ``(src, dst, rows)``)."""
        if not n:
            return []
        new_len, ps = length - n, self.page_size
        first, live = self.first[sid], self.live[sid]
        keep = -(-new_len // ps) - first
        self._drop(live[keep:])
        del live[keep:]
        copies = []
        if new_len % ps and self.ref[live[-1]] > 1:
            src = live[-1]
            dst = self._take()
            self._drop([src])
            live[-1] = dst
            copies.append((src, dst, new_len % ps))
        return copies

    def commit(self, sid, length: int) -> None:
        """The forward that made ``sid`` ``length`` long ended: free the pages below its
        window."""
        first = self.first[sid]
        drop = self.first_kept(length) - first
        if drop > 0:
            live = self.live[sid]
            self._drop(live[:drop])
            del live[:drop]
            self.first[sid] = first + drop

    def held(self, sid) -> tuple[int, int]:
        """(first position kept, pages held) of sequence ``sid``."""
        return self.first[sid] * self.page_size, len(self.live[sid])

    def check_invariants(self, lengths: dict) -> None:
        """AssertionError if this group's accounting is broken: ``lengths`` maps each sequence
        id of the cache to its length (the prefix cache's ghosts, keys that are not ints, hold
        no window pages of their own: the index's nodes do, counted in ``cref``)."""
        ps, s = self.page_size, self.spec.name
        lengths = {k: n for k, n in lengths.items() if isinstance(k, (int, np.integer))}
        assert set(self.live) == set(lengths) == set(self.first), (
            f"group {s}: sequences {sorted(self.live)} != the cache's {sorted(lengths)}")
        counts = np.zeros(self.num_pages, np.int64)
        for sid, live in self.live.items():
            length, first = lengths[sid], self.first[sid]
            assert first <= self.first_kept(length), (
                f"group {s}: sequence {sid} of length {length} freed keys from its window "
                f"(first live page {first})")
            assert len(live) == -(-length // ps) - first, (
                f"group {s}: sequence {sid} of length {length} holds {len(live)} pages from "
                f"page {first}")
            np.add.at(counts, np.asarray(live, np.int64), 1)
        assert (self.cref >= 0).all(), f"group {s}: a negative prefix-cache hold"
        counts += self.cref
        free = np.asarray(self.free, np.int64)
        assert len(np.unique(free)) == len(free), f"group {s}: a page is free twice"
        assert not counts[free].any(), f"group {s}: a page is both free and held"
        assert (counts == self.ref).all(), f"group {s}: reference counts disagree"
        assert int((counts > 0).sum()) + len(free) == self.num_pages, (
            f"group {s}: free {len(free)} + held {int((counts > 0).sum())} != {self.num_pages}")


class WindowGroups:
    """Every window group of a cache (``groups``, in ``CacheConfig.window_groups`` order)."""

    def __init__(self, specs, page_size: int):
        self.specs = tuple(specs)
        self.page_size = page_size
        self.groups = [WindowGroup(spec, page_size) for spec in self.specs]
        # ``reclaim(g, pages)``: frees at least ``pages`` of group ``g``'s cached pages (the
        # prefix cache sets it; None: nothing is ever cached)
        self.reclaim: Optional[Callable[[int, int], None]] = None

    def fresh(self) -> WindowGroups:
        """Empty groups of the same shape (``clear``)."""
        return WindowGroups(self.specs, self.page_size)

    # ------------------------------------------------------------------ sequences
    def add(self, sid) -> None:
        for g in self.groups:
            g.add(sid)

    def remove(self, sid) -> None:
        for g in self.groups:
            g.remove(sid)

    def _make_room(self, i: int, need: int) -> None:
        """Group ``i`` is about to take ``need`` pages (its ``available`` covers them): reclaim
        cached pages for what its free list lacks."""
        g = self.groups[i]
        if need > len(g.free):
            assert self.reclaim is not None
            self.reclaim(i, need - len(g.free))

    def check_fork(self, parent, fork_pos: int) -> None:
        for g in self.groups:
            if g.check_fork(parent, fork_pos) > g.available():
                raise g.full_error(1, f"forking sequence {parent} at {fork_pos} (a partial page)")

    def fork(self, parent, child, fork_pos: int) -> list:
        """``[(group index, src, dst, rows)]``: the partial pages to copy."""
        for i in range(len(self.groups)):
            self._make_room(i, 1 if fork_pos % self.page_size else 0)
        return [(i, *c) for i, g in enumerate(self.groups)
                for c in g.fork(parent, child, fork_pos)]

    def check_popn(self, sid, length: int, n: int) -> None:
        for g in self.groups:
            if g.check_popn(sid, length, n) > g.available():
                raise g.full_error(1, f"popn {n} on sequence {sid} (a shared partial page)")

    def popn(self, sid, length: int, n: int) -> list:
        for i, g in enumerate(self.groups):
            self._make_room(i, g.check_popn(sid, length, n))
        return [(i, *c) for i, g in enumerate(self.groups) for c in g.popn(sid, length, n)]

    # ------------------------------------------------------------------ forwards
    def need(self, sids, lengths, append) -> list:
        """Per group, the new pages a forward appending ``append[i]`` tokens to ``sids[i]``
        (``lengths[i]`` tokens now) takes."""
        return [sum(g.need(s, int(n), int(a)) for s, n, a in zip(sids, lengths, append))
                for g in self.groups]

    def check_room(self, sids, lengths, append, what: str = "forward") -> None:
        """CacheFullError naming the first group whose free pages do not cover the forward."""
        for g, need in zip(self.groups, self.need(sids, lengths, append)):
            if need > g.available():
                raise g.full_error(need, what)

    def reserve(self, sids, lengths, append) -> GroupUndo:
        """Take the forward's new pages (``check_room`` passed: cached pages are reclaimed
        first where the free ones fall short); returns the undo record."""
        for i, need in enumerate(self.need(sids, lengths, append)):
            self._make_room(i, need)
        before = []
        for g in self.groups:
            sizes = []
            for s, n, a in zip(sids, lengths, append):
                live = g.live[s]
                sizes.append(len(live))
                for _ in range(g.need(s, int(n), int(a))):
                    live.append(g._take())
            before.append(sizes)
        return GroupUndo(list(sids), before)

    def rollback(self, undo: GroupUndo) -> None:
        """Give back what ``reserve`` took, restoring the free lists' order."""
        for g, sizes in zip(self.groups, undo.before):
            for s, size in reversed(list(zip(undo.sids, sizes))):
                live = g.live[s]
                taken = live[size:]
                del live[size:]
                for page in reversed(taken):
                    g.ref[page] = 0
                    g.free.append(page)

    def commit(self, sids, lengths) -> None:
        """``end_forward``: free each group's pages below the window of ``sids`` (lengths after
        the forward)."""
        for g in self.groups:
            for s, n in zip(sids, lengths):
                g.commit(s, int(n))

    def plan(self, sids, lengths, append, qo_indptr, through_new: bool) -> tuple:
        """One ``GroupPlan`` per group for a reserved forward: ``lengths`` before it, ``append``
        its new tokens, ``qo_indptr`` its query rows; ``through_new``: the depth covers the new
        tokens too (a paged-only decode plan, K/V written first), else the history only."""
        ps = self.page_size
        batch = len(sids)
        lengths = np.asarray(lengths, np.int64)
        append = np.asarray(append, np.int64)
        ends = lengths + append if through_new else lengths
        total = int(append.sum())
        seq_of_token = np.repeat(np.arange(batch), append)
        positions = (lengths - qo_indptr[:-1])[seq_of_token] + np.arange(total)
        qo = np.asarray(qo_indptr, np.int32)
        is_decode = total == batch
        out = []
        for g in self.groups:
            firsts = np.fromiter((g.first[s] for s in sids), np.int64, batch)
            counts = -(-ends // ps) - firsts
            lists = [g.live[s] for s in sids]
            flat = np.fromiter((p for live in lists for p in live), np.int64,
                               sum(len(live) for live in lists))
            offsets = np.zeros(batch + 1, np.int64)
            np.cumsum([len(live) for live in lists], out=offsets[1:])
            # new token t of sequence i: its page is live[i][pos // ps - first[i]]
            page = flat[offsets[:-1][seq_of_token] + positions // ps - firsts[seq_of_token]]
            slots = (page * ps + positions % ps).astype(np.int32)
            page_indptr = np.zeros(batch + 1, np.int64)
            np.cumsum(counts, out=page_indptr[1:])
            # entry i reads the first counts[i] of its live pages
            take = flat[np.repeat(offsets[:-1] - page_indptr[:-1], counts)
                        + np.arange(int(page_indptr[-1]))]
            kv_len = ends - firsts * ps
            last_page_len = np.where(kv_len > 0, (kv_len - 1) % ps + 1, 0)
            zeros = np.zeros(batch, np.int32)
            depth = build(
                HostDepth, qo_indptr=qo, page_indptr=page_indptr.astype(np.int32),
                page_indices=take.astype(np.int32), last_page_len=last_page_len.astype(np.int32),
                kv_len=kv_len.astype(np.int32), sink_size=zeros, window_offset=zeros,
                k_rope_offset=(firsts * ps).astype(np.int32), num_entries=batch,
                use_decode=bool(is_decode), tree=None,
                max_kv_len=int(kv_len.max()) if batch else 0,
                max_qo_len=int(append.max()) if batch else 0,
                num_pages=int(page_indptr[-1]), covers_rows=True)
            out.append(GroupPlan(slots, depth))
        return tuple(out)

    # ------------------------------------------------------------------ queries
    def held(self, sid) -> dict:
        """{group name: (first position kept, pages held)} of sequence ``sid``."""
        return {g.spec.name: g.held(sid) for g in self.groups}

    def free_pages(self) -> dict:
        """{group name: available pages}: free ones and those only the prefix cache holds
        (reclaimed when needed)."""
        return {g.spec.name: g.available() for g in self.groups}

    def check_invariants(self, lengths: dict) -> None:
        for g in self.groups:
            g.check_invariants(lengths)


def group_specs(config) -> Optional[tuple]:
    """The ``GroupSpec`` of each window group of ``config`` (None: no window groups)."""
    if not config.window_groups:        # (state layers alone: core.slots, no page pools)
        return None
    return tuple(GroupSpec(kind.size, layers, config.window_group_pages(g))
                 for g, (kind, layers) in enumerate(config.window_groups))
