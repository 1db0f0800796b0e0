"""The backend contract itself: capability fields, the storage format of pages kept apart from
the compute dtypes, and the page layout declared once in the base class."""

import dataclasses

import numpy as np
import pytest

import kvcache
import kvcache.plugins
from kvcache.config import KV_FORMATS
from kvcache.conformance import make_config
from kvcache.reference import ReferenceBackend


class NarrowStore(ReferenceBackend):
    """Computes in float16 and float32 but stores pages in float16 only."""

    name = "narrow-store"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities,
                                       dtypes=("float16", "float32"), kv_dtypes=("float16",))


class _Plugin:
    @kvcache.hookimpl
    def kvcache_register_backends(self):
        return [NarrowStore]


@pytest.fixture
def narrow_store():
    kvcache.plugins.register_plugin(_Plugin(), name="narrow-store-test")
    yield NarrowStore
    kvcache.plugins.reset_plugins()


def test_every_capability_has_one_sentence_reason():
    for f in dataclasses.fields(kvcache.Capabilities):
        doc = f.metadata["doc"]
        assert doc.endswith(".") and doc.count(". ") == 0, (f.name, doc)
        reason = kvcache.Capabilities.reason(f.name)
        assert reason.startswith(f"capability {f.name!r} not declared (") and doc in reason


def test_kv_dtypes_default_to_the_compute_dtypes():
    caps = kvcache.Capabilities(dtypes=("float16", "bfloat16"))
    assert caps.kv_dtypes == ("float16", "bfloat16")
    assert caps.describe()["kv_dtypes"] == ("float16", "bfloat16")
    assert kvcache.Capabilities(dtypes=("float32",), kv_dtypes=("float16",)).kv_dtypes == ("float16",)
    for name in ("reference", "example", "metal", "cuda", "rocm"):
        row = next((r for r in kvcache.list_backends() if r["name"] == name), None)
        if row is not None and row["class"] is not None:
            caps = row["class"].capabilities
            # the compute dtypes, then the quantized formats the backend stores (issue 32)
            assert caps.kv_dtypes[:len(caps.dtypes)] == caps.dtypes, name
            assert set(caps.kv_dtypes[len(caps.dtypes):]) <= set(KV_FORMATS), name
    assert set(KV_FORMATS) <= set(ReferenceBackend.capabilities.kv_dtypes)


def test_config_kv_dtype_outside_kv_dtypes_is_refused(narrow_store):
    cache = kvcache.PagedKVCache(make_config(dtype="float16"), backend="narrow-store")
    assert kvcache.to_numpy(cache.pages[0]).shape == cache.backend.page_shape(cache.config.num_pages)
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match="kv_dtype 'float32': capability 'kv_dtypes' not declared"):
        kvcache.PagedKVCache(make_config(dtype="float32"), backend="narrow-store")


def test_page_shape_is_the_one_declaration_of_the_layout():
    config = make_config(num_kv_heads=3, gqa=2, head_dim=8, page_size=4)
    backend = ReferenceBackend(config)
    assert backend.page_shape(5) == (5, 2, 3, 4, 8)

    class Transposed(ReferenceBackend):
        def page_shape(self, num_pages):
            c = self.config
            return (num_pages, c.page_size, 2, c.num_kv_heads, c.head_dim)

    pages = Transposed(config).allocate_pages(5)
    assert len(pages) == config.num_layers and pages[0].shape == (5, 4, 2, 3, 8)
    assert np.all(pages[0] == 0)
