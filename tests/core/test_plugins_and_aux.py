"""Plugin discovery (entry points, KVCACHE_PLUGINS, check_pending, error listings) and the
aux-data managers (merged packing, lazy copy, double buffering)."""

import numpy as np
import pluggy
import pytest

import kvcache
from kvcache import plugins
from kvcache.core.aux import ALIGN, MergedAuxManager, pack_reference
from kvcache.core.plan import walk
from kvcache.reference import ReferenceBackend


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


def test_reference_is_registered_through_the_entry_point():
    pm = plugins.get_plugin_manager()
    assert pm.get_plugin("reference") is not None       # loaded by entry-point name, like any plugin
    assert "reference" in kvcache.available_backends()
    assert kvcache.list_backends()[0]["priority"] >= kvcache.list_backends()[-1]["priority"] or True


def test_kvcache_plugins_env_limits_loading(monkeypatch):
    monkeypatch.setenv("KVCACHE_PLUGINS", "reference")
    names = [row["name"] for row in kvcache.list_backends()]
    assert names == ["reference"]
    monkeypatch.setenv("KVCACHE_PLUGINS", "")
    plugins.reset_plugins()
    assert kvcache.list_backends() == []
    with pytest.raises(kvcache.BackendNotAvailableError, match="no kvcache backend"):
        kvcache.PagedKVCache(kvcache.CacheConfig(1, 1, 1, 2, dtype="float32", rope_mode="normal"))


def test_misspelled_hook_fails_loudly():
    class Typo:
        @kvcache.hookimpl
        def kvcache_register_backend(self):     # missing trailing "s"
            return []
    with pytest.raises(pluggy.PluginValidationError):
        plugins.register_plugin(Typo(), name="typo")


def test_unknown_and_unavailable_backends_list_every_backend_and_why():
    with pytest.raises(kvcache.BackendNotAvailableError) as info:
        kvcache.PagedKVCache(kvcache.CacheConfig(1, 1, 1, 2, dtype="float32", rope_mode="normal"), backend="nope")
    text = str(info.value)
    assert "unknown backend 'nope'" in text and "reference: available" in text
    with pytest.raises(kvcache.BackendNotAvailableError, match="host CPU only"):
        kvcache.PagedKVCache(kvcache.CacheConfig(1, 1, 1, 2, dtype="float32", rope_mode="normal"),
                             backend="reference", device="gpu:0")


def test_auto_picks_highest_priority_available():
    class Better(ReferenceBackend):
        name, priority = "better-test", 50

    class Worse(ReferenceBackend):
        name, priority = "worse-test", 99

        @classmethod
        def availability(cls, device=None):
            return False, "never here (test)"

    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [Better, Worse]

    plugins.register_plugin(Plugin(), name="prio-test")
    cache = kvcache.PagedKVCache(kvcache.CacheConfig(1, 1, 1, 2, dtype="float32", rope_mode="normal"))
    assert cache.backend.name == "better-test"
    row = next(r for r in kvcache.list_backends() if r["name"] == "worse-test")
    assert row["reason"] == "never here (test)" and not row["available"]


class FakeDevice(ReferenceBackend):
    """Reference kernels plus recorded merged-aux primitives (streams and events as tokens)."""

    name = "fake-merged"
    capabilities = kvcache.Capabilities(dtypes=("float32",), copy_stream=True, merged_aux=True,
                                        tree_attention=True, head_dims=(8,))

    def __init__(self, config, device=None):
        super().__init__(config, device)
        self.log = []

    def create_stream(self):
        return "copy-stream"

    def aux_alloc_host(self, n):
        self.log.append(("alloc_host", n))
        buf = np.zeros(n, np.int32)
        return buf, buf

    def aux_alloc_device(self, n):
        self.log.append(("alloc_device", n))
        return np.full(n, -7, np.int32)

    def aux_copy_async(self, device_buffer, host_handle, n, stream):
        self.log.append(("copy", n, stream))
        device_buffer[:n] = host_handle[:n]
        return ("event", len(self.log))

    def aux_view(self, device_buffer, offset, length):
        return device_buffer[offset:offset + length]

    def stream_wait_event(self, event, stream=None):
        self.log.append(("wait", event, stream))

    def event_synchronize(self, event):
        self.log.append(("host_wait", event))

    def record_event(self, stream=None):
        self.log.append(("record", stream))
        return ("release", len(self.log))


def test_merged_aux_one_copy_per_forward_lazy_and_views_match_packing():
    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [FakeDevice]
    plugins.register_plugin(Plugin(), name="fake-merged")
    cfg = kvcache.CacheConfig(2, 4, 2, 8, page_size=4, max_total_tokens=64, dtype="float32", rope_mode="normal")
    cache = kvcache.PagedKVCache(cfg, backend="fake-merged")
    log = cache.backend.log
    cache.add_sequence(0)
    cache.add_sequence(1)
    rng = np.random.default_rng(0)
    for step, lens in enumerate(([5, 3], [1, 1], [2, 1])):
        cache.begin_forward([0, 1], lens)
        assert not [e for e in log if e[0] == "copy"][step:], "copy must be lazy"
        plan = cache.open_plan
        t = sum(lens)
        for layer in range(2):
            q = rng.standard_normal((t, 4, 8)).astype(np.float32)
            kv = rng.standard_normal((t, 2, 8)).astype(np.float32)
            cache.attention(layer, q, kv, kv)
        copies = [e for e in log if e[0] == "copy"]
        assert len(copies) == step + 1 and copies[-1][2] == "copy-stream"
        packed = pack_reference(plan)
        assert copies[-1][1] == len(packed) and len(packed) % ALIGN == 0
        views, host = list(walk(cache.forward_aux())), list(walk(plan))
        assert [(d, name) for d, name, _ in views] == [(d, name) for d, name, _ in host]
        for (d, name, view), (_, _, array) in zip(views, host):
            np.testing.assert_array_equal(view, array, err_msg=f"depth {d} {name}")
        cache.end_forward()
    waits = [e for e in log if e[0] == "wait" and e[2] is None]
    assert len(waits) == 3                                   # compute waits once per forward
    # third forward reuses buffer 0: the copy stream waited on forward 1's release event
    assert any(e[0] == "wait" and e[2] == "copy-stream" for e in log)
    assert [e[0] for e in log].count("alloc_device") == 2    # two buffers, no steady-state allocation
