"""Planner step 4, block depths: one ``HostDepth`` of paged-attention entries per depth.

Sequences sharing a prefix share its blocks; depth ``d`` holds each sequence's ``d``-th block
(the last depth also holds every deeper block), and consecutive sequences with the same block
at a depth are coalesced into one entry so the shared pages are read once, unless a decode
batch gains too little from it (``decode_kernel_wins``): then every sequence keeps its own
entry and the decode kernel runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..backend import TreeMask
from .plan import HostDepth, build, evolve
from .request import exclusive_cumsum

MAX_BLOCK_DEPTH = 2
"""Depths beyond this are folded into the last depth (bounds kernel launches per layer)."""
COALESCE_RATIO = 1.1
"""Use the decode kernel (no coalescing) unless coalescing saves at least this factor of pages."""


def decode_kernel_wins(pages: int, grouped_pages: int) -> bool:
    """The coalescing choice of a decode depth reading ``pages`` pages, ``grouped_pages`` of
    them after coalescing: True when coalescing saves too little to give up the decode kernel.
    The one rule both the depth builder and the decode-step reuse apply."""
    return (pages / grouped_pages if grouped_pages else 0.0) < COALESCE_RATIO


def root_blocks(pt, last) -> np.ndarray:
    """The first (root) block of each sequence whose last block is ``last`` (B,)."""
    cur = last
    while True:
        up = pt.b_parent[cur]
        has = up >= 0
        if not has.any():
            return cur
        cur = np.where(has, up, cur)


def sharing_pays(pt, first) -> bool:
    """Whether coalescing consecutive sequences with the same first block ``first`` (B,; -1:
    none) into one entry saves enough pages to read them once (``decode_kernel_wins``): the
    one coalescing rule of decode batches and static-shape mixed steps."""
    heads = np.concatenate([[True], first[1:] != first[:-1]])
    pages = pt.b_npages[np.maximum(first, 0)] * (first >= 0)
    return not decode_kernel_wins(int(pages.sum()), int(pages[heads].sum()))


@dataclass
class DepthLastBlocks:
    """Where a depth holds the batch's last blocks, and its page counts behind the coalescing
    choice; the decode-step reuse updates the counts as last blocks grow.

    ``seq_index``/``entry_index``: the sequences whose last block this depth holds, and the
    entry holding each. ``pages``/``grouped_pages``: pages of each sequence's block at this
    depth, summed, before and after coalescing. ``own_block`` (B,) bool: the sequence's last
    block is its block at exactly this depth (growth changes this depth's counts)."""

    seq_index: np.ndarray
    entry_index: np.ndarray
    pages: int
    grouped_pages: int
    own_block: np.ndarray


def build_depths(pt, config, last, qo_indptr, *, is_decode: bool, tree_sizes=None,
                 tree_masks: Optional[list] = None, max_append: Optional[int] = None,
                 want_holders: bool = True, share: bool = False) -> tuple[tuple, Optional[list]]:
    """(the ``HostDepth`` of each depth, the ``DepthLastBlocks`` of each) for sequences with
    last blocks ``last`` (B,) and queries ``qo_indptr`` (B+1,). ``tree_sizes`` (B,) and
    ``tree_masks``: the sequences' token trees, carried by the entry holding the last block.
    ``max_append``: the longest sequence's query count when known; ``want_holders=False``:
    skip the ``DepthLastBlocks`` (None; only a reused decode plan reads them); ``share`` (a
    static-shape mixed step): one depth, each sequence's whole page list one entry, unless
    coalescing the batch's first blocks saves pages (the decode rule, ``decode_kernel_wins``),
    then the shared blocks are depth 0 and the rest depth 1."""
    batch = len(last)
    parent = pt.b_parent
    # walk parents for the whole batch at once: chain[k, i] is the k-th ancestor of i's last block
    chain = [last]
    cur = last
    while True:
        up = parent[cur]
        up[cur < 0] = -1                            # parent[-1] is some block's: mask it
        if np.maximum.reduce(up) < 0:
            break
        chain.append(up)
        cur = up
    width = len(chain)
    if width == 1 or np.minimum.reduce(chain[-1]) >= 0:
        # every trace equally deep (the common case): depth d is row width - 1 - d
        lo_depth = width
        trace = None
        ndepth = np.full(batch, width) if want_holders else None
    else:
        ancestors = np.stack(chain)                 # (K, B), leaf first
        ndepth = (ancestors >= 0).sum(axis=0)
        lo_depth = int(ndepth.min())
        src = ndepth[:, None] - 1 - np.arange(width)[None, :]
        trace = np.where(src >= 0, ancestors[np.maximum(src, 0), np.arange(batch)[:, None]],
                         -1)                        # (B, K) root first
    # static-shape decode reads each sequence's whole page list as one entry (one launch per
    # layer whatever the fork structure, so one captured step fits every batch of its bucket)
    flat = config.static_decode and is_decode
    max_depth = 1 if flat else MAX_BLOCK_DEPTH
    plain = not config.support_sliding_window and tree_sizes is None
    if width > 1 and ((is_decode and not flat and plain) or share):
        # a decode batch whose first blocks are not worth coalescing (nothing, or too little,
        # shared inside the batch: e.g. one sequence started from a cached prefix) reads each
        # sequence's whole page list as one entry, as an unforked sequence does: one launch,
        # and the same attention arithmetic as a sequence that computed those pages itself
        # (a static-shape mixed step takes the same rule)
        if not sharing_pays(pt, chain[width - 1] if trace is None else trace[:, 0]):
            max_depth = 1
    if config.batch_invariant:      # each sequence's whole page list, one entry: no coalescing
        max_depth = 1
    num_depths = min(width, max_depth)
    seq_all = np.arange(batch)
    depths, holders = [], []
    change = np.empty(batch + 1, bool)              # entry boundaries of coalesced groups
    change[0] = change[batch] = True
    for d in range(num_depths):
        at_d = chain[width - 1 - d] if trace is None else trace[:, d]
        full = d < lo_depth                         # every sequence has a block at depth d
        if full:
            npages_d = int(np.add.reduce(pt.b_npages[at_d]))
        else:
            npages_d = int(np.where(at_d >= 0, pt.b_npages[np.maximum(at_d, 0)], 0).sum())
        np.not_equal(at_d[1:], at_d[:-1], out=change[1:batch])
        bounds = change.nonzero()[0]
        starts = bounds[:-1]
        blocks_c = at_d[starts]
        if full:
            pages_c = int(np.add.reduce(pt.b_npages[blocks_c]))
        else:
            pages_c = int(np.where(blocks_c >= 0, pt.b_npages[np.maximum(blocks_c, 0)], 0).sum())
        use_decode = is_decode and (flat or decode_kernel_wins(npages_d, pages_c))
        last_depth = d == max_depth - 1
        single = full and (not last_depth or width == d + 1)      # one block per entry
        if use_decode or last_depth or len(starts) == batch:
            entry_qo = qo_indptr
            entry_seq = seq_all
            if single:
                pair_entry, pair_block = None, at_d
            elif last_depth:
                if trace is None:
                    trace = np.stack(chain[::-1], axis=1)   # (B, K) root first
                pair_entry, pair_block = np.nonzero(trace[:, d:] >= 0)
                pair_block = trace[:, d:][pair_entry, pair_block]
            else:
                pair_entry = np.nonzero(at_d >= 0)[0]
                pair_block = at_d[pair_entry]
        else:
            entry_qo = qo_indptr[bounds]
            entry_seq = starts                      # first sequence of each group
            if full:
                pair_entry, pair_block = None, blocks_c
            else:
                pair_entry = np.nonzero(blocks_c >= 0)[0]
                pair_block = blocks_c[pair_entry]
        if pair_entry is None and plain:
            depth = _single_depth(pt, config.page_size, entry_qo, pair_block, use_decode,
                                  max_append if entry_qo is qo_indptr else None)
            holds_last = None
        else:
            if pair_entry is None:
                pair_entry = np.arange(len(pair_block))
            depth, holds_last = _depth(pt, config.page_size, entry_qo, pair_entry, pair_block,
                                       use_decode, entry_seq, last, tree_sizes, tree_masks)
        if entry_qo is not qo_indptr:       # coalesced: an entry holds many sequences' rows
            depth = evolve(depth, shared=True)
        depths.append(depth)
        if want_holders:
            assert ndepth is not None                   # set whenever holders are wanted
            if holds_last is None:
                holds_last = _ends_with(depth, pair_block, last, entry_seq)
            holders.append(DepthLastBlocks(entry_seq[holds_last], holds_last, npages_d,
                                           pages_c, ndepth - 1 == d))
    return tuple(depths), (holders if want_holders else None)


def _ends_with(depth, blocks, last, entry_seq) -> np.ndarray:
    """Entries of a one-block-per-entry depth whose block is their sequence's last block."""
    return (blocks == last[entry_seq]).nonzero()[0]


def _single_depth(pt, ps, entry_qo, blocks, use_decode, max_qo_len) -> HostDepth:
    """``_depth``'s ``HostDepth`` when entry ``i`` reads exactly block ``blocks[i]`` and nothing
    slides or carries a tree (the common case): the same arrays in fewer numpy calls.
    ``max_qo_len``: the longest entry's query count, when known."""
    n = len(blocks)
    counts = pt.b_npages[blocks]
    page_indptr = np.zeros(n + 1, np.int32)
    np.cumsum(counts, out=page_indptr[1:])
    num_pages = int(page_indptr[-1])
    store = np.repeat(pt.b_pstart[blocks] - page_indptr[:-1], counts)
    store += np.arange(num_pages)
    kv_len = pt.b_len[blocks]
    last_page_len = kv_len - 1
    last_page_len %= ps
    last_page_len += 1
    last_page_len[kv_len == 0] = 0
    zeros = np.zeros(n, np.int32)
    if max_qo_len is None:
        max_qo_len = int(np.maximum.reduce(entry_qo[1:] - entry_qo[:-1])) if n else 0
    return build(
        HostDepth, qo_indptr=entry_qo.astype(np.int32), page_indptr=page_indptr,
        page_indices=pt.page_store[store], last_page_len=last_page_len, kv_len=kv_len,
        sink_size=zeros, window_offset=zeros, k_rope_offset=pt.b_start[blocks],
        num_entries=n, use_decode=bool(use_decode), tree=None,
        max_kv_len=int(np.maximum.reduce(kv_len)) if n else 0, max_qo_len=max_qo_len,
        num_pages=num_pages, covers_rows=True,
        uniform=not use_decode and _uniform(entry_qo, kv_len))


def _depth(pt, ps, entry_qo, pair_entry, pair_block, use_decode, entry_seq, last, tree_sizes,
           tree_masks) -> tuple[HostDepth, np.ndarray]:
    """The ``HostDepth`` whose entry ``pair_entry[j]`` reads block ``pair_block[j]`` (pairs
    sorted by entry, root first), and the entries holding a sequence's last block."""
    n = len(entry_qo) - 1
    counts = pt.b_npages[pair_block].astype(np.int64)
    page_indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(pair_entry, counts, minlength=n), out=page_indptr[1:])
    before = exclusive_cumsum(counts)
    store = np.repeat(pt.b_pstart[pair_block] - before[:-1], counts) + np.arange(before[-1])
    page_indices = pt.page_store[store]
    kv_len = np.bincount(pair_entry, pt.b_len[pair_block].astype(np.int64), minlength=n)
    kv_len = kv_len.astype(np.int64)
    # first and last block of each entry
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
    slid = has & (pt.b_window_offset[lb0] > 0)
    prefix = kv_len - np.where(has, pt.b_len[lb0], 0)
    sink = np.where(slid, prefix + pt.b_sink[lb0], 0)
    window_offset = np.where(slid, prefix + pt.b_window_offset[lb0], 0)
    span = np.where(slid, window_offset + kv_len - sink, kv_len)
    holds_last = has & (lb == last[entry_seq])
    tree = None
    if tree_sizes is not None:
        # only the entry holding a sequence's last block carries its tree
        sizes = np.where(holds_last, tree_sizes[entry_seq], 0)
        if sizes.any():
            tree = TreeMask(exclusive_cumsum(sizes).astype(np.int32),
                            np.concatenate([tree_masks[entry_seq[e]]
                                            for e in np.nonzero(sizes)[0]]).astype(np.int32))

    def i32(x):
        return np.ascontiguousarray(x, dtype=np.int32)

    depth = HostDepth(
        qo_indptr=i32(entry_qo), page_indptr=i32(page_indptr), page_indices=i32(page_indices),
        last_page_len=i32(np.where(span > 0, (span - 1) % ps + 1, 0)), kv_len=i32(kv_len),
        sink_size=i32(sink), window_offset=i32(window_offset),
        k_rope_offset=i32(np.where(has, pt.b_start[np.maximum(fb, 0)], 0)),
        num_entries=n, use_decode=bool(use_decode), tree=tree,
        max_kv_len=int(kv_len.max()) if n else 0,
        max_qo_len=int(np.diff(entry_qo).max()) if n else 0, num_pages=int(page_indptr[-1]),
        covers_rows=True,
        uniform=(not use_decode and tree is None and not slid.any()
                 and _uniform(entry_qo, kv_len)))
    return depth, np.flatnonzero(holds_last)


def _uniform(entry_qo, kv_len) -> bool:
    """Every entry has as many queries as the longest and as many keys as the longest (and
    at least one of each): ``DepthAux.uniform``."""
    n = len(kv_len)
    if n == 0 or np.minimum.reduce(kv_len) != np.maximum.reduce(kv_len) or kv_len[0] == 0:
        return False
    qo = entry_qo[1:] - entry_qo[:-1]
    return bool(qo[0] > 0 and np.minimum.reduce(qo) == np.maximum.reduce(qo))
