"""int8 / int4 pages moved between caches (issue 32): ``export_sequence`` gives the rows as
stored, packed (``kv_quant.affine_pack``: codes, scales, biases), ``import_sequence`` stores
them unchanged, so a sequence comes back with its codes bit for bit, across the reference and
metal backends (and through the host tier); another group size or compute dtype is refused
unless ``convert_dtype`` (then the values are stored again), a plain cache takes the values
with ``convert_dtype``. The judge of the codes is ``kv_quant.affine_quantize`` of the inputs
(RoPE off, so K is stored as given)."""

import pickle

import numpy as np
import pytest

import kvcache
from kvcache import HostTier, InvalidArgumentError, PagedKVCache, SequencePayload
from kvcache import kv_quant as kq

pytest.importorskip("ml_dtypes")
FORMATS = ["int8", "int4"]


def backends():
    ok = {r["name"]: r["available"] for r in kvcache.list_backends("cpu")}
    return ["reference"] + (["metal"] if ok.get("metal") else [])


def make(backend, kv_dtype="int8", dtype="float32", group=32, tokens=512, head_dim=64):
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=head_dim,
                              page_size=8, max_total_tokens=tokens, dtype=dtype,
                              kv_dtype=kv_dtype, kv_quant_group=group, rope_mode="none")
    return PagedKVCache(cfg, backend=backend, device="cpu")


def fill(cache, sid=0, n=21, seed=0):
    """A prefill of ``n`` random tokens into ``sid``; returns the K/V given, per layer."""
    rng = np.random.default_rng(seed)
    c = cache.config
    cache.add_sequence(sid)
    given = []
    with cache.forward([sid], [n]):
        for layer in range(c.num_layers):
            q, k, v = (rng.standard_normal((n, h, c.head_dim)).astype(np.float32) * m
                       for h, m in ((4, 1), (2, 3), (2, 1)))
            cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v))
            given.append((k, v))
    return given


def kv(cache, sid):
    return [tuple(kvcache.to_numpy(x) for x in cache.get_kv(sid, layer=layer))
            for layer in range(cache.config.num_layers)]


def expected_rows(given, cfg):
    """The packed rows the format makes of the given K/V (rounded to the compute dtype
    first), per layer: (k_rows, v_rows)."""
    from kvcache.reference import np_dtype
    bits = kq.AFFINE_BITS[cfg.kv_dtype]
    out = []
    for k, v in given:
        out.append(tuple(kq.affine_pack(*kq.affine_quantize(
            x.astype(np_dtype(cfg.dtype)).astype(np.float32), bits, cfg.kv_quant_group,
            cfg.dtype), bits) for x in (k, v)))
    return out


@pytest.mark.parametrize("src_backend", backends())
@pytest.mark.parametrize("dst_backend", backends())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_export_gives_the_packed_rows_and_import_keeps_the_codes(src_backend, dst_backend, fmt,
                                                                 dtype):
    src = make(src_backend, fmt, dtype)
    given = fill(src)
    payload = src.export_sequence(0)
    assert payload.kv_dtype == fmt and payload.dtype == dtype and payload.kv_quant_group == 32
    assert payload.array_dtype == "uint8"
    host = payload.to_numpy()
    want = expected_rows(given, src.config)
    assert host.k.shape == host.shape == (2, 21, 2, want[0][0].shape[-1])
    for layer, (wk, wv) in enumerate(want):
        np.testing.assert_array_equal(host.k[layer], wk)
        np.testing.assert_array_equal(host.v[layer], wv)
    # pickled and read from its header, into another cache (maybe another backend)
    moved = pickle.loads(pickle.dumps(host))
    moved = SequencePayload.from_header(moved.header(), moved.k, moved.v)
    assert moved.kv_quant_group == 32
    dst = make(dst_backend, fmt, dtype)
    dst.import_sequence(4, moved)
    for (a, b), (c, d) in zip(kv(src, 0), kv(dst, 4)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
    again = dst.export_sequence(4).to_numpy()
    np.testing.assert_array_equal(again.k, host.k)
    np.testing.assert_array_equal(again.v, host.v)
    # the values a payload reads back equal get_kv's
    from kvcache.reference import np_dtype
    values = [x.astype(np_dtype(dtype)).astype(np.float32) for x in moved.values()]
    for layer, (a, b) in enumerate(kv(src, 0)):
        np.testing.assert_array_equal(values[0][layer], a)
        np.testing.assert_array_equal(values[1][layer], b)


@pytest.mark.parametrize("backend", backends())
def test_a_device_payload_imports_into_the_same_backend(backend):
    src = make(backend, "int4")
    fill(src)
    dst = make(backend, "int4")
    dst.import_sequence(1, src.export_sequence(0))          # native arrays, no host copy
    for (a, b), (c, d) in zip(kv(src, 0), kv(dst, 1)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


def test_other_groups_or_dtypes_are_refused_unless_converted():
    src = make("reference", "int8", "float32", group=32)
    fill(src)
    payload = src.export_sequence(0).to_numpy()
    for other in (make("reference", "int8", "float32", group=64),
                  make("reference", "int8", "bfloat16", group=32)):
        free = other.num_available_pages
        with pytest.raises(InvalidArgumentError, match="convert_dtype=True"):
            other.import_sequence(0, payload)
        assert other.is_empty and other.num_available_pages == free
        other.import_sequence(0, payload, convert_dtype=True)      # values stored again
        from kvcache.reference import np_dtype
        cfg = other.config

        def rounded(x):
            return x.astype(np_dtype(cfg.dtype)).astype(np.float32)

        for (a, b), (c, d) in zip(kv(src, 0), kv(other, 0)):
            for x, y in ((a, c), (b, d)):       # the source's values, quantized again here
                want = kq.roundtrip(rounded(x), "int8", cfg.dtype, cfg.kv_quant_group)
                np.testing.assert_array_equal(y, rounded(want))
    int4 = make("reference", "int4")
    with pytest.raises(InvalidArgumentError, match="only a int4 payload"):
        int4.import_sequence(0, payload, convert_dtype=True)


def test_a_plain_cache_takes_the_values_with_convert_dtype():
    src = make("reference", "int4", "float32")
    fill(src)
    payload = src.export_sequence(0)
    plain = make("reference", "auto", "float32")
    with pytest.raises(InvalidArgumentError, match="convert_dtype"):
        plain.import_sequence(0, payload)
    plain.import_sequence(0, payload, convert_dtype=True)
    for (a, b), (c, d) in zip(kv(src, 0), kv(plain, 0)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)


def test_a_wrong_payload_is_refused_and_changes_nothing():
    src = make("reference", "int8")
    fill(src)
    host = src.export_sequence(0).to_numpy(with_checksum=False)
    dst = make("reference", "int8", tokens=8)           # 2 pages: too few for 21 tokens
    free = dst.num_available_pages
    with pytest.raises(kvcache.CacheFullError):
        dst.import_sequence(0, host)
    import dataclasses
    short = dataclasses.replace(host, k=host.k[..., :-1], v=host.v[..., :-1])
    with pytest.raises(InvalidArgumentError, match="shape"):
        make("reference", "int8").import_sequence(0, short)
    no_group = dataclasses.replace(host, kv_quant_group=None)
    with pytest.raises(InvalidArgumentError, match="kv_quant_group"):
        make("reference", "int8").import_sequence(0, no_group)
    assert dst.is_empty and dst.num_available_pages == free


@pytest.mark.parametrize("backend", backends())
def test_host_tier_parks_and_restores_affine_sequences(backend):
    cache = make(backend, "int4", "bfloat16")
    fill(cache, 0)
    fill(cache, 1, n=9, seed=3)
    before = kv(cache, 0)
    tier = HostTier(cache)
    tier.offload(0)
    assert 0 not in cache.sequence_ids and 0 in tier
    tier.restore(0)
    for (a, b), (c, d) in zip(before, kv(cache, 0)):
        np.testing.assert_array_equal(a, c)
        np.testing.assert_array_equal(b, d)
