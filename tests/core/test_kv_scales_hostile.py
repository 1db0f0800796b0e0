"""fp8 scales that once poisoned a cache (issue 51, item 1) and the accuracy gate's positions
(item 6): calibration from finite values only, heads a forward cannot calibrate (all zeros,
NaN, inf) calibrated by a later one, absurd outliers clipped, ``clear()`` forgetting calibrated
and imported scales but keeping those ``set_kv_scales`` gave, ``set_kv_scales`` checking the
float32 it stores; a gate that fails a store which drops, shifts or leaves unwritten a token.
The reference backend, and cuda's CPU test mode where it stores the format (fp8)."""

import numpy as np
import pytest

from kvcache import CacheConfig, InvalidArgumentError, PagedKVCache, to_numpy
from kvcache import kv_quant as kq
from kvcache.kv_scales import FP8_CALIBRATION_FORWARDS

FP8 = "float8_e4m3"
KINDS = ("nan", "inf", "zeros", "outlier")


def config(**kw):
    base = dict(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                max_total_tokens=256, dtype="float32", rope_mode="none", kv_dtype=FP8)
    return CacheConfig(**{**base, **kw})


def make(backend="reference", monkeypatch=None, **kw):
    if backend == "cuda":
        monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")      # the cuda backend's CPU test mode
        import kvcache
        row = {r["name"]: r for r in kvcache.list_backends("cpu")}.get("cuda")
        if row is None or not row["available"]:
            pytest.skip("the cuda backend's CPU test mode is not available")
        return PagedKVCache(config(**kw), backend="cuda", device="cpu")
    return PagedKVCache(config(**kw), backend=backend)


def hostile(kind, rng, tokens=5, heads=2, dim=64):
    """Standard normal values times 4 with NaN / +-inf in a few entries of every head, every
    value 0, or one 1e30 entry per head."""
    x = (rng.standard_normal((tokens, heads, dim)) * 4).astype(np.float32)
    if kind == "zeros":
        x[:] = 0
    elif kind == "outlier":
        x[1, :, 3] = 1e30
    else:
        bad = np.float32(np.nan if kind == "nan" else np.inf)
        x[1, :, 3] = bad
        x[3, :, 0] = -bad
    return x


def write(cache, sid, k, v=None, layer=0, q=None):
    """One forward appending ``k`` / ``v`` to a new sequence ``sid`` (attention on every
    layer); returns layer ``layer``'s output."""
    c = cache.config
    v = k if v is None else v
    q = np.zeros((len(k), c.num_qo_heads, c.head_dim), np.float32) if q is None else q
    cache.add_sequence(sid)
    with cache.forward([sid], [len(k)]):
        outs = [cache.attention(i, *(cache.from_numpy(x) for x in (q, k, v)))
                for i in range(c.num_layers)]
    return to_numpy(outs[layer])


# ------------------------------------------------------------------ the rule
@pytest.mark.parametrize("kind", ["nan", "inf"])
def test_calibration_counts_finite_values_only(kind):
    x = hostile(kind, np.random.default_rng(0))
    finite = np.where(np.isfinite(x), x, 0)
    scales, ok = kq.fp8_calibration(x)
    assert ok.all() and np.isfinite(scales).all()
    assert (scales == kq.calibrate_fp8(finite)).all()
    assert (scales == np.abs(finite).max(axis=(0, 2)) / np.float32(448)).all()


def test_a_head_of_zeros_or_non_finite_values_is_not_calibrated():
    x = np.zeros((4, 3, 16), np.float32)
    x[:, 1] = np.nan
    x[0, 2, 0] = -np.inf
    x[1, 2, 1] = kq.FP8_NEGLIGIBLE              # stored as code 0 at any scale the rule gives
    scales, ok = kq.fp8_calibration(x)
    assert not ok.any() and (scales == kq.FP8_PROVISIONAL_SCALE).all()
    # what such a head holds reads the same at any scale: 0, NaN, or the largest value
    for s in (1.0, 2.0 ** -24, 1e3):
        back = kq.roundtrip(x, FP8, "float32", scale=np.full(3, s, np.float32))
        assert (back[:, 0] == 0).all() and np.isnan(back[:, 1]).all()
        assert back[0, 2, 0] == -448 * np.float32(s) and back[1, 2, 1] == 0


def test_an_absurd_outlier_is_clipped_and_later_values_do_not_read_zero():
    rng = np.random.default_rng(1)
    x = hostile("outlier", rng)
    scales, ok = kq.fp8_calibration(x)
    median = np.median(np.abs(x[np.abs(x) < 1e29]))
    assert ok.all() and (scales < median * kq.FP8_OUTLIER_RATIO / 448 * 1.2).all()
    later = (rng.standard_normal((6, 2, 64)) * 2).astype(np.float32)
    back = kq.roundtrip(later, FP8, "float32", scale=scales)
    assert (kq.row_errors(later, back) < 0.1).all()
    assert kq.roundtrip(x, FP8, "float32", scale=scales)[1, 0, 3] == 448 * scales[0]  # saturates
    # an outlier within the ratio is not one: the largest value still sets the scale
    x[1, :, 3] = 100 * median
    assert (kq.calibrate_fp8(x) == np.float32(100 * median) / np.float32(448)).all()


# ------------------------------------------------------------------ the cache
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_a_hostile_first_forward_does_not_poison_later_forwards(backend, kind, monkeypatch):
    cache = make(backend, monkeypatch)
    rng = np.random.default_rng(2)
    write(cache, 0, hostile(kind, rng))
    ks, vs = cache.kv_scales(0)
    assert np.isfinite(ks + vs).all() and min(ks + vs) > 0
    later = (rng.standard_normal((7, 2, 64)) * 2).astype(np.float32)
    q = rng.standard_normal((7, 4, 64)).astype(np.float32)
    out = write(cache, 1, later, later, q=q)
    assert np.isfinite(out).all()
    for got in cache.get_kv(1, layer=0):
        err = kq.row_errors(later, to_numpy(got))
        assert err.max() < kq.ROW_BOUNDS[FP8], (kind, cache.kv_scales(0), err.max())
    if kind == "zeros":             # calibrated by the later forward, the zeros still read 0
        want = kq.calibrate_fp8(later).tolist()
        assert cache.kv_scales(0) == (tuple(want), tuple(want))
        assert all((to_numpy(x) == 0).all() for x in cache.get_kv(0, layer=0))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_the_affine_formats_have_no_scale_to_poison(fmt, kind):
    # (a guard: each group of each token is scaled on its own; only the hostile token's
    # groups read back NaN / saturated)
    cache = make(kv_dtype=fmt)
    rng = np.random.default_rng(3)
    x = hostile(kind, rng)
    write(cache, 0, x)
    later = (rng.standard_normal((7, 2, 64)) * 2).astype(np.float32)
    write(cache, 1, later)
    for got in cache.get_kv(1, layer=0):
        assert (to_numpy(got) == kq.roundtrip(later, fmt, "float32")).all()
    clean = [t for t in range(len(x)) if t not in (1, 3)]
    for got in cache.get_kv(0, layer=0):
        assert np.isfinite(to_numpy(got)[clean]).all()


def test_a_head_left_uncalibrated_waits_for_a_later_forward_and_abort_undoes_it():
    cache = make()
    rng = np.random.default_rng(4)
    k = (rng.standard_normal((3, 2, 64)) * 3).astype(np.float32)
    k[:, 1] = 0                                     # K's head 1: nothing to calibrate from
    v = k.copy()
    v[:, 1] = np.nan                                # V's head 1: NaN only
    write(cache, 0, k, v)
    first = cache.kv_scales(0)
    assert first[0][1] == first[1][1] == kq.FP8_PROVISIONAL_SCALE
    assert first[0][0] == kq.calibrate_fp8(k)[0]
    later = (rng.standard_normal((4, 2, 64)) * 0.5).astype(np.float32)
    cache.add_sequence(1)
    cache.begin_forward([1], [4])
    cache.attention(0, np.zeros((4, 4, 64), np.float32), later, later)
    assert cache.kv_scales(0)[0][1] != kq.FP8_PROVISIONAL_SCALE
    cache.abort_forward()
    assert cache.kv_scales(0) == first              # the abort restores the provisional scale
    with cache.forward([1], [4]):
        cache.attention(0, np.zeros((4, 4, 64), np.float32), later, later)
    want = kq.calibrate_fp8(later)[1]
    assert cache.kv_scales(0) == ((first[0][0], want), (first[1][0], want))
    stored_k, stored_v = (to_numpy(x) for x in cache.get_kv(0, layer=0))
    assert (stored_k[:, 1] == 0).all() and np.isnan(stored_v[:, 1]).all()
    assert (kq.row_errors(later, to_numpy(cache.get_kv(1, layer=0)[0])) < 0.15).all()


def test_a_head_that_never_holds_a_value_keeps_the_provisional_scale_for_good():
    cache = make()
    rng = np.random.default_rng(5)
    for sid in range(FP8_CALIBRATION_FORWARDS):
        x = rng.standard_normal((2, 2, 64)).astype(np.float32)
        x[:, 1] = 0
        write(cache, sid, x)
    assert cache.kv_scales(0)[0][1] == kq.FP8_PROVISIONAL_SCALE
    write(cache, 99, rng.standard_normal((2, 2, 64)).astype(np.float32))
    assert cache.kv_scales(0)[0][1] == kq.FP8_PROVISIONAL_SCALE


def test_a_static_decode_step_fixes_the_provisional_scale(monkeypatch):
    # a capturable step cannot read its values back: the heads not calibrated yet keep the
    # provisional scale from then on, and the step runs (cuda's CPU test mode, graph mode)
    cache = make("cuda", monkeypatch, static_decode=True, static_decode_batch_sizes=(1, 2),
                 prefill_chunk_size=64, max_batch_size=2)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((5, 2, 64)).astype(np.float32)
    x[:, 1] = 0
    write(cache, 0, x)
    with cache.forward([0], [1]):
        assert cache.open_plan.static_bucket is not None
        cache.attention(0, *(cache.from_numpy(rng.standard_normal((1, h, 64))) for h in (4, 2, 2)))
    write(cache, 1, rng.standard_normal((3, 2, 64)).astype(np.float32))
    assert cache.kv_scales(0)[0][1] == kq.FP8_PROVISIONAL_SCALE


def test_clear_forgets_calibrated_and_imported_scales_and_keeps_set_ones():
    rng = np.random.default_rng(7)
    cache = make(num_layers=2)
    cache.set_kv_scales(1, 0.01, [0.02, 0.03])
    pinned = cache.kv_scales(1)
    write(cache, 0, (rng.standard_normal((3, 2, 64)) * 9).astype(np.float32))
    calibrated = cache.kv_scales(0)
    assert calibrated is not None
    cache.clear()
    assert cache.kv_scales(0) is None and cache.kv_scales(1) == pinned
    later = rng.standard_normal((3, 2, 64)).astype(np.float32)
    write(cache, 0, later)                          # calibrated again, from this forward
    want = tuple(kq.calibrate_fp8(later).tolist())
    assert cache.kv_scales(0) == (want, want) != calibrated
    assert cache.kv_scales(1) == pinned
    # scales an import adopted are forgotten too
    src = make()
    write(src, 0, (rng.standard_normal((3, 2, 64)) * 9).astype(np.float32))
    dst = make()
    dst.import_sequence(5, src.export_sequence(0))
    assert dst.kv_scales(0) == src.kv_scales(0)
    dst.clear()
    assert dst.kv_scales(0) is None
    dst.set_kv_scales(0, 0.5, 0.5)                  # and set_kv_scales works again
    assert dst.kv_scales(0) == ((0.5, 0.5), (0.5, 0.5))


def test_an_import_adopts_its_scales_over_a_layer_no_forward_could_calibrate():
    rng = np.random.default_rng(8)
    src = make()
    write(src, 0, (rng.standard_normal((5, 2, 64)) * 3).astype(np.float32))
    dst = make()
    write(dst, 0, np.zeros((3, 2, 64), np.float32))  # provisional scales, nothing bound by them
    dst.import_sequence(1, src.export_sequence(0))
    assert dst.kv_scales(0) == src.kv_scales(0)
    for a, b in zip(dst.get_kv(1, layer=0), src.get_kv(0, layer=0)):
        assert (to_numpy(a) == to_numpy(b)).all()
    assert all((to_numpy(x) == 0).all() for x in dst.get_kv(0, layer=0))


def test_set_kv_scales_works_while_no_head_is_calibrated_and_not_after():
    cache = make()
    write(cache, 0, np.zeros((3, 2, 64), np.float32))
    cache.set_kv_scales(0, 0.25, 0.5)
    assert cache.kv_scales(0) == ((0.25, 0.25), (0.5, 0.5))
    assert all((to_numpy(x) == 0).all() for x in cache.get_kv(0, layer=0))
    with pytest.raises(InvalidArgumentError, match="layer 0 has its scales already"):
        cache.set_kv_scales(0, 1.0, 1.0)
    other = make()
    x = np.zeros((3, 2, 64), np.float32)
    x[0, 0, 0] = 1.0                                # one head calibrated binds the layer
    write(other, 0, x)
    with pytest.raises(InvalidArgumentError, match="layer 0 has its scales already"):
        other.set_kv_scales(0, 1.0, 1.0)


@pytest.mark.parametrize("which, value, shown", [
    ("k", 1e-50, "0.0"),                            # 0 as a float32
    ("v", 1e39, "inf"),                             # inf as a float32
    ("k", 1e-40, "1e-40"),                          # a float32 subnormal
    ("v", 1e36, "1e+36"),                           # 448 x it is inf in float32
    ("k", [0.5, 1e-50], "0.0"),                     # one head of several, named by index
])
def test_set_kv_scales_checks_the_float32_it_stores(which, value, shown):
    cache = make()
    lo, hi = kq.FP8_SCALE_LIMITS
    args = (value, 1.0) if which == "k" else (1.0, value)
    name = f"{which}_scale" + ("[1]" if isinstance(value, list) else "")
    with pytest.raises(InvalidArgumentError) as info:
        cache.set_kv_scales(0, *args)
    msg = str(info.value)
    assert f"{name}=" in msg and shown in msg and repr(lo) in msg and repr(hi) in msg
    assert cache.kv_scales(0) is None
    cache.set_kv_scales(0, lo, hi)                  # the limits themselves are taken
    assert cache.kv_scales(0) == ((lo, lo), (np.float32(hi).item(),) * 2)


# ------------------------------------------------------------------ the gate's positions
def _int4(x, which):
    return kq.roundtrip(x, "int4", "bfloat16")


@pytest.mark.parametrize("bug, words", [
    (lambda x, which: _int4(x, which)[:-1], r"shape \(255, 4, 128\)"),     # dropped
    (lambda x, which: np.concatenate([_int4(x, which)[:-1], np.zeros_like(x[:1])]),
     "token 255 of 256"),                                                  # not written
    (lambda x, which: np.concatenate([_int4(x, which)[:-1], _int4(x, which)[-2:-1]]),
     "token 255 of 256"),                                                  # repeated
    (lambda x, which: np.roll(_int4(x, which), 1, axis=0), "token"),       # shifted
])
def test_the_gate_fails_an_int4_store_that_loses_the_last_tokens_position(bug, words):
    assert kq.accuracy_gate("int4", store=_int4) <= kq.ACCURACY_BOUNDS["int4"]
    with pytest.raises(AssertionError, match=f"accuracy gate: int4 .*{words}"):
        kq.accuracy_gate("int4", store=bug)
