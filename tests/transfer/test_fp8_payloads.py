"""fp8 pages moved between caches (issue 32): ``export_sequence`` gives the values read back
(``code * scale``, in the compute dtype) with the layer scales, ``import_sequence`` adopts the
scales where the importing cache has none and stores the values again, which gives the same
codes; a cache with other scales refuses unless ``convert_dtype``; the host tier parks and
restores fp8 sequences. On the reference backend and the cuda backend's CPU test mode (which
stores real e4m3 codes)."""

import pickle

import numpy as np
import pytest

import kvcache
from kvcache import HostTier, InvalidArgumentError, PagedKVCache, SequencePayload

pytest.importorskip("ml_dtypes")
BACKENDS = ["reference", "cuda"]


def make(backend, kv_dtype="float8_e4m3", dtype="float32", tokens=512):
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=32,
                              page_size=8, max_total_tokens=tokens, dtype=dtype,
                              kv_dtype=kv_dtype, kv_quant_group=32, rope_mode="normal")
    if backend == "cuda":
        pytest.importorskip("torch")
        ok = {r["name"]: r["available"] for r in kvcache.list_backends("cpu")}
        if not ok.get("cuda"):
            pytest.skip("cuda backend not available here")
        return PagedKVCache(cfg, backend="cuda", device="cpu")
    return PagedKVCache(cfg, backend=backend)


def fill(cache, sid=0, n=21, seed=0):
    """A prefill of ``n`` random tokens (K of magnitude 3, V 1) into sequence ``sid``."""
    rng = np.random.default_rng(seed)
    c = cache.config
    cache.add_sequence(sid)
    with cache.forward([sid], [n]):
        for layer in range(c.num_layers):
            q, k, v = (rng.standard_normal((n, h, c.head_dim)).astype(np.float32) * m
                       for h, m in ((4, 1), (2, 3), (2, 1)))
            cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v))


def decode(cache, sid, seed=5):
    """One decode step's outputs of every layer (fixed inputs), as numpy."""
    rng = np.random.default_rng(seed)
    c = cache.config
    outs = []
    with cache.forward([sid], [1]):
        for layer in range(c.num_layers):
            q, k, v = (rng.standard_normal((1, h, c.head_dim)).astype(np.float32)
                       for h in (4, 2, 2))
            outs.append(kvcache.to_numpy(cache.attention(
                layer, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v))))
    return outs


def kv(cache, sid):
    return [tuple(kvcache.to_numpy(x) for x in cache.get_kv(sid, layer=layer))
            for layer in range(cache.config.num_layers)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("host", [False, True], ids=["device", "host-pickled"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_round_trip_gives_the_same_codes_and_outputs(backend, host, dtype):
    src = make(backend, dtype=dtype)
    fill(src)
    payload = src.export_sequence(0)
    assert payload.kv_dtype == "float8_e4m3" and payload.dtype == dtype
    assert payload.kv_scales == tuple(src.kv_scales(layer) for layer in range(2))
    if host:
        payload = pickle.loads(pickle.dumps(payload.to_numpy()))
        again = SequencePayload.from_header(payload.header(), payload.k, payload.v)
        assert again.kv_scales == payload.kv_scales and again.dtype == dtype
    dst = make(backend, dtype=dtype)
    assert dst.kv_scales(0) is None
    dst.import_sequence(3, payload)
    assert [dst.kv_scales(layer) for layer in range(2)] == list(payload.kv_scales)
    for (k1, v1), (k2, v2) in zip(kv(src, 0), kv(dst, 3)):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
    for a, b in zip(decode(src, 0), decode(dst, 3)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_scales_are_refused_unless_converting(backend):
    src = make(backend)
    fill(src)
    payload = src.export_sequence(0).to_numpy()
    dst = make(backend)
    for layer in range(2):
        dst.set_kv_scales(layer, 0.5, 0.5)
    free = dst.num_available_pages
    with pytest.raises(InvalidArgumentError, match="layer 0's fp8 scales"):
        dst.import_sequence(3, payload)
    assert dst.num_available_pages == free and 3 not in dst.sequence_ids
    assert dst.kv_scales(0) == ((0.5, 0.5), (0.5, 0.5))
    dst.import_sequence(3, payload, convert_dtype=True)          # stored again: rounded twice
    got, want = kv(dst, 3)[0][1], kv(src, 0)[0][1]
    assert np.abs(got - want).max() <= 0.5 * 2 ** -9 * 448 * 2 and not np.array_equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_import_adopts_no_scales(backend):
    """Validate, then mutate: an import that does not fit (CacheFullError) leaves the cache
    without the payload's scales, so its own first forward still calibrates."""
    src = make(backend)
    fill(src, n=60)
    payload = src.export_sequence(0)
    small = make(backend, tokens=32)
    with pytest.raises(kvcache.CacheFullError):
        small.import_sequence(3, payload)
    assert 3 not in small.sequence_ids and small.kv_scales(0) is None
    fill(small, sid=1, n=5, seed=1)
    assert small.kv_scales(0) is not None and small.kv_scales(0) != payload.kv_scales[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_payloads_meet_plain_caches_only_by_conversion(backend):
    src = make(backend)
    fill(src)
    payload = src.export_sequence(0).to_numpy()
    plain = make(backend, kv_dtype="auto")
    with pytest.raises(InvalidArgumentError, match="convert_dtype=True"):
        plain.import_sequence(3, payload)
    plain.import_sequence(3, payload, convert_dtype=True)        # the values, as they read
    for (k1, v1), (k2, v2) in zip(kv(src, 0), kv(plain, 3)):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)
    plain_payload = plain.export_sequence(3)
    with pytest.raises(InvalidArgumentError, match="only a float8_e4m3 payload"):
        make(backend).import_sequence(4, plain_payload, convert_dtype=True)


def test_payload_header_checks_for_fp8():
    src = make("reference")
    fill(src)
    p = src.export_sequence(0).to_numpy()
    SequencePayload.from_header(p.header(), p.k, p.v)                  # round trip
    bad = dict(p.header(), kv_scales=None)
    with pytest.raises(InvalidArgumentError, match="needs kv_scales"):
        SequencePayload.from_header(bad, p.k, p.v)
    bad = dict(p.header(), kv_scales=[[[1.0, -1.0], [1.0, 1.0]], None])
    with pytest.raises(InvalidArgumentError, match=r"kv_scales\[0\]"):
        SequencePayload.from_header(bad, p.k, p.v)
    bad = dict(p.header(), dtype=None)
    with pytest.raises(InvalidArgumentError, match="needs dtype"):
        SequencePayload.from_header(bad, p.k, p.v)
    # a plain payload's header without the new fields (an older writer) still reads
    plain = make("reference", kv_dtype="auto")
    fill(plain)
    q = plain.export_sequence(0).to_numpy()
    old = {k: v for k, v in q.header().items() if k not in ("dtype", "kv_scales")}
    assert SequencePayload.from_header(old, q.k, q.v).array_dtype == "float32"


@pytest.mark.parametrize("backend", BACKENDS)
def test_host_tier_parks_and_restores_fp8_sequences(backend):
    cache = make(backend)
    fill(cache, sid=0, n=30)
    before = kv(cache, 0)
    tier = HostTier(cache)
    free = cache.num_available_pages
    tier.offload(0)
    assert 0 not in cache.sequence_ids and cache.num_available_pages > free
    tier.restore(0)
    for (k1, v1), (k2, v2) in zip(before, kv(cache, 0)):
        np.testing.assert_array_equal(k1, k2)
        np.testing.assert_array_equal(v1, v2)


