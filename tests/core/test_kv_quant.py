"""Quantized KV storage, first part (issue 32): the ``kv_dtype`` / ``kv_quant_group`` config
fields, the exact rule of each format (``kvcache.kv_quant``, checked bit for bit against mlx's
own ``mx.quantize``), and the accuracy gate, shown failing on wrong fp8 scales."""

import numpy as np
import pytest

from kvcache import CacheConfig, InvalidArgumentError, PagedKVCache, UnsupportedFeatureError
from kvcache import kv_quant as kq
from kvcache.config import KV_FORMATS


def config(**kw):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                max_total_tokens=64, dtype="bfloat16", rope_mode="none")
    return CacheConfig(**{**base, **kw})


# ------------------------------------------------------------------ config
def test_kv_dtype_auto_reads_back_as_the_compute_dtype():
    assert config().kv_dtype == "bfloat16" and not config().kv_quantized
    assert config(dtype="float32", kv_dtype="auto").kv_dtype == "float32"
    assert config(kv_dtype="int4").kv_quantized


@pytest.mark.parametrize("kw, words", [
    (dict(kv_dtype="float8"), "kv_dtype='float8'"),
    (dict(kv_dtype="float16"), "kv_dtype='float16'"),          # another float dtype: not a format
    (dict(kv_dtype=8), "kv_dtype=8"),
    (dict(kv_dtype="int8", kv_quant_group=48), "kv_quant_group=48"),
    (dict(kv_dtype="int4", head_dim=96), "head_dim=96"),       # 96 % 64
    (dict(kv_dtype="int8", head_dim=64, head_dim_v=32), "head_dim_v=32"),
])
def test_bad_kv_formats_are_refused_by_name(kw, words):
    with pytest.raises(InvalidArgumentError, match=words.replace("(", r"\(")):
        config(**kw)


def test_token_bytes_count_the_format():
    bf16 = config().token_kv_bytes
    assert bf16 == 2 * 2 * 2 * 64 * 2
    assert config(kv_dtype="float8_e4m3").token_kv_bytes * 2 == bf16
    # int8: a byte per value plus a bf16 scale and bias per 64 values; int4 half the codes
    assert config(kv_dtype="int8").token_kv_bytes == 2 * 2 * 2 * (64 + 4)
    assert config(kv_dtype="int4", kv_quant_group=32).token_kv_bytes == 2 * 2 * 2 * (32 + 8)
    assert config(kv_dtype="int8").kv_bytes == config().num_pages * 4 * 2 * 2 * 2 * (64 + 4)


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_a_backend_that_does_not_declare_a_format_refuses_it(fmt):
    # the example plugin declares no kv_dtypes (its compute dtypes only); the reference does
    with pytest.raises(UnsupportedFeatureError, match="kv_dtypes"):
        PagedKVCache(config(kv_dtype=fmt), backend="example")
    assert PagedKVCache(config(kv_dtype=fmt), backend="reference").config.kv_dtype == fmt


# ------------------------------------------------------------------ the reference's pages
def filled(fmt, dtype="float32", scales=None):
    cache = PagedKVCache(config(kv_dtype=fmt, dtype=dtype), backend="reference")
    if scales is not None:
        for layer in range(2):
            cache.set_kv_scales(layer, *scales)
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((9, 2, 64)) * 3).astype(np.float32)
    v = rng.standard_normal((9, 2, 64)).astype(np.float32)
    q = rng.standard_normal((9, 4, 64)).astype(np.float32)
    cache.add_sequence(0)
    with cache.forward([0], [9]):
        outs = [cache.attention(layer, q, k, v) for layer in range(2)]
    return cache, q, k, v, outs


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_reference_pages_read_back_the_formats_rule_and_attention_reads_them(fmt):
    cache, q, k, v, outs = filled(fmt)
    scale = None
    if fmt == "float8_e4m3":
        ks, vs = cache.kv_scales(0)
        assert np.allclose(ks, kq.calibrate_fp8(k)) and np.allclose(vs, kq.calibrate_fp8(v))
        scale = (np.asarray(ks, np.float32), np.asarray(vs, np.float32))
    want_k = kq.roundtrip(k, fmt, "float32", 64, None if scale is None else scale[0])
    want_v = kq.roundtrip(v, fmt, "float32", 64, None if scale is None else scale[1])
    got_k, got_v = cache.get_kv(0, layer=1)
    assert got_k.dtype == np.float32 and (got_k == want_k).all() and (got_v == want_v).all()
    assert not (got_k == k).all()                               # it is quantized
    # the forward's own rows are read as stored too: causal attention over the round trip
    s = np.einsum("qhd,khd->hqk", q.reshape(9, 2, 2, 64).reshape(9, 4, 64).astype(np.float64),
                  np.repeat(want_k, 2, axis=1).astype(np.float64)) / 8.0
    s = np.where(np.tril(np.ones((9, 9), bool))[None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hqk,khd->qhd", w / w.sum(-1, keepdims=True), np.repeat(want_v, 2, axis=1))
    np.testing.assert_allclose(outs[1], o, rtol=1e-5, atol=1e-6)


def test_fp8_scales_given_are_used_and_set_once():
    cache, q, k, v, _ = filled("float8_e4m3", scales=([0.05, 0.1], 0.001))
    f32 = lambda x: float(np.float32(x))
    assert cache.kv_scales(1) == ((f32(0.05), f32(0.1)), (f32(0.001),) * 2)
    got_v = cache.get_kv(0, layer=0)[1]
    assert np.abs(v).max() > 1                                              # so v saturates
    assert np.abs(got_v).max() == pytest.approx(448 * 0.001, rel=1e-6)
    with pytest.raises(InvalidArgumentError, match="layer 0 has its scales already"):
        cache.set_kv_scales(0, 1.0, 1.0)


@pytest.mark.parametrize("args, words", [
    ((2, 1.0, 1.0), "layer_id 2"),
    ((0, [1.0, 2.0, 3.0], 1.0), "k_scale has 3 values"),
    ((0, 1.0, 0.0), "v_scale"),
    ((0, float("nan"), 1.0), "k_scale"),
])
def test_bad_fp8_scales_are_refused_and_change_nothing(args, words):
    cache = PagedKVCache(config(kv_dtype="float8_e4m3"), backend="reference")
    with pytest.raises(InvalidArgumentError, match=words):
        cache.set_kv_scales(*args)
    assert cache.kv_scales(0) is None


def test_scales_are_for_fp8_pages_only():
    cache = PagedKVCache(config(kv_dtype="int8"), backend="reference")
    with pytest.raises(InvalidArgumentError, match="scales are for 'float8_e4m3'"):
        cache.set_kv_scales(0, 1.0, 1.0)
    assert cache.kv_scales(0) is None


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_backend_without_packed_rows_refuses_to_move_affine_pages(fmt, monkeypatch):
    # affine pages move as packed rows (tests/transfer/test_affine_payloads.py): the core asks
    # gather_kv / append_kv(..., packed=True); a backend that stores the format but cannot
    # move its rows refuses, typed (the ABC's contract), and nothing changes
    from kvcache.reference import ReferenceBackend
    cache, *_ = filled(fmt)
    payload = cache.export_sequence(0)
    other, *_ = filled(fmt)
    asked = []

    def refusing(method):
        def call(self, *args, packed=False, **kw):
            if packed:
                asked.append(method.__name__)
                raise UnsupportedFeatureError(f"backend {self.name!r} does not move "
                                              f"{self.config.kv_dtype!r} pages")
            return method(self, *args, **kw)
        call.__name__ = method.__name__
        return call

    for name in ("gather_kv", "append_kv"):
        monkeypatch.setattr(ReferenceBackend, name, refusing(getattr(ReferenceBackend, name)))
    free = other.num_available_pages
    for call, args in (("export_sequences", ([0],)), ("export_sequence", (0,)),
                       ("import_sequence", (5, payload))):
        with pytest.raises(UnsupportedFeatureError, match=f"does not move '{fmt}' pages"):
            getattr(other, call)(*args)
    assert asked == ["gather_kv", "gather_kv", "append_kv"]
    assert other.sequence_ids == [0] and other.num_available_pages == free


# ------------------------------------------------------------------ the formats
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_affine_codes_scales_and_biases_are_mlx_quantize_bit_for_bit(dtype, bits, group):
    mx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(bits * group)
    x = rng.standard_normal((50, 128)) * rng.uniform(0.01, 10, (50, 1))
    x[3, :group] = 0                    # a zero group, a constant one, a negative constant one
    x[4, :group] = 1.5
    x[5, :group] = -2
    x = kq.roundtrip(x.astype(np.float32), dtype, dtype)           # values of the compute dtype
    codes, scales, biases = kq.affine_quantize(x, bits, group, dtype)
    mdt = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    wq, ms, mb = mx.quantize(mx.array(x).astype(mdt), group_size=group, bits=bits)
    packed = np.array(wq).view(np.uint8)
    theirs = np.stack([packed & 0xF, packed >> 4], -1).reshape(50, 128) if bits == 4 else packed
    assert (codes == theirs).all()
    assert (scales.astype(np.float32) == np.array(ms.astype(mx.float32))).all()
    assert (biases.astype(np.float32) == np.array(mb.astype(mx.float32))).all()


def test_affine_reads_the_group_edge_back_exactly_and_the_rest_within_a_step():
    rng = np.random.default_rng(0)
    x = kq.roundtrip(rng.standard_normal((20, 2, 64)).astype(np.float32) * 3, "bfloat16", "bfloat16")
    g = x.reshape(20, 2, 2, 32)
    edge_at = np.where(np.abs(g.min(-1)) > np.abs(g.max(-1)), g.argmin(-1), g.argmax(-1))
    for bits in (4, 8):
        codes, s, b = kq.affine_quantize(x, bits, 32, "bfloat16")
        got = kq.affine_dequantize(codes, s, b, 32).reshape(20, 2, 2, 32)
        pick = lambda a: np.take_along_axis(a, edge_at[..., None], -1)
        assert (pick(got) == pick(g)).all()          # the bias is the edge: code 0, exact
        # half a step of rounding, plus the scale's rounding to bf16 over up to 255 steps
        step = np.abs(s.astype(np.float32))[..., None]
        assert (np.abs(got - g) <= step * (0.5 + 255 * 2.0 ** -8)).all()
        assert np.abs(got - g).max() > 0                          # it does quantize


def test_fp8_saturates_instead_of_giving_nan_and_rounds_to_e4m3():
    x = np.array([[[1.0, -1.0, 1e6, -1e6, 0.0, 3.3]]], np.float32)
    scale = np.array([1.0], np.float32)
    back = kq.fp8_dequantize(kq.fp8_quantize(x, scale), scale)
    assert np.isfinite(back).all()
    assert back[0, 0].tolist()[:5] == [1.0, -1.0, 448.0, -448.0, 0.0]
    assert back[0, 0, 5] in (3.25, 3.5)            # 3 mantissa bits
    # the calibrated scale puts each head's largest magnitude at 448: no value saturates
    rng = np.random.default_rng(1)
    k = rng.standard_normal((30, 3, 16)).astype(np.float32) * np.array([0.01, 1, 500], np.float32)[None, :, None]
    s = kq.calibrate_fp8(k)
    rt = kq.fp8_dequantize(kq.fp8_quantize(k, s), s)
    assert np.allclose(np.abs(rt).max(axis=(0, 2)), np.abs(k).max(axis=(0, 2)))
    assert np.allclose(rt, k, rtol=2 ** -4, atol=float(s.max()) * 2 ** -9)


# ------------------------------------------------------------------ the accuracy gate
@pytest.mark.parametrize("fmt", KV_FORMATS + ("bfloat16",))
def test_the_gate_passes_each_format_with_its_rule(fmt):
    worst = kq.accuracy_gate(fmt)
    assert 0 < worst <= kq.ACCURACY_BOUNDS.get(fmt, 0.02) / 1.5


def fp8_store(factor=None, fixed=None):
    def store(x, which):
        s = np.full(x.shape[1], fixed, np.float32) if fixed is not None else kq.calibrate_fp8(x) * factor
        return kq.fp8_dequantize(kq.fp8_quantize(x, s), s)
    return store


@pytest.mark.parametrize("store, head", [
    (fp8_store(factor=0.01), 0),        # 100x too small: every head saturates
    (fp8_store(fixed=1.0), 3),          # no scale (1.0): the magnitude-60 head saturates
])
def test_the_gate_fails_loudly_on_a_wrong_fp8_scale(store, head):
    with pytest.raises(AssertionError, match=f"float8_e4m3 .* on KV head {head}"):
        kq.accuracy_gate("float8_e4m3", store=store)


def test_the_gate_fails_on_nan():
    with pytest.raises(AssertionError, match="accuracy gate"):
        kq.accuracy_gate("int8", store=lambda x, which: np.where(x > 5, np.nan, x))


@pytest.mark.parametrize("fmt", KV_FORMATS)
def test_a_prefix_cached_in_a_quantized_cache_is_read_as_it_was_stored(fmt):
    cache = PagedKVCache(config(kv_dtype=fmt, prefix_cache=True, dtype="float32"), backend="reference")
    rng = np.random.default_rng(2)
    tokens = list(range(1, 12))
    k = rng.standard_normal((11, 2, 64)).astype(np.float32)
    q = rng.standard_normal((11, 4, 64)).astype(np.float32)
    assert cache.add_sequence(0, tokens) == 0
    with cache.forward([0], [11]):
        for layer in range(2):
            cache.attention(layer, q, k, k)
    cold = cache.get_kv(0, 0, 8)
    cache.remove_sequence(0)
    assert cache.add_sequence(1, tokens) == 8                  # two whole pages of 4
    warm = cache.get_kv(1)
    assert all((w == c).all() for w, c in zip(warm, cold))
    assert not (warm[0][0] == k[:8]).all()                     # quantized, not the input


def test_a_group_holding_nan_reads_back_nan_and_the_others_are_untouched():
    x = np.random.default_rng(4).standard_normal((3, 2, 64)).astype(np.float32)
    x[1, 0, 5] = np.nan
    for fmt in ("int8", "int4"):
        back = kq.roundtrip(x, fmt, "float32", 32)
        assert np.isnan(back[1, 0, :32]).all() and np.isfinite(back[1, 0, 32:]).all()
        assert np.isfinite(np.delete(back.reshape(6, 64), 2, axis=0)).all()


def test_fp8_calibration_sees_k_as_stored_after_the_caches_rope():
    # rope_mode="normal": the cache rotates K as it writes it; a rotation can raise a
    # coordinate's magnitude (up to sqrt(2)), so the scale comes from the rotated K and no
    # value of the calibrating forward saturates
    cache = PagedKVCache(config(kv_dtype="float8_e4m3", dtype="float32", rope_mode="normal",
                                num_layers=1), backend="reference")
    rng = np.random.default_rng(9)
    k = rng.standard_normal((12, 2, 64)).astype(np.float32)
    k[:, :, 0] = k[:, :, 32] = 5.0                   # a rotated pair reaches up to 5 * sqrt(2)
    q = rng.standard_normal((12, 4, 64)).astype(np.float32)
    cache.add_sequence(0)
    with cache.forward([0], [12]):
        cache.attention(0, q, k, k)
    rotated = cache.backend.rope(k, np.arange(12), cache.config.rope_spec())
    assert np.abs(rotated).max() > np.abs(k).max() * 1.2
    np.testing.assert_allclose(cache.kv_scales(0)[0], kq.calibrate_fp8(rotated), rtol=1e-6)
    stored = cache.get_kv(0, layer=0)[0]
    assert np.allclose(np.abs(stored).max(axis=(0, 2)), np.abs(rotated).max(axis=(0, 2)), rtol=1e-6)


@pytest.mark.parametrize("fmt", ["float8_e4m3", "int8"])
def test_kv_scales_names_a_layer_outside_the_cache(fmt):
    cache = PagedKVCache(config(kv_dtype=fmt), backend="reference")
    for layer in (2, -1):                   # -1 once read the last layer's scales
        with pytest.raises(InvalidArgumentError, match=f"kv_scales: layer_id {layer} must be in"):
            cache.kv_scales(layer)
