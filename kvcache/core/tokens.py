"""Planner step 3, token arrays: where each new token is written and at which position it is
rotated, and the token trees' visibility masks. Runs after the reservation (a sliding window's
slots depend on its slide)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..backend import TreeMask
from .plan import TokenArrays, build
from .request import ForwardRequest, exclusive_cumsum


def token_arrays(state, config, req: ForwardRequest, qo_indptr, blen_before, seq_len_before,
                 slides: dict, self_tree_masks: Optional[list]) -> TokenArrays:
    """The ``TokenArrays`` of a reserved forward. ``blen_before``/``seq_len_before``: each last
    block's and sequence's length before the reservation; ``self_tree_masks``: per sequence,
    its tree's ``tree_masks`` when the ragged pass needs them (else None)."""
    pt, ps = state.pt, config.page_size
    seq_of_token = np.repeat(np.arange(req.batch), req.append)
    t = np.arange(req.total)
    first = qo_indptr[:-1]
    # token t of sequence i is its (t - first[i])-th new token
    in_block = (blen_before - first)[seq_of_token]
    in_block += t
    page, row = np.divmod(in_block, ps)
    page += pt.b_pstart[req.last][seq_of_token]
    # int32 slots cannot wrap: num_pages * page_size fits in int32 (CacheConfig)
    slots = pt.page_store[page]
    slots *= ps
    slots += row
    for i in slides:
        lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
        slots[lo:hi] = sliding_slots(state, config, req.seqs[i], int(blen_before[i]),
                                     int(req.append[i]))
    k_rope_offset = seq_len_before - req.tree_before       # the committed length
    if req.tree_parents is None:
        positions = (k_rope_offset - first)[seq_of_token]
        positions += t
    else:
        positions = np.zeros(req.total, np.int64)
        for i, seq in enumerate(req.seqs):
            lo, hi = int(qo_indptr[i]), int(qo_indptr[i + 1])
            positions[lo:hi] = int(k_rope_offset[i]) + np.asarray(seq.tree_depth[-(hi - lo):])
    self_tree = None
    if self_tree_masks is not None:
        sizes = np.array([len(seq.tree_parent) for seq in req.seqs], np.int64)
        self_tree = TreeMask(exclusive_cumsum(sizes).astype(np.int32),
                             np.concatenate(self_tree_masks).astype(np.int32))
    return build(TokenArrays, qo_indptr=qo_indptr.astype(np.int32),
                       q_positions=positions.astype(np.int32),
                       append_slots=slots,
                       k_rope_offset=k_rope_offset.astype(np.int32), self_tree=self_tree)


def sliding_slots(state, config, seq, block_len_before: int, append: int) -> np.ndarray:
    """Slots of a sliding sequence's new tokens: a token is stored if it is a first-time sink
    or inside the kept window; tokens that slid out within this forward get slot -1."""
    pt, ps = state.pt, config.page_size
    b = int(pt.s_last[seq.slot])
    blen, sink, window_offset = int(pt.b_len[b]), int(pt.b_sink[b]), int(pt.b_window_offset[b])
    pages = pt.pages_of(b)
    out = np.full(append, -1, np.int64)
    for r in range(append):
        pos_in_block = blen - append + r
        if block_len_before + r < sink:
            off = block_len_before + r
        elif pos_in_block < sink:
            continue
        else:
            off = pos_in_block - sink + window_offset
        out[r] = int(pages[off // ps]) * ps + off % ps
    return out


def tree_masks(seqs) -> list:
    """Per sequence, its uncommitted tree's ``(order, upper)`` pairs, flattened (``TreeMask``)."""
    masks = []
    for seq in seqs:
        order, upper = tree_order(seq.tree_parent)
        masks.append(np.stack([order, upper], axis=1).reshape(-1))
    return masks


def tree_order(parents: list) -> tuple[np.ndarray, np.ndarray]:
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
