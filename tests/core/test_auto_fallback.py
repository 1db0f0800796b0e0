"""``backend="auto"`` falls back (issue 28, item 6): when the highest-priority available plugin's
constructor or ``allocate_pages`` raises, auto warns why it skipped it and takes the next
backend by priority; it used to raise the plugin's own RuntimeError. A backend named explicitly
raises as before, and so does a ``KVCacheError`` (the configuration's fault, not the plugin's)."""

import numpy as np
import pytest

import kvcache
from kvcache import plugins
from kvcache.reference import ReferenceBackend


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch):
    monkeypatch.setenv("KVCACHE_PLUGINS", "reference")      # no torch / MLX plugin in the way
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


class BrokenInit(ReferenceBackend):
    name, priority = "broken-init-test", 90

    def __init__(self, config, device=None):
        raise RuntimeError("driver says no (test)")


class BrokenAlloc(ReferenceBackend):
    name, priority = "broken-alloc-test", 80

    def allocate_pages(self, num_pages):
        raise RuntimeError("out of device handles (test)")


class Fussy(ReferenceBackend):
    """Refuses the configuration with a typed error: that one is the caller's to see."""
    name, priority = "fussy-test", 95

    def __init__(self, config, device=None):
        raise kvcache.UnsupportedFeatureError("fussy-test does not do this config (test)")


def register(*classes):
    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return list(classes)
    plugins.register_plugin(Plugin(), name="fallback-test")


def config():
    return kvcache.CacheConfig(1, 2, 1, 8, page_size=4, max_total_tokens=32, dtype="float32",
                               rope_mode="none")


def test_auto_skips_plugins_that_fail_to_start_and_says_why():
    register(BrokenInit, BrokenAlloc)
    with pytest.warns(RuntimeWarning) as warned:
        cache = kvcache.PagedKVCache(config())
    assert cache.backend.name == "reference"
    text = [str(w.message) for w in warned]
    assert any("broken-init-test" in t and "driver says no" in t for t in text), text
    assert any("broken-alloc-test" in t and "out of device handles" in t for t in text), text
    cache.add_sequence(0)                 # a working cache
    with cache.forward([0], [2]):
        x = cache.from_numpy(np.ones((2, 2, 8)))
        cache.attention(0, x, cache.from_numpy(np.ones((2, 1, 8))), cache.from_numpy(np.ones((2, 1, 8))))
    assert cache.sequence_length(0) == 2


def test_a_named_backend_raises_its_own_error():
    register(BrokenInit, BrokenAlloc)
    with pytest.raises(RuntimeError, match="driver says no"):
        kvcache.PagedKVCache(config(), backend="broken-init-test")
    with pytest.raises(RuntimeError, match="out of device handles"):
        kvcache.PagedKVCache(config(), backend="broken-alloc-test")


def test_when_every_backend_fails_auto_lists_each_failure(monkeypatch):
    register(BrokenInit, BrokenAlloc)
    monkeypatch.setattr(ReferenceBackend, "allocate_pages",
                        lambda self, n: (_ for _ in ()).throw(RuntimeError("no host memory (test)")))
    with pytest.warns(RuntimeWarning), pytest.raises(kvcache.BackendNotAvailableError) as info:
        kvcache.PagedKVCache(config())
    msg = str(info.value)
    for part in ("broken-init-test", "driver says no", "broken-alloc-test",
                 "out of device handles", "'reference'", "no host memory"):
        assert part in msg, msg


def test_a_typed_refusal_is_not_skipped():
    register(Fussy, BrokenInit)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="fussy-test"):
        kvcache.PagedKVCache(config())
