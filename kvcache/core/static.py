"""Static-shape decode (``CacheConfig(static_decode=True)``): a plain decode plan padded to its
batch bucket, and the capacities of the fixed device buffer its arrays are copied into.

Padded rows append nowhere (slot -1) and their entries hold no keys, so they read o = 0 /
lse = -inf. Every shape and launch parameter then depends on the bucket alone
(``max_kv_len`` is the cache's bound; kernels read the real lengths from the arrays), so a
backend can capture the step once per bucket and replay it on later steps.
"""

from __future__ import annotations

import numpy as np

from .plan import ForwardPlan, HostDepth, TokenArrays, evolve


def pad_to_bucket(plan: ForwardPlan, config) -> ForwardPlan:
    """``plan`` (a plain decode plan of one depth) padded to its bucket."""
    batch = len(plan.seq_ids)
    bucket = config.static_bucket(batch)
    pad = bucket - batch
    rows = np.arange(bucket + 1, dtype=np.int32)

    def tail(array, fill):
        return np.concatenate([array, np.full(pad, fill, np.int32)]) if pad else array

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


def capacity_plan(config) -> ForwardPlan:
    """A padded plan of the largest bucket whose arrays have the largest length any step's
    can have (page lists: every row reading a whole cache's worth of pages, since shared
    prefixes repeat per row); the static aux buffer is laid out from it."""
    rows = config.static_buckets[-1]

    def room(n):
        return np.zeros(n, np.int32)

    tokens = TokenArrays(qo_indptr=room(rows + 1), q_positions=room(rows),
                         append_slots=room(rows), k_rope_offset=room(rows))
    depth = HostDepth(qo_indptr=room(rows + 1), page_indptr=room(rows + 1),
                      page_indices=room(rows * config.num_pages), last_page_len=room(rows),
                      kv_len=room(rows), sink_size=room(rows), window_offset=room(rows),
                      k_rope_offset=room(rows), num_entries=rows, use_decode=True)
    return ForwardPlan(seq_ids=[], append_lengths=room(0), total_tokens=rows, max_append=1,
                       paged_only=True, write_after=False, tokens=tokens, depths=(depth,),
                       static_bucket=rows)
