"""Decode steps without the general planner: the first step of a batch of unshared sequences
in a fixed number of numpy calls (``first_step``), and a repeat of the last decode batch as an
update of its plan (``DecodeReuse.next_step``), valid while no structural change bumped the
state's epoch: then only each sequence's last block grows, by one token, and that block ends
exactly one entry (of one depth) which holds only that sequence.

A decode step changes the page table directly (last blocks' lengths and pages, sequence
lengths), without bumping the epoch: the reused plan accounts for exactly that change.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import CacheFullError
from ..errors import pages as n_pages
from .depths import DepthLastBlocks, decode_kernel_wins
from .plan import ForwardPlan, ForwardUndo, HostDepth, TokenArrays, evolve


def reserve_pages(pt, page_size, seq_ids, last, blen, npages) -> np.ndarray:
    """Batch indices of the sequences whose last page is full (each needs one new page);
    raises CacheFullError, having changed nothing, when the free pages do not cover them."""
    grow = np.flatnonzero(blen == npages * page_size)
    if len(grow) > pt.num_free:
        raise CacheFullError(
            f"forward needs {n_pages(len(grow), 'new page')} but {pt.num_free} of {pt.num_pages} "
            f"are free (sequence {seq_ids[int(grow[0])]} alone needs 1 for 1 token)")
    return grow


def take_pages(pt, last, npages, grow) -> np.ndarray:
    """Take one page for each growing sequence and append it to its last block's region
    (vectorised: per-sequence Python only where a region is full and must move)."""
    fresh = pt.take_pages(len(grow))
    grown = last[grow]
    before = npages[grow]
    room = before < pt.b_pcap[grown]
    if room.all():                              # the common case: every region has room
        pt.page_store[pt.b_pstart[grown] + before] = fresh
        pt.b_npages[grown] = before + 1
        return fresh
    fits = grown[room]
    pt.page_store[pt.b_pstart[fits] + npages[grow][room]] = fresh[room]
    pt.b_npages[fits] += 1
    for j in np.flatnonzero(~room):             # a full region moves (amortised rare)
        pt.push_pages(int(grown[j]), fresh[j:j + 1])
    return fresh


def append_pages(indptr: np.ndarray, indices: np.ndarray, entries: np.ndarray,
                 pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR page lists with ``pages[i]`` appended to entry ``entries[i]`` (entries ascending, so
    each insert lands after the ones before it): one masked scatter, no per-entry Python."""
    ends = entries + 1
    at = indptr[ends] + np.arange(len(entries))          # where the new pages land
    keep = np.ones(len(indices) + len(entries), bool)
    keep[at] = False
    grown = np.empty(len(keep), np.int32)
    grown[keep] = indices
    grown[at] = pages
    shift = np.zeros(len(indptr), np.int32)
    shift[ends] = 1
    return indptr + np.cumsum(shift, dtype=np.int32), grown


def first_step(pt, page_size, seq_ids, slots, last) -> tuple[ForwardPlan, list]:
    """First step of a decode batch whose sequences are one block each (no shared prefix): the
    general planner's plan (tested equal) and ``DepthLastBlocks``, in a fixed number of numpy
    calls."""
    batch = len(seq_ids)
    blen = pt.b_len[last]
    npages = pt.b_npages[last]
    grow = reserve_pages(pt, page_size, seq_ids, last, blen, npages)
    undo = ForwardUndo(pt.num_free, slots, last, pt.s_len[slots], blen, npages)
    if len(grow):
        take_pages(pt, last, npages, grow)
        npages = pt.b_npages[last]
    pt.b_len[last] = blen + 1
    pt.s_len[slots] = undo.seq_len + 1
    kv_len = blen + 1
    in_page = blen % page_size
    page_indptr = np.zeros(batch + 1, np.int32)
    np.cumsum(npages, out=page_indptr[1:])
    before = page_indptr[:-1].astype(np.int64)
    store = np.repeat(pt.b_pstart[last] - before, npages) + np.arange(int(page_indptr[-1]))
    page_indices = pt.page_store[store]
    qo = np.arange(batch + 1, dtype=np.int32)
    zeros = np.zeros(batch, np.int32)
    num_pages = int(page_indptr[-1])
    depth = HostDepth(qo_indptr=qo, page_indptr=page_indptr, page_indices=page_indices,
                      last_page_len=in_page + 1, kv_len=kv_len, sink_size=zeros,
                      window_offset=zeros, k_rope_offset=zeros, num_entries=batch,
                      use_decode=True, max_kv_len=int(kv_len.max()), max_qo_len=1,
                      num_pages=num_pages, covers_rows=True)
    tokens = TokenArrays(qo_indptr=qo, q_positions=blen,
                         append_slots=page_indices[page_indptr[1:] - 1] * page_size + in_page,
                         k_rope_offset=blen)
    plan = ForwardPlan(seq_ids=seq_ids, append_lengths=np.ones(batch, np.int64),
                       total_tokens=batch, max_append=1, paged_only=True, write_after=False,
                       tokens=tokens, depths=(depth,), undo=undo)
    everyone = np.arange(batch)
    return plan, [DepthLastBlocks(everyone, everyone, num_pages, num_pages, np.ones(batch, bool))]


class DecodeReuse:
    """A decode batch's last plan, updated step to step (see the module docstring).

    ``epoch``: the state's epoch the plan was built at; ``holders``: per depth, its
    ``DepthLastBlocks``; ``flat``: the depth holding every last block with entry ``i`` =
    sequence ``i`` (no shared prefix, a shared prefix in the depths above, or static-shape
    decode), or None.
    """

    def __init__(self, plan: ForwardPlan, epoch: int, slots, last, holders: list,
                 keep_choice: bool):
        self.plan, self.epoch, self.slots, self.last = plan, epoch, slots, last
        self.seq_ids = plan.seq_ids
        self.holders = holders
        self.keep_choice = keep_choice  # static-shape decode: the flat choice never flips
        batch = len(slots)
        everyone = np.arange(batch)
        self.flat: Optional[int] = None
        held = [d for d, h in enumerate(holders) if len(h.seq_index)]
        if len(held) == 1:
            d = held[0]
            h, depth = holders[d], plan.depths[d]
            if (len(h.seq_index) == batch and depth.tree is None and depth.num_entries == batch
                    and np.array_equal(h.seq_index, everyone)
                    and np.array_equal(h.entry_index, everyone)):
                self.flat = d
        self.frames: Optional[tuple[_Frame, _Frame]] = None
        self.page_lists: Optional[_PageLists] = None
        if self.flat is not None:
            self.frames, self.page_lists = (_Frame(batch), _Frame(batch)), _PageLists(batch)
        self.turn = 0

    def _growth(self, grow, batch):
        """New pages per depth when sequences ``grow`` gain a page, or None when a depth's
        coalescing choice would flip (the plan must be rebuilt)."""
        holders = self.holders
        if len(holders) == 1:
            counts = [len(grow)]
        elif self.flat is not None:         # only the depth holding every last block grows
            counts = [0] * len(holders)
            counts[self.flat] = int(np.count_nonzero(holders[self.flat].own_block[grow]))
        else:
            grew = np.zeros(batch, bool)
            grew[grow] = True
            counts = [int(np.count_nonzero(grew & h.own_block)) for h in holders]
        if not self.keep_choice:
            for h, g, depth in zip(holders, counts, self.plan.depths):
                if g and decode_kernel_wins(h.pages + g, h.grouped_pages + g) != depth.use_decode:
                    return None
        return counts

    def _claim(self, pt, last, npages, grow):
        """The new pages of the sequences ``grow`` (one each; the holders' page counts updated),
        or None when a depth's coalescing choice would flip (the plan must be rebuilt)."""
        counts = self._growth(grow, len(last))
        if counts is None:
            return None
        for h, g in zip(self.holders, counts):
            h.pages += g
            h.grouped_pages += g
        return take_pages(pt, last, npages, grow)

    def next_step(self, pt, page_size):
        """The next step's plan, the page table updated; None, having changed nothing, when a
        depth's coalescing choice would flip."""
        if self.flat is not None:
            return self._flat_next(pt, page_size)
        last, slots = self.last, self.slots
        blen = pt.b_len[last]
        npages = pt.b_npages[last]
        grow = reserve_pages(pt, page_size, self.seq_ids, last, blen, npages)
        undo = ForwardUndo(pt.num_free, slots, last, pt.s_len[slots], blen, npages)
        fresh = None
        if len(grow):
            fresh = self._claim(pt, last, npages, grow)
            if fresh is None:
                return None
        pt.b_len[last] = blen + 1
        pt.s_len[slots] = undo.seq_len + 1
        in_page = blen % page_size
        plan = self._step(grow, fresh, in_page, page_size, undo)
        self.plan = plan
        return plan

    def _flat_next(self, pt, ps):
        """``next_step`` for the common layout (one depth holds every last block, entry ``i`` =
        sequence ``i``), allocation-free unless a sequence needs a page: every array is
        written into one of two alternating ``_Frame`` buffer sets (the plan of two steps ago
        is done by then), so a steady decode step allocates no numpy array."""
        last, slots = self.last, self.slots
        num_free = pt.num_free
        frames, page_lists = self.frames, self.page_lists
        assert frames is not None and page_lists is not None    # set with ``flat``
        f = frames[self.turn]
        blen = pt.b_len.take(last, out=f.blen)
        npages = pt.b_npages.take(last, out=f.npages)
        np.multiply(npages, ps, out=f.scratch)
        np.equal(blen, f.scratch, out=f.full)
        grow = fresh = None
        if np.count_nonzero(f.full):            # some last page is full: one page each
            grow = reserve_pages(pt, ps, self.seq_ids, last, blen, npages)
            fresh = self._claim(pt, last, npages, grow)
            if fresh is None:
                return None
        undo = ForwardUndo(num_free, slots, last, pt.s_len.take(slots, out=f.seq_len), blen,
                           npages)
        np.add(blen, 1, out=f.scratch)
        pt.b_len[last] = f.scratch
        np.add(undo.seq_len, 1, out=f.scratch)
        pt.s_len[slots] = f.scratch
        old = self.plan
        d = self.flat
        assert d is not None     # callers take this path only with a flat depth
        depth = old.depths[d]
        indptr, indices = depth.page_indptr, depth.page_indices
        if fresh is not None:
            indptr, indices = page_lists.append_pages(indptr, indices, grow, fresh)
        in_page = np.remainder(blen, ps, out=f.in_page)
        kv_len = np.add(depth.kv_len, 1, out=f.kv_len)
        positions = np.add(old.tokens.q_positions, 1, out=f.positions)  # = committed length
        np.subtract(indptr[1:], 1, out=f.scratch)
        slots_new = indices.take(f.scratch, out=f.append_slots)
        slots_new *= ps
        slots_new += in_page
        tokens = evolve(old.tokens, q_positions=positions, k_rope_offset=positions,
                        append_slots=slots_new)
        depths = list(old.depths)
        last_page_len = np.add(in_page, 1, out=f.last_page_len)
        depths[d] = evolve(depth, kv_len=kv_len, last_page_len=last_page_len,
                           page_indptr=indptr, page_indices=indices,
                           max_kv_len=depth.max_kv_len + 1,    # every entry gained one key
                           num_pages=int(indptr[-1]))
        self.turn ^= 1
        self.plan = evolve(old, tokens=tokens, depths=tuple(depths), undo=undo)
        return self.plan

    def _step(self, grow, fresh, in_page, ps, undo) -> ForwardPlan:
        """The general layout: per depth, update the entries holding last blocks."""
        old = self.plan
        batch = len(self.last)
        fresh_of = None
        if fresh is not None:
            grew = np.zeros(batch, bool)
            grew[grow] = True
            fresh_of = np.zeros(batch, np.int32)
            fresh_of[grow] = fresh
        append_slots = np.empty(batch, np.int32) if len(self.holders) > 1 else None
        depths = []
        for h, depth in zip(self.holders, old.depths):
            seq_i, ent = h.seq_index, h.entry_index
            if not len(seq_i):
                depths.append(depth)
                continue
            kv_len = depth.kv_len.copy()
            kv_len[ent] += 1
            last_page_len = depth.last_page_len.copy()
            last_page_len[ent] = in_page[seq_i] + 1
            indptr, indices = depth.page_indptr, depth.page_indices
            if fresh_of is not None:
                g = grew[seq_i]
                if g.any():
                    indptr, indices = append_pages(indptr, indices, ent[g], fresh_of[seq_i[g]])
            new_slots = indices[indptr[ent + 1] - 1] * ps + in_page[seq_i]
            if append_slots is None:
                append_slots = new_slots          # one depth: seq_i is the whole batch, in order
            else:
                append_slots[seq_i] = new_slots
            depths.append(evolve(depth, kv_len=kv_len, last_page_len=last_page_len,
                                 page_indptr=indptr, page_indices=indices,
                                 max_kv_len=int(kv_len.max()), num_pages=int(indptr[-1])))
        t = old.tokens
        tokens = evolve(t, q_positions=t.q_positions + 1, k_rope_offset=t.k_rope_offset + 1,
                        append_slots=append_slots)
        return evolve(old, tokens=tokens, depths=tuple(depths), undo=undo)


class _Frame:
    """The per-sequence arrays (each (B,)) of one decode step of the common layout
    (``DecodeReuse._flat_next``); two frames alternate."""

    def __init__(self, batch: int):
        def buf(dtype=np.int32):
            return np.empty(batch, dtype)
        self.blen, self.npages, self.seq_len, self.scratch = buf(), buf(), buf(), buf()
        self.in_page, self.kv_len, self.positions = buf(), buf(), buf()
        self.append_slots, self.last_page_len = buf(), buf()
        self.full = buf(bool)


class _PageLists:
    """Two alternating CSR page-list buffers (``page_indptr`` (B+1,), ``page_indices``, grown
    only, by doubling) for the decode steps of the common layout: a step that appends pages
    writes into the pair its input does not live in."""

    def __init__(self, batch: int):
        self.indptr = [np.empty(batch + 1, np.int32), np.empty(batch + 1, np.int32)]
        self.indices = [np.empty(0, np.int32), np.empty(0, np.int32)]

    def append_pages(self, indptr, indices, entries, pages):
        """``append_pages`` into the buffer pair that ``indptr`` is not."""
        k = 1 if indptr is self.indptr[0] else 0
        n = len(indices) + len(entries)
        if n > len(self.indices[k]):
            self.indices[k] = np.empty(max(n, 2 * len(self.indices[k])), np.int32)
        grown, out = self.indices[k][:n], self.indptr[k]
        ends = entries + 1
        at = indptr[ends] + np.arange(len(entries))     # where the new pages land
        keep = np.ones(n, bool)
        keep[at] = False
        grown[keep] = indices
        grown[at] = pages
        shift = np.zeros(len(indptr), np.int32)
        shift[ends] = 1
        np.cumsum(shift, out=out)
        out += indptr
        return out, grown
