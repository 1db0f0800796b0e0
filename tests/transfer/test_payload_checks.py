"""Issue 28, items 2, 4, 8 on every backend of the CPU suite, cuda's CPU test mode included
(tests/conformance runs TestPayloadImport on the backends available without KVCACHE_CUDA_CPU,
so cuda is checked here): a payload whose K/V are not what its header says, a reservation of
another cache, malformed reserve_import items. Each refused typed, naming the value, and the
cache (free pages, sequences, their K/V) exactly as before. No forward runs: payloads are
built by hand, so the cuda case costs no Triton interpretation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError
from kvcache.transfer import payload_fields
from transfer_cases import make_cache, snapshot

BACKENDS = ["reference", "cuda", "metal"]


def small_config():
    # head_dim 64: every backend's kernels take it; one layer, one KV head keep it small
    return kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=64,
                               page_size=4, max_total_tokens=64, max_batch_size=2,
                               dtype="float32", rope_mode="none")


def host_payload(cfg, n, seed):
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim))
            .astype(np.float32) for _ in range(2))
    plain = kvcache.SequencePayload(k, v, start=0, num_tokens=n, source_length=n,
                                    **payload_fields(cfg))
    return dataclasses.replace(plain, checksum=kvcache.transfer.checksum(k, v, plain.header()))


def bad_payloads(good):
    """(label, payload, what the error names): arrays that are not the header's (the
    issue's list), and a changed byte under the exporter's checksum."""
    k = good.k
    flipped = k.copy()
    flipped.reshape(-1).view(np.uint8)[3] ^= 0x40
    arrays = [("bool", k > 0), ("int32", k.astype(np.int32)),
              ("uint32", k.view(np.uint32)), ("float64", k.astype(np.float64)),
              ("float16", k.astype(np.float16)), ("complex64", k.astype(np.complex64)),
              ("str", k.astype(str)), ("object", np.full(k.shape, None, dtype=object))]
    out = [(f"K of {label}", dataclasses.replace(good, k=a, checksum=None), label)
           for label, a in arrays]
    out.append(("K a list", dataclasses.replace(good, k=k.tolist(), checksum=None), "list"))
    out.append(("V None", dataclasses.replace(good, v=None, checksum=None), "NoneType"))
    out.append(("K one token short", dataclasses.replace(good, k=k[:, 1:], checksum=None),
                "shape"))
    out.append(("a flipped bit", dataclasses.replace(good, k=flipped), "checksum"))
    v_flipped = good.v.copy()
    v_flipped.reshape(-1).view(np.uint8)[-2] ^= 0x01
    out.append(("a flipped bit of V", dataclasses.replace(good, v=v_flipped), "checksum"))
    # header fields the checksum covers (issue 51: only K/V were): each still a valid value
    for change in (dict(window_size=4), dict(sink_size=2), dict(source_length=12),
                   dict(rope_theta=5000.0), dict(rope_scale=2.0),
                   dict(start=3, source_length=12)):
        out.append((f"{change} changed", dataclasses.replace(good, **change), "checksum"))
    out.append(("kv_dtype float64", dataclasses.replace(good, kv_dtype="float64"), "float64"))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_payload_that_is_not_its_header_is_refused_and_nothing_changes(backend):
    cfg = small_config()
    cache = make_cache(backend, cfg)
    cache.import_sequence(1, host_payload(cfg, 6, 0))     # K/V that must stay as they are
    good = host_payload(cfg, 9, 1)
    before = snapshot(cache)
    for label, bad, names in bad_payloads(good):
        with pytest.raises(InvalidArgumentError, match=names) as err:
            cache.import_sequence(7, bad)
        assert "sequence 7" in str(err.value), (label, err.value)
        with pytest.raises(InvalidArgumentError, match=names):
            cache.reserve_import([(8, good, None, None), (7, bad, None, None)])
        assert snapshot(cache) == before, label
    cache.import_sequence(7, good)                 # the genuine payload goes in, bit for bit
    k, v = cache.get_kv(7)
    assert np.array_equal(kvcache.to_numpy(k), good.k)
    assert np.array_equal(kvcache.to_numpy(v), good.v)
    cache.state.pt.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_another_caches_reservation_is_refused_and_stays_usable(backend):
    """Before: B closed A's reservation (ForwardStateError 'cleared', or a silent cancel) and
    A's pages never came back."""
    cfg = small_config()
    a, b = make_cache(backend, cfg), make_cache("reference", cfg)
    b.import_sequence(1, host_payload(cfg, 5, 2))
    good = host_payload(cfg, 9, 3)
    free_a, before_b = a.num_available_pages, snapshot(b)
    for method in ("write_import", "commit_import", "cancel_import"):
        res = a.reserve_import([(7, good, None, None)])
        args = ((res, b.from_numpy(good.k), b.from_numpy(good.v)) if method == "write_import"
                else (res,))
        with pytest.raises(InvalidArgumentError, match="another cache"):
            getattr(b, method)(*args)
        assert snapshot(b) == before_b, method
        a.cancel_import(res)                       # still A's to give back
        assert a.num_available_pages == free_a and a.is_empty, method
    res = a.reserve_import([(7, good, None, None)])
    a.write_import(res, a.from_numpy(good.k), a.from_numpy(good.v))
    a.commit_import(res)
    assert np.array_equal(kvcache.to_numpy(a.get_kv(7)[0]), good.k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_malformed_import_arguments_are_typed(backend):
    cfg = small_config()
    cache = make_cache(backend, cfg)
    before = snapshot(cache)
    good = host_payload(cfg, 3, 4)
    for items, names in [([(9,)], r"item 0 .*\(9,\)"), ([None], "item 0 .*None"),
                         (5, "int"), ([(7, good)], "item 0")]:
        with pytest.raises(InvalidArgumentError, match=names):
            cache.reserve_import(items)
    for method in ("commit_import", "cancel_import"):
        with pytest.raises(InvalidArgumentError, match="NoneType"):
            getattr(cache, method)(None)
    with pytest.raises(InvalidArgumentError, match="rope_inv_freq=None"):
        kvcache.SequencePayload.from_header({**good.header(), "rope_inv_freq": None})
    # an array where a string or int belongs (a pickled payload can hold anything): compared
    # with `!=` / `in` it raised numpy's untyped "truth value of an array is ambiguous"
    for field in ("version", "kv_dtype", "rope_mode"):
        with pytest.raises(kvcache.KVCacheError, match=field.replace("version", "format version")):
            cache.import_sequence(7, dataclasses.replace(good, **{field: np.array([1, 2])}))
    assert snapshot(cache) == before


def test_the_checksum_covers_the_fp8_scales_and_the_ids_positions():
    """Issue 51: an fp8 payload whose kv_scales were altered under its checksum was adopted and
    read back up to 2.8 off; the checksum now covers every header field but backend, device and
    itself. Altered scales, an altered window, a flipped V byte: each refused naming the
    checksum; the genuine payload imports."""
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=64,
                              page_size=4, max_total_tokens=64, max_batch_size=2,
                              dtype="float32", rope_mode="none", kv_dtype="float8_e4m3")
    src = kvcache.PagedKVCache(cfg, backend="reference")
    src.add_sequence(0)
    rng = np.random.default_rng(3)
    with src.forward([0], [6]):
        for layer in range(2):
            x = src.from_numpy(rng.standard_normal((6, 1, 64)).astype(np.float32))
            src.attention(layer, src.from_numpy(rng.standard_normal((6, 2, 64)).astype(np.float32)),
                          x, x)
    good = src.export_sequence(0).to_numpy()
    assert good.checksum is not None and good.kv_scales[0] is not None
    (k0, v0), rest = good.kv_scales[0], good.kv_scales[1:]
    scaled = ((tuple(2 * s for s in k0), v0),) + rest
    v = good.v.copy()
    v.reshape(-1).view(np.uint8)[-1] ^= 0x10
    for label, bad in (("scales", dataclasses.replace(good, kv_scales=scaled)),
                       ("window", dataclasses.replace(good, window_size=4)),
                       ("V", dataclasses.replace(good, v=v))):
        dest = kvcache.PagedKVCache(cfg, backend="reference")
        with pytest.raises(InvalidArgumentError, match="checksum"):
            dest.import_sequence(5, bad)
        assert dest.is_empty and dest.kv_scales(0) is None, label
    dest = kvcache.PagedKVCache(cfg, backend="reference")
    dest.import_sequence(5, good)
    assert dest.kv_scales(0) == good.kv_scales[0]


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("axis", [0, 1, 2, 3], ids=["layers", "tokens", "heads", "dim"])
def test_an_array_truncated_at_any_boundary_is_refused(which, axis):
    """Issue 51's families: K or V cut short along each axis (a layer, a token, a KV head, a
    column of the row), with and without the checksum: refused naming the shape, nothing
    changes; the bytes cut at the end of the flat array cannot even take the header's shape."""
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                              page_size=4, max_total_tokens=64, max_batch_size=2,
                              dtype="float32", rope_mode="none")
    cache = make_cache("reference", cfg)
    good = host_payload(cfg, 5, 7)
    before = snapshot(cache)
    arr = getattr(good, which)
    cut = np.take(arr, range(arr.shape[axis] - 1), axis=axis)
    for checksum in (good.checksum, None):
        bad = dataclasses.replace(good, **{which: cut}, checksum=checksum)
        with pytest.raises(InvalidArgumentError, match="shape|checksum"):
            cache.import_sequence(3, bad)
        assert snapshot(cache) == before
    flat = np.ascontiguousarray(arr).reshape(-1)[:-1]
    with pytest.raises(InvalidArgumentError):
        cache.import_sequence(3, dataclasses.replace(good, **{which: flat}, checksum=None))
    assert snapshot(cache) == before
