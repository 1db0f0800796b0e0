"""CUDA-graph mode (``CacheConfig(static_decode=True)``), for backends declaring ``static_decode``:
decode batches padded to their bucket give the reference's results on the real rows and
o = 0 / lse = -inf on padded rows, one fixed device buffer holds every step's index arrays, and
forwards that are not plain decode steps stay eager; with ``static_mixed=True`` (and
``tree_attention``) steps that prefill are padded to a token bucket, one paged pass over chain
trees, with the reference's results. Capturing a graph is the backend package's own API (e.g.
``kvcache_cuda.DecodeGraphs``) and is tested there."""

from __future__ import annotations

from .base import Conformance

import numpy as np

from .tolerance import Mismatch, assert_close


def _family(p):
    """Histories of one to three blocks: 0, its fork 1, 1's mid-page fork 2, and 3 unrelated."""
    ps = p.config.page_size
    p.add(0)
    p.prefill(0, 2 * ps + 3)
    p.fork(0, 1)
    p.prefill(1, ps // 2 + 1)
    p.fork(1, 2, 2 * ps + 2)
    p.prefill(2, 3)
    p.add(3)
    p.prefill(3, 5)


class TestGraphMode(Conformance):
    """CUDA-graph mode (``CacheConfig(static_decode=True)``), run where the backend declares
    ``static_decode``: a decode batch pads to its bucket (``static_bucket``), padded rows give
    o = 0 and lse = -inf, one fixed device buffer receives every step's index arrays (one copy
    per ``begin_forward``, so a captured graph reads current data), other forwards stay eager,
    and an aborted step changes nothing."""

    def test_decode_padded_to_bucket(self, make_pair):
        p = make_pair(needs=("static_decode",), static_decode=True, rope_mode="normal")
        _family(p)
        for ids, bucket in (([2, 0, 3], 4), ([1], 1), ([3, 2, 1, 0], 4), ([0, 2], 2)):
            p.begin(ids, [1] * len(ids))
            if p.dut.static_bucket != bucket:
                raise Mismatch(f"graph mode: a decode batch of {len(ids)} should pad to bucket "
                               f"{bucket}, static_bucket is {p.dut.static_bucket}{p.context()}")
            p.check_positions()
            for layer in range(p.config.num_layers):
                p.attend(layer)
            p.end()

    def test_bucket_rows_and_padding(self, make_pair):
        """Inputs of the bucket's rows (what a captured step feeds) are accepted; real rows match
        the reference, padded rows give o = 0 and lse = -inf."""
        p = make_pair(needs=("static_decode",), static_decode=True)
        _family(p)
        ids = [3, 1, 0]
        p.begin(ids, [1, 1, 1])
        bucket = p.dut.static_bucket
        c = p.config
        for layer in range(c.num_layers):
            q, k, v = (p.random(bucket, h, c.head_dim) for h in (c.num_qo_heads, c.num_kv_heads,
                                                                 c.num_kv_heads))
            o_r, l_r = p.ref.attention(layer, *(p.ref.from_numpy(x[:3]) for x in (q, k, v)),
                                       return_lse=True)
            o_d, l_d = p.dut.attention(layer, *(p.dut.from_numpy(x) for x in (q, k, v)),
                                       return_lse=True)
            o_d, l_d = p.dut.backend.to_numpy(o_d), p.dut.backend.to_numpy(l_d)
            assert_close(f"graph-mode output (layer {layer})", p.ref.backend.to_numpy(o_r), o_d[:3],
                         p.tol, context=p.context())
            assert_close(f"graph-mode lse (layer {layer})", p.ref.backend.to_numpy(l_r), l_d[:3],
                         p.tol, lse=True, context=p.context())
            if not (np.all(o_d[3:] == 0) and np.all(np.isneginf(l_d[3:]))):
                raise Mismatch(f"graph mode: padded rows must give o = 0 and lse = -inf (layer "
                               f"{layer}){p.context()}")
        p.model = None           # the dense model saw no attention calls this forward
        p.end()

    def test_one_fixed_buffer_across_steps(self, make_pair):
        p = make_pair(needs=("static_decode",), static_decode=True)
        _family(p)
        manager = p.dut.aux_manager
        buffers = set()
        for step in range(2 * p.config.page_size + 2):       # page lists grow meanwhile
            copies = manager.copies
            p.begin([0, 1, 2, 3], [1, 1, 1, 1])
            if manager.copies != copies + 1:
                raise Mismatch(f"graph mode: begin_forward must issue the step's one aux copy "
                               f"(step {step}: {manager.copies - copies} copies){p.context()}")
            buffers.add(id(manager.static_device_buffer))
            p.attend(0)
            p.attend(1)
            p.end()
        if len(buffers) != 1:
            raise Mismatch(f"graph mode: the device aux buffer moved ({len(buffers)} buffers over "
                           f"the steps); captured graphs would read stale data{p.context()}")

    def test_other_forwards_stay_eager(self, make_pair):
        p = make_pair(needs=("static_decode",), static_decode=True, static_decode_batch_sizes=(1, 2))
        _family(p)
        for ids, lens in (([0, 1], [3, 1]), ([0, 1, 2], [1, 1, 1])):   # prefill; too many rows
            p.begin(ids, lens)
            if p.dut.static_bucket is not None:
                raise Mismatch(f"graph mode: forward {ids} {lens} is not a bucketed decode step "
                               f"but got bucket {p.dut.static_bucket}{p.context()}")
            for layer in range(p.config.num_layers):
                p.attend(layer)
            p.end()
        p.decode([3, 0], steps=2)

    def test_aborted_step_changes_nothing(self, make_pair):
        """A graph-mode decode step (its index arrays already copied by begin_forward) that is
        aborted leaves the cache exactly as before it; the next steps use the buffer as usual."""
        p = make_pair(needs=("static_decode",), static_decode=True, rope_mode="normal")
        _family(p)
        p.aborted([2, 0, 3], [1, 1, 1])
        p.decode([2, 0, 3], steps=2)
        p.aborted([2, 0, 3], [1, 1, 1], layers=p.config.num_layers, how="raise")
        p.decode([0, 2, 3], steps=1)

    def test_decode_with_window_left(self, make_pair):
        """A per-query window in graph-mode decode steps (padded buckets, forked histories)."""
        p = make_pair(needs=("static_decode", "window_left"), static_decode=True,
                      rope_mode="normal")
        _family(p)
        w = p.config.page_size // 2 + 1
        for ids in ([2, 0, 3], [1], [3, 2, 1, 0]):
            p.forward(ids, [1] * len(ids), window_left=w)
        p.decode([0, 2], steps=2, window_left=0)


class TestStaticMixedSteps(Conformance):
    """Static-shape mixed steps (``CacheConfig(static_mixed=True)``), run where the backend
    declares ``static_decode`` and ``tree_attention``: a forward that prefills (alone or beside
    decode rows) pads to its token bucket as one paged pass whose new tokens are chain trees
    (``TreeMask.chains``); it gives the reference's results on the real rows, o = 0 and
    lse = -inf on padded rows (inputs of the bucket's rows), takes a per-layer ``window_left``
    where the backend declares it, and its arrays go to one fixed buffer of their own; a step
    whose sequences share a prefix is two such passes merged (the shared pages read once);
    decode steps keep their decode buckets."""

    def _pair(self, make_pair, **kw):
        return make_pair(needs=("static_decode", "tree_attention"), static_decode=True,
                         static_mixed=True, rope_mode="normal", **kw)

    def test_mixed_steps_match_the_reference(self, make_pair):
        p = self._pair(make_pair)
        _family(p)                       # its prefills are static-shape mixed steps already
        manager = p.dut.aux_manager
        buffers: dict = {}
        for ids, lens in (([2, 0, 3], [4, 1, 9]), ([1, 3], [1, 17]), ([0, 1, 2, 3], [1, 1, 1, 2]),
                          ([3, 2], [6, 2])):
            p.begin(ids, lens)
            plan = p.dut.open_plan
            bucket = p.config.static_mixed_bucket(sum(lens))
            if not plan.static_mixed or p.dut.static_bucket != bucket:
                raise Mismatch(f"static mixed: forward {ids} {lens} should pad to token bucket "
                               f"{bucket}, static_bucket is {p.dut.static_bucket}{p.context()}")
            p.check_positions()
            kind = plan.static_kind
            buffers.setdefault(kind, set()).add(id(manager.static_buffer(*kind)))
            for layer in range(p.config.num_layers):
                p.attend(layer)
            p.end()
        if any(len(b) != 1 for b in buffers.values()):
            raise Mismatch(f"static mixed: a kind of step's device aux buffer moved "
                           f"({ {k: len(b) for k, b in buffers.items()} } buffers per kind over "
                           f"the steps){p.context()}")
        p.decode([3, 0, 2], steps=2)
        p.begin([3, 0], [1, 1])
        if p.dut.open_plan.static_mixed or p.dut.static_bucket != 2:
            raise Mismatch(f"static mixed: a decode step should keep its decode bucket 2, got "
                           f"{p.dut.static_bucket}{p.context()}")
        for layer in range(p.config.num_layers):
            p.attend(layer)
        p.end()

    def test_shared_prefix_mixed_steps(self, make_pair):
        # many sequences under one prefix, one of them prefilling: the step reads the shared
        # pages once (depth 0) and merges them with each sequence's own (depth 1), both padded
        p = self._pair(make_pair)
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 3 * ps)
        for sid in (1, 2, 3):
            p.fork(0, sid)
            p.prefill(sid, sid + 1)
        steps = ((([1, 0, 2, 3], [1, 5, 1, 1]), 2), (([0, 1, 2, 3], [1, 1, ps + 2, 1]), 2),
                 (([3, 2], [ps + 1, 1]), 2))
        for (ids, lens), depths in steps:
            p.begin(ids, lens)
            plan = p.dut.open_plan
            if plan.static_kind != (True, depths) or p.dut.static_bucket is None:
                raise Mismatch(f"static mixed: forward {ids} {lens} over a shared prefix should "
                               f"plan {depths} padded depths, got kind {plan.static_kind}, bucket "
                               f"{p.dut.static_bucket}{p.context()}")
            p.check_positions()
            for layer in range(p.config.num_layers):
                p.attend(layer)
            p.end()
        p.decode([0, 1, 2, 3], steps=2)

    def test_bucket_rows_and_padding(self, make_pair):
        p = self._pair(make_pair)
        _family(p)
        ids, lens = [3, 1], [1, 6]
        p.begin(ids, lens)
        bucket, total, c = p.dut.static_bucket, sum(lens), p.config
        for layer in range(c.num_layers):
            q, k, v = (p.random(bucket, h, c.head_dim) for h in (c.num_qo_heads, c.num_kv_heads,
                                                                 c.num_kv_heads))
            o_r, l_r = p.ref.attention(layer, *(p.ref.from_numpy(x[:total]) for x in (q, k, v)),
                                       return_lse=True)
            o_d, l_d = p.dut.attention(layer, *(p.dut.from_numpy(x) for x in (q, k, v)),
                                       return_lse=True)
            o_d, l_d = p.dut.backend.to_numpy(o_d), p.dut.backend.to_numpy(l_d)
            assert_close(f"static mixed output (layer {layer})", p.ref.backend.to_numpy(o_r),
                         o_d[:total], p.tol, context=p.context())
            assert_close(f"static mixed lse (layer {layer})", p.ref.backend.to_numpy(l_r),
                         l_d[:total], p.tol, lse=True, context=p.context())
            if not (np.all(o_d[total:] == 0) and np.all(np.isneginf(l_d[total:]))):
                raise Mismatch(f"static mixed: padded rows must give o = 0 and lse = -inf "
                               f"(layer {layer}){p.context()}")
        p.model = None           # the dense model saw no attention calls this forward
        p.end()

    def test_window_left_in_mixed_steps(self, make_pair):
        p = make_pair(needs=("static_decode", "tree_attention", "window_left"),
                      static_decode=True, static_mixed=True, rope_mode="normal")
        _family(p)
        p.begin([2, 0, 3], [5, 1, 12])
        for layer in range(p.config.num_layers):
            p.attend(layer, window_left=7 if layer == 0 else -1)
        p.end()
