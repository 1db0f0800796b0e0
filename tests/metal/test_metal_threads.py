"""A metal cache built on one thread works from another (MLX streams belong to the thread that
made them), one thread at a time; a second thread during a forward gets ForwardStateError."""

import threading

import numpy as np
import pytest

import kvcache
from kvcache import ForwardStateError

from metal_testutil import DEVICE, assert_close


def config():
    return kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8,
                               page_size=4, max_total_tokens=128, dtype="float32",
                               rope_mode="normal")


def forward(cache, ids, lens, rng):
    c = cache.config
    t = sum(lens)
    outs = []
    with cache.forward(ids, lens):
        for layer in range(c.num_layers):
            q, k, v = (cache.from_numpy(rng.standard_normal((t, h, c.head_dim)))
                       for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            outs.append(kvcache.to_numpy(cache.attention(layer, q, k, v)))
    return outs


def in_thread(fn):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            box["error"] = exc

    t = threading.Thread(target=target, name="metal-worker")
    t.start()
    t.join(60)
    return box


def test_cache_built_on_one_thread_runs_on_another():
    metal = kvcache.PagedKVCache(config(), backend="metal", device=DEVICE)
    ref = kvcache.PagedKVCache(config(), backend="reference")
    for cache in (metal, ref):
        cache.add_sequence(0)
        forward(cache, [0], [5], np.random.default_rng(0))

    def program(cache):
        rng = np.random.default_rng(1)
        cache.add_sequence(1)
        outs = forward(cache, [0, 1], [1, 6], rng) + forward(cache, [1, 0], [1, 1], rng)
        cache.fork_sequence(1, 2, 3)
        outs += forward(cache, [2], [2], rng)
        return outs, [kvcache.to_numpy(a) for s in (0, 1, 2) for a in cache.get_kv(s)]

    box = in_thread(lambda: program(metal))
    assert "error" not in box, repr(box.get("error"))
    got_outs, got_kv = box["value"]
    want_outs, want_kv = program(ref)
    for got, want in zip(got_outs + got_kv, want_outs + want_kv):
        assert_close(got, want, "float32")
    forward(metal, [0, 1, 2], [1, 1, 1], np.random.default_rng(2))    # back on the first thread
    assert metal.sequence_length(0) == 8


def test_second_thread_during_a_forward_raises_before_changing_anything():
    cache = kvcache.PagedKVCache(config(), backend="metal", device=DEVICE)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.begin_forward([0], [3])
    box = in_thread(lambda: cache.begin_forward([1], [2]))
    assert isinstance(box.get("error"), ForwardStateError), box
    assert threading.current_thread().name in str(box["error"])
    assert cache.sequence_length(1) == 0
    cache.abort_forward()
    assert cache.sequence_length(0) == 0
    box = in_thread(lambda: forward(cache, [1], [2], np.random.default_rng(0)))
    assert "error" not in box, repr(box.get("error"))
    assert cache.sequence_length(1) == 2
