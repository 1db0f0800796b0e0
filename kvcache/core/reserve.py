"""Planner step 2, reserve: count the new pages a forward needs, refusing (nothing changed)
when the free pages do not cover them. The planner then reserves them through
``CacheState.reserve_forward``, which bumps the plan epoch and records the ``ForwardUndo``."""

from __future__ import annotations

import numpy as np

from ..errors import CacheFullError
from ..errors import pages as n_pages
from .request import ForwardRequest


def page_need(state, config, req: ForwardRequest, before=None) -> tuple[np.ndarray, dict]:
    """(new pages per sequence, ``SlidePlan`` per index of each sliding sequence): what
    ``CacheState.reserve_forward`` takes off the free list for ``req``, changing nothing and
    refusing nothing (``count_pages`` refuses; ``Planner.pages_needed`` answers a scheduler).
    A sequence's need counts its partial last page (new tokens fill it first); a sliding
    sequence's need is its ``SlidePlan.new_pages``, taken before any slide frees a page.
    ``before``: (last block lengths, their page counts, sequence lengths), each (B,), when
    already gathered."""
    pt = state.pt
    if before is None:
        before = (pt.b_len[req.last], pt.b_npages[req.last], None)
    blen, npages = before[0], before[1]
    need = -(-(blen + req.append) // config.page_size)     # int64: append is
    need -= npages
    np.maximum(need, 0, out=need)
    slides = {}
    if config.support_sliding_window:
        for i in np.flatnonzero(pt.s_window[req.slots] >= 0):
            slides[int(i)] = state.slide_plan(req.seqs[i], int(req.append[i]))
            need[i] = slides[int(i)].new_pages     # before its slide frees any
    return need, slides


def count_pages(state, config, req: ForwardRequest, before=None) -> tuple[np.ndarray, dict]:
    """``page_need``, refused with CacheFullError (nothing changed) when the free pages do not
    cover it."""
    pt = state.pt
    need, slides = page_need(state, config, req, before)
    needed = int(need.sum())
    if needed > pt.num_free:
        worst = int(np.argmax(need))
        raise CacheFullError(
            f"forward needs {n_pages(needed, 'new page')} but {pt.num_free} of {pt.num_pages} "
            f"are free (sequence {req.seq_ids[worst]} alone needs {int(need[worst])} for "
            f"{n_pages(int(req.append[worst]), 'token')})")
    return need, slides

