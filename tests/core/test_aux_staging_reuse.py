"""The merged aux manager waits (on the host) for the last copy out of a staging buffer before it
rewrites that buffer (issue 28, item 10: without the ``event_synchronize`` in
``MergedAuxManager.upload`` the whole CPU suite passed, because its fake device copied
synchronously).

Here the fake device's copies are asynchronous as far as the host can know: a copy counts as
done only once the host has waited on its event, and until then it may read its staging buffer
at any time. The fake keeps what each copy in flight must read, and records a race when the
staging buffer no longer holds it (the host rewrote memory a copy may still be reading). The
GPU twin of this test, where the race gives wrong attention, is
``tests/cuda/test_cuda_aux_run_ahead_gpu.py``."""

import numpy as np
import pytest

import kvcache
from kvcache import plugins
from kvcache.reference import ReferenceBackend


class AsyncCopyDevice(ReferenceBackend):
    """Reference kernels; merged aux whose host->device copies are in flight until waited on."""

    name = "async-copy-test"
    capabilities = kvcache.Capabilities(dtypes=("float32",), copy_stream=True, merged_aux=True,
                                        tree_attention=True, head_dims=(8,))

    def __init__(self, config, device=None):
        super().__init__(config, device)
        self.in_flight: dict = {}         # event -> (host buffer, what the copy must read)
        self.races: list = []
        self.copies = self.host_waits = 0

    def create_stream(self):
        return "copy-stream"

    def aux_alloc_host(self, n):
        buf = np.zeros(n, np.int32)
        return buf, buf

    def aux_alloc_device(self, n):
        return np.full(n, -7, np.int32)

    def check_in_flight(self):
        for event, (host, expected) in self.in_flight.items():
            if not np.array_equal(host[:len(expected)], expected):
                self.races.append(f"copy {event}'s staging buffer rewritten before it completed")

    def aux_copy_async(self, device_buffer, host_handle, n, stream):
        self.check_in_flight()                     # the host has just written a staging buffer
        self.copies += 1
        event = ("copy", self.copies)
        # the kernels here run at once, so the device side is filled now; the host side stays
        # "being read" until the host waits on the event
        device_buffer[:n] = host_handle[:n]
        self.in_flight[event] = (host_handle, host_handle[:n].copy())
        return event

    def aux_view(self, device_buffer, offset, length):
        return device_buffer[offset:offset + length]

    def event_synchronize(self, event):
        self.host_waits += 1
        self.check_in_flight()
        self.in_flight.pop(event, None)

    def stream_wait_event(self, event, stream=None):
        pass

    def record_event(self, stream=None):
        return ("release", self.copies)


@pytest.fixture
def cache():
    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [AsyncCopyDevice]
    plugins.reset_plugins()
    plugins.register_plugin(Plugin(), name="async-copy-test")
    cfg = kvcache.CacheConfig(2, 4, 2, 8, page_size=4, max_total_tokens=256, max_batch_size=4,
                              dtype="float32", rope_mode="normal")
    yield kvcache.PagedKVCache(cfg, backend="async-copy-test")
    plugins.reset_plugins()


def test_no_staging_buffer_is_rewritten_while_its_copy_is_in_flight(cache):
    rng = np.random.default_rng(0)
    for sid in range(4):
        cache.add_sequence(sid)
    steps = [([0, 1], [5, 3]), ([0, 1], [1, 1]), ([2], [7]), ([0, 1, 2], [1, 1, 1]),
             ([3, 0], [4, 2]), ([1, 2, 3], [1, 1, 1]), ([0], [1]), ([3, 2, 1, 0], [2, 1, 1, 3])]
    for seq_ids, lens in steps:
        t = sum(lens)
        with cache.forward(seq_ids, lens):
            for layer in range(2):
                q = rng.standard_normal((t, 4, 8)).astype(np.float32)
                kv = rng.standard_normal((t, 2, 8)).astype(np.float32)
                cache.attention(layer, q, kv, kv)
    b = cache.backend
    b.check_in_flight()
    assert b.copies == len(steps)
    assert not b.races, b.races
    # the waits are for staging-buffer reuse only: one per copy that reuses a buffer
    assert b.host_waits <= len(steps)
