"""Sliding windows of ``CacheState`` (``WindowOps``): enabling one on a sequence, and sliding a
windowed sequence's last block as a forward appends to it (``sliding.plan_slide`` is the
arithmetic; this applies it to the page table).

A windowed sequence keeps its tokens in one block it holds alone: enabling a window folds the
blocks only it reaches into its last one, and a sequence may share no more than its sinks
(shared pages cannot slide out).
"""

from __future__ import annotations

import numpy as np

from ..errors import ForwardStateError, InvalidArgumentError
from .epoch import query
from .pagetable import SeqState
from .sequences import SequenceOps
from .sliding import plan_slide
from .validate import INT32_MAX
from .validate import int_arg as as_int


class WindowOps(SequenceOps):
    """Enabling and sliding windows (see the module docstring)."""

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
