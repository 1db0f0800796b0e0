"""The attention keywords of issue 27 on the public API: bad values are typed errors naming the
value and the forward, a backend without the capability refuses naming it, and a refused call
changes nothing (the layer can run again, the forward commits as if the call never happened)."""

import dataclasses

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError, UnsupportedFeatureError
from kvcache.reference import ReferenceBackend


def _cache(**kw):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                              page_size=4, max_total_tokens=64, dtype="float32", rope_mode="none", **kw)
    c = kvcache.PagedKVCache(cfg, backend="reference")
    c.add_sequence(7)
    return c


def _qkv(c, n=3):
    rng = np.random.default_rng(0)
    cfg = c.config
    return [c.from_numpy(rng.standard_normal((n, h, d))) for h, d in
            ((cfg.num_qo_heads, cfg.head_dim), (cfg.num_kv_heads, cfg.head_dim),
             (cfg.num_kv_heads, cfg.head_dim_v))]


@pytest.mark.parametrize("kw, match", [
    (dict(logit_softcap=-1.0), r"logit_softcap must be positive.*sequences \[7\]"),
    (dict(logit_softcap=float("nan")), r"logit_softcap must be finite"),
    (dict(logit_softcap="30"), r"logit_softcap must be a real number"),
    (dict(sinks=np.zeros(4)), r"sinks has shape \(4,\) and dtype float64"),
    (dict(sinks="sinks"), r"sinks must be a reference backend array"),
])
def test_bad_values_are_typed_and_change_nothing(kw, match):
    c = _cache()
    c.begin_forward([7], [3])
    with pytest.raises(InvalidArgumentError, match=match):
        c.attention(0, *_qkv(c), **kw)
    plain = c.attention(0, *_qkv(c))          # the layer runs after the refusal
    c.end_forward()
    assert c.sequence_length(7) == 3 and plain.shape == (3, 4, 16)


def test_sinks_of_the_wrong_shape_name_the_heads():
    c = _cache()
    c.begin_forward([7], [3])
    with pytest.raises(InvalidArgumentError, match=r"expected \(4,\) \(one logit per query head\)"):
        c.attention(0, *_qkv(c), sinks=c.from_numpy(np.zeros(2)))
    c.abort_forward()


@pytest.mark.parametrize("capability, kw", [("logit_softcap", dict(logit_softcap=5.0)),
                                            ("attention_sinks", "sinks")])
def test_a_backend_without_the_capability_refuses_naming_it(monkeypatch, capability, kw):
    caps = dataclasses.replace(ReferenceBackend.capabilities, **{capability: False})
    monkeypatch.setattr(ReferenceBackend, "capabilities", caps)
    c = _cache()
    c.begin_forward([7], [3])
    if kw == "sinks":
        kw = dict(sinks=c.from_numpy(np.zeros(4)))
    with pytest.raises(UnsupportedFeatureError, match=f"capability '{capability}' not declared"):
        c.attention(0, *_qkv(c), **kw)
    c.abort_forward()
    assert c.sequence_length(7) == 0


def test_a_value_head_dim_the_backend_lacks_is_refused_at_creation(monkeypatch):
    caps = dataclasses.replace(ReferenceBackend.capabilities, head_dims_v=())
    monkeypatch.setattr(ReferenceBackend, "capabilities", caps)
    with pytest.raises(UnsupportedFeatureError, match="head_dim_v 8"):
        _cache(head_dim_v=8)
    assert _cache(head_dim_v=16).config.page_row_dim == 16      # equal dims need nothing


def test_value_head_dim_shapes_the_output_and_the_pages():
    c = _cache(head_dim_v=8)
    assert c.config.page_row_dim == 16
    with c.forward([7], [3]):
        o = c.attention(0, *_qkv(c))
    assert o.shape == (3, 4, 8)
    k, v = c.get_kv(7)
    assert k.shape == (1, 3, 2, 16) and v.shape == (1, 3, 2, 8)
    c.begin_forward([7], [1])
    q, k1, v1 = _qkv(c, 1)
    with pytest.raises(InvalidArgumentError, match=r"v has shape \(1, 2, 16\), expected \(1, 2, 8\)"):
        c.attention(0, q, k1, c.from_numpy(np.zeros((1, 2, 16))))
    c.abort_forward()
