"""int8 / int4 pages on the metal backend (issue 32), on MLX's CPU device: the page rows hold
exactly ``kv_quant``'s codes (what ``mx.quantize`` makes for mlx-lm's quantized cache on Apple
GPUs and MLX's CPU), the page arrays take the bytes
``CacheConfig.kv_bytes`` counts, a value head dim other than head_dim works, and many forwards
queued with no output read until the end equal the reference backend's emulation (MLX
evaluates lazily: nothing synchronizes between them). Conformance (``TestQuantizedKV``) covers
the rest against the reference."""

import numpy as np
import pytest

import mlx.core as mx

import kvcache
from kvcache.conformance import assert_close
from kvcache.kv_quant import affine_pack, affine_quantize
from kvcache.reference import NP_DTYPES
from kvcache_metal.backend import MetalBackend

from metal_testutil import DEVICE

FORMATS = ["int8", "int4"]


def config(fmt, dtype="bfloat16", d=64, dv=None, group=32, **kw):
    return kvcache.CacheConfig(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=d,
                               head_dim_v=dv, page_size=kw.pop("page_size", 8),
                               max_total_tokens=kw.pop("max_total_tokens", 512), dtype=dtype,
                               kv_dtype=fmt, kv_quant_group=group, rope_mode="normal", **kw)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_page_rows_hold_the_rules_codes(fmt, dtype):
    cfg = config(fmt, dtype)
    bits = 8 if fmt == "int8" else 4
    row = 64 * bits // 8 + 2 * (64 // 32) * np.dtype(NP_DTYPES[dtype]).itemsize
    cache = kvcache.PagedKVCache(cfg, backend="metal", device=DEVICE)
    assert all(p.dtype == mx.uint8 and p.shape == (cfg.num_pages, 2, 2, 8, row)
               for p in cache.pages)
    assert sum(p.nbytes for p in cache.pages) == cfg.kv_bytes
    # the kernel itself, at known slots: each row is kv_quant's codes, scales, biases (which
    # mx.quantize also makes on an Apple GPU and MLX's CPU, not on MLX's CUDA build)
    mb = MetalBackend(cfg, DEVICE)
    pages = mb.allocate_pages(cfg.num_pages)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((11, 2, 64)).astype(np.float32) * 3
    v = rng.standard_normal((11, 2, 64)).astype(np.float32)
    slots = rng.choice(cfg.num_pages * 8, 11, replace=False).astype(np.int32)
    mb.append_kv(pages[0], mb.from_numpy(k), mb.from_numpy(v), mb.aux_to_device(slots))
    stored = np.array(pages[0])[slots // 8, :, :, slots % 8]                  # (11, 2, 2, row)
    for which, x in enumerate((k, v)):
        want = affine_pack(*affine_quantize(x.astype(NP_DTYPES[dtype]), bits, 32, dtype), bits)
        np.testing.assert_array_equal(stored[:, which], want)


def _pair(cfg):
    return (kvcache.PagedKVCache(cfg, backend="reference"),
            kvcache.PagedKVCache(cfg, backend="metal", device=DEVICE))


@pytest.mark.parametrize("fmt", FORMATS)
def test_queued_forwards_read_at_the_end_equal_the_reference(fmt):
    """Prefills in chunks, a fork mid-page, decode and mixed steps, a popn: every output kept
    as a lazy MLX array and compared only at the end; then get_kv of each sequence."""
    cfg = config(fmt, "bfloat16", page_size=8)
    ref, dut = _pair(cfg)
    rng = np.random.default_rng(1)
    outs = {"ref": [], "dut": []}

    def step(seq_ids, lengths):
        t = sum(lengths)
        q = rng.standard_normal((t, 4, 64))
        k = rng.standard_normal((t, 2, 64)) * 2
        v = rng.standard_normal((t, 2, 64))
        for name, cache in (("ref", ref), ("dut", dut)):
            cache.begin_forward(seq_ids, lengths)
            for layer in range(cfg.num_layers):
                o = cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k),
                                    cache.from_numpy(v), 0.125)
                outs[name].append(o)
            cache.end_forward()

    for cache in (ref, dut):
        cache.add_sequence(0)
        cache.add_sequence(1)
    step([0, 1], [13, 5])
    step([1, 0], [9, 1])
    for cache in (ref, dut):
        cache.fork_sequence(0, 2, 10)
    for _ in range(6):
        step([0, 1, 2], [1, 1, 1])
    step([2, 0], [7, 1])
    for cache in (ref, dut):
        cache.popn(1, 3)
    step([1, 2], [2, 1])
    assert len(outs["dut"]) == len(outs["ref"]) == 20
    for i, (want, got) in enumerate(zip(outs["ref"], outs["dut"])):
        assert_close(f"output {i}", kvcache.to_numpy(want), kvcache.to_numpy(got), "bfloat16")
    for sid in (0, 1, 2):
        for layer in range(cfg.num_layers):
            wk, wv = ref.get_kv(sid, layer=layer)
            gk, gv = dut.get_kv(sid, layer=layer)
            assert_close(f"K {sid}/{layer}", kvcache.to_numpy(wk), kvcache.to_numpy(gk), "bfloat16")
            assert_close(f"V {sid}/{layer}", kvcache.to_numpy(wv), kvcache.to_numpy(gv), "bfloat16")


@pytest.mark.parametrize("fmt", FORMATS)
def test_value_head_dim_other_than_head_dim(fmt):
    """K rows of 128 values and V rows of 64 share a page row of 128's bytes (V's tail zero)."""
    cfg = config(fmt, "float32", d=128, dv=64, group=64)
    ref, dut = _pair(cfg)
    for cache in (ref, dut):
        cache.add_sequence(0)
    res = {}
    for name, cache in (("ref", ref), ("dut", dut)):
        r = np.random.default_rng(3)
        got = []
        for n in (12, 1, 1):
            q, k, v = r.standard_normal((n, 4, 128)), r.standard_normal((n, 2, 128)), \
                r.standard_normal((n, 2, 64))
            cache.begin_forward([0], [n])
            got.append(kvcache.to_numpy(cache.attention(0, cache.from_numpy(q),
                                                        cache.from_numpy(k),
                                                        cache.from_numpy(v), 0.1)))
            cache.attention(1, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v), 0.1)
            cache.end_forward()
        res[name] = got
    for i, (want, got) in enumerate(zip(res["ref"], res["dut"])):
        assert got.shape[-1] == 64
        assert_close(f"output {i}", want, got, "float32")
    wk, wv = ref.get_kv(0, layer=1)
    gk, gv = dut.get_kv(0, layer=1)
    assert_close("K", kvcache.to_numpy(wk), kvcache.to_numpy(gk), "float32")
    assert_close("V", kvcache.to_numpy(wv), kvcache.to_numpy(gv), "float32")


def test_float64_input_rounds_once_to_float16():
    """``from_numpy`` of float64 values to float16 rounds once, as numpy (and the reference)
    does; MLX alone reads float64 as float32 and rounds again, which differs at rare ties and
    moved an int8 code in the conformance suite."""
    cfg = config("auto", "float16")
    dut = kvcache.PagedKVCache(cfg, backend="metal", device=DEVICE)
    x = np.random.default_rng(4).standard_normal(200_000)
    got = np.array(dut.from_numpy(x).astype(mx.float32))
    want = x.astype(np.float16).astype(np.float32)
    assert np.array_equal(got, want)


def _ties(dtype, bits, group=32):
    """Rows whose values land on a code's midpoint: groups spanning ``0 .. n_bins`` hold
    ``k + 0.5`` (exact in every compute dtype), so ``(x - bias) / scale`` is a tie that rounds
    half to even under the rule and half away from zero under mx.quantize's CUDA kernel."""
    n_bins = (1 << bits) - 1
    rng = np.random.default_rng(bits)
    x = rng.integers(0, n_bins, (5, 2, 64)).astype(np.float32) + 0.5
    x[..., ::group] = 0.0
    x[..., 1::group] = n_bins
    return x.astype(NP_DTYPES[dtype]).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_ops_encoder_is_the_rule_bit_for_bit_at_midpoints(fmt, dtype):
    """The encoder that runs off Apple GPUs (MLX ops, MLX's CUDA build included) gives
    ``kv_quant``'s codes, scales and biases byte for byte, on ordinary values and on values at
    a code's midpoint (where mx.quantize's CUDA kernel, rounding half away from zero, parted
    from the rule on an H100: docs/conformance.md)."""
    from kvcache_metal.affine import AffineRows
    bits = 8 if fmt == "int8" else 4
    rows = AffineRows(bits, 32, dtype, 64)
    assert not rows.fused and MetalBackend(config(fmt, dtype), DEVICE).affine.fused is False
    rng = np.random.default_rng(1)
    ties = _ties(dtype, bits)
    for x in (rng.standard_normal((7, 2, 64)).astype(np.float32) * 3, ties):
        want = affine_pack(*affine_quantize(x.astype(NP_DTYPES[dtype]), bits, 32, dtype), bits)
        got = np.array(rows.encode(mx.array(x)))
        np.testing.assert_array_equal(got[..., :want.shape[-1]], want)
    half_away = np.floor(np.abs(ties) + 0.5)        # the CUDA kernel's rounding, for contrast
    assert (half_away != np.round(np.abs(ties))).any()
