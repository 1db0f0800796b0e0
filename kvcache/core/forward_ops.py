"""A forward's changes to ``CacheState`` (``ForwardOps``): reserving its tokens and pages
(sliding windows as they fill), extending sequences' token trees, and rolling both back when
the forward is aborted (the ``ForwardUndo`` record, ``plan``)."""

from __future__ import annotations

import numpy as np

from .plan import ForwardUndo
from .window import WindowOps


class ForwardOps(WindowOps):
    """Reserving, extending and rolling back a forward (see the module docstring)."""

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
        if undo.groups is not None:
            pt.groups.rollback(undo.groups)
