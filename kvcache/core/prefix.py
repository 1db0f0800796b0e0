"""Automatic prefix caching: an index of full pages keyed by the token ids that produced them.

The index is a tree of *nodes*, one per full page and extra key. A node is filed under its
depth, its own page's ids (int64 bytes) and the extra key's hash; nodes with one such key (the
same page at the same depth after different prefixes, or extra keys with one hash) share it, and
are told apart by the ids of their whole prefix (one byte comparison with the ids the node was
computed from) and the extra key (by equality). So the longest cached prefix of a prompt is a
binary search over the depth, each probe a dict lookup on one page, then one comparison (see
``PrefixIndex.find``), with no pass over the prompt (its host cost is a few microseconds at
1,000 tokens), and no two prefixes can ever be taken for each other.

The pages stay in the page table. A node is *held* by the sequence that computed its page, as
long as that sequence lives (its ``Track``): indexing changes nothing in the page table, so a
sequence's blocks, and the plans built on them, stay as they were. When the sequence is removed,
it becomes a *ghost*: a hidden sequence (keyed by a ``Ghost`` object no caller can name) cut back
to its deepest held page. A new sequence whose tokens match ``m`` pages forks from the holder of
the ``m``-th node, so its whole matched prefix comes from one sequence's pages. Pages that only
ghosts reach are cached: they count as available, and are evicted least recently used, a ghost's
deepest page first, when pages are needed. A sequence that pops (``popn``) pages it holds
hands them to a ghost first; one that slides them out (a window) lets go of their nodes.

Pure Python over the page table (numpy only for counting); no array library.
"""

from __future__ import annotations

import abc
import array
import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np


class Ghost:
    """The key of a hidden sequence that holds cached pages (compared by identity)."""

    __slots__ = ("nodes",)

    def __init__(self, nodes: Optional[set] = None):
        self.nodes: set = set() if nodes is None else nodes     # the nodes this ghost holds

    def __repr__(self) -> str:
        return f"<prefix-cache ghost holding {len(self.nodes)} pages>"


@dataclass(eq=False)
class Track:
    """A real sequence's token record: the ids of its positions as far as the caller told
    them (``tokens``), the index nodes of its full recorded pages (``chain``, whoever holds
    them) and the nodes whose pages are its own (``nodes``); ``owner``: its sequence id."""

    owner: Any
    extra: Any = None
    tokens: array.array = field(default_factory=lambda: array.array("q"))
    chain: list = field(default_factory=list)
    nodes: set = field(default_factory=set)


class Node:
    """One cached full page: ``depth`` pages from the root (1 = the first page); ``key``: where
    the index files it, ``(depth, its page's ids as int64 bytes, _extra_hash(extra))``."""

    __slots__ = ("id", "key", "parent", "depth", "holder", "kids", "tick", "alive", "src", "extra",
                 "wp", "ck")

    def __init__(self, id: int, key: tuple, parent: Optional["Node"], holder: Union[Ghost, Track],
                 src: bytes, extra: Any):
        self.id, self.key, self.parent, self.holder, self.tick = id, key, parent, holder, 0
        self.src = src          # int64 bytes of (at least) the token prefix up to this page
        self.extra = extra      # the extra key it was computed under
        self.depth: int = 1 if parent is None else parent.depth + 1
        self.kids: set = set()  # the nodes one page deeper (their holders may hold copies of this page)
        self.alive = True
        # window groups: per group, the group's page at this node's position that the node
        # holds (-1: none, never stored or reclaimed); see ``PrefixIndex._window_depth``
        self.wp: Optional[list] = None
        # state layers: the checkpoint row holding the states at this node's boundary (-1:
        # none); see ``PrefixIndex._state_depth``
        self.ck = -1


class Prompt:
    """Token ids as the index takes them: ``raw``, their int64 bytes, already checked (ids
    >= 0; a copy, so the caller's object may change later: this does not); ``n``, how many."""

    __slots__ = ("raw", "n")

    def __init__(self, raw: bytes):
        self.raw = raw
        self.n = len(raw) >> 3

    @property
    def ids(self) -> np.ndarray:
        """The ids (a read-only uint64 array)."""
        return np.frombuffer(self.raw, np.uint64)

    def __len__(self) -> int:
        return self.n


def _extra_hash(extra) -> int:
    """The extra key's part of a node's key (extra keys of one hash share it: told apart by
    equality)."""
    return 0 if extra is None else hash(extra)


def _key(holder):
    """The page-table key of a holder."""
    return holder if isinstance(holder, Ghost) else holder.owner


class BasePrefixCache(abc.ABC):
    """What a cache's ``KVManager`` asks of its prefix cache (SGLang's ``BasePrefixCache``):
    ``match`` a prompt, ``insert`` a sequence's full pages, ``release`` a sequence's hold on
    them, ``evict`` cached pages for room. ``PrefixIndex`` implements it."""

    @abc.abstractmethod
    def match(self, prompt: Prompt, extra) -> tuple[int, int]:
        """``(length, pages)``: the longest cached prefix of ``prompt`` under extra key
        ``extra``, in tokens (whole pages, at least one token left uncached), and the cached
        pages a sequence starting from it would hold (taken from the available ones); ``(0,
        0)``: nothing cached. Changes nothing."""

    @abc.abstractmethod
    def insert(self, seq) -> None:
        """Index ``seq``'s full pages whose token ids are recorded and whose KV is stored."""

    @abc.abstractmethod
    def release(self, seq, keep: int = 0) -> None:
        """``seq`` lets go of the indexed pages it holds deeper than ``keep`` pages."""

    @abc.abstractmethod
    def evict(self, pages: int) -> int:
        """Free at least ``pages`` cached pages (fewer when fewer are cached); returns how
        many were freed."""


class PrefixIndex(BasePrefixCache):
    """The index over one ``CacheState`` (see the module docstring)."""

    def __init__(self, state):
        self.state = state
        self.ps = state.page_size
        self.nodes: dict = {}       # Node.key -> the nodes filed there (almost always one)
        self.count = 0              # how many nodes
        self._last = 0              # the depth find's last search ended at: tried first
        self._heap: list = []
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self._evictable: tuple = (None, 0, None)  # ((epoch, version), count, reached blocks)
        # evictions free only pages no real sequence reaches: they leave the plan epoch (and a
        # reused decode plan) alone and bump this instead
        self._version = 0
        # window groups (CacheConfig.layer_kinds): per group, page -> the nodes holding it
        self.groups = state.pt.groups
        self._wnodes: list = []
        self.window_miss_tokens = 0
        """Tokens of cached full pages that attached sequences did not start from because a
        window group's pages for that boundary were no longer held."""
        # state layers: the checkpoint rows (``core.slots.StateCheckpoints``; None: none)
        self.slots = state.slots
        self.ckpts = None if self.slots is None else self.slots.checkpoints
        self.checkpoint_miss_tokens = 0
        """Tokens of cached full pages (whose window pages were held) that attached sequences
        did not start from because no state checkpoint was held at a boundary past them."""
        if self.groups is not None:
            self._wnodes = [{} for _ in self.groups.groups]
            self.groups.reclaim = self._reclaim

    # ------------------------------------------------------------------ lookups
    def match(self, prompt: Prompt, extra) -> tuple[int, int]:
        node = self.find(prompt, extra)
        if node is None:
            return (0, 0)
        pinned = self.pinned(node)
        if self.groups is not None:     # a budget for every group: the most any of them loses
            pinned = max(pinned, *self._window_pinned(node))
        return (node.depth * self.ps, pinned)

    def find(self, prompt: Prompt, extra, windows: bool = True,
             states: bool = True) -> Optional[Node]:
        """The deepest node of the longest cached prefix of ``prompt``, whole pages, leaving at
        least one token uncached (its logits are what a model computes next), that a new
        sequence can fork from (not the pages of a sequence with an uncommitted token tree);
        None: nothing cached. Its depth is the prefix's length in pages. Changes nothing but
        the depth it tries first next time.

        Depth ``d`` is cached when a node filed under the prompt's page ``d`` holds its first
        ``d`` pages; then so is every shallower depth (a node's parent stays while it does), so
        a binary search finds the deepest, trying the whole prompt first (the usual hit), then
        the depth the last search ended at and the one past it (requests sharing a system
        prompt end at its last page: three probes instead of a binary search's log2 of the
        prompt's pages). The search only asks whether anything is filed under a depth's key (a
        cached depth always has one), and the depth it ends at is then checked: when that holds
        the prompt's prefix, no deeper one can (the next depth's key is absent); when it does
        not (a page alike after another prefix), the search runs again checking every probe.
        ``windows`` / ``states``: the match must also restore every window group's pages
        (``_window_depth``) / every state layer's states (``_state_depth``) at its end."""
        ps = self.ps
        pages = (prompt.n - 1) // ps
        nodes = self.nodes
        if pages <= 0 or not nodes:
            return None
        raw, pb = prompt.raw, ps * 8
        xh = _extra_hash(extra)
        end = pages * pb
        filed = nodes.get((pages, raw[end - pb:end], xh))
        if filed is None:
            lo, hi = 0, pages - 1           # depth lo has a key; depth hi + 1 has none
            h = self._last
            if h < hi:      # the depth the last search ended at first (one shared system prompt)
                end = h * pb
                if h and (h, raw[end - pb:end], xh) not in nodes:
                    hi = h - 1
                else:
                    lo = h
                    end += pb
                    if (h + 1, raw[end - pb:end], xh) in nodes:
                        lo = h + 1
                    else:
                        hi = h
            while lo < hi:
                mid = (lo + hi + 1) // 2
                end = mid * pb
                if (mid, raw[end - pb:end], xh) in nodes:
                    lo = mid
                else:
                    hi = mid - 1
            self._last = lo
            if lo == 0:
                return None
            end = lo * pb
            filed = nodes[(lo, raw[end - pb:end], xh)]
        prefix = memoryview(raw)[:end]
        for node in filed:
            if node.src.startswith(prefix) and (node.extra is extra or _same(node.extra, extra)):
                break
        else:
            node = self._find_checking(raw, extra, xh, end // pb - 1)
        seqs = self.state.pt.seqs
        while node is not None and isinstance(node.holder, Track) \
                and not seqs[node.holder.owner].committed:
            node = node.parent
        windows = windows and self.groups is not None
        states = states and self.slots is not None
        while node is not None:     # the deepest node meeting both (each moves it up only)
            at = node
            if windows:
                node = self._window_depth(node)
            if states and node is not None:
                node = self._state_depth(node)
            if node is at:
                break
        return node

    def _state_depth(self, node: Node) -> Optional[Node]:
        """The deepest node on ``node``'s path (itself included) holding a state checkpoint: a
        sequence continuing after its boundary starts from those states. None: no such node."""
        at: Optional[Node] = node
        while at is not None and at.ck < 0:
            at = at.parent
        return at

    def _window_depth(self, node: Node) -> Optional[Node]:
        """The deepest node on ``node``'s path (itself included) whose boundary every window
        group can be restored at: a sequence continuing after position ``P = depth * ps`` sees
        keys from ``P - w`` on in a group of window ``w``, so the nodes of the pages from the
        one holding ``max(0, P - w)`` to the one ending at ``P`` must all hold their group
        page. None: no such node."""
        path: list = []
        at: Optional[Node] = node
        while at is not None:
            path.append(at)
            at = at.parent
        path.reverse()
        ps = self.ps
        runs = []       # per group: runs[j] = held group pages ending at path[j], in a row
        for g, group in enumerate(self.groups.groups):
            run, n = [], 0
            for at in path:
                n = n + 1 if at.wp is not None and at.wp[g] >= 0 else 0
                run.append(n)
            runs.append((group, run))
        for d in range(len(path), 0, -1):
            if all(run[d - 1] >= d - group.first_kept(d * ps) for group, run in runs):
                return path[d - 1]
        return None

    def _window_pinned(self, node: Node) -> list:
        """Per window group, the cached (available) pages attaching ``node``'s prefix would
        make a sequence hold."""
        out = []
        for g, group in enumerate(self.groups.groups):
            first = group.first_kept(node.depth * self.ps)
            pages: list = []
            at: Optional[Node] = node
            while at is not None and at.depth > first:
                assert at.wp is not None        # _window_depth found them all held
                pages.append(at.wp[g])
                at = at.parent
            out.append(sum(1 for p in pages if group.ref[p] == group.cref[p]))
        return out

    def _find_checking(self, raw: bytes, extra, xh: int, hi: int) -> Optional[Node]:
        """``find``'s search checking the prefix at every probe (``raw``: the prompt's ids,
        ``xh``: ``_extra_hash(extra)``); ``hi``: no deeper depth than it is cached."""
        view, pb, nodes = memoryview(raw), self.ps * 8, self.nodes

        def at(depth: int) -> Optional[Node]:
            end = depth * pb
            for node in nodes.get((depth, raw[end - pb:end], xh), ()):
                if node.src.startswith(view[:end]) and _same(node.extra, extra):
                    return node
            return None

        lo, found = 0, None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = at(mid)
            if node is None:
                hi = mid - 1
            else:
                lo, found = mid, node
        return found

    def track(self, seq) -> Track:
        if seq.prefix is None:
            seq.prefix = Track(seq.seq_id)
        return seq.prefix

    # ------------------------------------------------------------------ attach
    def attach(self, seq_id: int, prompt: Prompt, extra) -> int:
        """Add sequence ``seq_id`` (validated by the caller) holding the longest cached prefix
        of ``prompt``; returns its length in tokens."""
        state = self.state
        node = self.find(prompt, extra)
        depth = 0 if node is None else node.depth
        if self.groups is not None or self.slots is not None:
            # the full pages matched further: window, then checkpoint misses
            whole = self._depth(self.find(prompt, extra, False, False))
            windowed = self._depth(self.find(prompt, extra, True, False))
            self.window_miss_tokens += (whole - windowed) * self.ps
            self.checkpoint_miss_tokens += (windowed - depth) * self.ps
        path: list = []
        if self.slots is not None:      # checked by the caller (check_take)
            self.slots.take(seq_id)
            if node is not None:        # it starts from the states at the boundary
                self.slots.restore[seq_id] = node.ck
        if node is not None:
            holder = state.pt.seqs[_key(node.holder)]
            state._fork(holder, seq_id, node.depth * self.ps)   # page-aligned: nothing copied
            tick = next(self._clock)        # _touch(path), in the walk that lists it
            at: Optional[Node] = node
            while at is not None:
                at.tick = tick
                path.append(at)
                at = at.parent
            path.reverse()
            self._pushed(tick, node)
        else:
            state.pt.add_sequence(seq_id, state.pt.new_block())
        if self.groups is not None:     # the window keys a continuation reads (_window_depth)
            for g, group in enumerate(self.groups.groups):
                first = group.first_kept(len(path) * self.ps)
                group.adopt(seq_id, first, [n.wp[g] for n in path[first:]])
        state.epoch += 1
        seq = state.pt.seqs[seq_id]
        seq.prefix = Track(seq_id, extra, array.array("q", prompt.raw), path)
        return len(path) * self.ps

    @staticmethod
    def _depth(node: Optional[Node]) -> int:
        return 0 if node is None else node.depth

    def _touch(self, path: list) -> None:
        """Mark ``path`` used now. The heap holds every ghost's deepest node (the eviction
        candidates; a stale tick is corrected when popped), and is rebuilt when stale entries
        outnumber the nodes."""
        tick = next(self._clock)
        for node in path:
            node.tick = tick
        self._pushed(tick, path[-1])

    def _pushed(self, tick: int, node: Node) -> None:
        """``node``, used at ``tick``, onto the heap (rebuilt when mostly stale)."""
        heap = self._heap
        heapq.heappush(heap, (tick, node.id, node))
        if len(heap) > 2 * self.count + 1024:
            heap[:] = [(n.tick, n.id, n) for filed in self.nodes.values() for n in filed]
            heapq.heapify(heap)

    # ------------------------------------------------------------------ record and index
    def extend(self, seq, prompt: Prompt) -> None:
        """Record the ids of ``seq``'s next positions, then index what is complete."""
        self.track(seq).tokens.frombytes(prompt.raw)
        self.insert(seq)

    def insert(self, seq) -> None:
        """Add ``seq``'s full pages whose tokens are recorded and whose KV is stored (committed,
        no sliding window) to the index; the sequence holds the new nodes."""
        t = seq.prefix
        if t is None or seq.window != -1 or not seq.committed:
            return
        while t.chain and not t.chain[-1].alive:      # evicted (deepest first: a suffix)
            t.chain.pop()
        ps = self.ps
        full = min(int(self.state.pt.s_len[seq.slot]), len(t.tokens)) // ps
        if full <= len(t.chain):
            return
        new = []
        parent = t.chain[-1] if t.chain else None
        src = t.tokens[:full * ps].tobytes()
        pb, nodes, extra, ids, chain = ps * 8, self.nodes, t.extra, self._ids, t.chain
        xh = _extra_hash(extra)
        for d in range(len(chain) + 1, full + 1):
            key = (d, src[(d - 1) * pb:d * pb], xh)
            filed = nodes.get(key)
            if filed is None:
                node = Node(next(ids), key, parent, t, src, extra)
                nodes[key] = [node]
                new.append(node)
            else:       # the one with this page after this parent (a first page: this extra key)
                for node in filed:
                    if node.parent is parent and (parent is not None or _same(node.extra, extra)):
                        break
                else:
                    node = Node(next(ids), key, parent, t, src, extra)
                    filed.append(node)
                    new.append(node)
            chain.append(node)
            parent = node
        if new:
            self.count += len(new)
            t.nodes.update(new)
            for node in new:
                if node.parent is not None:
                    node.parent.kids.add(node)
            if self.groups is not None:
                self._hold_window(seq.seq_id, chain, full)
            self._touch(new)

    def _hold_window(self, sid, chain: list, full: int) -> None:
        """The chain's nodes (of ``sid``'s first ``full`` pages) take the window groups' pages
        ``sid`` still holds at their positions, where they hold none yet: what a sequence
        attached at their boundaries will read (``_window_depth``)."""
        for g, group in enumerate(self.groups.groups):
            first, live = group.first[sid], group.live[sid]
            held = self._wnodes[g]
            for d in range(first + 1, min(full, first + len(live)) + 1):
                node = chain[d - 1]
                if node.wp is None:
                    node.wp = [-1] * len(self.groups.groups)
                if node.wp[g] < 0:
                    page = live[d - 1 - first]
                    node.wp[g] = page
                    group.cache_hold(page)
                    held.setdefault(page, []).append(node)

    def _drop_window(self, node: Node, g: int) -> None:
        """``node`` lets go of its page of window group ``g``."""
        wp = node.wp
        assert wp is not None
        page, wp[g] = wp[g], -1
        nodes = self._wnodes[g][page]
        nodes.remove(node)
        if not nodes:
            del self._wnodes[g][page]
        self.groups.groups[g].cache_drop(page)

    def _reclaim(self, g: int, pages: int) -> None:
        """Free at least ``pages`` of window group ``g``'s cached pages (the group's
        ``available`` covers them), least recently used first, the shallowest of a prefix
        first (fewer boundaries read it), and a few more, at most 64, so that the next forwards
        find free pages. Only the nodes' window pages go: a boundary that needed them is then
        a window miss (``window_miss_tokens``); their full pages stay cached."""
        group = self.groups.groups[g]
        ref, cref = group.ref, group.cref
        cands = [(max(n.tick for n in nodes), min(n.depth for n in nodes), page, nodes)
                 for page, nodes in self._wnodes[g].items() if ref[page] == cref[page]]
        want = len(group.free) + max(pages, min(len(cands), 64, group.num_pages // 32))
        cands.sort(key=lambda c: c[:3])
        for _, _, _, nodes in cands:
            if len(group.free) >= want:
                break
            for node in list(nodes):
                self._drop_window(node, g)

    def truncated(self, seq, keep: Optional[int] = None) -> None:
        """``seq`` now holds fewer tokens (popn), or its ids past ``keep`` are stale (a token
        tree's commit): forget them, and let go of the nodes of pages it no longer has."""
        t = seq.prefix
        if t is None:
            return
        n = int(self.state.pt.s_len[seq.slot])
        n = n if keep is None else min(n, keep)
        del t.tokens[n:]
        del t.chain[n // self.ps:]
        self.release(seq, n // self.ps)

    def detach(self, seq, keep: int) -> None:
        """Before ``seq`` pops back to ``keep`` pages (``popn``): the nodes it holds deeper than
        that go to a ghost forked from it at the deepest, so their pages stay cached (the
        sequence's own copy of a partial page is then written on copy, as for any fork)."""
        t = seq.prefix
        deeper = set() if t is None else {n for n in t.nodes if n.depth > keep}
        if not deeper or seq.window != -1 or not seq.committed:
            return
        ghost = Ghost(deeper)
        t.nodes -= deeper
        deepest = max(deeper, key=lambda n: n.depth)
        self.state._fork(seq, ghost, deepest.depth * self.ps)     # page-aligned: nothing copied
        for node in deeper:
            node.holder = ghost
        heapq.heappush(self._heap, (deepest.tick, deepest.id, deepest))
        self.state.epoch += 1

    def release(self, seq, keep: int = 0) -> None:
        """``seq`` lets go of the nodes it holds deeper than ``keep`` pages (``_drop_chain``)."""
        t = seq.prefix
        if t is not None:
            self._drop_chain(t, [n for n in t.nodes if n.depth > keep])

    def _drop_chain(self, holder: Union[Ghost, Track], nodes: list) -> None:
        """``holder`` gives up ``nodes``, deepest first: a node with children moves to a child's
        holder (whose pages run through a copy of its page), one without leaves the index."""
        for node in sorted(nodes, key=lambda n: -n.depth):
            if node.kids:
                holder.nodes.discard(node)
                node.holder = next(iter(node.kids)).holder
                node.holder.nodes.add(node)
            else:
                self._remove_node(node)

    def forked(self, parent, child, fork_pos: int) -> None:
        """``child`` was forked from ``parent`` at ``fork_pos``: it knows the parent's ids up to
        there (the parent keeps holding their pages)."""
        t = parent.prefix
        if t is None:
            return
        child.prefix = Track(child.seq_id, t.extra, t.tokens[:fork_pos], t.chain[:fork_pos // self.ps])

    def retire(self, seq) -> bool:
        """``seq`` is being removed: when it holds nodes, it becomes their ghost, cut back to the
        deepest of them (True: the caller must not remove it). A sequence with a window or an
        uncommitted token tree lets go of its nodes instead (False)."""
        t = seq.prefix
        if t is None or not t.nodes:
            return False
        if seq.window != -1 or not seq.committed:
            self.release(seq)
            return False
        state, pt = self.state, self.state.pt
        deepest = max(t.nodes, key=lambda n: n.depth)
        excess = int(pt.s_len[seq.slot]) - deepest.depth * self.ps
        if excess > 0:
            state._popn(seq, excess)        # page-aligned: nothing copied
            seq = pt.seqs[t.owner]
        if self.groups is not None:     # the nodes hold the window pages a hit needs
            self.groups.remove(t.owner)
        if self.slots is not None:      # a ghost has no state: its checkpoints are the nodes'
            self.slots.release(t.owner)
        ghost = Ghost(t.nodes)
        for node in t.nodes:
            node.holder = ghost
        pt.seqs[ghost] = pt.seqs.pop(t.owner)
        seq.seq_id, seq.prefix = ghost, None
        heapq.heappush(self._heap, (deepest.tick, deepest.id, deepest))
        state.epoch += 1
        return True

    # ------------------------------------------------------------------ state checkpoints
    def checkpoint_positions(self, seqs: list, lengths: np.ndarray, appends: np.ndarray) -> list:
        """The boundaries a forward passes whose states would be checkpoints: ``(row,
        position)`` pairs, ``row`` indexing ``seqs`` (the forward's sequences, whose lengths
        after it are ``lengths`` and appends ``appends``), ``position`` a multiple of the
        interval in ``(length - append, length]`` up to the recorded ids (so its page can be
        indexed). Changes nothing."""
        assert self.ckpts is not None
        step, out = self.ckpts.interval, []
        lengths = np.asarray(lengths, np.int64)
        starts = lengths - np.asarray(appends, np.int64)
        # most decode steps pass no boundary: only those rows are looked at
        for row in np.flatnonzero(lengths // step > starts // step).tolist():
            seq = seqs[row]
            t = seq.prefix
            if t is None or seq.window != -1 or not seq.committed:
                continue
            end = min(int(lengths[row]), len(t.tokens))
            p = (int(lengths[row]) - int(appends[row])) // step * step + step
            while p <= end:
                out.append((row, p))
                p += step
        return out

    def keep_checkpoints(self, seqs: list, wanted: list) -> list:
        """After a forward's pages joined the index (``insert``): the nodes of the boundaries
        ``wanted`` (``(row, position)`` pairs of ``checkpoint_positions``, ``row`` indexing
        ``seqs``) that hold no checkpoint take a row. Returns ``(index into wanted, row)`` of
        each to write; a boundary whose node holds one already (the same states: the same
        ids) or has left the index is skipped. The deepest boundaries go first: with too few
        rows, the longest prefixes keep theirs (a prompt sent again hits furthest)."""
        ckpts, ps, out, kept = self.ckpts, self.ps, [], set()
        assert ckpts is not None
        for i in range(len(wanted) - 1, -1, -1):
            row, p = wanted[i]
            t = seqs[row].prefix
            d = p // ps
            if t is None or len(t.chain) < d:
                continue
            node = t.chain[d - 1]
            if node.ck >= 0 or not node.alive:
                kept.add(node)
                continue
            ck = ckpts.take(node, kept)
            if ck < 0:
                break
            kept.add(node)
            out.append((i, ck))
        return out

    def checkpoint_at(self, seq, depth: int) -> int:
        """The checkpoint row holding ``seq``'s states after its first ``depth`` pages (the
        node of that page on its chain, alive, with a checkpoint), else -1 (``popn`` to it)."""
        t = seq.prefix
        if self.ckpts is None or t is None or depth < 1 or len(t.chain) < depth:
            return -1
        node = t.chain[depth - 1]
        return node.ck if node.alive and node.depth == depth else -1

    # ------------------------------------------------------------------ files
    def chains(self, tips: Optional[list] = None) -> list:
        """The indexed prefixes as a forest of chains, each written once (the prefix cache's
        files, ``kvcache.prefix_files``): ``(tip, base, parent)`` per chain, parents first.
        ``tip``: the chain's deepest node (its holder's first ``tip.depth`` pages are the
        whole prefix); ``base``: the depth, in pages, at which the chain leaves chain
        ``parent`` (an index into the list; None and 0 for a chain from the root). ``tips``:
        the nodes whose prefixes to cover (None: every node, through the leaves, least
        recently used first). Changes nothing."""
        if tips is None:
            tips = sorted((n for filed in self.nodes.values() for n in filed if not n.kids),
                          key=lambda n: (n.tick, n.id))
        covered: dict = {}      # node -> the chain that holds it
        out: list = []
        for tip in tips:
            path, at = [], tip
            while at is not None and at not in covered:
                path.append(at)
                at = at.parent
            if not path:
                continue
            for node in path:
                covered[node] = len(out)
            out.append((tip, 0, None) if at is None else (tip, at.depth, covered[at]))
        return out

    def holder_key(self, node: Node):
        """The page-table key of the sequence (a real one's id, or a ``Ghost``) whose first
        ``node.depth`` pages hold ``node``'s prefix."""
        return _key(node.holder)

    def adopt(self, seq, prompt: Prompt, extra) -> None:
        """Record ``prompt`` as the ids of ``seq``'s positions under extra key ``extra`` (a
        sequence with none recorded yet: an imported one) and index its full pages; the
        sequence holds the new nodes (``retire`` then leaves them cached)."""
        seq.prefix = Track(seq.seq_id, extra, array.array("q", prompt.raw))
        self.insert(seq)

    # ------------------------------------------------------------------ eviction
    def _length(self, ghost: Ghost) -> int:
        pt = self.state.pt
        return int(pt.s_len[pt.seqs[ghost].slot])

    def _reached(self) -> np.ndarray:
        """Per block: reached by a real sequence (cached by epoch and version)."""
        state = self.state
        key = (state.epoch, self._version)
        if self._evictable[0] == key:
            return self._evictable[2]
        pt = state.pt
        reached = np.zeros(pt.num_blocks, bool)
        ghosts = [s.slot for k, s in pt.seqs.items() if isinstance(k, Ghost)]
        lasts = pt.s_last[:pt.num_slots].copy()
        lasts[ghosts] = -1
        frontier = lasts[lasts >= 0]
        while len(frontier):
            frontier = frontier[~reached[frontier]]
            reached[frontier] = True
            frontier = pt.b_parent[frontier]
            frontier = frontier[frontier >= 0]
        live = pt.b_live[:pt.num_blocks] & ~reached
        count = int(pt.b_npages[:pt.num_blocks][live].sum()) if ghosts else 0
        self._evictable = (key, count, reached)
        return reached

    def evictable(self) -> int:
        """Pages that only ghosts reach: freed by eviction when pages are needed."""
        self._reached()
        return self._evictable[1]

    def pinned(self, node: Optional[Node]) -> int:
        """The evictable pages that attaching the prefix up to ``node`` (``find``; None:
        nothing) would make a sequence hold."""
        if node is None:
            return 0
        reached = self._reached()
        pt = self.state.pt
        left, pinned = node.depth, 0
        for b in pt.trace(pt.seqs[_key(node.holder)]):
            n = min(int(pt.b_npages[b]), left)
            if not reached[b]:
                pinned += n
            left -= n
            if left <= 0:
                break
        return pinned

    def clear(self) -> int:
        """Evict every page that only ghosts reach; returns the pages freed."""
        return self.evict(self.state.pt.num_pages)

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` pages (fewer only when fewer are evictable), least recently
        used first; returns the pages freed. A candidate is a ghost's deepest node whose page no
        other sequence reads: without children it leaves the index; with children (whose
        holders hold copies of its page, computed again) it moves to one of their holders.
        Either way its ghost gives the page back. A ghost's next nodes follow in the same pass
        while they are the least recently used (one ``popn`` per ghost, not per page). Nodes
        skipped because a sequence still reads their page are retried once something was
        freed."""
        pt = self.state.pt
        start = pt.num_free
        while pt.num_free - start < pages:
            skipped, before = [], pt.num_free
            while pt.num_free - start < pages and self._heap:
                entry = heapq.heappop(self._heap)
                tick, _, node = entry
                ghost = node.holder
                if not node.alive or not isinstance(ghost, Ghost):
                    continue        # gone, or a live sequence's: pushed when it retires
                if node.tick != tick:                         # used since: back in its place
                    heapq.heappush(self._heap, (node.tick, node.id, node))
                    continue
                if self._length(ghost) != node.depth * self.ps:
                    continue        # not its ghost's deepest: pushed again when it becomes so
                own = self._own_floor(ghost)
                if own >= node.depth:
                    skipped.append(entry)
                    continue
                limit = self._heap[0][0] if self._heap else None
                floor = max(own, node.depth - (pages - (pt.num_free - start)))
                chain = [node]
                while True:
                    nxt = chain[-1].parent  # the ghost's next deepest node, past others' nodes
                    while nxt is not None and nxt.holder is not ghost:
                        nxt = nxt.parent
                    if nxt is None or nxt.depth <= floor or (limit is not None and nxt.tick > limit):
                        break
                    chain.append(nxt)
                self._drop_chain(ghost, chain)
                self._trim(ghost, nxt)
            for entry in skipped:
                heapq.heappush(self._heap, entry)
            if pt.num_free == before or not skipped:
                break
        if pt.num_free != start:
            self._version += 1
        return pt.num_free - start

    def _own_floor(self, ghost: Ghost) -> int:
        """The depth past which the ghost's pages are its own (no other sequence reads them):
        the start of its trailing blocks that only it references."""
        pt = self.state.pt
        b = int(pt.s_last[pt.seqs[ghost].slot])
        floor = self._length(ghost) // self.ps
        while b != -1 and pt.b_ref[b] == 1:
            if pt.b_len[b] > 0:
                floor = int(pt.b_start[b]) // self.ps
            b = int(pt.b_parent[b])
        return 0 if b == -1 else floor

    def _remove_node(self, node: Node) -> None:
        if node.ck >= 0:                # its checkpoint goes with it
            assert self.ckpts is not None
            self.ckpts.drop(node)
        if node.wp is not None:         # its window pages go with it
            for g, page in enumerate(node.wp):
                if page >= 0:
                    self._drop_window(node, g)
        node.alive = False
        self.count -= 1
        filed = self.nodes[node.key]
        if len(filed) == 1:
            del self.nodes[node.key]
        else:
            filed.remove(node)
        node.holder.nodes.discard(node)
        if node.parent is not None:
            node.parent.kids.discard(node)

    def _trim(self, ghost: Ghost, deepest: Optional[Node]) -> None:
        """Cut a ghost back to ``deepest``, its deepest held node now (None: it holds none and
        goes)."""
        if deepest is None:
            assert not ghost.nodes
            self._drop_ghost(ghost)
            return
        seq = self.state.pt.seqs[ghost]
        excess = self._length(ghost) - deepest.depth * self.ps
        if excess > 0:
            self.state._popn(seq, excess)
            heapq.heappush(self._heap, (deepest.tick, deepest.id, deepest))    # a candidate now

    def _drop_ghost(self, ghost: Ghost) -> None:
        self.state._release(self.state.pt.seqs[ghost])     # its seq_id is the ghost key

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise AssertionError if the index disagrees with the page table (tests call this)."""
        pt = self.state.pt
        pb = self.ps * 8
        assert self.count == sum(map(len, self.nodes.values()))
        for key, filed in self.nodes.items():
            assert filed, f"nothing filed under {key}"
            prefixes = [(n.src[:n.depth * pb], n.extra) for n in filed]
            assert all(a[0] != b[0] or not _same(a[1], b[1])
                       for i, a in enumerate(prefixes) for b in prefixes[:i]), "one prefix twice"
        for node in (n for filed in self.nodes.values() for n in filed):
            end = node.depth * pb
            assert node.alive and node.key == (node.depth, node.src[end - pb:end], _extra_hash(node.extra))
            assert node.parent is None or node.src.startswith(node.parent.src[:end - pb])
            holder = node.holder
            assert _key(holder) in pt.seqs, f"node {node.id} held by a sequence not in the cache"
            assert node in holder.nodes
            if isinstance(holder, Track):
                assert pt.seqs[holder.owner].prefix is holder
            assert int(pt.s_len[pt.seqs[_key(holder)].slot]) >= node.depth * self.ps
            assert node.parent is None or (node.parent.alive and node in node.parent.kids)
        if self.groups is not None:
            for g, group in enumerate(self.groups.groups):
                counted = np.zeros(group.num_pages, np.int64)
                for page, nodes in self._wnodes[g].items():
                    assert nodes and all(n.alive and n.wp[g] == page for n in nodes)
                    counted[page] = len(nodes)
                assert (counted == group.cref).all(), f"group {g}: window holds disagree"
        if self.ckpts is not None:
            self.ckpts.check(n for filed in self.nodes.values() for n in filed if n.ck >= 0)
            assert all(n.depth * self.ps % self.ckpts.interval == 0 for n in self.ckpts.held.values())
        for k, seq in pt.seqs.items():
            if isinstance(k, Ghost):
                assert k.nodes, "a ghost holds no page"
                assert self._length(k) == max(n.depth for n in k.nodes) * self.ps


def _same(a, b) -> bool:
    """Extra keys ``a`` and ``b`` are the same key (equal: the index is a dict of them in
    effect; an ``__eq__`` that raises is a different key)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
