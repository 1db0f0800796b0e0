"""The forward planner: ``begin_forward``'s host work, vectorised over the batch (numpy only; no
per-sequence Python on the decode steady-state path except for sequences that need a page).

One forward is planned in named steps, each in its own module:

1. validate (``request``): the batch, its lengths and token tree, nothing changed;
2. reserve (``reserve``, ``CacheState.reserve_forward``): new pages and tokens, undo recorded;
3. token arrays (``tokens``): positions, append slots, the new tokens' tree mask;
4. depths (``depths``): one ``HostDepth`` of paged-attention entries per block depth.

Decode batches take shortcuts (``decode``): a repeat of the last decode batch updates its plan
while the state's epoch is unchanged; the first step of unshared sequences is built directly.
Static-shape decode (``static``) pads a plain decode plan to its batch bucket; with
``static_mixed`` (set by the cache) a mixed step is planned as one paged pass (chain trees over
the new tokens, one entry per sequence), or two merged where its sequences share a prefix worth
reading once (a decode batch sharing one is then planned the same way), and padded to its token
bucket.

Attention of one layer then runs, per the plan: when ``paged_only``, K/V are written first and
one paged attention per depth covers history and new tokens (tree masks hide non-ancestors);
otherwise a causal (or tree-masked) ragged pass over the new tokens plus one paged attention
per depth over the history as it was before this forward, merged by lse.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..errors import UnsupportedFeatureError
from .decode import DecodeReuse, first_step
from .depths import build_depths, root_blocks, sharing_pays
from .plan import ForwardPlan, ForwardUndo, build, evolve
from .request import ForwardRequest, check_batch, check_forward, exclusive_cumsum
from .reserve import count_pages, page_need
from .state import CacheState
from .static import chain_masks, pad_mixed, pad_to_bucket
from .tokens import token_arrays, tree_masks
from .validate import all_int_ones, same_int_ids


class Planner:
    """Plans forwards over a ``CacheState`` for a configuration and backend capabilities."""

    fast_path = True
    """Take the decode shortcuts when they apply (tests turn them off to compare)."""
    static_mixed = False
    """Plan mixed steps as static-shape ones (``CacheConfig.static_mixed``; the cache sets it
    per forward: off while fp8 scales are still to be calibrated by an eager forward)."""

    def __init__(self, state: CacheState, config, capabilities):
        self.state = state
        self.config = config
        self.capabilities = capabilities
        self._reuse: Optional[DecodeReuse] = None

    @property
    def decode_reuse(self):
        """The decode batch whose plan the next identical decode step updates (``DecodeReuse``),
        or None."""
        return self._reuse

    def begin(self, seq_ids, append_lengths, tree_parent_ptr=None) -> ForwardPlan:
        """Plan (and reserve) a forward: ``seq_ids`` (B ids), ``append_lengths`` (B ints),
        ``tree_parent_ptr`` (T ints or None). Raises a typed error, changing nothing, on bad
        input or when the pages do not suffice; ``rollback(plan.undo)`` undoes it."""
        if self.state.pt.groups is not None:
            return self._begin_grouped(seq_ids, append_lengths, tree_parent_ptr)
        plan = self._repeat_decode(seq_ids, append_lengths, tree_parent_ptr)
        if plan is None:
            plan = self._plan(seq_ids, append_lengths, tree_parent_ptr)
        if (self.config.static_decode and self._reuse is not None and self._reuse.plan is plan
                and len(plan.seq_ids) <= self.config.static_buckets[-1]):
            return pad_to_bucket(plan, self.config)
        return plan

    def _begin_grouped(self, seq_ids, append_lengths, tree_parent_ptr) -> ForwardPlan:
        """``begin`` in a cache with window groups: every group's pages are counted before
        anything is reserved (CacheFullError naming the group), the full pool is planned as
        without groups, then each group reserves its pages and gets its ``GroupPlan``."""
        groups = self.state.pt.groups
        req = self._grouped_request(seq_ids, append_lengths, tree_parent_ptr)
        lengths = self.state.pt.s_len[req.slots].astype(np.int64)
        groups.check_room(req.seq_ids, lengths, req.append,
                          f"forward of sequences {req.seq_ids}")
        plan = self._repeat_decode(seq_ids, append_lengths, None)
        if plan is None:
            plan = self._plan(seq_ids, append_lengths, None)
        undo = groups.reserve(req.seq_ids, lengths, req.append)
        plan.undo.groups = undo
        return evolve(plan, groups=groups.plan(req.seq_ids, lengths, req.append,
                                               plan.tokens.qo_indptr, plan.paged_only))

    def _grouped_request(self, seq_ids, append_lengths, tree_parent_ptr) -> ForwardRequest:
        """Step 1 in a cache with window groups: token trees are refused (not composed with
        window groups yet)."""
        if tree_parent_ptr is not None:
            raise UnsupportedFeatureError(
                "token trees in a cache with window groups (CacheConfig.layer_kinds): not "
                "composed with window groups yet (docs/hybrid.md); pass token_tree_parent_ptr=None")
        return self._request(seq_ids, append_lengths, None)

    def group_pages_needed(self, seq_ids, append_lengths, tree_parent_ptr=None) -> list:
        """Per window group, the pages ``begin`` would take off its free list now (the
        validation of ``pages_needed``); [] without window groups. Changes nothing."""
        groups = self.state.pt.groups
        if groups is None:
            return []
        req = self._grouped_request(seq_ids, append_lengths, tree_parent_ptr)
        return groups.need(req.seq_ids, self.state.pt.s_len[req.slots], req.append)

    def pages_needed(self, seq_ids, append_lengths, tree_parent_ptr=None) -> tuple[int, int]:
        """(pages taken, pages freed) by the forward ``begin(seq_ids, append_lengths,
        tree_parent_ptr)`` would reserve now: taken off the free list (what must be free, else
        CacheFullError), and given back by its sliding windows after every new page is taken.
        The same validation (``_request``) and page count (``reserve.page_need``) as ``begin``,
        without reserving, refusing for room, or touching the decode reuse: changes nothing."""
        if self.state.pt.groups is not None:
            req = self._grouped_request(seq_ids, append_lengths, tree_parent_ptr)
        else:
            req = self._request(seq_ids, append_lengths, tree_parent_ptr)
        need, slides = page_need(self.state, self.config, req)
        return int(need.sum()), sum(s.erase_count for s in slides.values())

    def append_room(self, seq_id, pages: int, limit: int) -> int:
        """The most new tokens (at most ``limit``) that one forward of ``seq_id`` alone can
        append taking at most ``pages`` free pages, by ``reserve.page_need``'s count (the room
        in its own last page first; a sliding window's need as ``pages_needed`` counts it).
        Validates ``seq_id`` and ``limit`` as ``begin`` would (``limit`` tokens in one forward);
        changes nothing."""
        req = self._request([seq_id], [limit], None)
        pt, ps = self.state.pt, self.config.page_size
        pages = max(pages, 0)
        if not (self.config.support_sliding_window and pt.s_window[req.slots[0]] >= 0):
            room = int(pt.b_npages[req.last[0]]) * ps - int(pt.b_len[req.last[0]])
            most = min(limit, room + pages * ps)
            if pt.groups is not None:
                # each window group holds the pages up to the sequence's last one too: its
                # room is the last page's plus its own free pages
                length = int(pt.s_len[req.slots[0]])
                tail = -(-length // ps) * ps - length
                for free in pt.groups.free_pages().values():
                    most = min(most, tail + free * ps)
            return most

        def need(n: int) -> int:
            return int(page_need(self.state, self.config, self._request([seq_id], [n], None))[0].sum())
        if need(limit) <= pages:
            return limit
        lo, hi = 0, limit                   # need(lo) <= pages < need(hi); need grows with n
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if need(mid) <= pages else (lo, mid)
        return lo

    def rollback(self, undo: ForwardUndo) -> None:
        """Undo a forward that ``begin`` planned: the page table, the free pages and the token
        trees as they were before it (the epoch moves on: nothing built on the undone state is
        reused)."""
        self._reuse = None
        self.state.rollback_forward(undo)

    # ------------------------------------------------------------------ the steps
    def _repeat_decode(self, seq_ids, append_lengths, tree_parent_ptr):
        """The last decode batch again, one token each, nothing structural changed since: its
        plan updated (None when that does not apply)."""
        reuse = self._reuse
        if (reuse is None or not self.fast_path or tree_parent_ptr is not None
                or reuse.epoch != self.state.epoch
                or not same_int_ids(seq_ids, reuse.seq_ids)
                or not all_int_ones(append_lengths, len(reuse.seq_ids))):
            return None
        plan = reuse.next_step(self.state.pt, self.config.page_size)
        if plan is None:
            self._reuse = None      # a coalescing choice flips: rebuild
        return plan

    def _plan(self, seq_ids, append_lengths, tree_parent_ptr) -> ForwardPlan:
        cfg, pt = self.config, self.state.pt
        self._reuse = None
        req = self._request(seq_ids, append_lengths, tree_parent_ptr)
        if self._unshared_decode(req):
            plan, holders = first_step(pt, cfg.page_size, req.seq_ids, req.slots, req.last)
            return self._remember(plan, req, holders)
        # each last block's and sequence's state before this forward, gathered once
        before = (pt.b_len[req.last], pt.b_npages[req.last], pt.s_len[req.slots])
        need, slides = count_pages(self.state, cfg, req, before)
        return self._general(req, need, slides, before)

    def _request(self, seq_ids, append_lengths, tree_parent_ptr) -> ForwardRequest:
        """Step 1, validate: the checked ``ForwardRequest`` (typed errors, nothing changed)."""
        if tree_parent_ptr is not None and self.state.slots is not None:
            # a rejected draft token would have to be taken back out of the state
            self.state.slots.refuse_rewind("token trees (token_tree_parent_ptr)")
        pt = self.state.pt
        seq_ids, seqs, append = check_batch(pt, self.config, seq_ids, append_lengths)
        return check_forward(pt, self.config, self.capabilities, seq_ids, seqs, append,
                             tree_parent_ptr)

    def _unshared_decode(self, req: ForwardRequest) -> bool:
        """A decode batch of sequences that are one block each, without trees or windows."""
        pt = self.state.pt
        return (self.fast_path and req.tree_parents is None and req.is_decode
                and not self.config.support_sliding_window
                and not req.tree_before.any() and bool((pt.b_parent[req.last] < 0).all()))

    def _general(self, req: ForwardRequest, need, slides, before) -> ForwardPlan:
        cfg, pt = self.config, self.state.pt
        write_after = cfg.support_sliding_window
        had_tree = bool(req.tree_before.any())
        one_pass = req.tree_parents is None and not had_tree and not write_after
        bucket = cfg.static_mixed_bucket(req.total) if self.static_mixed else None
        if cfg.batch_invariant and one_pass and not req.is_decode:
            # every prompt chunk one pass over its sequence's whole page list (decode batches
            # take the decode path below, one entry per sequence as well)
            plan = self._one_pass(req, need, slides, before)
            return plan if bucket is None else pad_mixed(plan, cfg)
        if (one_pass and bucket is not None
                # a decode batch joins them where its sequences share a prefix worth reading
                # once (static-shape decode reads one entry per sequence); never in a
                # batch-invariant cache, which reads no prefix once for several sequences
                and (not req.is_decode or (not cfg.batch_invariant
                                           and sharing_pays(pt, root_blocks(pt, req.last))))):
            return self._static_mixed(req, need, slides, before)
        paged_only = (req.is_decode and not write_after) or had_tree
        qo_indptr = exclusive_cumsum(req.append)
        blen_before, _, seq_len_before = before
        depths = holders = None
        max_append = int(req.append.max())
        # only a plan the next decode step reuses needs to know where the last blocks are
        reused = req.is_decode and req.tree_parents is None and not write_after
        if not paged_only:          # the ragged pass covers the new tokens: depths see history
            depths, holders = build_depths(pt, cfg, req.last, qo_indptr, is_decode=req.is_decode,
                                           max_append=max_append, want_holders=reused)
        undo = self.state.reserve_forward(req.seqs, req.last, req.append, need, slides,
                                          slots=req.slots, before=before)
        masks = None
        if req.tree_parents is not None:
            self.state.extend_trees(undo, req.seqs, req.tree_parents, qo_indptr)
            masks = tree_masks(req.seqs)
        tokens = token_arrays(self.state, cfg, req, qo_indptr, blen_before, seq_len_before,
                              slides, None if paged_only else masks)
        if paged_only:
            sizes = pt.s_tree[req.slots].astype(np.int64) if masks is not None else None
            depths, holders = build_depths(pt, cfg, req.last, qo_indptr, is_decode=req.is_decode,
                                           tree_sizes=sizes, tree_masks=masks,
                                           max_append=max_append, want_holders=reused)
        assert depths is not None                     # set on either branch above
        plan = build(ForwardPlan, seq_ids=req.seq_ids, append_lengths=req.append,
                           total_tokens=req.total, max_append=max_append,
                           paged_only=paged_only, write_after=write_after, tokens=tokens,
                           depths=depths, undo=undo)
        if reused:
            assert holders is not None                    # built because reused asked for them
            return self._remember(plan, req, holders)
        return plan

    def _static_mixed(self, req: ForwardRequest, need, slides, before) -> ForwardPlan:
        """A mixed step as one paged pass (K/V written first; each sequence one entry over its
        whole page list, its new tokens a chain tree), or two merged where the batch shares a
        prefix worth reading once, padded to its token bucket."""
        return pad_mixed(self._one_pass(req, need, slides, before), self.config)

    def _one_pass(self, req: ForwardRequest, need, slides, before) -> ForwardPlan:
        """One paged pass per layer (K/V written first; each sequence one entry over its whole
        page list, its new tokens a chain tree), or two merged where the batch shares a prefix
        worth reading once (never in a batch-invariant cache: ``build_depths``); unpadded."""
        cfg, pt = self.config, self.state.pt
        qo_indptr = exclusive_cumsum(req.append)
        blen_before, _, seq_len_before = before
        undo = self.state.reserve_forward(req.seqs, req.last, req.append, need, slides,
                                          slots=req.slots, before=before)
        tokens = token_arrays(self.state, cfg, req, qo_indptr, blen_before, seq_len_before,
                              slides, None)
        sizes, masks = chain_masks(req.append)
        depths, _ = build_depths(pt, cfg, req.last, qo_indptr, is_decode=False, tree_sizes=sizes,
                                 tree_masks=masks, max_append=int(req.append.max()),
                                 want_holders=False, share=True)
        return build(ForwardPlan, seq_ids=req.seq_ids, append_lengths=req.append,
                     total_tokens=req.total, max_append=int(req.append.max()), paged_only=True,
                     write_after=False, tokens=tokens, depths=depths, undo=undo)

    def _remember(self, plan: ForwardPlan, req: ForwardRequest, holders: list) -> ForwardPlan:
        """Keep a plain decode plan for the next step to update."""
        if self.fast_path:
            self._reuse = DecodeReuse(plan, self.state.epoch, req.slots, req.last, holders,
                                      keep_choice=self.config.static_decode)
        return plan
