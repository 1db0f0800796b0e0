"""Static-shape steps: a plain decode plan padded to its batch bucket
(``CacheConfig(static_decode=True)``), a mixed step's one-pass plan padded to its token bucket
(``CacheConfig(static_mixed=True)``), and the capacities of the fixed device buffers their
arrays are copied into.

Padded rows append nowhere (slot -1) and their entries hold no keys, so they read o = 0 /
lse = -inf. Every shape and launch parameter then depends on the bucket alone
(``max_kv_len`` is the cache's bound; kernels read the real lengths from the arrays), so a
backend can capture the step once per bucket and replay it on later steps.

A mixed step (prefill chunks, with or without decode rows) is one paged pass per layer: K/V are
written first and each sequence is one entry over its whole page list, its new tokens a chain
token tree (token ``r`` sees the history and new tokens ``0..r``: causal), so every array has
one fixed length per token bucket: tokens ``bucket``, entries ``max_batch_size``. Where the
batch's sequences share a prefix worth reading once (the planner's decode rule), the step is
two paged passes merged: the shared blocks (depth 0), then each sequence's own (depth 1), each
depth padded the same way; such steps are a kind of their own (``ForwardPlan.static_kind``).
"""

from __future__ import annotations

import numpy as np

from ..backend import TreeMask
from .plan import ForwardPlan, HostDepth, TokenArrays, evolve


def _pad(array, pad: int, fill) -> np.ndarray:
    """``array`` with ``pad`` int32 values ``fill`` after it (the aux copy stores int32)."""
    return np.concatenate([array, np.full(pad, fill, np.int32)]) if pad else array


def pad_to_bucket(plan: ForwardPlan, config) -> ForwardPlan:
    """``plan`` (a plain decode plan of one depth) padded to its bucket."""
    batch = len(plan.seq_ids)
    bucket = config.static_bucket(batch)
    pad = bucket - batch
    rows = np.arange(bucket + 1, dtype=np.int32)

    def tail(array, fill):
        return _pad(array, pad, fill)

    t, d = plan.tokens, plan.depths[0]
    tokens = TokenArrays(qo_indptr=rows, q_positions=tail(t.q_positions, 0),
                         append_slots=tail(t.append_slots, -1),
                         k_rope_offset=tail(t.k_rope_offset, 0))
    depth = HostDepth(qo_indptr=rows, page_indptr=tail(d.page_indptr, d.page_indptr[-1]),
                      page_indices=d.page_indices, last_page_len=tail(d.last_page_len, 0),
                      kv_len=tail(d.kv_len, 0), sink_size=tail(d.sink_size, 0),
                      window_offset=tail(d.window_offset, 0),
                      k_rope_offset=tail(d.k_rope_offset, 0), num_entries=bucket,
                      use_decode=True, max_kv_len=config.num_pages * config.page_size,
                      max_qo_len=1, num_pages=d.num_pages)
    return evolve(plan, tokens=tokens, depths=(depth,), static_bucket=bucket)


def chain_masks(append_lengths) -> tuple[np.ndarray, list]:
    """Per sequence of ``append_lengths`` (B,) new tokens, the ``TreeMask`` pairs of a chain
    (token ``r``: order ``r``, upper ``n``: it sees tokens ``0..r``), as ``build_depths`` takes
    them: (tree sizes (B,), one flat int32 array of pairs per sequence)."""
    sizes = np.asarray(append_lengths, np.int64)
    return sizes, [np.stack([np.arange(n, dtype=np.int32), np.full(n, n, np.int32)],
                            axis=1).reshape(-1) for n in sizes.tolist()]


def pad_mixed(plan: ForwardPlan, config) -> ForwardPlan:
    """``plan`` (a mixed step planned as paged passes: ``paged_only``, its depths' entries
    carrying the sequences' chain trees) padded to its token bucket and each depth to
    ``max_batch_size`` entries. Every depth gets a tree (empty where it carries none), so the
    arrays of a kind of step are the same every step."""
    total = plan.total_tokens
    bucket = config.static_mixed_bucket(total)
    entries = config.max_batch_size
    pad_t = bucket - total
    assert plan.paged_only
    tail = _pad
    t = plan.tokens
    pad_e = entries - len(plan.seq_ids)
    tokens = TokenArrays(qo_indptr=tail(t.qo_indptr, pad_e, total),
                         q_positions=tail(t.q_positions, pad_t, 0),
                         append_slots=tail(t.append_slots, pad_t, -1),
                         k_rope_offset=tail(t.k_rope_offset, pad_e, 0))
    depths = []
    for d in plan.depths:
        pad_e = entries - d.num_entries
        tree = d.tree
        if tree is None:
            tree = TreeMask(np.zeros(d.num_entries + 1, np.int32), np.zeros(0, np.int32))
        tree_rows = int(tree.indptr[-1])
        depths.append(HostDepth(
            qo_indptr=tail(d.qo_indptr, pad_e, total),
            page_indptr=tail(d.page_indptr, pad_e, d.page_indptr[-1]),
            page_indices=d.page_indices, last_page_len=tail(d.last_page_len, pad_e, 0),
            kv_len=tail(d.kv_len, pad_e, 0), sink_size=tail(d.sink_size, pad_e, 0),
            window_offset=tail(d.window_offset, pad_e, 0),
            k_rope_offset=tail(d.k_rope_offset, pad_e, 0), num_entries=entries,
            use_decode=False,
            tree=TreeMask(tail(tree.indptr, pad_e, tree_rows),
                          tail(tree.mask, 2 * (bucket - tree_rows), 0), chains=True),
            max_kv_len=config.num_pages * config.page_size, max_qo_len=bucket,
            num_pages=d.num_pages, shared=d.shared))
    return evolve(plan, tokens=tokens, depths=tuple(depths), static_bucket=bucket,
                  static_mixed=True)


def static_capacity(config, kind: tuple) -> ForwardPlan:
    """The capacity plan of static-shape steps of ``kind`` (``ForwardPlan.static_kind``): a
    padded plan of the kind's largest bucket whose arrays have the largest length any step's
    can have (page lists: every entry reading a whole cache's worth of pages, since shared
    prefixes repeat per entry); the kind's fixed device buffer is laid out from it."""
    mixed, depths = kind
    if mixed:
        return _capacity(config, config.static_mixed_buckets[-1], config.max_batch_size,
                         mixed=True, depths=depths)
    rows = config.static_buckets[-1]
    return _capacity(config, rows, rows, mixed=False, depths=depths)


def _capacity(config, rows: int, entries: int, mixed: bool, depths: int) -> ForwardPlan:
    """A plan of ``rows`` tokens and ``depths`` depths of ``entries`` entries, each array at its
    largest length; ``mixed``: with the chain trees of a mixed step."""

    def room(n):
        return np.zeros(n, np.int32)

    tokens = TokenArrays(qo_indptr=room(entries + 1), q_positions=room(rows),
                         append_slots=room(rows), k_rope_offset=room(entries))
    depth = HostDepth(qo_indptr=room(entries + 1), page_indptr=room(entries + 1),
                      page_indices=room(entries * config.num_pages), last_page_len=room(entries),
                      kv_len=room(entries), sink_size=room(entries), window_offset=room(entries),
                      k_rope_offset=room(entries), num_entries=entries, use_decode=not mixed,
                      tree=TreeMask(room(entries + 1), room(2 * rows)) if mixed else None)
    return ForwardPlan(seq_ids=[], append_lengths=room(0), total_tokens=rows,
                       max_append=rows if mixed else 1, paged_only=True, write_after=False,
                       tokens=tokens, depths=(depth,) * depths, static_bucket=rows,
                       static_mixed=mixed)
