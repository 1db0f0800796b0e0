"""Quantized KV storage (``CacheConfig(kv_dtype=...)``, capability ``kv_dtypes``) on the backend
under test, per format it declares.

The reference stores each format exactly as ``kvcache.kv_quant`` defines it, so the backend is
compared with the same quantization, not with full precision: attention (prefill, decode,
mixed batches, forks and popn over quantized pages), ``get_kv`` (dequantized values), fp8 scale
calibration, and the accuracy gate run through the backend's own pages, which must fail on a
wrong fp8 scale.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvcache.config import KV_FORMATS
from kvcache.formats import kv_format

from .base import Conformance
from .test_sequences import decode_with_sinks, several_roots_and_commit

FP8_SCALES = (0.02, 0.03)
"""Per-head fp8 scales set on both caches where a test needs identical codes (the values of
the suite's standard-normal K/V reach about 4.5 / 0.02 = 225 < 448)."""


HOSTILE = ("nan", "inf", "zeros", "outlier")
"""First forwards that once poisoned an fp8 layer for the life of the cache (issue 51)."""


def seed_for_hostile(fmt: str, kind: str) -> int:
    return zlib.crc32(f"{fmt}-{kind}".encode())


def hostile_values(kind: str, rng, shape) -> tuple:
    """``(values (T, H, D) float64, clean (T,) bool)``: standard normal values times 4 with, per
    ``kind``, NaN or +-inf in a few entries of every head, every value 0, or one 1e30 entry in
    every head; ``clean`` marks the tokens holding none of these (a NaN, inf or outlier is its
    token's own: the format may read it back as NaN, saturated, or spread over its group)."""
    x = rng.standard_normal(shape) * 4
    clean = np.ones(shape[0], bool)
    if kind == "zeros":
        x[:] = 0
    elif kind == "outlier":
        x[1, :, 3] = 1e30                   # (inf in a float16 compute dtype)
        clean[1] = False
    else:
        bad = np.nan if kind == "nan" else np.inf
        x[1, :, 3] = bad
        x[3, :, 0] = -bad if kind == "inf" else bad
        clean[[1, 3]] = False
    return x, clean


def _pair(make_pair, fmt, **kw):
    p = make_pair(kv_dtype=fmt, **kw)
    if kv_format(fmt).scaled:         # one scale rule for both: the codes are then the same
        heads = p.config.num_kv_heads
        for cache in (p.ref, p.dut):
            for layer in range(p.config.num_layers):
                cache.set_kv_scales(layer, [FP8_SCALES[h % 2] for h in range(heads)],
                                    FP8_SCALES[0])
    return p


class TestQuantizedKV(Conformance):
    """Attention and ``get_kv`` over quantized pages equal the reference's emulation of the
    same format; fp8 scales calibrate from the first forward and are forgotten with an aborted
    one; a first forward of NaN, inf, zeros or an outlier poisons no later value; the accuracy
    gate holds through the backend's pages."""

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_prefill_then_decode(self, make_pair, fmt):
        """Chunked prefill over two sequences, then decode steps; every output and the stored
        K/V (read back dequantized) against the reference."""
        p = _pair(make_pair, fmt)
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [2 * ps + 3, max(ps - 1, 1)])
        p.forward([1, 0], [ps + 2, 1])
        p.decode([0, 1], steps=3)

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_fork_and_popn_over_quantized_pages(self, make_pair, fmt):
        """A mid-page fork copies a partial quantized page; popn drops rows; both go on."""
        p = _pair(make_pair, fmt)
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 3)
        p.fork(0, 1, ps + max(ps // 2, 1) if ps > 1 else 2)
        p.decode([1, 0], steps=2)
        p.popn(0, ps // 2 + 1)
        p.forward([0, 1], [ps, 2])

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_token_tree_and_commit(self, make_pair, fmt):
        """A draft tree over quantized pages (RoPE applied as K is stored), then a commit that
        compacts the accepted rows (copied as stored)."""
        several_roots_and_commit(_pair(make_pair, fmt, needs=("tree_attention",),
                                       rope_mode="normal"))

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_sliding_window_with_sinks(self, make_pair, fmt):
        """A window with sink tokens over quantized pages; RoPE inline (the stored K is the
        unrotated one, rotated as it is read)."""
        decode_with_sinks(_pair(make_pair, fmt, support_sliding_window=True, rope_mode="normal"))

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_the_result_does_not_depend_on_chunking(self, make_pair, fmt):
        """Every kernel reads K/V as stored, the forward's own rows too: a prompt run as one
        forward and as three gives the same last-row output on the backend."""
        p = _pair(make_pair, fmt, num_layers=1)
        c, cache = p.config, p.dut
        n = 2 * c.page_size + 5
        rng = np.random.default_rng(3)
        q = rng.standard_normal((n, c.num_qo_heads, c.head_dim))
        k = rng.standard_normal((n, c.num_kv_heads, c.head_dim))
        v = rng.standard_normal((n, c.num_kv_heads, c.head_dim_v))
        from kvcache import to_numpy
        outs = []
        for sid, cuts in ((10, [0, n]), (11, sorted({0, 3, c.page_size + 1, n}))):
            cache.add_sequence(sid)
            for a, b in zip(cuts, cuts[1:]):
                with cache.forward([sid], [b - a]):
                    o = cache.attention(0, *(cache.from_numpy(x[a:b]) for x in (q, k, v)))
            outs.append(to_numpy(o)[-1].astype(np.float64))
        tol = p.tol
        np.testing.assert_allclose(outs[1], outs[0], rtol=tol.rtol * 4, atol=tol.atol * 4)

    def test_fp8_scales_calibrate_from_the_first_forward(self, make_pair):
        """Without set_kv_scales, a layer's scales are its first forward's largest magnitude per
        KV head over 448; an aborted forward's calibration is forgotten."""
        from kvcache import kv_quant
        fmt = "float8_e4m3"
        p = make_pair(kv_dtype=fmt, num_layers=1)
        c, cache = p.config, p.dut
        rng = np.random.default_rng(5)
        q = rng.standard_normal((6, c.num_qo_heads, c.head_dim))
        k = rng.standard_normal((6, c.num_kv_heads, c.head_dim)) * np.arange(1, c.num_kv_heads + 1)[None, :, None]
        v = rng.standard_normal((6, c.num_kv_heads, c.head_dim_v)) * 7
        cache.add_sequence(0)
        cache.begin_forward([0], [6])
        cache.attention(0, *(cache.from_numpy(x) for x in (q, k, v)))
        assert cache.kv_scales(0) is not None
        cache.abort_forward()
        assert cache.kv_scales(0) is None
        with cache.forward([0], [6]):
            cache.attention(0, *(cache.from_numpy(x) for x in (q, k, v)))
        rounded = [np.asarray(cache.backend.to_numpy(cache.from_numpy(x)), np.float32) for x in (k, v)]
        want = [kv_quant.calibrate_fp8(x) for x in rounded]
        got = cache.kv_scales(0)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)

    @pytest.mark.parametrize("kind", HOSTILE)
    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_a_hostile_first_forward_does_not_poison_the_layer(self, make_pair, fmt, kind):
        """A first forward holding NaN, inf, only zeros or one 1e30 outlier: a later forward's
        K/V read back as their own values within the format's per-token bound (fp8: the scales
        are calibrated from finite values, an all-zero or non-finite head from a later forward,
        an absurd outlier clipped; the affine formats scale each group of each token on its
        own), its attention is finite, and the first forward's clean tokens read back
        finite."""
        from kvcache import kv_quant, to_numpy
        p = make_pair(kv_dtype=fmt, num_layers=1)
        c, cache = p.config, p.dut
        rng = np.random.default_rng(seed_for_hostile(fmt, kind))
        first, clean = hostile_values(kind, rng, (5, c.num_kv_heads, c.head_dim))
        cache.add_sequence(0)
        q = rng.standard_normal((5, c.num_qo_heads, c.head_dim))
        # (1e30 overflows to inf in a float16 compute dtype: the cast is meant, not warned)
        with cache.forward([0], [5]), np.errstate(over="ignore"):
            cache.attention(0, *(cache.from_numpy(x) for x in (q, first, first)))
        if kv_format(fmt).scaled:
            assert all(np.isfinite(s).all() and min(s) > 0 for s in cache.kv_scales(0))
        later = rng.standard_normal((7, c.num_kv_heads, c.head_dim)) * 2
        ql = rng.standard_normal((7, c.num_qo_heads, c.head_dim))
        cache.add_sequence(1)
        with cache.forward([1], [7]):
            out = cache.attention(0, *(cache.from_numpy(x) for x in (ql, later, later)))
        assert np.isfinite(to_numpy(out)).all()
        want = np.asarray(cache.backend.to_numpy(cache.from_numpy(later)), np.float32)
        bound = kv_quant.ROW_BOUNDS[fmt]
        for got in cache.get_kv(1, layer=0):
            err = kv_quant.row_errors(want, to_numpy(got))
            assert np.isfinite(err).all() and err.max() <= bound, (
                f"{fmt} after a first forward of {kind}: a later token reads back "
                f"{np.nanmax(np.where(np.isfinite(err), err, np.inf)):.3f} away from its value "
                f"(bound {bound}); scales {cache.kv_scales(0)}")
        for got in cache.get_kv(0, layer=0):
            assert np.isfinite(to_numpy(got)[clean]).all()

    @pytest.mark.parametrize("fmt", KV_FORMATS)
    def test_accuracy_gate_through_the_backend(self, make_pair, fmt):
        """K/V written through the backend's pages and read back with get_kv pass the gate; for
        fp8, scales set 100x too small fail it loudly."""
        from kvcache import kv_quant, to_numpy

        def store_with(scales=None):
            counter = iter(range(1000))

            def store(x, which):
                p = make_pair(kv_dtype=fmt, num_layers=1, head_dim=128, num_kv_heads=4, gqa=1,
                              max_total_tokens=512)
                cache = p.dut
                if scales is not None:
                    s = (kv_quant.calibrate_fp8(x) * scales).tolist()
                    cache.set_kv_scales(0, s, s)
                sid = next(counter)
                cache.add_sequence(sid)
                t = len(x)
                with cache.forward([sid], [t]):
                    cache.append_kv(0, cache.from_numpy(x), cache.from_numpy(x))
                k, v = cache.get_kv(sid, layer=0)
                return to_numpy(k if which == "k" else v).astype(np.float32)
            return store

        dtype = make_pair(kv_dtype=fmt).config.dtype
        kv_quant.accuracy_gate(fmt, dtype, 64, store=store_with(), seeds=(0,))
        if kv_format(fmt).scaled:
            with pytest.raises(AssertionError, match="accuracy gate"):
                kv_quant.accuracy_gate(fmt, dtype, 64, store=store_with(0.01), seeds=(0,))

    def test_fp8_sequences_move_between_caches(self, make_pair):
        """An fp8 sequence exported from the backend and imported into a fresh cache of the
        backend and into the reference (their scales adopted from the payload) reads back the
        same values, and a decode step over it gives the same output there as on the source."""
        from kvcache import PagedKVCache, to_numpy
        fmt = "float8_e4m3"
        p = _pair(make_pair, fmt)
        p.add(0)
        p.prefill(0, 2 * p.config.page_size + 3)
        payload = p.dut.export_sequence(0)
        assert payload.kv_dtype == fmt and payload.kv_scales == tuple(
            p.dut.kv_scales(layer) for layer in range(p.config.num_layers))
        fresh = PagedKVCache(p.config, backend=p.dut.backend.name, device=p.dut.backend.device)
        fresh.import_sequence(5, payload)
        ref = PagedKVCache(p.config, backend="reference")
        ref.import_sequence(5, payload.to_numpy())
        for layer in range(p.config.num_layers):
            want = [to_numpy(x) for x in p.dut.get_kv(0, layer=layer)]
            for cache in (fresh, ref):
                assert cache.kv_scales(layer) == p.dut.kv_scales(layer)
                got = [to_numpy(x) for x in cache.get_kv(5, layer=layer)]
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
        c = p.config
        outs = []
        for cache, sid in ((p.dut, 0), (fresh, 5)):
            rng = np.random.default_rng(8)                # the same inputs for both
            with cache.forward([sid], [1]):
                for layer in range(c.num_layers):
                    x = [rng.standard_normal((1, h, d)) for h, d in (
                        (c.num_qo_heads, c.head_dim), (c.num_kv_heads, c.head_dim),
                        (c.num_kv_heads, c.head_dim_v))]
                    outs.append(to_numpy(cache.attention(layer, *map(cache.from_numpy, x))))
        half = len(outs) // 2
        for a, b in zip(outs[:half], outs[half:]):
            np.testing.assert_array_equal(a, b)

    def test_fp8_sequences_move_through_the_batched_transfer(self, make_pair):
        """The batched route (``export_sequences``, ``reserve_import`` / ``write_import`` /
        ``commit_import``, what ``kvcache.distributed`` uses) moves fp8 sequences as
        ``export_sequence`` / ``import_sequence`` do: the values read back in the compute dtype
        with the scales, adopted at the commit (a cancelled reservation leaves none), giving
        the same values in a fresh cache of the backend and in the reference."""
        from kvcache import PagedKVCache, to_numpy
        fmt = "float8_e4m3"
        p = _pair(make_pair, fmt)
        ps, layers = p.config.page_size, range(p.config.num_layers)
        p.add(0, 1)
        p.prefill(0, 2 * ps + 3)
        p.prefill(1, ps + 1)
        ids = [0, 1]
        headers, k, v = p.dut.export_sequences(ids)
        want = tuple(p.dut.kv_scales(layer) for layer in layers)
        off = 0
        for sid, h in zip(ids, headers):
            one = p.dut.export_sequence(sid)
            assert h.header() == one.header() and h.kv_scales == want
            n = h.num_tokens
            np.testing.assert_array_equal(to_numpy(k)[:, off:off + n], to_numpy(one.k))
            np.testing.assert_array_equal(to_numpy(v)[:, off:off + n], to_numpy(one.v))
            off += n
        items = [(5, headers[0], None, None), (6, headers[1], None, None)]
        for cache in (PagedKVCache(p.config, backend=p.dut.backend.name,
                                   device=p.dut.backend.device),
                      PagedKVCache(p.config, backend="reference")):
            free = cache.num_available_pages
            cache.cancel_import(cache.reserve_import(items))
            assert cache.num_available_pages == free
            assert [cache.kv_scales(layer) for layer in layers] == [None] * len(layers)
            res = cache.reserve_import(items)
            cache.write_import(res, *(cache.from_numpy(to_numpy(x)) for x in (k, v)))
            assert cache.kv_scales(0) is None and cache.sequence_ids == []   # not before the commit
            cache.commit_import(res)
            for layer in layers:
                assert cache.kv_scales(layer) == want[layer]
                for sid, did in zip(ids, (5, 6)):
                    got = [to_numpy(x) for x in cache.get_kv(did, layer=layer)]
                    exp = [to_numpy(x) for x in p.dut.get_kv(sid, layer=layer)]
                    np.testing.assert_array_equal(got[0], exp[0])
                    np.testing.assert_array_equal(got[1], exp[1])

    @pytest.mark.parametrize("fmt", [f for f in KV_FORMATS if kv_format(f).packed])
    def test_affine_sequences_move_between_caches(self, make_pair, fmt):
        """int8 / int4 sequences move as their packed rows (``gather_kv`` / ``append_kv``
        with ``packed=True``): the backend's export equals the reference's bit for bit (the
        same codes, scales and biases), and imported into a fresh cache of the backend and
        into the reference, one at a time and through the batched route, they read back the
        source's values and export the same rows again."""
        from kvcache import PagedKVCache, to_numpy
        p = _pair(make_pair, fmt)
        ps, c = p.config.page_size, p.config
        p.add(0, 1)
        p.prefill(0, 2 * ps + 3)
        p.prefill(1, ps + 1)
        ids = [0, 1]
        rows = {}
        for sid in ids:
            mine, theirs = p.dut.export_sequence(sid), p.ref.export_sequence(sid)
            assert mine.kv_dtype == fmt and mine.kv_quant_group == c.kv_quant_group
            rows[sid] = (to_numpy(mine.k), to_numpy(mine.v))
            np.testing.assert_array_equal(rows[sid][0], to_numpy(theirs.k))
            np.testing.assert_array_equal(rows[sid][1], to_numpy(theirs.v))
        headers, k, v = p.dut.export_sequences(ids)
        np.testing.assert_array_equal(to_numpy(k), np.concatenate([rows[s][0] for s in ids], 1))
        np.testing.assert_array_equal(to_numpy(v), np.concatenate([rows[s][1] for s in ids], 1))

        def fresh():
            return (PagedKVCache(c, backend=p.dut.backend.name, device=p.dut.backend.device),
                    PagedKVCache(c, backend="reference"))

        for batched in (False, True):
            for cache in fresh():
                if batched:
                    b = cache.backend
                    res = cache.reserve_import([(5, headers[0], None, None),
                                                (6, headers[1], None, None)])
                    cache.write_import(res, *(b.from_numpy(to_numpy(x), "uint8") for x in (k, v)))
                    cache.commit_import(res)
                else:                      # one at a time, a host payload
                    for sid in ids:
                        cache.import_sequence(sid + 5, p.dut.export_sequence(sid).to_numpy())
                self._same_as_source(cache, p.dut, ids, rows)

    @staticmethod
    def _same_as_source(cache, source, ids, rows):
        """``cache``'s sequences ``sid + 5`` export ``rows[sid]`` and read back ``source``'s
        values of ``sid``."""
        from kvcache import to_numpy
        for sid in ids:
            again = cache.export_sequence(sid + 5)
            np.testing.assert_array_equal(to_numpy(again.k), rows[sid][0])
            np.testing.assert_array_equal(to_numpy(again.v), rows[sid][1])
            for layer in range(cache.config.num_layers):
                got = [to_numpy(x) for x in cache.get_kv(sid + 5, layer=layer)]
                want = [to_numpy(x) for x in source.get_kv(sid, layer=layer)]
                np.testing.assert_array_equal(got[0], want[0])
                np.testing.assert_array_equal(got[1], want[1])
