"""Appends and page copies write into the page buffer in place: same Python object (the core's
``cache.pages[layer]``), same data pointer, and no allocation of a cache-sized buffer."""

import mlx.core as mx
import numpy as np
import pytest

import kvcache
from kvcache_metal.backend import MetalBackend
from kvcache_metal.ops import rope_cos_sin
from kvcache.backend import RopeSpec

from metal_testutil import DEVICE


def data_ptr(a):
    mx.eval(a)
    view = np.array(a, copy=False)          # zero-copy on MLX's CPU device / unified memory
    ptr = view.__array_interface__["data"][0]
    del view                                # a live view would pin the buffer (no donation)
    return ptr


def big_cache(pages=20000, rope_mode="none", sliding=False):
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=16,
                              page_size=16, max_total_tokens=pages * 16, dtype="float16",
                              rope_mode=rope_mode, support_sliding_window=sliding)
    return kvcache.PagedKVCache(cfg, backend="metal", device=DEVICE)


class Watch:
    """Page objects, pointers and peak memory around a block of cache calls."""

    def __init__(self, cache):
        self.cache = cache

    def __enter__(self):
        self.objs = list(self.cache.pages)
        self.ptrs = [data_ptr(p) for p in self.cache.pages]
        mx.synchronize()
        mx.reset_peak_memory()
        self.base = mx.get_active_memory()
        return self

    def __exit__(self, *exc):
        if exc[0] is not None:
            return False
        self.cache.backend.synchronize()
        mx.synchronize()
        nbytes = self.cache.pages[0].nbytes
        grew = mx.get_peak_memory() - self.base
        assert all(a is b for a, b in zip(self.objs, self.cache.pages)), "page arrays rebound"
        assert [data_ptr(p) for p in self.cache.pages] == self.ptrs, "page buffer reallocated"
        assert grew < nbytes // 4, f"peak memory grew by {grew} bytes; one layer is {nbytes}"
        return False


@pytest.mark.parametrize("rope_mode", ["none", "normal"])
def test_decode_loop_in_place(rope_mode):
    cache = big_cache(rope_mode=rope_mode)
    rng = np.random.default_rng(0)
    for s in range(4):
        cache.add_sequence(s)
    with Watch(cache):
        for step, lens in enumerate([[20, 5, 1, 33]] + [[1, 1, 1, 1]] * 6):
            t = sum(lens)
            q, k, v = (cache.from_numpy(rng.standard_normal((t, h, 16))) for h in (2, 1, 1))
            with cache.forward(list(range(4)), lens):
                for layer in range(2):
                    o = cache.attention(layer, q, k, v)
                    mx.eval(o)
        cache.fork_sequence(0, 10, 19)            # partial-page copy
        cache.popn(10, 3)
        cache.begin_forward([10], [3], [-1, 0, 0])
        for layer in range(2):
            mx.eval(cache.attention(layer, *(cache.from_numpy(rng.standard_normal((3, h, 16)))
                                             for h in (2, 1, 1))))
        cache.end_forward()
        cache.commit_accepted_token_tree_nodes([10], [2])   # compaction copy
        k, v = cache.get_kv(10)
        mx.eval(k, v)
    assert cache.sequence_length(10) == 16 + 2


def test_sliding_in_place():
    cache = big_cache(sliding=True, rope_mode="normal")
    rng = np.random.default_rng(1)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, 24, 4)
    with Watch(cache):
        for lens in [[30], [1], [5], [1]]:
            t = lens[0]
            q, k, v = (cache.from_numpy(rng.standard_normal((t, h, 16))) for h in (2, 1, 1))
            with cache.forward([0], lens):
                for layer in range(2):
                    mx.eval(cache.attention(layer, q, k, v))


def test_head_dim_v_append_in_place():
    """D != Dv: K and V go into their parts of the max(D, Dv)-wide rows by two scatters; the
    page buffer is still updated in place (same object, same pointer, no cache-sized copy)."""
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=16,
                              head_dim_v=24, page_size=16, max_total_tokens=20000 * 16,
                              dtype="float16", rope_mode="none")
    mb = MetalBackend(cfg, DEVICE)
    pages = mb.allocate_pages(cfg.num_pages)[0]
    obj, ptr = pages, data_ptr(pages)
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    rng = np.random.default_rng(2)
    for step in range(4):
        k = mb.from_numpy(rng.standard_normal((8, 1, 16)))
        v = mb.from_numpy(rng.standard_normal((8, 1, 24)))
        mb.append_kv(pages, k, v, mb.aux_to_device(np.arange(8) + 8 * step))
        del k, v
    mb.synchronize()
    mx.synchronize()
    assert pages is obj and data_ptr(pages) == ptr
    assert mx.get_peak_memory() - base < pages.nbytes // 4


def test_watch_detects_a_copy():
    """The observables fail when a write does copy the buffer (here: an extra reference pins
    the old buffer, so MLX's scatter cannot donate it)."""
    cache = big_cache()
    pinned = None
    with pytest.raises(AssertionError):
        with Watch(cache):
            pinned = cache.pages[0][:]                        # a second reference to the buffer
            mx.eval(pinned)
            kv = cache.from_numpy(np.ones((1, 1, 16)))
            cache.backend.append_kv(cache.pages[0], kv, kv, cache.backend.aux_to_device(np.array([5])))
    del pinned


def test_gpu_rope_angles_on_cpu():
    """The float32 digit-split RoPE angles used on the Apple GPU (no float64), checked here."""
    pos = np.array([0, 1, 5, 4999, 65535, 1000000, -7], np.int32)
    inv = 0.5 * 500000.0 ** (-2.0 * np.arange(32) / 64)
    ref = pos[:, None].astype(np.float64) * inv
    for precise, tol in ((True, 1e-6), (False, 5e-5)):
        c, s = rope_cos_sin(mx.array(pos), 64, RopeSpec(500000.0, 0.5), precise)
        assert np.abs(np.array(c) - np.cos(ref)).max() < tol
        assert np.abs(np.array(s) - np.sin(ref)).max() < tol
