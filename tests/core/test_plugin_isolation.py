"""A plugin whose import or hook fails is listed as unusable, with the reason, and hides no other
backend; the reference backend works without ml_dtypes (no bfloat16 then)."""

import importlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcache
from kvcache import plugins
from kvcache.reference import ReferenceBackend

CONFIG = dict(num_layers=1, num_qo_heads=1, num_kv_heads=1, head_dim=2)


@pytest.fixture(autouse=True)
def fresh_plugins():
    plugins.reset_plugins()
    yield
    plugins.reset_plugins()


class Spare(ReferenceBackend):
    name, priority = "spare-test", -50


class Working:
    @kvcache.hookimpl
    def kvcache_register_backends(self):
        return [Spare]


class Raising:
    @kvcache.hookimpl
    def kvcache_register_backends(self):
        import kvcache_no_such_dependency  # noqa: F401
        return []


class NotABackend:
    @kvcache.hookimpl
    def kvcache_register_backends(self):
        return [Spare, 42]


def row(name):
    return next(r for r in kvcache.list_backends() if r["name"] == name)


def test_broken_plugin_is_listed_and_hides_nothing():
    plugins.register_plugin(Working(), name="working-test")
    plugins.register_plugin(Raising(), name="raising-test")
    plugins.register_plugin(NotABackend(), name="bad-return-test")

    raising, bad = row("raising-test"), row("bad-return-test")
    assert not raising["available"] and raising["class"] is None
    assert "ModuleNotFoundError" in raising["reason"] and "kvcache_no_such_dependency" in raising["reason"]
    assert not bad["available"] and "returned 42, not a Backend subclass" in bad["reason"]
    assert row("spare-test")["available"] and row("reference")["available"]
    assert set(plugins.backend_classes()) >= {"reference", "spare-test"}

    cache = kvcache.PagedKVCache(kvcache.CacheConfig(**CONFIG, dtype="float32", rope_mode="normal"), backend="spare-test")
    assert cache.backend.name == "spare-test"
    assert kvcache.PagedKVCache(kvcache.CacheConfig(**CONFIG, dtype="float32", rope_mode="normal")).backend.name == "reference"

    with pytest.raises(kvcache.BackendNotAvailableError) as info:
        plugins.resolve_backend("raising-test")
    assert "is not available: kvcache_register_backends raised ModuleNotFoundError" in str(info.value)
    with pytest.raises(kvcache.BackendNotAvailableError) as info:
        plugins.resolve_backend("nope")
    text = str(info.value)
    assert "unknown backend 'nope'" in text and "reference: available" in text
    assert "raising-test: unavailable (kvcache_register_backends raised ModuleNotFoundError" in text
    assert "bad-return-test: unavailable" in text


def test_failing_reference_plugin_breaks_only_reference(monkeypatch):
    """The original bug: the built-in plugin's import error broke every backend lookup."""
    monkeypatch.setitem(sys.modules, "kvcache.reference", None)   # the hook's import now fails
    plugins.register_plugin(Working(), name="working-test")
    ref = row("reference")
    assert not ref["available"] and ref["class"] is None
    assert "kvcache_register_backends raised" in ref["reason"] and "kvcache.reference" in ref["reason"]
    assert plugins.resolve_backend("spare-test") is Spare
    assert "spare-test" in kvcache.available_backends()
    with pytest.raises(kvcache.BackendNotAvailableError, match="'reference' is not available: "
                                                                "kvcache_register_backends raised"):
        kvcache.PagedKVCache(kvcache.CacheConfig(**CONFIG, dtype="float32", rope_mode="normal"), backend="reference")
    from kvcache.cli import _info

    class Args:
        device = None
    assert _info(Args()) == 0     # `kvcache info` lists it and carries on


@pytest.fixture
def reference_without_ml_dtypes(monkeypatch):
    """kvcache.reference imported afresh as if ml_dtypes were not installed (all restored after)."""
    monkeypatch.setattr(kvcache, "reference", sys.modules["kvcache.reference"])
    monkeypatch.setattr(kvcache, "arrays", sys.modules["kvcache.arrays"])
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)          # `import ml_dtypes` raises
    monkeypatch.delitem(sys.modules, "kvcache.reference")
    monkeypatch.delitem(sys.modules, "kvcache.arrays")           # (the host dtype table's home)
    module = importlib.import_module("kvcache.reference")
    assert module.ReferenceBackend is not ReferenceBackend
    return module


def test_reference_without_ml_dtypes(reference_without_ml_dtypes):
    ref = reference_without_ml_dtypes
    cls = ref.ReferenceBackend
    assert cls.capabilities.dtypes == ("float16", "float32")
    assert "bfloat16" not in ref.NP_DTYPES and "ml_dtypes" in ref.BFLOAT16_MISSING
    ok, reason = cls.availability()
    assert ok and "no bfloat16" in reason and "ml_dtypes" in reason

    assert plugins.resolve_backend("reference") is cls       # the built-in hook sees this module
    with pytest.raises(kvcache.UnsupportedFeatureError, match="capability 'dtypes'"):
        kvcache.PagedKVCache(kvcache.CacheConfig(**CONFIG, dtype="bfloat16", rope_mode="normal"), backend="reference")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="ml_dtypes"):
        cls(kvcache.CacheConfig(**CONFIG, dtype="bfloat16", rope_mode="normal"))   # bypassing PagedKVCache

    for dtype in ("float16", "float32"):
        cache = kvcache.PagedKVCache(kvcache.CacheConfig(**CONFIG, dtype=dtype, rope_mode="normal"), backend="reference")
        x = cache.from_numpy(np.array([[1.5, -2.0]]))
        assert x.dtype == np.dtype(dtype)
        back = cache.backend.to_numpy(x)
        assert back.dtype == np.float32 and back.tolist() == [[1.5, -2.0]]


def test_kvcache_info_without_ml_dtypes():
    """`kvcache info` in a process where ml_dtypes cannot be imported."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None
        from kvcache.cli import main
        sys.exit(main(["info"]))
    """)
    env = dict(os.environ, KVCACHE_PLUGINS="reference,example")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("reference "))
    assert "available" in line and "no bfloat16" in line and "ml_dtypes" in line
    assert "dtypes:             float16, float32\n" in out
    try:
        import kvcache_example  # noqa: F401
    except ImportError:
        return
    # the example plugin imports ml_dtypes at module level: listed as unusable, with the reason
    line = next(ln for ln in out.splitlines() if ln.startswith("example "))
    assert "unavailable" in line and "ml_dtypes" in line
