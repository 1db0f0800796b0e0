"""Automatic prefix caching: an index of full pages keyed by the token ids that produced them.

The index is a tree of *nodes*, one per full page: a node's key is (its parent node, the extra
key, the page's token ids), so a chain of nodes spells a token prefix page by page and lookups
compare token ids exactly (no hash can collide into a wrong prefix).

The pages themselves stay in the page table. A node is *held* by a ghost: a hidden sequence
(keyed by a ``Ghost`` object no caller can name) forked from the sequence that computed the
page, ending at that sequence's last indexed page. Sharing works as for any fork: a new
sequence whose tokens match ``m`` pages is forked from the holder of the ``m``-th node, so its
whole matched prefix comes from one sequence's pages. Pages that only ghosts reach are cached:
they count as available, and are evicted least recently used (leaf nodes first, the tail page
of their ghost) when pages are needed. A real sequence never holds a node, so removing, popping
or forking it needs no index update beyond its own token record.

Pure Python over the page table (numpy only for counting); no array library.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


class Ghost:
    """The key of a hidden sequence that holds cached pages (compared by identity)."""

    __slots__ = ("nodes",)

    def __init__(self):
        self.nodes: set = set()         # the nodes this ghost holds

    def __repr__(self) -> str:
        return f"<prefix-cache ghost holding {len(self.nodes)} pages>"


class Node:
    """One cached full page: ``depth`` pages from the root (1 = the first page)."""

    __slots__ = ("id", "key", "parent", "depth", "holder", "children", "tick", "alive")

    def __init__(self, id: int, key: tuple, parent: Optional["Node"], holder: Ghost, tick: int):
        self.id, self.key, self.parent, self.holder, self.tick = id, key, parent, holder, tick
        self.depth: int = 1 if parent is None else parent.depth + 1
        self.children = 0
        self.alive = True


@dataclass
class Track:
    """A real sequence's token record: the ids of its positions as far as the caller told
    them (``tokens``), the index nodes of its full recorded pages (``chain``), and the ghost
    that holds the pages it added to the index (None before it added any, or once it popped
    below that ghost's end)."""

    extra: Any = None
    tokens: list = field(default_factory=list)
    chain: list = field(default_factory=list)
    ghost: Optional[Ghost] = None


class PrefixIndex:
    """The index over one ``CacheState`` (see the module docstring)."""

    def __init__(self, state):
        self.state = state
        self.ps = state.page_size
        self.nodes: dict = {}
        self._heap: list = []
        self._clock = itertools.count(1)
        self._ids = itertools.count()
        self._evictable: tuple = (-1, 0)        # (epoch, count)

    # ------------------------------------------------------------------ lookups
    def _page_key(self, parent: Optional[Node], extra, tokens, d: int) -> tuple:
        ps = self.ps
        return (-1 if parent is None else parent.id, extra, tuple(tokens[d * ps:(d + 1) * ps]))

    def match(self, tokens, extra) -> list:
        """The nodes of the longest cached prefix of ``tokens``, whole pages, leaving at least
        one token uncached (its logits are what a model computes next)."""
        path: list = []
        parent = None
        for d in range((len(tokens) - 1) // self.ps):
            node = self.nodes.get(self._page_key(parent, extra, tokens, d))
            if node is None:
                break
            path.append(node)
            parent = node
        return path

    def track(self, seq) -> Track:
        if seq.prefix is None:
            seq.prefix = Track()
        return seq.prefix

    # ------------------------------------------------------------------ attach
    def attach(self, seq_id: int, tokens: list, extra) -> int:
        """Add sequence ``seq_id`` (validated by the caller) holding the longest cached prefix
        of ``tokens``; returns its length in tokens."""
        state = self.state
        path = self.match(tokens, extra)
        if path:
            holder = state.pt.seqs[path[-1].holder]
            state._fork(holder, seq_id, len(path) * self.ps)    # page-aligned: nothing copied
            self._touch(path)
        else:
            state.pt.add_sequence(seq_id, state.pt.new_block())
        state.epoch += 1
        seq = state.pt.seqs[seq_id]
        seq.prefix = Track(extra, list(tokens), list(path))
        return len(path) * self.ps

    def _touch(self, path: list) -> None:
        tick = next(self._clock)
        for node in path:
            node.tick = tick
        heapq.heappush(self._heap, (tick, path[-1].id, path[-1]))

    # ------------------------------------------------------------------ record and index
    def extend(self, seq, tokens: list) -> None:
        """Record the ids of ``seq``'s next positions, then index what is complete."""
        self.track(seq).tokens.extend(tokens)
        self.index(seq)

    def index(self, seq) -> None:
        """Add ``seq``'s full pages whose tokens are recorded and whose KV is stored (committed,
        no sliding window) to the index; a new node is held by the sequence's ghost, forked
        anew at its last indexed page."""
        t = seq.prefix
        if t is None or seq.window != -1 or not seq.committed:
            return
        while t.chain and not t.chain[-1].alive:      # evicted (leaves first: a suffix)
            t.chain.pop()
        pt, ps = self.state.pt, self.ps
        full = min(int(pt.s_len[seq.slot]), len(t.tokens)) // ps
        if full <= len(t.chain):
            return
        new = []
        parent = t.chain[-1] if t.chain else None
        for d in range(len(t.chain), full):
            key = self._page_key(parent, t.extra, t.tokens, d)
            node = self.nodes.get(key)
            if node is None:
                node = Node(next(self._ids), key, parent, t.ghost, 0)   # holder set below
                self.nodes[key] = node
                if parent is not None:
                    parent.children += 1
                new.append(node)
            t.chain.append(node)
            parent = node
        if not new:
            return
        ghost = Ghost()
        self.state._fork(seq, ghost, new[-1].depth * ps)      # page-aligned: nothing copied
        old = t.ghost
        if old is not None:                                   # its pages are a prefix of ours
            for node in old.nodes:
                node.holder = ghost
            ghost.nodes = old.nodes
            self._drop_ghost(old)
        for node in new:
            node.holder = ghost
            ghost.nodes.add(node)
        t.ghost = ghost
        self._touch(new)
        self.state.epoch += 1

    def truncated(self, seq, keep: Optional[int] = None) -> None:
        """``seq`` now holds fewer tokens (popn): forget recorded ids past its end (or past
        ``keep``); its ghost keeps the pages it holds, as a cache entry of its own."""
        t = seq.prefix
        if t is None:
            return
        n = int(self.state.pt.s_len[seq.slot])
        del t.tokens[n if keep is None else min(n, keep):]
        del t.chain[n // self.ps:]
        if t.ghost is not None and self._length(t.ghost) > n:
            t.ghost = None

    def forked(self, parent, child, fork_pos: int) -> None:
        """``child`` was forked from ``parent`` at ``fork_pos``: it knows the parent's ids up to
        there."""
        t = parent.prefix
        if t is None:
            return
        child.prefix = Track(t.extra, t.tokens[:fork_pos], t.chain[:fork_pos // self.ps])

    # ------------------------------------------------------------------ eviction
    def _length(self, ghost: Ghost) -> int:
        pt = self.state.pt
        return int(pt.s_len[pt.seqs[ghost].slot])

    def evictable(self) -> int:
        """Pages that only ghosts reach: freed by eviction when pages are needed."""
        state = self.state
        if self._evictable[0] == state.epoch:
            return self._evictable[1]
        pt = state.pt
        count = 0
        ghosts = [s.slot for k, s in pt.seqs.items() if isinstance(k, Ghost)]
        if ghosts:
            lasts = pt.s_last[:pt.num_slots].copy()
            lasts[ghosts] = -1
            reached = np.zeros(pt.num_blocks, bool)
            frontier = lasts[lasts >= 0]
            while len(frontier):
                frontier = frontier[~reached[frontier]]
                reached[frontier] = True
                frontier = pt.b_parent[frontier]
                frontier = frontier[frontier >= 0]
            live = pt.b_live[:pt.num_blocks] & ~reached
            count = int(pt.b_npages[:pt.num_blocks][live].sum())
        self._evictable = (state.epoch, count)
        return count

    def evict(self, pages: int) -> int:
        """Free at least ``pages`` pages (fewer only when fewer are evictable), least recently
        used leaf pages first; returns the pages freed."""
        pt = self.state.pt
        start = pt.num_free
        skipped = []
        while pt.num_free - start < pages and self._heap:
            entry = heapq.heappop(self._heap)
            tick, _, node = entry
            if not node.alive or node.children or node.tick != tick:
                continue                                      # stale entry
            ghost = node.holder
            if not self._tail_is_own(ghost):
                skipped.append(entry)                         # a sequence still reads it
                continue
            self._remove_node(node)
            self._trim(ghost)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if pt.num_free != start:
            self.state.epoch += 1
        return pt.num_free - start

    def _tail_is_own(self, ghost: Ghost) -> bool:
        """Whether the ghost's last page is reached by no other sequence."""
        pt = self.state.pt
        b = int(pt.s_last[pt.seqs[ghost].slot])
        while b != -1 and pt.b_len[b] == 0 and pt.b_ref[b] == 1:
            b = int(pt.b_parent[b])
        return b != -1 and pt.b_ref[b] == 1

    def _remove_node(self, node: Node) -> None:
        node.alive = False
        del self.nodes[node.key]
        node.holder.nodes.discard(node)
        parent = node.parent
        if parent is not None:
            parent.children -= 1
            if not parent.children:
                heapq.heappush(self._heap, (parent.tick, parent.id, parent))

    def _trim(self, ghost: Ghost) -> None:
        """Cut a ghost back to its deepest held page (dropping it when it holds none)."""
        if not ghost.nodes:
            self._drop_ghost(ghost)
            return
        keep = max(n.depth for n in ghost.nodes) * self.ps
        seq = self.state.pt.seqs[ghost]
        excess = self._length(ghost) - keep
        if excess > 0:
            self.state._popn(seq, excess)

    def _drop_ghost(self, ghost: Ghost) -> None:
        pt = self.state.pt
        seq = pt.seqs[ghost]
        b = int(pt.s_last[seq.slot])
        while b != -1 and pt.b_ref[b] == 1:
            parent = int(pt.b_parent[b])
            pt.free_block(b)
            b = parent
        if b != -1:
            pt.b_ref[b] -= 1
        pt.drop_sequence(ghost)

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise AssertionError if the index disagrees with the page table (tests call this)."""
        pt = self.state.pt
        for key, node in self.nodes.items():
            assert node.alive and node.key == key
            assert node.holder in pt.seqs, f"node {node.id} held by a ghost not in the cache"
            assert node in node.holder.nodes
            assert self._length(node.holder) >= node.depth * self.ps
            assert node.parent is None or node.parent.alive
        for k, seq in pt.seqs.items():
            if isinstance(k, Ghost):
                assert k.nodes, "a ghost holds no page"
                assert self._length(k) == max(n.depth for n in k.nodes) * self.ps
