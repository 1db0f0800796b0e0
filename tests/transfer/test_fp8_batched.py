"""fp8 pages through the batched transfer (issue 32): ``export_sequences``, ``reserve_import``,
``write_import`` / ``commit_import`` / ``cancel_import`` (the route ``kvcache.distributed``
takes) with the semantics of ``export_sequence`` / ``import_sequence``: the values read back
in the compute dtype with the layer scales out, the scales adopted (at the commit, all or
nothing) and the values stored again in, which gives the source's codes.

Judged by what does not go through the code under test: ``export_sequence``'s payloads and the
source's ``get_kv`` (values), the source's page codes read out of its pages (bit for bit),
``import_sequence`` into a fresh cache (conversions), and the cache's scales, pages and
sequences before and after every refused or cancelled call. On the reference backend and the
cuda backend's CPU test mode (real e4m3 codes), and across the two."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcache
from kvcache import CacheFullError, InvalidArgumentError, SequenceExistsError
from transfer_cases import (assert_same_kv, config, fp8_codes, make_cache, run_forward, same,
                            snapshot)

pytest.importorskip("ml_dtypes")
FP8 = "float8_e4m3"
BACKENDS = ["reference", "cuda"]
PAIRS = [("reference", "reference"), ("cuda", "cuda"), ("reference", "cuda"),
         ("cuda", "reference")]
IDS, STARTS = [1, 2, 3], [0, 9, 0]


def fp8_cache(backend, dtype="float32", page_size=4, tokens=1024, kv_dtype=FP8):
    return make_cache(backend, config(page_size, dtype, "normal", kv_dtype=kv_dtype,
                                      max_total_tokens=tokens))


def source(backend, dtype="float32", seed=0):
    """Sequences 1 (21 tokens), 2 (forked from 1 at 9, grown by 6) and 3 (5 tokens); the
    scales calibrated from the first forward (the seed's data: another seed, other scales)."""
    src = fp8_cache(backend, dtype)
    rng = np.random.default_rng(seed)
    src.add_sequence(1)
    run_forward(src, [1], [21], rng)
    src.fork_sequence(1, 2, 9)
    run_forward(src, [2], [6], rng)
    src.add_sequence(3)
    run_forward(src, [3], [5], rng)
    return src


def scales(cache):
    return [cache.kv_scales(layer) for layer in range(cache.config.num_layers)]


def items(headers, ids=IDS, parents=(None, 1, None)):
    return [(sid, h, parent, None) for sid, h, parent in zip(ids, headers, parents)]


def moved(dst, a):
    """``a`` (another cache's array) as ``dst``'s array in its compute dtype (bits kept)."""
    return dst.from_numpy(kvcache.to_numpy(a))


def join(dst, *arrays):
    return dst.from_numpy(np.concatenate([kvcache.to_numpy(a) for a in arrays], axis=1))


def assert_same_codes(src, sid, dst, did):
    np.testing.assert_array_equal(fp8_codes(src, sid), fp8_codes(dst, did))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_sequences_gives_export_sequences_values_and_scales(backend, dtype):
    src = source(backend, dtype)
    headers, k, v = src.export_sequences(IDS, STARTS)
    want = scales(src)
    assert None not in want
    assert src.backend.dtype_name(k) == dtype and src.backend.dtype_name(v) == dtype
    off = 0
    for sid, start, h in zip(IDS, STARTS, headers):
        one = src.export_sequence(sid, start)
        assert h.k is None and h.header() == one.header()
        assert h.kv_dtype == FP8 and h.dtype == dtype and list(h.kv_scales) == want
        n = h.num_tokens
        gk, gv = src.get_kv(sid, start)
        for got, a, b in ((k[:, off:off + n], one.k, gk), (v[:, off:off + n], one.v, gv)):
            assert same(got, a, dtype) and same(got, b, dtype)
        off += n
    assert k.shape[1] == off


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_batched_import_adopts_the_scales_at_commit_and_stores_the_source_codes(pair, dtype):
    src = source(pair[0], dtype)
    # across backends another page size too; on one backend the same, so that attention
    # sums in the same order and its outputs compare bit for bit
    dst = fp8_cache(pair[1], dtype, page_size=4 if pair[0] == pair[1] else 3)
    headers, k, v = src.export_sequences(IDS, STARTS)
    res = dst.reserve_import(items(headers))
    assert scales(dst) == [None, None], "the reservation holds the scales until the commit"
    dst.write_import(res, moved(dst, k), moved(dst, v))
    assert scales(dst) == [None, None] and dst.sequence_ids == []
    dst.commit_import(res)
    assert scales(dst) == scales(src)
    dst.state.pt.check_invariants()
    for sid in IDS:
        assert_same_kv(src, sid, dst, sid)
        assert_same_codes(src, sid, dst, sid)
    if pair[0] == pair[1]:                                   # attention reads the same codes
        outs = []
        for cache in (src, dst):
            outs.append(run_forward(cache, [2, 3], [1, 2], np.random.default_rng(9),
                                    return_output=True))
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_import_takes_the_values_in_the_compute_dtype(backend):
    src = source(backend, "bfloat16")
    dst = fp8_cache(backend, "bfloat16")
    headers, k, v = src.export_sequences(IDS, STARTS)
    res = dst.reserve_import(items(headers))
    b = dst.backend
    if backend == "cuda":
        import torch
        wrong = [x.to(torch.float8_e4m3fn) for x in (k, v)]     # the storage dtype's codes
    else:
        wrong = [b.from_numpy(kvcache.to_numpy(x), "float32") for x in (k, v)]
    before = snapshot(dst)
    with pytest.raises(InvalidArgumentError, match=r"k must be a \w+ array .* in bfloat16 \(the "
                       r"compute dtype: the values, which this float8_e4m3 cache quantizes"):
        dst.write_import(res, *wrong)
    assert snapshot(dst) == before and scales(dst) == [None, None]
    dst.write_import(res, k, v)
    dst.commit_import(res)
    for sid in IDS:
        assert_same_codes(src, sid, dst, sid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_and_refused_commits_leave_no_scales(backend):
    src = source(backend)
    headers, k, v = src.export_sequences([1, 3])
    batch = items(headers, [1, 3], [None, None])
    dst = fp8_cache(backend)
    before = snapshot(dst)
    res = dst.reserve_import(batch)
    assert dst.num_available_pages < before[0]
    dst.write_import(res, k, v)
    dst.cancel_import(res)
    assert snapshot(dst) == before and scales(dst) == [None, None]
    # a commit refused (the id taken meanwhile): no scales, the reservation stays open
    res = dst.reserve_import(batch)
    dst.write_import(res, k, v)
    dst.add_sequence(3)
    with pytest.raises(SequenceExistsError, match="sequence 3"):
        dst.commit_import(res)
    assert scales(dst) == [None, None] and dst.sequence_ids == [3]
    dst.remove_sequence(3)
    dst.commit_import(res)
    assert scales(dst) == scales(src)
    for sid in (1, 3):
        assert_same_codes(src, sid, dst, sid)
    # a reservation that does not fit adopts nothing either
    small = fp8_cache(backend, tokens=16)
    with pytest.raises(CacheFullError):
        small.reserve_import(batch)
    assert scales(small) == [None, None] and small.is_empty


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_layer_calibrated_after_the_reservation_refuses_write_and_commit(backend):
    src = source(backend)
    headers, k, v = src.export_sequences([1, 3])
    batch = items(headers, [1, 3], [None, None])
    dst = fp8_cache(backend)
    res = dst.reserve_import(batch)
    dst.add_sequence(9)                            # its own forward calibrates its own scales
    run_forward(dst, [9], [4], np.random.default_rng(5))
    own = scales(dst)
    assert None not in own and own != scales(src)
    before = snapshot(dst)
    for call, args in (("write_import", (res, k, v)), ("commit_import", (res,))):
        with pytest.raises(InvalidArgumentError, match="after the import was reserved"):
            getattr(dst, call)(*args)
        assert snapshot(dst) == before and scales(dst) == own
    dst.cancel_import(res)
    # with convert_dtype the values are stored with the cache's scales, as import_sequence does
    res = dst.reserve_import(batch, convert_dtype=True)
    dst.write_import(res, k, v)
    dst.commit_import(res)
    judge = fp8_cache(backend)
    judge.add_sequence(9)
    run_forward(judge, [9], [4], np.random.default_rng(5))
    for sid in (1, 3):
        judge.import_sequence(sid, src.export_sequence(sid), convert_dtype=True)
        assert_same_kv(judge, sid, dst, sid)
        assert_same_codes(judge, sid, dst, sid)
    assert scales(dst) == own


@pytest.mark.parametrize("backend", BACKENDS)
def test_reservations_adopting_the_same_scales_commit_in_any_order(backend):
    """What a receiver with several transfers in flight does: each reservation adopts the
    sender's scales; the first commit makes them the cache's, the second finds them equal."""
    src = source(backend)
    (h1, h3), k, v = src.export_sequences([1, 3])
    dst = fp8_cache(backend)
    r1 = dst.reserve_import([(1, h1, None, None)])
    r3 = dst.reserve_import([(3, h3, None, None)])
    n1 = h1.num_tokens
    dst.write_import(r3, k[:, n1:], v[:, n1:])
    dst.write_import(r1, k[:, :n1], v[:, :n1])
    dst.commit_import(r3)
    assert scales(dst) == scales(src)
    dst.commit_import(r1)
    for sid in (1, 3):
        assert_same_codes(src, sid, dst, sid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_items_with_different_scales_are_refused_unless_converting(backend):
    a, b = source(backend, seed=0), source(backend, seed=1)
    assert scales(a) != scales(b)
    (ha,), ka, va = a.export_sequences([1])
    (hb,), kb, vb = b.export_sequences([3])
    batch = [(1, ha, None, None), (7, hb, None, None)]
    dst = fp8_cache(backend)
    before = snapshot(dst)
    with pytest.raises(InvalidArgumentError, match=r"import of sequence 7: layer 0's fp8 scales "
                       r"are .* \(adopted from sequence 1, earlier in this reservation\)"):
        dst.reserve_import(batch)
    assert snapshot(dst) == before and scales(dst) == [None, None]
    # convert_dtype: as two import_sequence calls would, the first item's scales for both
    res = dst.reserve_import(batch, convert_dtype=True)
    dst.write_import(res, join(dst, ka, kb), join(dst, va, vb))
    dst.commit_import(res)
    judge = fp8_cache(backend)
    judge.import_sequence(1, a.export_sequence(1))
    judge.import_sequence(7, b.export_sequence(3), convert_dtype=True)
    assert scales(dst) == scales(judge) == scales(a)
    for sid in (1, 7):
        assert_same_kv(judge, sid, dst, sid)
        assert_same_codes(judge, sid, dst, sid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_mismatches_with_the_cache_are_checked_as_import_sequence_does(backend):
    src = source(backend)
    headers, k, v = src.export_sequences([1, 3])
    batch = items(headers, [1, 3], [None, None])
    dst = fp8_cache(backend)
    for layer in range(2):
        dst.set_kv_scales(layer, 0.01, 0.01)
    before = snapshot(dst)
    with pytest.raises(InvalidArgumentError, match=r"import of sequence 1: layer 0's fp8 scales "
                       r"are \(\(0.0099999"):
        dst.reserve_import(batch)
    assert snapshot(dst) == before
    res = dst.reserve_import(batch, convert_dtype=True)
    assert res.scales == {}
    dst.write_import(res, k, v)
    dst.commit_import(res)
    judge = fp8_cache(backend)
    for layer in range(2):
        judge.set_kv_scales(layer, 0.01, 0.01)
    for sid in (1, 3):
        judge.import_sequence(sid, src.export_sequence(sid), convert_dtype=True)
        assert_same_codes(judge, sid, dst, sid)
    # a layer without scales on either side cannot store a payload's tokens
    fresh = fp8_cache(backend)
    blind = dataclasses.replace(headers[0], kv_scales=(headers[0].kv_scales[0], None))
    with pytest.raises(InvalidArgumentError, match="no fp8 scales for layer 1 and this cache "
                       "has none either"):
        fresh.reserve_import([(1, blind, None, None)])
    assert fresh.is_empty and scales(fresh) == [None, None]
    assert fresh.num_available_pages == fresh.num_total_pages


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_caches_take_fp8_batches_only_by_conversion(backend):
    src = source(backend)
    headers, k, v = src.export_sequences([1, 3])
    batch = items(headers, [1, 3], [None, None])
    plain = fp8_cache(backend, kv_dtype="auto")
    with pytest.raises(InvalidArgumentError, match="convert_dtype=True"):
        plain.reserve_import(batch)
    res = plain.reserve_import(batch, convert_dtype=True)
    plain.write_import(res, k, v)                  # the values: the plain cache's storage dtype
    plain.commit_import(res)
    for sid in (1, 3):
        assert_same_kv(src, sid, plain, sid)
    (ph,), _, _ = plain.export_sequences([1])
    with pytest.raises(InvalidArgumentError, match="only a float8_e4m3 payload"):
        fp8_cache(backend).reserve_import([(1, ph, None, None)], convert_dtype=True)
