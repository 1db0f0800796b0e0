"""Merged aux path of the CUDA backend: one packed upload per forward on the copy stream, device
views equal to the packed reference layout, double-buffer alternation, event ordering.

On CPU the streams and events are ``HostStream``/``HostEvent`` recorders, so the same manager
logic runs and its stream/event traffic is observable."""

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.core.plan import walk
from kvcache.core.aux import MergedAuxManager, pack_reference

pytestmark = pytest.mark.skipif(cc.ON_GPU, reason="host stream/event recorders are CPU-mode only; "
                                "the GPU proof is gpu_check.sh's profiler section")


def _cache(**kw):
    cfg = cc.config(hq=4, hkv=2, d=64, ps=16, layers=2, dtype="float32", rope_mode="normal", **kw)
    return kvcache.PagedKVCache(cfg, backend="cuda", device="cpu")


def _qkv(cache, rng, t):
    c = cache.config
    return [cache.from_numpy(rng.standard_normal((t, h, c.head_dim)).astype(np.float32))
            for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]


def test_merged_manager_and_copy_stream_are_used():
    cache = _cache()
    from kvcache_cuda.backend import HostStream
    assert isinstance(cache.aux_manager, MergedAuxManager)
    assert isinstance(cache.copy_stream, HostStream)
    assert cache.copy_stream is not cache.backend.current_stream()


def test_one_lazy_copy_per_forward_and_views_match_pack_reference():
    cache = _cache()
    rng = np.random.default_rng(0)
    for s in (0, 1, 2):
        cache.add_sequence(s)
    cache.begin_forward([0, 1, 2], [5, 17, 9])
    mgr = cache.aux_manager
    assert mgr.copies == 0, "the copy must be lazy (not issued by begin_forward)"
    plan = cache.open_plan
    for layer in range(2):
        cache.attention(layer, *_qkv(cache, rng, 31))
    pos = cache.query_positions()
    assert mgr.copies == 1, "one merged host->device copy per forward"
    views = [view for _, _, view in walk(cache.forward_aux())]
    arrays = [array for _, _, array in walk(plan)]
    packed = pack_reference(plan)
    offsets, total = MergedAuxManager.layout(arrays)
    slot = mgr.slots[mgr.current]
    device_buf = slot.device
    for view, array, off in zip(views, arrays, offsets, strict=True):
        np.testing.assert_array_equal(view.numpy(), array)
        np.testing.assert_array_equal(view.numpy(), packed[off:off + len(array)])
        # a view into the one device buffer, not a copy
        assert view.untyped_storage().data_ptr() == device_buf.untyped_storage().data_ptr()
        assert view.storage_offset() == off
    assert total <= device_buf.numel()
    np.testing.assert_array_equal(pos.numpy(), plan.tokens.q_positions)
    # the device buffer is distinct memory from the (pinned on GPU) staging buffer
    assert device_buf.untyped_storage().data_ptr() != slot.host_handle.untyped_storage().data_ptr()
    cache.end_forward()


def test_double_buffer_alternates_and_orders_by_events():
    cache = _cache()
    b, mgr, copy_stream = cache.backend, cache.aux_manager, cache.copy_stream
    compute = b.current_stream()
    rng = np.random.default_rng(1)
    cache.add_sequence(0)
    used, storages = [], []
    for step in range(4):
        n_before_compute = len(compute.waited)
        cache.begin_forward([0], [3 if step == 0 else 1])
        qkv = _qkv(cache, rng, 3 if step == 0 else 1)
        cache.attention(0, *qkv)
        used.append(mgr.current)
        storages.append(cache.forward_aux().tokens.qo_indptr.untyped_storage().data_ptr())
        # the compute stream waited on the event recorded on the copy stream after the copy
        new = compute.waited[n_before_compute:]
        assert len(new) == 1 and new[0].stream is copy_stream
        assert new[0] is mgr.slots[mgr.current].copy_event
        cache.attention(1, *qkv)
        cache.end_forward()
        assert mgr.slots[mgr.current].release_event is not None
    assert used == [0, 1, 0, 1]
    assert storages[0] == storages[2] != storages[1] == storages[3]
    # every copy into a device buffer waited on compute work: for a new buffer, the work queued
    # when it was allocated; for a reused one, the work that last read it
    release_events = [e for e in copy_stream.waited]
    assert len(release_events) == 4 and all(e.stream is compute for e in release_events)
    # reusing a staging buffer: the host waited for the copy that last read it
    assert mgr.slots[0].copy_event is not None
    assert mgr.copies == 4 and mgr.allocations == 2


def test_upload_is_a_copy_not_an_alias_of_staging():
    cache = _cache()
    cache.add_sequence(0)
    cache.begin_forward([0], [4])
    pos = cache.query_positions()
    before = pos.clone()
    cache.aux_manager.slots[cache.aux_manager.current].host[:] = -7   # scribble on staging
    assert (pos == before).all()
    cache.abort_forward()


def test_aux_primitives_directly():
    cfg = cc.config()
    from kvcache_cuda.backend import CudaBackend, HostEvent
    b = CudaBackend(cfg, "cpu")
    handle, host = b.aux_alloc_host(64)
    assert host.dtype == np.int32 and host.shape == (64,)
    host[:] = np.arange(64)
    assert int(handle[5]) == 5                       # the numpy view aliases the handle
    dev = b.aux_alloc_device(64)
    stream = b.create_stream()
    ev = b.aux_copy_async(dev, handle, 40, stream)
    assert isinstance(ev, HostEvent) and ev.stream is stream
    np.testing.assert_array_equal(dev[:40].numpy(), np.arange(40))
    v = b.aux_view(dev, 16, 8)
    np.testing.assert_array_equal(v.numpy(), np.arange(16, 24))
    assert v.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()
    up = b.aux_to_device(np.array([3, 1, 2], np.int32))
    assert b.dtype_name(up) == "int32"


@pytest.mark.parametrize("head_dim", range(32, 257, 8))
@pytest.mark.parametrize("elem", [2, 4])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_tiles_fit_h100_shared_memory(head_dim, elem, kind):
    """K and V tiles of every pipeline stage must fit the H100's 227 KiB of shared memory (the
    CPU interpreter cannot see this limit: a too-big table first failed on the GPU, and so did
    head_dim 80 in float32, which runs padded to 128 but once got the unpadded lookup)."""
    from kvcache_cuda.tuning import CUDA_TUNING
    padded = 1 << (head_dim - 1).bit_length()
    t = CUDA_TUNING.tiles(kind, head_dim, float32=elem == 4)
    assert 2 * t.block_n * padded * elem * t.num_stages <= 232448, t


def test_clear_inside_a_forward_releases_the_aux_buffer():
    """clear() ends an open forward: its aux buffer gets a release event, so the next copy into
    that buffer waits for the kernels that read it (graph mode's single buffer included)."""
    cfg = cc.config(static_decode=True, max_batch_size=4)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
    cache.add_sequence(0)
    cache.begin_forward([0], [1])                       # a graph-mode step: buffer uploaded
    assert cache.static_bucket == 1
    cache.clear()
    assert cache.aux_manager._statics[(False, 1)].release_event is not None
    assert cache.aux_manager._static_open is None


def _copy_waits(cache):
    """Events the copy stream waited on that were recorded on the compute stream."""
    compute = cache.backend.current_stream()
    return [e for e in cache.copy_stream.waited if getattr(e, "stream", None) is compute]


def test_first_copy_into_a_new_device_buffer_waits_for_the_compute_stream():
    """The allocator may hand a new aux device buffer memory that kernels still queued on the
    compute stream write (a host running ahead of the GPU). The copy stream is not ordered after
    them, so the first copy into every new buffer (each slot's first use, each growth, the
    graph-mode buffer) must wait on a compute-stream event recorded at allocation. Without it the
    H100 hit illegal memory accesses (tools/gpu_run_ahead.sh)."""
    cache = _cache()
    rng = np.random.default_rng(0)
    cache.add_sequence(0)
    mgr = cache.aux_manager
    waits = []
    for n in (3, 1, 1, 700, 1):        # slot 0 new, slot 1 new, reuse, growth, reuse
        before = len(_copy_waits(cache))
        allocations = mgr.allocations
        with cache.forward([0], [n]):
            for layer in range(2):
                cache.attention(layer, *_qkv(cache, rng, n))
        waits.append((mgr.allocations - allocations, len(_copy_waits(cache)) - before))
    for step, (allocated, waited) in enumerate(waits):
        assert waited >= allocated, (f"forward {step}: {allocated} new device buffer(s) but the copy "
                                     f"stream waited on {waited} compute-stream event(s)")
    assert [a for a, _ in waits] == [1, 1, 0, 1, 0]


def test_graph_buffer_first_copy_waits_for_the_compute_stream():
    cache = _cache(static_decode=True)
    cache.add_sequence(0)
    rng = np.random.default_rng(1)
    with cache.forward([0], [4]):
        for layer in range(2):
            cache.attention(layer, *_qkv(cache, rng, 4))
    before = len(_copy_waits(cache))
    cache.begin_forward([0], [1])          # graph mode: begin_forward copies into the new buffer
    assert cache.static_bucket is not None
    assert len(_copy_waits(cache)) > before, "the graph buffer's first copy did not wait"
    cache.abort_forward()


@pytest.mark.parametrize("graph", [False, True])
def test_abort_forward_releases_the_aux_buffer(graph):
    """An aborted forward's aux buffer gets a release event like an ended one's, so the next
    copy into it waits for the kernels that may still read it."""
    cache = kvcache.PagedKVCache(cc.config(static_decode=graph, max_batch_size=4), backend="cuda",
                                 device=cc.DEVICE)
    mgr = cache.aux_manager
    cache.add_sequence(0)
    cache.begin_forward([0], [1])
    cache.query_positions()                             # eager: the lazy copy happens here
    cache.abort_forward()
    if graph:
        assert mgr._statics[(False, 1)].release_event is not None and mgr._static_open is None
    else:
        assert mgr.slots[mgr.current].release_event is not None
    assert cache.sequence_length(0) == 0


def test_buffers_made_under_inference_mode_serve_outside_it():
    """A cache built and first driven under ``torch.inference_mode()`` (as an engine's generate
    loop does) stays usable outside it: its pages, aux buffers and scratch are normal tensors,
    not inference tensors that refuse in-place updates."""
    import torch
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        cache = _cache()
        cache.add_sequence(0)
        with cache.forward([0], [5]):
            for layer in range(2):
                cache.attention(layer, *_qkv(cache, rng, 5))
    for n in (3, 1):                      # a prefill and a decode step outside inference mode
        with cache.forward([0], [n]):
            for layer in range(2):
                out = cache.attention(layer, *_qkv(cache, rng, n))
        assert out.shape[0] == n and not out.is_inference()
    assert cache.sequence_length(0) == 9
