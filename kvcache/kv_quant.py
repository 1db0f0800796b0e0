"""The quantized KV formats, exactly (``CacheConfig.kv_dtype``): the rule every backend storing
them follows, in numpy. The reference backend stores through it; a backend's conformance compares
its quantized pages and attention against it, not against full precision.

* ``"float8_e4m3"``: ``code = e4m3fn(clip(x / scale, -448, 448))`` with one float32 ``scale``
  per (layer, KV head) for K and one for V; the value read back is ``float32(code) * scale``.
  Out-of-range values saturate to +-448 (never NaN: e4m3fn has no infinity, and a plain cast of
  an out-of-range value gives NaN).
* ``"int8"`` / ``"int4"``: affine codes per group of ``group`` values along the head dim, as
  ``mx.quantize`` makes them (mlx-lm's quantized cache; bit for bit on mlx 0.32, tested): the
  group's edge value (its min or max, whichever is larger in magnitude) is represented exactly,
  ``scale`` and ``bias`` are rounded to the compute dtype, ``code = clip(round((x - bias) /
  scale), 0, 2**bits - 1)`` with the float32 scale and bias; the value read back is
  ``float32(code) * float32(scale) + float32(bias)`` (one rounding, in float32).

``calibrate_fp8`` is the scale rule when none is given: the largest magnitude a (layer, KV
head) holds in the first forward that writes it (K as stored: rotated where the cache applies
RoPE), over 448, so that forward's values are in range and later ones saturate. Only finite
values count (a NaN or an infinity is that token's own, stored as NaN / saturated, and never
becomes the head's scale), and an absurd outlier is clipped: the magnitude used is at most
``FP8_OUTLIER_RATIO`` times the median magnitude of the head's nonzero finite values (a single
1e30 beside values near 1 would otherwise make every later value read 0). A head with no
finite value above ``FP8_NEGLIGIBLE`` (all zeros, or only NaN / inf) cannot be calibrated
from that forward: ``fp8_calibration`` says so, and the cache stores it with the provisional
scale ``FP8_PROVISIONAL_SCALE`` (what it holds then, zeros, NaN and saturated infinities, reads
the same at any scale) and calibrates it from a later forward.
"""

from __future__ import annotations

import numpy as np

from .formats import FORMAT_TABLE, affine_row_bytes   # affine_row_bytes: re-exported here

try:        # a dependency of the package (float8 and bfloat16 in numpy); the reference backend
    import ml_dtypes    # declares no quantized format without it
except ImportError:
    ml_dtypes = None  # type: ignore[assignment]

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn magnitude: scaled values are clipped to it."""
_TINY = np.float32(2.0 ** -24)      # a calibrated scale is never below this
FP8_NEGLIGIBLE = 2.0 ** -34
"""Finite magnitudes at most this are stored as code 0 at any scale the rule gives (>= 2**-24:
half e4m3's smallest subnormal, 2**-10, times 2**-24): a head holding only such values (or NaN
/ inf) is not calibrated from them."""
FP8_OUTLIER_RATIO = 2.0 ** 14
"""The largest magnitude calibration uses is at most this times the median magnitude of the
head's nonzero finite values: the median then still codes as a normal e4m3 number (448 / 2**14
> 2**-6), and a larger outlier saturates instead of pushing every other value to zero."""
FP8_PROVISIONAL_SCALE = 1.0
"""The scale a head that could not be calibrated yet is stored with (``fp8_calibration``)."""
FP8_SCALE_LIMITS = (float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max) / FP8_MAX)
"""The scales ``set_kv_scales`` takes, after the float32 cast: a normal float32 (1e-50 would
be 0) whose saturated code, 448 times it, is still a finite float32 (1e39 would be inf)."""
_MEDIAN_SAMPLE = 1 << 16            # values per head the outlier median looks at (about)


def _float_dtype(name: str):
    from .arrays import np_dtype        # the one name -> numpy dtype table (bfloat16 too)
    return np_dtype(name)


def fp8_calibration(x) -> tuple:
    """``(scales, calibrated)`` for ``x`` ``(T, H, D)``: per head the float32 scale of the rule
    (module docstring) and whether the head could be calibrated from ``x`` at all; a head that
    could not (no finite value above ``FP8_NEGLIGIBLE``) gets ``FP8_PROVISIONAL_SCALE``."""
    a = np.abs(np.asarray(x, np.float32))
    finite = np.isfinite(a)
    if not finite.all():
        a = np.where(finite, a, np.float32(0))
    heads = a.shape[1]
    amax = a.max(axis=(0, 2)) if a.size else np.zeros(heads, np.float32)
    calibrated = amax > np.float32(FP8_NEGLIGIBLE)
    scales = np.full(heads, FP8_PROVISIONAL_SCALE, np.float32)
    step = max(1, -(-a.shape[0] * a.shape[2] // _MEDIAN_SAMPLE))    # every step-th token
    for h in np.flatnonzero(calibrated):
        row = a[::step, h, :].ravel()
        nonzero = row[row > 0]
        top = amax[h]
        if nonzero.size:
            top = min(top, np.float32(np.median(nonzero)) * np.float32(FP8_OUTLIER_RATIO))
        scales[h] = max(np.float32(top) / np.float32(FP8_MAX), _TINY)
    return scales, calibrated


def calibrate_fp8(x) -> np.ndarray:
    """One float32 scale per head for ``x`` ``(T, H, D)``: ``max |x| / 448`` over its tokens'
    and dims' finite values, the maximum clipped to ``FP8_OUTLIER_RATIO`` times their median
    nonzero magnitude, at least 2**-24; ``FP8_PROVISIONAL_SCALE`` for a head with no finite
    value above ``FP8_NEGLIGIBLE`` (``fp8_calibration`` tells those apart)."""
    return fp8_calibration(x)[0]


def fp8_quantize(x, scale) -> np.ndarray:
    """e4m3fn codes of ``x`` ``(T, H, D)`` with ``scale`` ``(H,)`` float32, saturating."""
    scaled = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[None, :, None]
    return np.clip(scaled, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)


def fp8_dequantize(codes, scale) -> np.ndarray:
    """float32 values of e4m3fn ``codes`` ``(T, H, D)`` with ``scale`` ``(H,)``."""
    return codes.astype(np.float32) * np.asarray(scale, np.float32)[None, :, None]


def affine_quantize(x, bits: int, group: int, dtype: str) -> tuple:
    """``(codes uint8, scales, biases)`` of ``x`` ``(..., D)`` (values of the compute ``dtype``):
    ``codes`` ``(..., D)``, ``scales`` / ``biases`` ``(..., D // group)`` in ``dtype``."""
    n_bins = np.float32((1 << bits) - 1)
    xs = np.asarray(x, np.float32)
    xs = xs.reshape(*xs.shape[:-1], xs.shape[-1] // group, group)
    hi, lo = xs.max(-1, keepdims=True), xs.min(-1, keepdims=True)
    low_edge = np.abs(lo) > np.abs(hi)
    scale = np.maximum((hi - lo) / n_bins, np.float32(1e-7))
    scale = np.where(low_edge, scale, -scale).astype(np.float32)
    edge = np.where(low_edge, lo, hi)
    with np.errstate(invalid="ignore"):     # an infinite edge: the group reads back NaN
        q0 = np.round(edge / scale)
    with np.errstate(divide="ignore", invalid="ignore"):     # q0 == 0 takes the other branch
        scale = np.where(q0 != 0, edge / q0, scale).astype(np.float32)
    bias = np.where(q0 == 0, np.float32(0), edge).astype(np.float32)
    with np.errstate(invalid="ignore"):    # a group holding NaN reads back NaN (scale NaN)
        codes = np.clip(np.round((xs - bias) / scale), 0, n_bins).astype(np.uint8)
    dt = _float_dtype(dtype)
    return (codes.reshape(*codes.shape[:-2], -1), scale[..., 0].astype(dt),
            bias[..., 0].astype(dt))


def affine_dequantize(codes, scales, biases, group: int) -> np.ndarray:
    """float32 values of affine ``codes`` ``(..., D)`` with ``scales`` / ``biases``
    ``(..., D // group)``."""
    c = np.asarray(codes, np.float32)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // group, group)
    s = np.asarray(scales).astype(np.float32)[..., None]
    b = np.asarray(biases).astype(np.float32)[..., None]
    return (c * s + b).reshape(*c.shape[:-2], -1)


AFFINE_BITS = {name: fmt.bits for name, fmt in FORMAT_TABLE.items() if fmt.packed}
"""Bits per code of the affine formats (``kvcache.formats.FORMAT_TABLE``' packed ones)."""


def affine_pack(codes, scales, biases, bits: int) -> np.ndarray:
    """The packed form of affine rows, as payloads carry them and the metal backend stores
    them: ``uint8`` ``(..., affine_row_bytes)``, the codes (int4: two to a byte, the even
    value in the low nibble: ``mx.quantize``'s little-endian packing read byte by byte), then
    the scales, then the biases, each in its dtype's little-endian bytes. ``codes`` ``(..., D)``
    uint8; ``scales`` / ``biases`` ``(..., D // group)``."""
    c: np.ndarray = np.asarray(codes, np.uint8)
    if bits == 4:
        c = (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)
    parts = [c]
    for a in (scales, biases):
        a = np.asarray(a)
        parts.append(np.ascontiguousarray(a.astype(a.dtype.newbyteorder("<"))).view(np.uint8))
    return np.concatenate(parts, axis=-1)


def affine_unpack(rows, dim: int, bits: int, group: int,
                  dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(codes, scales, biases)`` of packed rows ``(..., >= affine_row_bytes)``
    (``affine_pack``'s inverse; bytes past the row are ignored)."""
    rows = np.asarray(rows, np.uint8)
    n_code = dim * bits // 8
    dt = np.dtype(_float_dtype(dtype)).newbyteorder("<")
    n_par = (dim // group) * dt.itemsize
    packed = rows[..., :n_code]
    codes: np.ndarray
    if bits == 4:
        codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*rows.shape[:-1], dim)
    else:
        codes = packed.copy()
    scales = np.ascontiguousarray(rows[..., n_code:n_code + n_par]).view(dt)
    biases = np.ascontiguousarray(rows[..., n_code + n_par:n_code + 2 * n_par]).view(dt)
    return codes, scales, biases


def roundtrip(x, kv_dtype: str, dtype: str, group: int = 64, scale=None) -> np.ndarray:
    """What a page of ``kv_dtype`` gives back for ``x`` ``(T, H, D)`` (float32): the value
    stored, read back. ``scale`` ``(H,)``: fp8's per-head scales (None: ``calibrate_fp8(x)``).
    A ``dtype`` name other than the formats: ``x`` rounded to it."""
    fmt = FORMAT_TABLE.get(kv_dtype)
    if fmt is not None and fmt.scaled:
        scale = calibrate_fp8(x) if scale is None else scale
        return fp8_dequantize(fp8_quantize(x, scale), scale)
    if fmt is not None and fmt.packed:
        codes, s, b = affine_quantize(x, fmt.bits, group, dtype)
        return affine_dequantize(codes, s, b, group)
    return np.asarray(x).astype(_float_dtype(kv_dtype)).astype(np.float32)


ACCURACY_BOUNDS = {"float8_e4m3": 0.25, "int8": 0.1, "int4": 0.6}
"""The accuracy gate's bound per format: the largest relative error of one head's attention
output (``||o_quantized - o|| / ||o||`` over the gate's queries) allowed against full precision
on ``gate_data``. The right scales stay under a third of it (fp8 <= 0.15, int8 <= 0.05, int4
<= 0.34 over seeds 0-5); an fp8 scale 100x too small, or the scale 1.0 on heads of magnitude
60, reads 0.5-1.0."""

ROW_BOUNDS = {"float8_e4m3": 0.15, "int8": 0.15, "int4": 0.5}
"""The accuracy gate's bound per format on each token's own row: the largest relative error
``||stored[t, h] - x[t, h]|| / ||x[t, h]||`` of one (token, KV head) allowed. Attention over
the gate's keys does not see positions (it is a weighted sum over all of them), so a store
that drops, shifts, repeats or leaves unwritten a token would pass it; every token row must
read back as its own. The right rules stay under half of it (fp8 <= 0.051, int8 <= 0.061 with
a bfloat16 scale, int4 <= 0.25 over seeds 0-5, groups 32-128, each compute dtype); another
token's row, or zeros, reads 1.0-1.5."""


def gate_data(seed: int = 0, tokens: int = 256, head_dim: int = 128) -> tuple:
    """Structured ``(q, k, v)`` for the accuracy gate, float32: 8 queries, ``tokens`` keys and
    values over 4 KV heads of magnitudes 0.05, 1, 8 and 60 (a scale that fits one head does not
    fit the others), K with an outlier channel 8x the rest (as real models' K has), queries
    scaled so the scores' standard deviation is about 1."""
    rng = np.random.default_rng(seed)
    mag = np.array([0.05, 1.0, 8.0, 60.0], np.float32)[None, :, None]
    k = rng.standard_normal((tokens, 4, head_dim)).astype(np.float32) * mag
    k[:, :, 5] *= 8
    v = rng.standard_normal((tokens, 4, head_dim)).astype(np.float32) * mag
    q = rng.standard_normal((8, 4, head_dim)).astype(np.float32) / mag
    return q, k, v


def _attend(q, k, v) -> np.ndarray:
    s = np.einsum("qhd,khd->hqk", q, k) / np.float32(np.sqrt(q.shape[-1]))
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v)


_HEAD_MAGNITUDES = (0.05, 1, 8, 60)


def _stored(kv_dtype, dtype, group, store, seed) -> tuple:
    """``(q, k, v, k_back, v_back)``: ``gate_data(seed)`` and what ``store`` gives back for K
    and V (AssertionError when its shape is not the input's: a token dropped or added)."""
    q, k, v = gate_data(seed)
    if store is None:
        def store(x, which):
            return roundtrip(x, kv_dtype, dtype, group)
    back = []
    for x, which in ((k, "k"), (v, "v")):
        got = np.asarray(store(x, which), np.float32)
        if got.shape != x.shape:
            raise AssertionError(
                f"quantized KV accuracy gate: {kv_dtype} storage ({dtype} compute) gives back "
                f"{which.upper()} of shape {got.shape} for {x.shape} (tokens, KV heads, head "
                f"dim) stored, seed {seed}: a token dropped or added?")
        back.append(got)
    return q, k, v, back[0], back[1]


def attention_errors(kv_dtype: str, dtype: str = "bfloat16", group: int = 64, store=None,
                     seed: int = 0) -> np.ndarray:
    """Per head of ``gate_data(seed)``: the relative error of attention over K and V as
    ``store`` gives them back against full precision. ``store(x, which)`` (``which``: "k" or
    "v"; ``x`` ``(T, 4, D)`` float32) returns what a cache of ``kv_dtype`` reads back, e.g. a
    backend's pages through ``get_kv``; default: this module's rule with calibrated scales."""
    q, k, v, kq_, vq_ = _stored(kv_dtype, dtype, group, store, seed)
    return _attention_errors(q, k, v, kq_, vq_)


def _attention_errors(q, k, v, k_back, v_back) -> np.ndarray:
    o = _attend(q, k, v)
    oq = _attend(q, k_back, v_back)
    return np.linalg.norm(oq - o, axis=(0, 2)) / np.linalg.norm(o, axis=(0, 2))


def row_errors(x, back) -> np.ndarray:
    """``(T, H)``: each (token, head) row's relative error ``||back - x|| / ||x||`` (NaN stays
    NaN)."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.asarray(back, np.float32) - x
        return np.linalg.norm(diff, axis=-1) / np.linalg.norm(x, axis=-1)


def accuracy_gate(kv_dtype: str, dtype: str = "bfloat16", group: int = 64, store=None,
                  seeds=(0, 1, 2)) -> float:
    """Fail loudly (AssertionError naming the format, head, error and bound) when attention
    over ``kv_dtype`` storage (``store``: see ``attention_errors``) is further from full
    precision than ``ACCURACY_BOUNDS`` allows on ``gate_data``, or when a token's own row reads
    back further from it than ``ROW_BOUNDS`` allows (naming the token: positions count, a
    store that drops, shifts or leaves unwritten a token fails) or with another shape; returns
    the largest attention error. A format that is not quantized must give back full precision
    up to its rounding (bound 0.02, rows too)."""
    bound = ACCURACY_BOUNDS.get(kv_dtype, 0.02)
    row_bound = ROW_BOUNDS.get(kv_dtype, 0.02)
    worst = 0.0
    for seed in seeds:
        q, k, v, k_back, v_back = _stored(kv_dtype, dtype, group, store, seed)
        err = _attention_errors(q, k, v, k_back, v_back)
        if not np.isfinite(err).all() or err.max() > bound:
            head = int(np.nanargmax(np.where(np.isfinite(err), err, np.inf)))
            raise AssertionError(
                f"quantized KV accuracy gate: {kv_dtype} storage ({dtype} compute) gives "
                f"attention {float(err[head]):.3f} away from full precision on KV head {head} "
                f"(magnitude {_HEAD_MAGNITUDES[head]}), seed {seed}; the bound is {bound} "
                f"(a wrong or missing scale?)")
        for x, back, which in ((k, k_back, "K"), (v, v_back, "V")):
            rows = row_errors(x, back)
            bad = np.where(np.isfinite(rows), rows, np.inf)
            if bad.max() > row_bound:
                t, h = (int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))
                raise AssertionError(
                    f"quantized KV accuracy gate: {kv_dtype} storage ({dtype} compute) gives "
                    f"back token {t} of {len(x)} of {which} on KV head {h} (magnitude "
                    f"{_HEAD_MAGNITUDES[h]}) {float(rows[t, h]):.3f} away from its input, seed "
                    f"{seed}; the bound per token is {row_bound} (a token dropped, shifted or "
                    f"not written?)")
        worst = max(worst, float(err.max()))
    return worst
