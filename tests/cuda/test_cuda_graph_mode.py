"""Graph mode (``CacheConfig(static_decode=True)``): padded decode plans in one fixed-address aux
buffer, outputs equal to eager non-graph execution and to the reference (forks at several
depths, histories growing 100x), and ``DecodeGraphs`` capture/replay with its refusals.

On CPU the capture is a stand-in that re-runs the step; the same tests run real CUDA graphs with
``KVCACHE_CUDA_TEST_DEVICE=cuda`` (see docs/backends/cuda.md)."""

import numpy as np
import pytest

import background_runs
import cuda_cases as cc
import kvcache
from kvcache.conformance import assert_close
from kvcache.core.plan import walk
from kvcache.errors import ForwardStateError, InvalidArgumentError

DTYPES = ["float32"] if cc.INTERPRET else cc.DTYPES
# Under the Triton interpreter (spawned by test_cuda_triton_interpreter.py in CI) each graph-mode
# decode scenario costs 10-35 s: there CI keeps test_graph_mode_decode_equals_with_window_left[20]
# (the same forked histories, bucket 8 padded and unpadded, buckets 1 and 2, through the Triton
# decode kernel, plus a window) and `make test-all` runs the other two; a window of 0 through
# the Triton kernels is test_ragged_window_left[triton-0]. The CPU torch mode and a GPU run all.
SLOW_IN_INTERPRETER = cc.SLOW_IN_INTERPRETER


def make(dtype, graph, backend="cuda", rope="normal", buckets=(), max_tokens=8192,
         kv_dtype="auto"):
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                              page_size=16, max_batch_size=8, max_total_tokens=max_tokens,
                              prefill_chunk_size=2048, dtype=dtype, rope_mode=rope,
                              static_decode=graph, static_decode_batch_sizes=buckets,
                              kv_dtype=kv_dtype)
    if backend == "reference":
        return kvcache.PagedKVCache(cfg.__class__(**{**cfg.__dict__, "static_decode": False}),
                                    backend="reference")
    return kvcache.PagedKVCache(cfg, backend=backend, device=cc.DEVICE)


def run_layers(cache, rows):
    """Attention on every layer with zero inputs, so that end_forward may commit the forward."""
    c = cache.config
    q, kv = (cache.from_numpy(np.zeros((rows, h, c.head_dim), np.float32))
             for h in (c.num_qo_heads, c.num_kv_heads))
    for layer in range(c.num_layers):
        cache.attention(layer, q, kv, kv)


class Trio:
    """A graph-mode cuda cache, an eager cuda cache and the reference, driven identically."""

    def __init__(self, dtype, seed=0, **kw):
        self.graph = make(dtype, True, **kw)
        self.eager = make(dtype, False, **kw)
        self.ref = make(dtype, False, backend="reference", **kw)
        self.caches = (self.graph, self.eager, self.ref)
        self.cfg = self.graph.config
        self.rng = np.random.default_rng(seed)
        if self.cfg.kv_dtype == "float8_e4m3":     # one set of scales (K's per head, V's)
            for c in self.caches:
                for layer in range(self.cfg.num_layers):
                    c.set_kv_scales(layer, [0.011, 0.009], 0.0105)

    def each(self, method, *args):
        for c in self.caches:
            getattr(c, method)(*args)

    def inputs(self, rows):
        c = self.cfg
        return [self.rng.standard_normal((rows, h, c.head_dim)).astype(np.float32)
                for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]

    def prefill(self, sid, n):
        self.each("begin_forward", [sid], [n])
        for layer in range(self.cfg.num_layers):
            parts = self.inputs(n)
            for c in self.caches:
                c.attention(layer, *map(c.from_numpy, parts))
        self.each("end_forward")

    def decode(self, ids, padded_inputs=False, window_left=-1, softcap=None, sinks=None):
        """One decode step; the graph cache gets bucket-row inputs when ``padded_inputs``;
        ``softcap`` / ``sinks`` (numpy, one logit per query head) go to every layer."""
        win = dict(return_lse=True, window_left=window_left)
        if softcap:
            win["logit_softcap"] = softcap
        sink = {c: c.from_numpy(sinks) for c in self.caches} if sinks is not None else {}
        self.each("begin_forward", ids, [1] * len(ids))
        bucket = self.graph.static_bucket
        assert bucket == self.cfg.static_bucket(len(ids))
        outs = []
        for layer in range(self.cfg.num_layers):
            parts = self.inputs(bucket)
            real = [p[:len(ids)] for p in parts]
            o_g, l_g = self.graph.attention(layer, *map(self.graph.from_numpy, parts if padded_inputs else real),
                                            sinks=sink.get(self.graph), **win)
            o_e, l_e = self.eager.attention(layer, *map(self.eager.from_numpy, real),
                                            sinks=sink.get(self.eager), **win)
            o_r, l_r = self.ref.attention(layer, *map(self.ref.from_numpy, real),
                                          sinks=sink.get(self.ref), **win)
            outs.append((o_g, l_g, o_e, l_e, o_r, l_r))
        self.each("end_forward")
        return outs


def _np(x):
    return kvcache.to_numpy(x).astype(np.float64)


def check(outs, n, dtype, padded, sinks=None):
    for o_g, l_g, o_e, l_e, o_r, l_r in outs:
        g, lg = _np(o_g), _np(l_g)
        assert_close("graph vs eager o", _np(o_e), g[:n], dtype)
        assert_close("graph vs reference o", _np(o_r), g[:n], dtype)
        assert_close("graph vs reference lse", _np(l_r), lg[:n], dtype, lse=True)
        if padded:        # padding rows see no key: o = 0, lse = -inf (each head's sink)
            empty = np.broadcast_to(-np.inf if sinks is None else sinks, lg[n:].shape)
            assert (g[n:] == 0).all() and np.allclose(lg[n:], empty, rtol=0, atol=1e-6)


def family(trio, lengths=(40, 7, 3)):
    """Sequence 0, a fork 1 of it, a fork 2 of 1 mid-page, a fork 3 of 0 at a page boundary,
    and an unrelated sequence 4: histories of one to three blocks."""
    trio.each("add_sequence", 0)
    trio.prefill(0, lengths[0])
    trio.each("fork_sequence", 0, 1, -1)
    trio.prefill(1, lengths[1])
    trio.each("fork_sequence", 1, 2, 45)
    trio.prefill(2, lengths[2])
    trio.each("fork_sequence", 0, 3, 32)
    trio.prefill(3, 5)
    trio.each("add_sequence", 4)
    trio.prefill(4, 9)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_IN_INTERPRETER) for d in DTYPES])
def test_graph_mode_decode_equals_eager_and_reference(dtype):
    trio = Trio(dtype, rope="normal")
    family(trio)
    ids = [2, 0, 4, 1, 3]                       # pads to bucket 8
    for step in range(6):
        check(trio.decode(ids, padded_inputs=step % 2 == 0), len(ids), dtype, step % 2 == 0)
    check(trio.decode([3]), 1, dtype, False)     # bucket 1
    check(trio.decode([1, 4]), 2, dtype, False)  # bucket 2


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_IN_INTERPRETER) for d in DTYPES])
def test_graph_mode_decode_over_fp8_pages_equals_eager_and_reference(dtype):
    """fp8 pages in graph-mode decode: the layer's scales are fixed device arrays, so a replay
    reads them as the eager kernels do; equal to eager and to the reference's emulation."""
    trio = Trio(dtype, rope="normal", kv_dtype="float8_e4m3")
    family(trio)
    for step, ids in enumerate(([2, 0, 4, 1, 3], [3], [1, 4], [2, 0, 4, 1, 3])):
        check(trio.decode(ids, padded_inputs=step % 2 == 0), len(ids), dtype, step % 2 == 0)
    assert np.allclose(trio.graph.kv_scales(1), ((0.011, 0.009), (0.0105, 0.0105)))


@pytest.mark.parametrize("window_left", [pytest.param(0, marks=SLOW_IN_INTERPRETER), 20])
def test_graph_mode_decode_equals_with_window_left(window_left):
    """A per-query window in graph-mode decode: a plain kernel argument, so padded buckets and
    forked histories give the eager and reference results."""
    trio = Trio("float32", rope="normal")
    family(trio)
    for step, ids in enumerate(([2, 0, 4, 1, 3], [3], [1, 4])):
        check(trio.decode(ids, padded_inputs=step == 0, window_left=window_left), len(ids),
              "float32", step == 0)


def test_graph_decode_softcap_and_sinks_equal_eager_and_reference():
    """Logit soft-capping and attention sinks in graph-mode decode (forked histories: several
    depths, the sink in exactly one of their calls; split-K in the eager cuda caches): equal to
    eager and to the reference, padding rows' lse the sink."""
    trio = Trio("float32", rope="normal")
    for c in trio.caches[:2]:
        c.backend.tuning = c.backend.tuning.with_(force_splits=2, split_min_keys=16)
    family(trio)
    sinks = np.linspace(-1.0, 2.5, trio.cfg.num_qo_heads).astype(np.float32)
    for step, ids in enumerate(([2, 0, 4, 1, 3], [3], [1, 4])):
        outs = trio.decode(ids, padded_inputs=step == 0, softcap=3.0, sinks=sinks)
        check(outs, len(ids), "float32", step == 0, sinks)


def test_graph_aux_buffer_has_fixed_addresses_and_one_copy_per_step():
    cache = make("float32", True)
    for sid in range(3):
        cache.add_sequence(sid)
        cache.begin_forward([sid], [20 + 17 * sid])
        run_layers(cache, 20 + 17 * sid)
        cache.end_forward()
    manager = cache.aux_manager
    allocations = manager.allocations            # the eager prefills' buffers
    seen = None
    for step in range(40):                       # crosses page boundaries: page lists grow
        copies = manager.copies
        ids = [0, 1, 2] if step % 5 else [2, 0, 1]
        cache.begin_forward(ids, [1, 1, 1])
        assert manager.copies == copies + 1      # copied by begin_forward itself
        views = list(walk(cache.forward_aux()))
        ptrs = {(d, k): v.data_ptr() for d, k, v in views}
        shapes = {(d, k): tuple(v.shape) for d, k, v in views}
        if seen is None:
            seen = (ptrs, shapes)
        assert (ptrs, shapes) == seen, f"step {step}: the graph aux views moved or changed shape"
        run_layers(cache, 3)
        cache.end_forward()
    assert manager.allocations == allocations + 1


def test_graph_plan_pads_and_keeps_launch_parameters_fixed():
    cache = make("float32", True, max_tokens=4096)
    for sid in range(5):
        cache.add_sequence(sid)
        cache.begin_forward([sid], [3 + 30 * sid])
        run_layers(cache, 3 + 30 * sid)
        cache.end_forward()
    cache.fork_sequence(4, 9, 50)
    metas = set()
    for ids in ([0, 1, 2], [4, 9, 0], [9, 3, 1]):
        cache.begin_forward(ids, [1, 1, 1])
        plan = cache.open_plan
        d = plan.depths[0]
        assert plan.static_bucket == 4 and len(plan.depths) == 1
        np.testing.assert_array_equal(plan.tokens.qo_indptr, np.arange(5))
        assert plan.tokens.append_slots[3] == -1 and d.kv_len[3] == 0
        assert d.page_indptr[4] == d.page_indptr[3]
        metas.add((d.num_entries, d.use_decode, d.max_kv_len, d.tree is not None))
        cache.abort_forward()
    assert metas == {(4, True, cache.config.num_pages * 16, False)}


def test_prefill_and_oversized_batches_stay_eager():
    cache = make("float32", True, buckets=(1, 2, 4))
    for sid in range(6):
        cache.add_sequence(sid)
    cache.begin_forward([0, 1], [5, 3])
    assert cache.static_bucket is None        # prefill: eager plan
    cache.abort_forward()
    cache.begin_forward(list(range(6)), [1] * 6)
    assert cache.static_bucket is None        # beyond the largest bucket: eager
    cache.abort_forward()
    cache.begin_forward([0, 1, 2], [1, 1, 1])
    assert cache.static_bucket == 4
    cache.abort_forward()


def test_wrong_row_counts_are_refused():
    cache = make("float32", True)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.begin_forward([0, 1, 0][:2], [1, 1])
    c = cache.config
    q = cache.from_numpy(np.zeros((3, c.num_qo_heads, c.head_dim), np.float32))
    kv = cache.from_numpy(np.zeros((3, c.num_kv_heads, c.head_dim), np.float32))
    with pytest.raises(InvalidArgumentError, match="or 2 rows: the static-shape bucket"):
        cache.attention(0, q, kv, kv)


def test_graph_mode_needs_the_capability():
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=64,
                              dtype="float32", static_decode=True, rope_mode="normal")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="static_decode"):
        kvcache.PagedKVCache(cfg, backend="reference")


# ---------------------------------------------------------------------- DecodeGraphs
class Engine:
    """A minimal engine: static per-bucket inputs, a step over all layers, capture and replay."""

    def __init__(self, cache, seed=0, **features):
        from kvcache_cuda import DecodeGraphs
        self.cache = cache
        self.features = features          # logit_softcap / sinks, passed to every layer
        self.graphs = DecodeGraphs(cache)
        self.static = {}
        self.rng = np.random.default_rng(seed)

    def buffers(self, bucket):
        if bucket not in self.static:
            c = self.cache.config
            self.static[bucket] = [[self.cache.from_numpy(np.zeros((bucket, h, c.head_dim), np.float32))
                                    for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]
                                   for _ in range(c.num_layers)]
        return self.static[bucket]

    def fill(self, bucket, n):
        """New random inputs for n real rows (padding rows zero); returns them as numpy."""
        c = self.cache.config
        values = []
        for layer in self.buffers(bucket):
            vals = []
            for buf, h in zip(layer, (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)):
                x = np.zeros((bucket, h, c.head_dim), np.float32)
                x[:n] = self.rng.standard_normal((n, h, c.head_dim))
                buf.copy_(self.cache.from_numpy(x))
                vals.append(x[:n])
            values.append(vals)
        return values

    def step_fn(self, bucket):
        bufs = self.buffers(bucket)

        def step():
            return [self.cache.attention(layer, *bufs[layer], return_lse=True, **self.features)
                    for layer in range(self.cache.config.num_layers)]
        return step


@pytest.mark.parametrize("features", [False, True], ids=["plain", "softcap-sinks"])
def test_decode_graphs_capture_short_replay_long_with_forks(features):
    """Capture at ~10-token histories, replay at 100x longer ones and after forks; every replay
    equals eager execution on a non-graph cuda cache and the reference, fed the same inputs.
    ``softcap-sinks``: every layer with logit soft-capping and attention sinks (a captured sinks
    tensor and cap, as a model's parameters are)."""
    dtype = "float32"
    graph_cache = make(dtype, True, max_tokens=16384)
    eager = make(dtype, False, max_tokens=16384)
    ref = make(dtype, False, backend="reference", max_tokens=16384)
    caches = (graph_cache, eager, ref)
    sinks = np.linspace(-1.0, 2.5, graph_cache.config.num_qo_heads).astype(np.float32)
    feat = {c: dict(logit_softcap=3.0, sinks=c.from_numpy(sinks)) if features else {}
            for c in caches}
    engine = Engine(graph_cache, **feat[graph_cache])

    def both(method, *args):
        for c in caches:
            getattr(c, method)(*args)

    def prefill(sid, n):
        both("begin_forward", [sid], [n])
        for layer in range(graph_cache.config.num_layers):
            parts = engine.rng.standard_normal((3, n, 8, 64)).astype(np.float32)
            for c in caches:
                c.attention(layer, c.from_numpy(parts[0]), c.from_numpy(parts[1][:, :2]),
                            c.from_numpy(parts[2][:, :2]))
        both("end_forward")

    def step(ids, capture=False):
        both("begin_forward", ids, [1] * len(ids))
        bucket = graph_cache.static_bucket
        values = engine.fill(bucket, len(ids))
        outs = engine.graphs.capture(engine.step_fn(bucket)) if capture else engine.graphs.replay()
        for layer, (o, lse) in enumerate(outs):
            o_r, l_r = ref.attention(layer, *map(ref.from_numpy, values[layer]), return_lse=True,
                                     **feat[ref])
            o_e, l_e = eager.attention(layer, *map(eager.from_numpy, values[layer]),
                                       return_lse=True, **feat[eager])
            n = len(ids)
            assert_close("graph vs reference o", _np(o_r), _np(o)[:n], dtype)
            assert_close("graph vs reference lse", _np(l_r), _np(lse)[:n], dtype, lse=True)
            assert_close("graph vs eager o", _np(o_e), _np(o)[:n], dtype)
            assert_close("graph vs eager lse", _np(l_e), _np(lse)[:n], dtype, lse=True)
            empty = np.broadcast_to(sinks if features else -np.inf, _np(lse)[n:].shape)
            assert (_np(o)[n:] == 0).all() and np.allclose(_np(lse)[n:], empty, rtol=0, atol=1e-6)
        both("end_forward")

    for sid in range(3):
        both("add_sequence", sid)
        prefill(sid, 8 + sid)
    step([0, 1, 2], capture=True)                # bucket 4, short histories
    step([2, 1, 0])
    for sid in (0, 1):                           # 100x longer histories
        for _ in range(2):
            prefill(sid, 600)
    both("fork_sequence", 0, 5, 700)             # several depths: 0 -> 5 -> 6
    prefill(5, 40)
    both("fork_sequence", 5, 6, -1)
    prefill(6, 3)
    step([5, 6, 1])
    step([6, 0, 5, 2])
    assert graph_cache.sequence_length(0) > 100 * 10

    # a batch that pads to a bucket with no graph is refused, and nothing ran
    both("begin_forward", [0], [1])
    with pytest.raises(InvalidArgumentError, match="pads to bucket 1, but graphs were captured for buckets \\[4\\]"):
        engine.graphs.replay()
    both("abort_forward")
    # replaying twice in one forward, or outside a forward, is refused
    both("begin_forward", [0, 1], [1, 1])
    with pytest.raises(InvalidArgumentError):
        engine.graphs.replay()                   # bucket 2 has no graph either
    both("abort_forward")
    with pytest.raises(ForwardStateError):
        engine.graphs.replay()


def test_decode_graphs_refuse_eager_forwards_and_double_replay():
    cache = make("float32", True, buckets=(2, 4))
    engine = Engine(cache)
    for sid in range(6):
        cache.add_sequence(sid)
        cache.begin_forward([sid], [4])
        run_layers(cache, 4)
        cache.end_forward()
    cache.begin_forward([0, 1], [1, 1])
    engine.fill(2, 2)
    engine.graphs.capture(engine.step_fn(2))
    with pytest.raises(ForwardStateError, match="already ran"):
        engine.graphs.replay()
    cache.end_forward()
    cache.begin_forward([0, 1], [2, 1])          # prefill: eager only
    with pytest.raises(InvalidArgumentError, match="not a static-shape decode step"):
        engine.graphs.replay()
    cache.abort_forward()
    cache.begin_forward(list(range(6)), [1] * 6)  # beyond the largest bucket
    with pytest.raises(InvalidArgumentError, match="not a static-shape decode step"):
        engine.graphs.replay()
    cache.abort_forward()
    with pytest.raises(InvalidArgumentError, match="static_decode=True"):
        from kvcache_cuda import DecodeGraphs
        DecodeGraphs(make("float32", False))


def test_aborted_graph_step_is_undone_and_the_graphs_still_serve():
    """A graph-mode decode step aborted after its replay leaves the cache as before it (lengths,
    free pages, get_kv bit for bit); later replays of the same graph equal the reference."""
    graph_cache = make("float32", True)
    ref = make("float32", False, backend="reference")
    engine = Engine(graph_cache)
    for c in (graph_cache, ref):
        for sid in range(3):
            c.add_sequence(sid)
    for sid, n in enumerate((15, 16, 31)):          # the step grows pages of 1 and 2
        values = [engine.rng.standard_normal((n, h, 64)).astype(np.float32) for h in (8, 2, 2)]
        for c in (graph_cache, ref):
            with c.forward([sid], [n]):
                for layer in range(2):
                    c.attention(layer, *map(c.from_numpy, values))

    def snapshot():
        return (graph_cache.num_available_pages, [graph_cache.sequence_length(s) for s in range(3)],
                [_np(a) for s in range(3) for a in graph_cache.get_kv(s)])

    def step(ids, capture=False, abort=False):
        graph_cache.begin_forward(ids, [1] * len(ids))
        values = engine.fill(graph_cache.static_bucket, len(ids))
        outs = engine.graphs.capture(engine.step_fn(graph_cache.static_bucket)) if capture \
            else engine.graphs.replay()
        if abort:
            graph_cache.abort_forward()
            return
        graph_cache.end_forward()
        with ref.forward(ids, [1] * len(ids)):
            for layer, (o, _) in enumerate(outs):
                o_r = ref.attention(layer, *map(ref.from_numpy, values[layer]))
                assert_close("graph vs reference o", _np(o_r), _np(o)[:len(ids)],
                             graph_cache.config.dtype)

    step([0, 1, 2], capture=True)
    before = snapshot()
    step([2, 1, 0], abort=True)
    after = snapshot()
    assert before[:2] == after[:2]
    for x, y in zip(before[2], after[2]):
        np.testing.assert_array_equal(x, y)
    for _ in range(3):
        step([2, 1, 0])


def test_replay_counts_every_captured_layer_as_run():
    """A real CUDA graph replay runs no Python: replay itself marks the captured layers as run,
    so end_forward accepts the step."""
    cache = make("float32", True, buckets=(2,))
    engine = Engine(cache)
    for sid in range(2):
        cache.add_sequence(sid)
    cache.begin_forward([0, 1], [1, 1])
    engine.fill(2, 2)
    engine.graphs.capture(engine.step_fn(2))
    cache.end_forward()

    class Silent:                                  # what a device graph's replay does in Python
        def replay(self):
            return None

    engine.graphs.graphs[2] = (Silent(), engine.graphs.graphs[2][1])
    cache.begin_forward([0, 1], [1, 1])
    engine.graphs.replay()
    cache.end_forward()
    assert cache.sequence_length(0) == 2


@pytest.mark.skipif(not cc.ON_GPU, reason="counts the kernels of a real CUDA graph's replay")
def test_captured_split_decode_zeroes_its_merge_counters_once_per_replay():
    """A captured split-K decode step reuses its first layer's launch record (partials scratch
    and merge counters) on later layers, as an eager step does: the replay runs one memset
    (the counters' zeros) for the whole step, not one per layer. Four replays queued, each
    step's outputs copied on the stream and read only at the end, equal eager steps."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    graph, eager = make("float32", True, buckets=(2,)), make("float32", False)
    for c in (graph, eager):
        c.backend.tuning = c.backend.tuning.with_(force_splits=4, split_min_keys=16)
    engine = Engine(graph)
    layers = graph.config.num_layers
    for sid, n in ((0, 300), (1, 350)):    # random histories: every split's partial matters
        hist = engine.rng.standard_normal((layers, 3, n, 8, 64)).astype(np.float32)
        for c in (graph, eager):
            c.add_sequence(sid)
            c.begin_forward([sid], [n])
            for layer in range(layers):
                c.attention(layer, c.from_numpy(hist[layer, 0]), c.from_numpy(hist[layer, 1, :, :2]),
                            c.from_numpy(hist[layer, 2, :, :2]))
            c.end_forward()
    kept, want = [], []
    for step in range(5):                  # step 0 captures (and runs) the step
        for c in (graph, eager):
            c.begin_forward([0, 1], [1, 1])
        values = engine.fill(2, 2)
        if step == 0:
            outs = engine.graphs.capture(engine.step_fn(2))
        elif step == 1:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                outs = engine.graphs.replay()
                torch.cuda.synchronize()
        else:
            outs = engine.graphs.replay()
        kept.append([(o.clone(), lse.clone()) for o, lse in outs])
        want.append([eager.attention(layer, *map(eager.from_numpy, values[layer]), return_lse=True)
                     for layer in range(layers)])
        for c in (graph, eager):
            c.end_forward()
    names = [e.name for e in prof.events() if str(e.device_type).endswith("CUDA")]
    decodes = [n for n in names if "_paged_decode_kernel" in n]
    others = [n for n in names if "_paged_decode_kernel" not in n and "_rope_append_kernel" not in n
              and "memcpy" not in n.lower()]
    assert len(decodes) == layers, names
    assert len(others) <= 1, f"more than the counters' one memset per replay: {others}"
    for got, exp in zip(kept, want):
        for (o, lse), (o_e, l_e) in zip(got, exp):
            assert_close("graph vs eager o", _np(o_e), _np(o)[:2], "float32")
            assert_close("graph vs eager lse", _np(l_e), _np(lse)[:2], "float32", lse=True)


if not (cc.ON_GPU or cc.INTERPRET):
    # background_runs.py: the child starts when collection ends and runs on the second core
    import os
    import sys
    background_runs.register(
        "test_conformance_graph_mode_class_on_cpu_test_mode",
        [sys.executable, "-m", "kvcache.cli", "conformance", "--backend", "cuda", "--device", "cpu",
         "-k", "TestGraphMode or TestStaticMixedSteps"],
        dict(os.environ, KVCACHE_CUDA_CPU="1"), timeout=600)


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="CPU run of the suite's graph-mode class")
def test_conformance_graph_mode_class_on_cpu_test_mode():
    """The conformance suite's TestGraphMode and TestStaticMixedSteps against this backend's CPU
    test mode (CI has no GPU: elsewhere the classes only skip, by capability)."""
    # the child (registered below) started when collection ended, on the second core
    r = background_runs.result("test_conformance_graph_mode_class_on_cpu_test_mode")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    # the quick matrix (the default): every test of both classes once
    assert "TestGraphMode                6       0       0        0" in out, out[-3000:]
    assert "TestStaticMixedSteps         4       0       0        0" in out, out[-3000:]
    assert "verdict: CONFORMS" in out
