"""Sliding window with attention sinks, as pure arithmetic on one block.

Kept tokens of a sliding block: ``sink`` tokens at in-block offsets ``0..sink-1``, then the
window at offsets ``window_offset .. window_offset + (len - sink) - 1``. Sliding frees whole
pages between the sink pages and the window. The same function serves the dry run
(validation: how many pages will the forward need?) and the real update, so the two cannot
disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlidePlan:
    new_pages: int     # pages appended to the block before sliding
    erase_at: int      # index of the first page freed by the slide
    erase_count: int   # pages freed (consecutive from erase_at)
    block_len: int     # block length after append and slide
    seq_len: int       # sequence length after append and slide
    sink: int
    window_offset: int

    @property
    def net_pages(self) -> int:
        return self.new_pages - self.erase_count


def plan_slide(*, seq_len: int, block_len: int, sink: int, window_offset: int, npages: int, window: int,
               last_block_sink: int, append: int, page_size: int) -> SlidePlan:
    """Reserve ``append`` tokens in the last block, then slide the window."""
    target = -(-(block_len - sink + window_offset + append) // page_size)
    new_pages = max(target - npages, 0)
    npages += new_pages
    block_len += append
    seq_len += append
    if window < 0 or seq_len <= window:
        return SlidePlan(new_pages, 0, 0, block_len, seq_len, sink, window_offset)
    slide = seq_len - window
    if last_block_sink > 0 and sink == 0:
        sink = window_offset = last_block_sink   # first slide: pin the sinks
    sink_pages = -(-sink // page_size)
    page_after, offset_after = divmod(window_offset + slide, page_size)
    erase = max(page_after - sink_pages, 0)
    page_after -= erase
    return SlidePlan(new_pages, sink_pages, erase, block_len - slide, window, sink,
                     page_after * page_size + offset_after)
