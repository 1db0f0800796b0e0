"""``PagedKVCache.watch_forward`` and ``export_sequences`` inside a forward: what a
layer-pipelined transfer (``kvcache.distributed.send_sequence`` during a prefill) stands on."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache


def _cache():
    cfg = kvcache.CacheConfig(num_layers=3, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_batch_size=4, max_total_tokens=128,
                              prefill_chunk_size=64, rope_mode="normal")
    return kvcache.PagedKVCache(cfg, backend="reference")


class Watcher:
    def __init__(self):
        self.events = []

    def layer_written(self, layer):
        self.events.append(layer)

    def forward_closed(self, committed):
        self.events.append(("closed", committed))


def _rows(cache, n, rng):
    c = cache.config
    return [cache.from_numpy(rng.standard_normal((n, h, c.head_dim)).astype(np.float32))
            for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]


def test_a_watcher_hears_each_layer_then_the_close():
    cache, rng = _cache(), np.random.default_rng(0)
    cache.add_sequence(1)
    w = Watcher()
    with pytest.raises(kvcache.ForwardStateError):
        cache.watch_forward(w)                  # outside a forward
    cache.begin_forward([1], [5])
    cache.watch_forward(w)
    q, k, v = _rows(cache, 5, rng)
    cache.attention(0, q, k, v)
    cache.append_kv(2, k, v)
    cache.mark_layers_run([1, 2])               # 2 ran already: heard once
    assert w.events == [0, 2, 1]
    cache.end_forward()
    assert w.events[-1] == ("closed", True)
    cache.begin_forward([1], [1])               # dropped at the close: hears nothing more
    cache.abort_forward()
    assert len(w.events) == 4
    for close, committed in ((cache.abort_forward, False), (cache.clear, False)):
        w = Watcher()
        cache.add_sequence(2) if 2 not in cache.sequence_ids else None
        cache.begin_forward([2], [2])
        cache.watch_forward(w)
        close()
        assert w.events == [("closed", committed)]


def test_export_inside_a_forward_gives_the_written_layers_as_after_it():
    cache, rng = _cache(), np.random.default_rng(1)
    cache.add_sequence(1)
    with cache.forward([1], [6]):
        for layer in range(3):
            cache.attention(layer, *_rows(cache, 6, rng))
    cache.begin_forward([1], [4])
    headers, k, v = cache.export_sequences([1], layers=range(0, 0))     # the headers alone
    assert k is None and v is None and headers[0].num_tokens == 10
    with pytest.raises(kvcache.ForwardStateError, match=r"layers \[0\] are not written"):
        cache.export_sequences([1], layers=range(0, 1))
    inside = []
    for layer in range(3):
        cache.attention(layer, *_rows(cache, 4, rng))
        inside.append(cache.export_sequences([1], layers=range(layer, layer + 1)))
        if layer < 2:
            with pytest.raises(kvcache.ForwardStateError, match="not written"):
                cache.export_sequences([1])     # every layer: some still unwritten
    cache.end_forward()
    after_h, after_k, after_v = cache.export_sequences([1])
    for layer, (h, k, v) in enumerate(inside):
        assert h[0].header() == after_h[0].header()
        assert np.array_equal(kvcache.to_numpy(k)[0], kvcache.to_numpy(after_k)[layer])
        assert np.array_equal(kvcache.to_numpy(v)[0], kvcache.to_numpy(after_v)[layer])
