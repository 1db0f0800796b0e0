"""``DepthAux.uniform``: the planner's host promise that every entry of a depth has as many
queries and as many keys as the longest (the cuda backend then runs several sequences through
cuDNN's batched attention on views of the rows, trusting it). Judged against the plan's own
index arrays: a wrong True would send a call with entries of other shapes to a kernel that
reads them at fixed strides."""

from __future__ import annotations

import numpy as np
import pytest

from test_batch_invariant_plans import _cache, _plan


def _prefill(cache, sids, lens):
    c = cache.config
    rng = np.random.default_rng(sum(lens))
    n = sum(lens)
    with cache.forward(sids, lens):
        cache.attention(0, *(rng.standard_normal((n, h, c.head_dim)).astype(np.float32)
                             for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)))


def _really_uniform(depth) -> bool:
    qo = np.diff(np.asarray(depth.qo_indptr))
    kv = np.asarray(depth.kv_len)[:depth.num_entries]
    return bool(depth.num_entries and qo.min() == qo.max() == depth.max_qo_len > 0
                and kv.min() == kv.max() == depth.max_kv_len > 0
                and not np.asarray(depth.sink_size).any()
                and not np.asarray(depth.window_offset).any())


@pytest.mark.parametrize("histories, chunks, want", [
    ([12, 12, 12], [5, 5, 5], True),          # equal chunks over equal histories
    ([12, 12, 12], [5, 5, 4], False),         # one chunk shorter
    ([12, 13, 12], [5, 5, 5], False),         # one history longer
    ([12], [7], True),                        # one entry
    ([12, 12], [1, 1], False),                # decode: the decode kernel's, never uniform
])
def test_the_planner_promises_uniform_only_when_it_holds(histories, chunks, want):
    cache = _cache()
    sids = list(range(len(histories)))
    for sid, n in zip(sids, histories):
        cache.add_sequence(sid)
        _prefill(cache, [sid], [n])
    plan = _plan(cache, sids, chunks)
    assert len(plan.depths) == 1
    depth = plan.depths[0]
    assert depth.uniform == want
    if depth.uniform:
        assert _really_uniform(depth)


def test_a_shared_prefix_depth_and_a_sliding_window_are_judged_by_their_arrays():
    """Forks of one prefix (a depth of the shared pages, then each sequence's own) and a
    sliding-window cache (sinks and a gap): the flag is True only where the arrays agree."""
    cache = _cache()
    cache.add_sequence(0)
    _prefill(cache, [0], [16])
    for sid in (1, 2):
        cache.fork_sequence(0, sid)
    for sid in (0, 1, 2):
        _prefill(cache, [sid], [3])
    plan = _plan(cache, [0, 1, 2], [4, 4, 4])
    assert plan.depths
    for depth in plan.depths:
        assert depth.uniform == _really_uniform(depth)
    slide = _cache(support_sliding_window=True)
    for sid in (0, 1):
        slide.add_sequence(sid)
        slide.enable_sliding_window(sid, 8, 2)
        _prefill(slide, [sid], [20])
    plan = _plan(slide, [0, 1], [4, 4])
    assert plan.depths
    for depth in plan.depths:
        assert np.asarray(depth.window_offset).any()     # the window slid: a gap after sinks
        assert depth.uniform == _really_uniform(depth) == False  # noqa: E712
