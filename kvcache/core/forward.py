"""``begin_forward``: validate a batch, reserve its pages and build the forward's int32 index
arrays on the host, vectorised over the batch (numpy only; no per-sequence Python on the decode
steady-state path except for sequences that need a new page).

Attention of one layer then runs, per the plan:
* ``append_first`` (decode batches without sliding windows, or a token tree continuing an
  uncommitted tree): K/V are written first and one paged attention per block depth covers
  history and new tokens (tree masks hide non-ancestors);
* otherwise: causal (or tree-masked) ragged self-attention over the new tokens, plus one paged
  attention per block depth over the history as it was before this forward, merged by lse.
Block depths: sequences sharing a prefix share its blocks; depth ``d`` holds each sequence's
``d``-th block (the last depth also holds every deeper block), and consecutive sequences with
the same block at a depth are coalesced into one entry so the shared pages are read once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import (CacheFullError, ForwardStateError, InvalidArgumentError,
                      SequenceNotFoundError)
from .state import CacheState
from .validate import (INT32_MAX, all_int_ones, bool_like_positions, int_array, same_int_ids,
                       seq_id_list)

MAX_BLOCK_DEPTH = 2
"""Depths beyond this are folded into the last depth (bounds kernel launches per layer)."""
COALESCE_RATIO = 1.1
"""Use the decode kernel (no coalescing) unless coalescing saves at least this factor of pages."""


@dataclass
class DepthMeta:
    num_entries: int
    use_decode: bool
    has_tree: bool
    max_kv_len: int
    num_pages: int
    max_qo_len: int = 1


@dataclass
class ForwardPlan:
    seq_ids: list
    append_lengths: np.ndarray
    total_tokens: int
    append_first: bool
    write_after: bool
    self_tree: bool
    max_append: int
    arrays: dict = field(default_factory=dict)
    depths: list = field(default_factory=list)
    decode_info: object = None
    """For a plain decode plan: per depth, where each sequence's last block sits and the page
    counts behind the coalescing choice (``ForwardBuilder`` updates such plans step to step)."""
    graph_bucket: object = None
    """Graph mode: the batch bucket this decode plan is padded to (None: an eager plan)."""
    undo: object = None
    """What this forward changed in the page table (``ForwardUndo``), for ``rollback``."""


class ForwardUndo:
    """The state a forward changed, recorded as it reserved (no copy of the page table): its
    sequences' lengths, their last blocks' lengths and page counts, the free-page count, and for
    the rare cases a sliding block's pages and the tree sizes."""

    __slots__ = ("num_free", "slots", "last", "seq_len", "block_len", "npages", "free_top",
                 "slid", "trees")

    def __init__(self, num_free, slots, last, seq_len, block_len, npages):
        self.num_free, self.slots, self.last = num_free, slots, last
        self.seq_len, self.block_len, self.npages = seq_len, block_len, npages
        self.free_top = None    # free-stack entries above the reserved pages, as they were
        self.slid = ()          # (block, pages, sink, gap) of each sliding sequence
        self.trees = ()         # (sequence, uncommitted tree size) of each tree sequence


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _gather_page_ids(pt, region_starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Page ids of several blocks' regions in ``page_store``, concatenated (one repeat + one
    fancy index instead of a loop over blocks)."""
    before = _exclusive_cumsum(counts)
    index = np.repeat(region_starts - before[:-1], counts) + np.arange(before[-1])
    return pt.page_store[index]


class _DecodeLayout:
    """A decode batch's last plan, updated instead of rebuilt while the same ids come back and
    no structural change bumped the state's epoch: then only each sequence's last block grows,
    and that block ends exactly one entry (of one depth) which holds only that sequence."""

    def __init__(self, plan, epoch, slots, last, own, pages):
        self.seq_ids, self.epoch, self.slots, self.last = plan.seq_ids, epoch, slots, last
        self.bool_like = bool_like_positions(plan.seq_ids)
        self.append_lengths = plan.append_lengths
        self.arrays = plan.arrays
        self.depths = plan.depths
        self.own = own          # per depth: (sequence index, entry index) of last blocks there
        batch = len(slots)
        everyone = np.arange(batch)
        # the common layout: one depth holds every last block, entry i = sequence i (no shared
        # prefix, a shared prefix in the depths above, or graph mode); None otherwise
        self.flat = None
        holders = [d for d, (seq_i, _) in enumerate(own) if len(seq_i)]
        if len(holders) == 1:
            d = holders[0]
            seq_i, ent = own[d]
            if (len(seq_i) == batch and not plan.depths[d].has_tree and plan.depths[d].num_entries == batch
                    and np.array_equal(seq_i, everyone) and np.array_equal(ent, everyone)):
                self.flat = d
        self.pages = pages      # per depth: [pages at that depth, pages after coalescing, mask of
                                #   sequences whose last block is the depth's own block]


def _append_pages(indptr: np.ndarray, indices: np.ndarray, entries: np.ndarray,
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


def _all_ones(lengths, batch: int) -> bool:
    """True when ``lengths`` is ``batch`` int ones (a list, tuple or int array; True and 1.0
    compare equal to 1 but are not ints), without per-element Python."""
    return all_int_ones(lengths, batch)


def _tree_order(parents: list) -> tuple[np.ndarray, np.ndarray]:
    """(order, upper) of a preorder walk; children visited in index order (parents precede
    children, so one forward and one backward pass suffice)."""
    n = len(parents)
    size = [1] * n
    for node in range(n - 1, -1, -1):
        p = parents[node]
        if p >= 0:
            size[p] += size[node]
    order = [0] * n
    next_free = [0] * n
    next_root = 0
    for node in range(n):
        p = parents[node]
        if p < 0:
            order[node] = next_root
            next_root += size[node]
        else:
            order[node] = next_free[p]
            next_free[p] += size[node]
        next_free[node] = order[node] + 1
    order_a = np.asarray(order, np.int32)
    return order_a, order_a + np.asarray(size, np.int32)


class ForwardBuilder:
    fast_path = True
    """Take the decode fast path when it applies (tests turn it off to compare the two)."""

    def __init__(self, state: CacheState, config, capabilities):
        self.state = state
        self.config = config
        self.capabilities = capabilities
        self._layout = None

    # ------------------------------------------------------------------ entry point
    def begin(self, seq_ids, append_lengths, tree_parent_ptr=None) -> ForwardPlan:
        plan = self._begin(seq_ids, append_lengths, tree_parent_ptr)
        if (self.config.cuda_graph and plan.decode_info is not None
                and len(plan.seq_ids) <= self.config.graph_buckets[-1]):
            return self._pad_for_graph(plan)
        return plan

    def _begin(self, seq_ids, append_lengths, tree_parent_ptr=None) -> ForwardPlan:
        cfg, pt = self.config, self.state.pt
        layout = self._layout
        if layout is not None and tree_parent_ptr is None and layout.epoch == self.state.epoch:
            if (same_int_ids(seq_ids, layout.seq_ids, layout.bool_like)
                    and _all_ones(append_lengths, len(layout.seq_ids))):
                plan = (self._decode_step if layout.flat is None else self._decode_step_flat)(layout)
                if plan is not None:
                    return plan
        seq_ids = seq_id_list(seq_ids, "seq_ids")
        batch = len(seq_ids)
        if not 1 <= batch <= cfg.max_batch_size:
            raise InvalidArgumentError(
                f"a forward needs 1 to max_batch_size={cfg.max_batch_size} sequences, got {batch}")
        # each length bounded in Python ints first, so the int64 sum below cannot wrap
        append = int_array(append_lengths, "append_lengths", 1, cfg.prefill_chunk_size, length=batch,
                           owner=lambda i: f"sequence {seq_ids[i]}",
                           limit=f"prefill_chunk_size={cfg.prefill_chunk_size}")
        total = int(append.sum())
        if total > cfg.prefill_chunk_size:
            raise InvalidArgumentError(
                f"forward of {total} tokens exceeds prefill_chunk_size={cfg.prefill_chunk_size}")
        try:
            seqs = [pt.seqs[s] for s in seq_ids]
        except (KeyError, TypeError):
            missing = next(s for s in seq_ids if not isinstance(s, (int, np.integer)) or s not in pt.seqs)
            raise SequenceNotFoundError(
                f"sequence {missing!r} in begin_forward is not in the cache") from None
        if len(set(seq_ids)) != batch:
            dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
            raise InvalidArgumentError(f"sequence {dup} appears twice in one forward")
        slots = np.array([s.slot for s in seqs], np.int64)
        if self.fast_path and tree_parent_ptr is None and total == batch and not cfg.support_sliding_window:
            last = pt.s_last[slots]
            if not pt.s_tree[slots].any() and (pt.b_parent[last] < 0).all():
                plan = self._decode_fast(seq_ids, slots, last)
                self._remember(plan, slots, last)
                return plan
        tree_before = pt.s_tree[slots].astype(np.int64)
        has_prev_tree = bool(tree_before.any())
        if tree_parent_ptr is None and has_prev_tree:
            i = int(np.argmax(tree_before > 0))
            raise ForwardStateError(
                f"sequence {seq_ids[i]} has {int(tree_before[i])} uncommitted token-tree tokens; "
                f"call commit_accepted_token_tree_nodes or pass token_tree_parent_ptr")
        parents = None
        if tree_parent_ptr is not None:
            parents = self._check_tree(seq_ids, append, tree_before, tree_parent_ptr, total)
        sliding = (pt.s_window[slots] >= 0) if cfg.support_sliding_window else np.zeros(batch, bool)
        last = pt.s_last[slots].astype(np.int64)
        blen_before = pt.b_len[last].astype(np.int64)
        need = np.maximum(-(-(blen_before + append) // cfg.page_size) - pt.b_npages[last], 0)
        plans = {}
        for i in np.nonzero(sliding)[0]:
            plans[int(i)] = self.state.slide_plan(seqs[i], int(append[i]))
            need[i] = plans[int(i)].new_pages     # before its slide frees any (see _reserve)
        needed = int(need.sum())
        if needed > pt.num_free:
            worst = int(np.argmax(need))
            raise CacheFullError(
                f"forward needs {needed} new pages but {pt.num_free} of {pt.num_pages} are free "
                f"(sequence {seq_ids[worst]} alone needs {int(need[worst])} for {int(append[worst])} tokens)")

        # ---------------------------------------------------------- mutate from here on
        self.state.epoch += 1
        is_decode = bool((append == 1).all())
        write_after = bool(cfg.support_sliding_window)
        append_first = (is_decode and not write_after) or has_prev_tree
        plan = ForwardPlan(seq_ids, append, total, append_first, write_after,
                           self_tree=parents is not None and not append_first,
                           max_append=int(append.max()))
        qo_indptr = _exclusive_cumsum(append)
        seq_len_before = pt.s_len[slots].astype(np.int64)
        plan.undo = ForwardUndo(pt.num_free, slots, last, pt.s_len[slots], pt.b_len[last],
                                pt.b_npages[last])
        if parents is not None:
            plan.undo.trees = [(seq, len(seq.tree_parent)) for seq in seqs]
        if not append_first:
            self._build_depths(plan, last, qo_indptr, append, is_decode, None, seqs)
        self._reserve(plan.undo, seqs, last, append, need, sliding, plans)

        # per-token arrays
        seq_of_token = np.repeat(np.arange(batch), append)
        r = np.arange(total) - qo_indptr[seq_of_token]
        ps = cfg.page_size
        in_block = blen_before[seq_of_token] + r
        store_idx = pt.b_pstart[last][seq_of_token] + in_block // ps
        slots_new = pt.page_store[store_idx].astype(np.int64) * ps + in_block % ps
        for i, sp in plans.items():
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            slots_new[lo:hi] = self._sliding_slots(seqs[i], int(blen_before[i]), int(append[i]))
        committed = seq_len_before - tree_before
        positions = committed[seq_of_token] + r
        if parents is not None:
            positions = self._apply_tree(plan, seqs, slots, append, qo_indptr, parents, committed)
        plan.arrays.update(qo_indptr=qo_indptr.astype(np.int32),
                           q_positions=positions.astype(np.int32),
                           append_slots=slots_new.astype(np.int32),
                           k_ragged_offset=committed.astype(np.int32))
        if append_first:
            tree_sizes = pt.s_tree[slots].astype(np.int64) if parents is not None else None
            self._build_depths(plan, last, qo_indptr, append, is_decode, tree_sizes, seqs)
        if self.fast_path and is_decode and parents is None and not write_after:
            self._remember(plan, slots, last)
        else:
            plan.decode_info = None
        return plan

    def _reserve(self, undo, seqs, last, append, need, sliding, plans):
        """Take every new page of the forward, then slide: a page that slides out goes back to
        the free list but is never handed to this same forward, so an aborted forward has
        written nothing into the rows its sequences keep again."""
        pt = self.state.pt
        offsets = _exclusive_cumsum(need)
        fresh = pt.take_pages(int(offsets[-1]))
        for i in np.flatnonzero(need > 0):
            if not sliding[i]:
                pt.push_pages(int(last[i]), fresh[offsets[i]:offsets[i + 1]])
        if plans:
            undo.free_top = pt.free_pages[pt.num_free:undo.num_free].copy()
            undo.slid = []
            for i in plans:
                b = int(last[i])
                undo.slid.append((b, pt.pages_of(b).copy(), int(pt.b_sink[b]), int(pt.b_gap[b])))
                self.state.apply_slide(seqs[i], int(append[i]), fresh[offsets[i]:offsets[i + 1]])
        plain = np.flatnonzero(~sliding)
        pt.b_len[last[plain]] += append[plain].astype(np.int32)
        pt.s_len[undo.slots[plain]] += append[plain].astype(np.int32)

    def rollback(self, undo: ForwardUndo) -> None:
        """Undo a forward that ``begin`` planned: the page table, the free pages and the token
        trees as they were before it. The decode layout is dropped (it may describe the undone
        step), and the epoch moves on so that nothing built on the undone state is reused."""
        pt = self.state.pt
        pt.b_len[undo.last] = undo.block_len
        pt.b_npages[undo.last] = undo.npages
        pt.s_len[undo.slots] = undo.seq_len
        for b, pages, sink, gap in undo.slid:
            pt.set_pages(b, pages)
            pt.b_sink[b], pt.b_gap[b] = sink, gap
        if undo.free_top is not None:
            pt.free_pages[undo.num_free - len(undo.free_top):undo.num_free] = undo.free_top
        pt.num_free = undo.num_free
        for seq, size in undo.trees:
            del seq.tree_parent[size:], seq.tree_depth[size:]
            pt.s_tree[seq.slot] = size
        self._layout = None
        self.state.epoch += 1

    # ------------------------------------------------------------------ decode fast paths
    def _reserve_decode_pages(self, seq_ids, last, blen, npages):
        """Batch indices of the sequences whose last page is full (each needs one new page);
        raises CacheFullError, having changed nothing, when the free pages do not cover them."""
        pt, ps = self.state.pt, self.config.page_size
        grow = np.flatnonzero(blen == npages * ps)
        if len(grow) > pt.num_free:
            raise CacheFullError(
                f"forward needs {len(grow)} new pages but {pt.num_free} of {pt.num_pages} are "
                f"free (sequence {seq_ids[int(grow[0])]} alone needs 1 for 1 tokens)")
        return grow

    def _take_decode_pages(self, last, npages, grow):
        """Take one page for each growing sequence and append it to its last block's region
        (vectorised: per-sequence Python only where a region is full and must move)."""
        pt = self.state.pt
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

    def _decode_fast(self, seq_ids, slots, last) -> ForwardPlan:
        """First step of a decode batch whose sequences are one block each (no shared prefix):
        the general path's arrays (tested equal) in a fixed number of numpy calls."""
        pt, ps = self.state.pt, self.config.page_size
        batch = len(seq_ids)
        blen = pt.b_len[last]
        npages = pt.b_npages[last]
        grow = self._reserve_decode_pages(seq_ids, last, blen, npages)
        undo = ForwardUndo(pt.num_free, slots, last, pt.s_len[slots], blen, npages)
        if len(grow):
            self._take_decode_pages(last, npages, grow)
            npages = pt.b_npages[last]
        pt.b_len[last] = blen + 1
        pt.s_len[slots] = undo.seq_len + 1
        kv_len = blen + 1
        in_page = blen % ps
        page_indptr = np.zeros(batch + 1, np.int32)
        np.cumsum(npages, out=page_indptr[1:])
        page_indices = _gather_page_ids(pt, pt.b_pstart[last], npages)
        qo = np.arange(batch + 1, dtype=np.int32)
        zeros = np.zeros(batch, np.int32)
        plan = ForwardPlan(seq_ids, np.ones(batch, np.int64), batch, append_first=True,
                           write_after=False, self_tree=False, max_append=1, undo=undo)
        plan.arrays.update({
            "qo_indptr": qo, "q_positions": blen,
            "append_slots": page_indices[page_indptr[1:] - 1] * ps + in_page,
            "k_ragged_offset": blen,
            "d0.qo_indptr": qo, "d0.page_indptr": page_indptr, "d0.page_indices": page_indices,
            "d0.last_page_len": in_page + 1, "d0.kv_len": kv_len, "d0.sink_size": zeros,
            "d0.window_offset": zeros, "d0.k_rope_offset": zeros,
        })
        plan.depths.append(DepthMeta(batch, True, False, int(kv_len.max()), int(page_indptr[-1])))
        pages = int(page_indptr[-1])
        everyone = np.arange(batch)
        plan.decode_info = ([(everyone, everyone)], [[pages, pages, np.ones(batch, bool)]])
        return plan

    def _remember(self, plan, slots, last) -> None:
        own, pages = plan.decode_info
        self._layout = _DecodeLayout(plan, self.state.epoch, slots, last, own, pages)

    def _decode_step_flat(self, layout: _DecodeLayout):
        """``_decode_step`` for the common layout: one depth holds every last block and its
        entries are the batch's sequences in order (depths above it do not change): the same
        updates on whole arrays."""
        pt, ps = self.state.pt, self.config.page_size
        last = layout.last
        blen = pt.b_len[last]
        npages = pt.b_npages[last]
        grow = self._reserve_decode_pages(layout.seq_ids, last, blen, npages)
        undo = ForwardUndo(pt.num_free, layout.slots, last, pt.s_len[layout.slots], blen, npages)
        a = layout.arrays
        d = layout.flat
        p = f"d{d}."
        indptr, indices = a[p + "page_indptr"], a[p + "page_indices"]
        k = len(grow)
        meta = layout.depths[d]
        if k:
            pages = layout.pages[d]
            if len(layout.pages) > 1:       # growth counts where the block is the depth's own
                k_own = int(np.count_nonzero(pages[2][grow]))
            else:
                k_own = k
            for dd, (total, grouped, _) in enumerate(layout.pages):
                g = k_own if dd == d else 0
                ratio = (total + g) / (grouped + g) if grouped + g else 0.0
                if not self.config.cuda_graph and (ratio < COALESCE_RATIO) != layout.depths[dd].use_decode:
                    self._layout = None
                    return None
            pages[0] += k_own
            pages[1] += k_own
            fresh = self._take_decode_pages(last, npages, grow)
            indptr, indices = _append_pages(indptr, indices, grow, fresh)
        pt.b_len[last] = blen + 1
        pt.s_len[layout.slots] = undo.seq_len + 1
        in_page = blen % ps
        kv_len = a[p + "kv_len"] + 1
        arrays = dict(a)
        positions = a["q_positions"] + 1                  # = committed length: both arrays
        arrays.update({"q_positions": positions, "k_ragged_offset": positions,
                       "append_slots": indices[indptr[1:] - 1] * ps + in_page,
                       p + "kv_len": kv_len, p + "last_page_len": in_page + 1,
                       p + "page_indptr": indptr, p + "page_indices": indices})
        depths = list(layout.depths)
        depths[d] = DepthMeta(meta.num_entries, meta.use_decode, False, int(kv_len.max()),
                              int(indptr[-1]), meta.max_qo_len)
        plan = ForwardPlan(layout.seq_ids, layout.append_lengths, len(last), True, False, False, 1,
                           arrays=arrays, depths=depths, decode_info=(layout.own, layout.pages),
                           undo=undo)
        layout.arrays, layout.depths = arrays, depths
        return plan

    def _decode_step(self, layout: _DecodeLayout):
        """A repeat of the last decode batch: update its arrays (lengths +1, a new page at the
        end of the entry holding a sequence's last block) instead of rebuilding them. Returns
        None, having changed nothing, when a depth's coalescing choice would flip."""
        pt, ps = self.state.pt, self.config.page_size
        last, slots = layout.last, layout.slots
        batch = len(last)
        blen = pt.b_len[last]
        npages = pt.b_npages[last]
        grow = self._reserve_decode_pages(layout.seq_ids, last, blen, npages)
        undo = ForwardUndo(pt.num_free, slots, last, pt.s_len[slots], blen, npages)
        k = len(grow)
        counts = []
        if k:
            grew = np.zeros(batch, bool)
            grew[grow] = True
            for d, (total, grouped, exact) in enumerate(layout.pages):
                g = int(np.count_nonzero(grew & exact)) if len(layout.pages) > 1 else k
                ratio = (total + g) / (grouped + g) if grouped + g else 0.0
                if not self.config.cuda_graph and (ratio < COALESCE_RATIO) != layout.depths[d].use_decode:
                    self._layout = None
                    return None
                counts.append(g)
            fresh_of = np.zeros(batch, np.int32)
            fresh_of[grow] = self._take_decode_pages(last, npages, grow)
            for d, g in enumerate(counts):
                layout.pages[d][0] += g
                layout.pages[d][1] += g
        pt.b_len[last] = blen + 1
        pt.s_len[slots] = undo.seq_len + 1
        a = layout.arrays
        arrays = dict(a)
        arrays["q_positions"] = a["q_positions"] + 1
        arrays["k_ragged_offset"] = a["k_ragged_offset"] + 1
        in_page = blen % ps
        append_slots = np.empty(batch, np.int32) if len(layout.own) > 1 else None
        depths = []
        for d, (seq_i, ent) in enumerate(layout.own):
            meta = layout.depths[d]
            if not len(seq_i):
                depths.append(meta)
                continue
            p = f"d{d}."
            kv_len = a[p + "kv_len"].copy()
            kv_len[ent] += 1
            last_page_len = a[p + "last_page_len"].copy()
            last_page_len[ent] = in_page[seq_i] + 1
            indptr, indices = a[p + "page_indptr"], a[p + "page_indices"]
            if k:
                g = grew[seq_i]
                if g.any():
                    indptr, indices = _append_pages(indptr, indices, ent[g], fresh_of[seq_i[g]])
            new_slots = indices[indptr[ent + 1] - 1] * ps + in_page[seq_i]
            if append_slots is None:
                append_slots = new_slots          # one depth: seq_i is the whole batch, in order
            else:
                append_slots[seq_i] = new_slots
            arrays.update({p + "kv_len": kv_len, p + "last_page_len": last_page_len,
                           p + "page_indptr": indptr, p + "page_indices": indices})
            depths.append(DepthMeta(meta.num_entries, meta.use_decode, meta.has_tree,
                                    int(kv_len.max()), int(indptr[-1]), meta.max_qo_len))
        arrays["append_slots"] = append_slots
        plan = ForwardPlan(layout.seq_ids, layout.append_lengths, batch, append_first=True,
                           write_after=False, self_tree=False, max_append=1)
        plan.arrays, plan.depths = arrays, depths
        plan.decode_info = (layout.own, layout.pages)
        plan.undo = undo
        layout.arrays, layout.depths = arrays, depths
        return plan

    # ------------------------------------------------------------------ CUDA-graph decode
    def _pad_for_graph(self, plan: ForwardPlan) -> ForwardPlan:
        """Pad a plain decode plan to its batch bucket: padded rows append nowhere (slot -1) and
        their entries hold no keys, so they read o = 0 / lse = -inf. Every shape and launch
        parameter now depends on the bucket alone (``max_kv_len`` is the cache's bound, kernels
        read the real lengths from the arrays), which makes the plan capturable."""
        cfg = self.config
        batch = len(plan.seq_ids)
        bucket = cfg.graph_bucket(batch)
        pad = bucket - batch
        a = plan.arrays
        rows = np.arange(bucket + 1, dtype=np.int32)

        def tail(array, fill):
            return np.concatenate([array, np.full(pad, fill, np.int32)]) if pad else array

        meta = plan.depths[0]
        arrays = {
            "qo_indptr": rows, "q_positions": tail(a["q_positions"], 0),
            "append_slots": tail(a["append_slots"], -1),
            "k_ragged_offset": tail(a["k_ragged_offset"], 0),
            "d0.qo_indptr": rows,
            "d0.page_indptr": tail(a["d0.page_indptr"], a["d0.page_indptr"][-1]),
            "d0.page_indices": a["d0.page_indices"],
        }
        for key in ("last_page_len", "kv_len", "sink_size", "window_offset", "k_rope_offset"):
            arrays[f"d0.{key}"] = tail(a[f"d0.{key}"], 0)
        graph = ForwardPlan(plan.seq_ids, plan.append_lengths, plan.total_tokens, True, False,
                            False, 1, arrays=arrays, decode_info=plan.decode_info, undo=plan.undo)
        graph.depths = [DepthMeta(bucket, True, False, cfg.num_pages * cfg.page_size,
                                  meta.num_pages, 1)]
        graph.graph_bucket = bucket
        return graph

    # ------------------------------------------------------------------ validation helpers
    def _check_tree(self, seq_ids, append, tree_before, tree_parent_ptr, total):
        cfg = self.config
        from ..errors import UnsupportedFeatureError
        if not self.capabilities.tree_attention:
            from ..backend import Capabilities
            raise UnsupportedFeatureError(Capabilities.reason("tree_attention"))
        if cfg.support_sliding_window:
            raise InvalidArgumentError(
                "token trees are not supported in a cache built with support_sliding_window=True")
        if cfg.effective_rope_mode == "inline":
            raise InvalidArgumentError("token trees need rope_mode 'none' or 'normal', not 'inline'")
        qo = _exclusive_cumsum(append)
        seq_of_token = np.repeat(np.arange(len(append)), append)
        # int64 without wrapping (a uint64 2**64-1 is not -1); the own-index bound follows
        ptr = int_array(tree_parent_ptr, "token_tree_parent_ptr", -1, INT32_MAX, length=total,
                        owner=lambda t: f"sequence {seq_ids[seq_of_token[t]]}")
        own = tree_before[seq_of_token] + np.arange(total) - qo[seq_of_token]
        bad = np.nonzero((ptr < -1) | (ptr >= own))[0]
        if len(bad):
            t = int(bad[0])
            raise InvalidArgumentError(
                f"token_tree_parent_ptr[{t}] = {int(ptr[t])} for sequence {seq_ids[seq_of_token[t]]}: "
                f"a parent must be -1 or smaller than the token's tree index {int(own[t])}")
        return ptr

    # ------------------------------------------------------------------ sliding windows
    def _sliding_slots(self, seq, block_len_before: int, append: int) -> np.ndarray:
        """Seed semantics: a new token is stored if it is a first-time sink or inside the kept
        window; tokens that slid out within this forward get slot -1."""
        pt, ps = self.state.pt, self.config.page_size
        b = int(pt.s_last[seq.slot])
        blen, sink, gap = int(pt.b_len[b]), int(pt.b_sink[b]), int(pt.b_gap[b])
        pages = pt.pages_of(b)
        out = np.full(append, -1, np.int64)
        for r in range(append):
            pos_in_block = blen - append + r
            if block_len_before + r < sink:
                off = block_len_before + r
            elif pos_in_block < sink:
                continue
            else:
                off = pos_in_block - sink + gap
            out[r] = int(pages[off // ps]) * ps + off % ps
        return out

    # ------------------------------------------------------------------ token trees
    def _apply_tree(self, plan, seqs, slots, append, qo_indptr, parents, committed):
        pt = self.state.pt
        positions = np.zeros(plan.total_tokens, np.int64)
        masks, sizes = [], []
        for i, seq in enumerate(seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            seq.tree_parent.extend(int(p) for p in parents[lo:hi])
            for node in range(len(seq.tree_depth), len(seq.tree_parent)):
                p = seq.tree_parent[node]
                seq.tree_depth.append(0 if p < 0 else seq.tree_depth[p] + 1)
            pt.s_tree[seq.slot] = len(seq.tree_parent)
            positions[lo:hi] = int(committed[i]) + np.asarray(seq.tree_depth[-(hi - lo):])
            order, upper = _tree_order(seq.tree_parent)
            masks.append(np.stack([order, upper], axis=1).reshape(-1))
            sizes.append(len(seq.tree_parent))
        plan.tree_masks = masks
        plan.tree_sizes = np.asarray(sizes, np.int64)
        if plan.self_tree:
            plan.arrays["self_tree_indptr"] = _exclusive_cumsum(plan.tree_sizes).astype(np.int32)
            plan.arrays["self_tree_mask"] = np.concatenate(masks).astype(np.int32)
        return positions

    # ------------------------------------------------------------------ block depths
    def _build_depths(self, plan, last, qo_indptr, append, is_decode, tree_sizes, seqs):
        pt, ps = self.state.pt, self.config.page_size
        batch = len(last)
        # walk parents for the whole batch at once: chain[k, i] is the k-th ancestor of i's last block
        chain = [last]
        cur = last
        while True:
            cur = np.where(cur >= 0, pt.b_parent[np.maximum(cur, 0)], -1)
            if not (cur >= 0).any():
                break
            chain.append(cur)
        chain = np.stack(chain)                         # (K, B), leaf first
        ndepth = (chain >= 0).sum(axis=0)
        width = chain.shape[0]
        src = ndepth[:, None] - 1 - np.arange(width)[None, :]
        trace = np.where(src >= 0, chain[np.maximum(src, 0), np.arange(batch)[:, None]], -1)  # (B, K) root first
        # graph mode: decode reads each sequence's whole page list as one entry (one launch per
        # layer whatever the fork structure, so one captured graph fits every batch)
        flat = self.config.cuda_graph and is_decode
        max_depth = 1 if flat else MAX_BLOCK_DEPTH
        num_depths = min(int(ndepth.max()), max_depth)
        plan.decode_info = ([], pages_info := [])
        for d in range(num_depths):
            at_d = trace[:, d]
            coalesce_ok = d != max_depth - 1
            npages_d = np.where(at_d >= 0, pt.b_npages[np.maximum(at_d, 0)], 0)
            starts = np.concatenate([[0], np.nonzero(at_d[1:] != at_d[:-1])[0] + 1])
            blocks_c = at_d[starts]
            pages_c = int(np.where(blocks_c >= 0, pt.b_npages[np.maximum(blocks_c, 0)], 0).sum())
            ratio = npages_d.sum() / pages_c if pages_c else 0.0
            use_decode = is_decode and (ratio < COALESCE_RATIO or flat)
            pages_info.append([int(npages_d.sum()), pages_c, ndepth - 1 == d])
            if use_decode or not coalesce_ok or len(starts) == batch:
                entry_qo = qo_indptr
                entry_seq = np.arange(batch)
                if d == max_depth - 1:
                    pair_entry, pair_block = np.nonzero(trace[:, d:] >= 0)
                    pair_block = trace[:, d:][pair_entry, pair_block]
                else:
                    pair_entry = np.nonzero(at_d >= 0)[0]
                    pair_block = at_d[pair_entry]
            else:
                entry_qo = np.concatenate([qo_indptr[starts], [qo_indptr[-1]]])
                entry_seq = starts                      # first sequence of each group
                pair_entry = np.nonzero(blocks_c >= 0)[0]
                pair_block = blocks_c[pair_entry]
            self._emit_depth(plan, d, entry_qo, pair_entry, pair_block, use_decode,
                             tree_sizes, seqs, entry_seq, last)

    def _emit_depth(self, plan, d, entry_qo, pair_entry, pair_block, use_decode, tree_sizes,
                    seqs, entry_seq, last):
        pt, ps = self.state.pt, self.config.page_size
        n = len(entry_qo) - 1
        counts = pt.b_npages[pair_block].astype(np.int64)
        page_indptr = np.zeros(n + 1, np.int64)
        np.cumsum(np.bincount(pair_entry, counts, minlength=n), out=page_indptr[1:])
        total_pages = int(page_indptr[-1])
        page_indices = _gather_page_ids(pt, pt.b_pstart[pair_block], counts)
        lens = pt.b_len[pair_block].astype(np.int64)
        kv_len = np.bincount(pair_entry, lens, minlength=n).astype(np.int64)
        # first and last block of each entry (pairs are sorted by entry, root first)
        entries = np.arange(n)
        lo = np.searchsorted(pair_entry, entries, "left")
        hi = np.searchsorted(pair_entry, entries, "right")
        has = hi > lo
        if len(pair_block):
            fb = np.where(has, pair_block[np.minimum(lo, len(pair_block) - 1)], -1)
            lb = np.where(has, pair_block[np.maximum(hi - 1, 0)], -1)
        else:
            fb = lb = np.full(n, -1, np.int64)
        lb0 = np.maximum(lb, 0)
        slid = has & (pt.b_gap[lb0] > 0)
        prefix = kv_len - np.where(has, pt.b_len[lb0], 0)
        sink = np.where(slid, prefix + pt.b_sink[lb0], 0)
        gap = np.where(slid, prefix + pt.b_gap[lb0], 0)
        span = np.where(slid, gap + kv_len - sink, kv_len)
        last_page_len = np.where(span > 0, (span - 1) % ps + 1, 0)
        k_rope_offset = np.where(has, pt.b_start[np.maximum(fb, 0)], 0)
        arrays = {"qo_indptr": entry_qo, "page_indptr": page_indptr, "page_indices": page_indices,
                  "last_page_len": last_page_len, "kv_len": kv_len, "sink_size": sink,
                  "window_offset": gap, "k_rope_offset": k_rope_offset}
        has_tree = False
        if tree_sizes is not None:
            # only the entry holding a sequence's last block carries its tree
            holds = (lb == last[entry_seq]) & has
            sizes = np.where(holds, tree_sizes[entry_seq], 0)
            if sizes.any():
                has_tree = True
                arrays["tree_indptr"] = _exclusive_cumsum(sizes)
                arrays["tree_mask"] = np.concatenate(
                    [plan.tree_masks[entry_seq[e]] for e in np.nonzero(sizes)[0]])
        for key, value in arrays.items():
            plan.arrays[f"d{d}.{key}"] = np.ascontiguousarray(value, dtype=np.int32)
        holds_last = np.flatnonzero(has & (lb == last[entry_seq]))
        plan.decode_info[0].append((entry_seq[holds_last], holds_last))
        max_qo = int(np.diff(entry_qo).max()) if n else 0
        plan.depths.append(DepthMeta(n, use_decode, has_tree, int(kv_len.max()) if n else 0,
                                     total_pages, max_qo))
