"""Logit soft-capping, attention sinks, a value head dim other than head_dim, and small / odd head
dims: every kernel of the mode's implementation(s) (torch on CPU, Triton under the interpreter,
both on a GPU) against attention written out here in float64 numpy (independent of the
reference backend and of the code under test)."""

import zlib

import numpy as np
import pytest

import cuda_cases as cc
from cuda_cases import Entry
from kvcache.conformance import assert_close

SCALE = 0.3           # large enough that a cap of 2 changes most scores
CAP = 2.0


def _slim(dtype, keep: bool):
    """The interpreter (every program in numpy) runs float16 only on the case marked ``keep`` of
    each test; float32 and the other modes run them all."""
    if cc.INTERPRET and dtype == "float16" and not keep:
        pytest.skip("interpreter: float16 runs one case of this test")


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------- the expected math
def np_attend(q, k, v, visible, scale, group, softcap=0.0, sinks=None):
    """q (n, Hq, D), k (m, Hkv, D), v (m, Hkv, Dv), visible (n, m) -> o (n, Hq, Dv), lse (n, Hq),
    float64: softmax over the visible keys (and the head's sink logit, with no value)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    n, hq, _ = q.shape
    dv = v.shape[2]
    o = np.zeros((n, hq, dv))
    lse = np.full((n, hq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        s = q[:, h] @ kh.T * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = np.where(visible, s, -np.inf)
        if sinks is not None:
            s = np.concatenate([s, np.full((n, 1), float(sinks[h]))], axis=1)
            vh = np.concatenate([vh, np.zeros((1, dv))])
        if s.shape[1] == 0:
            continue
        peak = s.max(axis=1, keepdims=True)
        seen = np.isfinite(peak[:, 0])
        w = np.exp(s[seen] - peak[seen])
        den = w.sum(axis=1)
        o[seen, h] = (w @ vh) / den[:, None]
        lse[seen, h] = peak[seen, 0] + np.log(den)
    return o, lse


def _no_keys(q, dv, sinks):
    """o = 0 and lse = -inf (the sink with sinks): rows that see no key."""
    t, hq = q.shape[:2]
    lse = np.full((t, hq), -np.inf) if sinks is None else np.tile(sinks, (t, 1))
    return np.zeros((t, hq, dv)), lse


def np_ragged(q, k, v, qo, scale, group, **kw):
    """Causal attention of each sequence's rows among themselves (rows outside: o 0 / lse -inf
    or the sink)."""
    o, lse = _no_keys(q, v.shape[2], kw.get("sinks"))
    for lo, hi in zip(qo[:-1], qo[1:]):
        if hi > lo:
            vis = np.tri(hi - lo, dtype=bool)
            o[lo:hi], lse[lo:hi] = np_attend(q[lo:hi], k[lo:hi], v[lo:hi], vis, scale, group, **kw)
    return o, lse


def np_paged(q, pages, depth, scale, group, d, dv, ps, **kw):
    """Each entry's rows over its kv_len keys read through the page table (no window / tree);
    rows no entry covers see no key."""
    o, lse = _no_keys(q, dv, kw.get("sinks"))
    qo = np.asarray(depth.qo_indptr)
    for i in range(depth.num_entries):
        lo, hi, n = int(qo[i]), int(qo[i + 1]), int(depth.kv_len[i])
        j = np.arange(n)
        page = np.asarray(depth.page_indices)[int(depth.page_indptr[i]) + j // ps]
        keys = pages[page, 0, :, j % ps, :d]
        vals = pages[page, 1, :, j % ps, :dv]
        o[lo:hi], lse[lo:hi] = np_attend(q[lo:hi], keys, vals, np.ones((hi - lo, n), bool),
                                         scale, group, **kw)
    return o, lse


# ---------------------------------------------------------------------- helpers
def _check(mine, dtype, got_o, got_lse, want_o, want_lse):
    assert tuple(got_o.shape) == want_o.shape
    assert_close("o", want_o, mine.to_numpy(got_o), dtype)
    assert_close("lse", want_lse, mine.to_numpy(got_lse), dtype, lse=True)


def _sinks(mine, rng, hq, dtype="float32"):
    """Sink logits per head (one large, so it dominates its rows), as a backend array, and the
    values the kernel sees (rounded to ``dtype``)."""
    s = rng.normal(0.0, 1.5, hq).astype(np.float32)
    s[1] = 4.0
    t = mine.from_numpy(s, dtype)
    return t, mine.to_numpy(t).astype(np.float64)


def _features(feature, mine, rng, hq, sink_dtype="float32"):
    """(kwargs for the backend, kwargs for np_attend) of 'softcap' | 'sinks' | 'both'."""
    call, want = {}, {}
    if feature in ("softcap", "both"):
        call["logit_softcap"] = want["softcap"] = CAP
    if feature in ("sinks", "both"):
        call["sinks"], want["sinks"] = _sinks(mine, rng, hq, sink_dtype)
    return call, want


def _ragged_inputs(mine, rng, lengths, hq, hkv, d, dv):
    qo = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    t = int(qo[-1])
    q, k, v = (cc.rand(mine, rng, (t, h, w)) for h, w in ((hq, d), (hkv, d), (hkv, dv)))
    return q, k, v, qo


def _np(mine, *xs):
    return [mine.to_numpy(x).astype(np.float64) for x in xs]


def _paged(mine, ref, rng, entries, *, use_decode, row_offset=1, tail_rows=2):
    """cc.paged_case, plus NaN in the page-row columns past D (K) and Dv (V): a kernel that reads
    the padding of a row fails."""
    c = mine.config
    case = cc.paged_case(rng, ref, mine, entries, use_decode=use_decode, row_offset=row_offset,
                         tail_rows=tail_rows)
    pool = mine.to_numpy(case.pages)
    pool[:, 0, ..., c.head_dim:] = np.nan
    pool[:, 1, ..., c.head_dim_v:] = np.nan
    case.pages = mine.from_numpy(pool)
    return case, pool.astype(np.float64)


def _run_ragged(impl, dtype, feature, hq=8, hkv=2, d=64, dv=None, lengths=(5, 1, 14, 0, 9),
                seed=()):
    dv = dv or d
    cfg = cc.config(hq=hq, hkv=hkv, d=d, dtype=dtype, head_dim_v=dv)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("ragged", impl, dtype, feature, d, dv, *seed)
    q, k, v, qo = _ragged_inputs(mine, rng, list(lengths), hq, hkv, d, dv)
    call, want = _features(feature, mine, rng, hq)
    o, lse = mine.ragged_attention(q, k, v, cc.ints(mine, qo), SCALE, num_seqs=len(lengths),
                                   max_len=max(lengths), **call)
    _check(mine, dtype, o, lse, *np_ragged(*_np(mine, q, k, v), qo, SCALE, hq // hkv, **want))


def _run_paged(impl, dtype, feature, entries, *, use_decode, splits=1, hq=8, hkv=2, d=64,
               dv=None, seed=(), sink_dtype="float32"):
    dv = dv or d
    cfg = cc.config(hq=hq, hkv=hkv, d=d, dtype=dtype, head_dim_v=dv)
    ref, mine = cc.pair(cfg, impl)
    if use_decode:
        mine.tuning = mine.tuning.with_(force_splits=splits, split_min_keys=16)
    else:       # the paged prefill kernel's key splits (a shared prefix's depth)
        mine.tuning = mine.tuning.with_(force_prefill_splits=splits)
    rng = _rng("paged", impl, dtype, feature, use_decode, splits, d, dv, *seed)
    case, pool = _paged(mine, ref, rng, entries, use_decode=use_decode)
    call, want = _features(feature, mine, rng, hq, sink_dtype)
    o, lse = mine.paged_attention(case.q, case.pages, case.depth, SCALE, **call)
    (q,) = _np(mine, case.q)
    _check(mine, dtype, o, lse,
           *np_paged(q, pool, case.ref_depth, SCALE, hq // hkv, d, dv, cfg.page_size, **want))
    return mine.to_numpy(lse)


# rows 0 and the last two belong to no entry; entry 1 has no key: all see only the sink
PREFILL = [Entry(3, 40), Entry(2, 0), Entry(4, 17)]
# 3 splits of whole 128-key tiles: the 300-key entry fills all three, the 129-key one two
DECODE = [Entry(1, 300), Entry(1, 0), Entry(1, 129), Entry(1, 16)]


# ---------------------------------------------------------------------- softcap / sinks
@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
def test_ragged_softcap_sinks(impl, dtype, feature):
    _slim(dtype, feature == "both")
    _run_ragged(impl, dtype, feature)


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_prefill_softcap_sinks(impl, dtype, feature, splits):
    """With key splits the sink joins their merge once, and rows no split sees (no entry, no
    key) read the sink alone."""
    _slim(dtype, feature == "sinks" or splits == 3)
    lse = _run_paged(impl, dtype, feature, PREFILL, use_decode=False, splits=splits)
    if feature == "sinks":           # rows of no entry / an entry without keys: the sink itself
        assert np.isfinite(lse[[0, 4, 5, -1]]).all()


@pytest.mark.parametrize("feature", ["softcap", "sinks", "both"])
@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_softcap_sinks(impl, dtype, feature, splits):
    """Split-K: the sink joins the merge once (a sink counted per split is off by a lot with
    three non-empty splits); the entry without keys and rows of no entry get lse = sink."""
    _slim(dtype, feature == "both" and splits == 3)
    sink_dtype = "float16" if dtype == "float16" else "float32"    # any float dtype works
    _run_paged(impl, dtype, feature, DECODE, use_decode=True, splits=splits, sink_dtype=sink_dtype)


def test_softcap_saturates_and_sinks_shift_lse(impl):
    """Sanity of the expected math itself on one case: a huge scale with a cap keeps every
    score within +-cap, and a sink adds exactly its term to the denominator."""
    cfg = cc.config(hq=4, hkv=2, d=16, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("sanity", impl)
    q, k, v, qo = _ragged_inputs(mine, rng, [6], 4, 2, 16, 16)
    sinks = mine.from_numpy(np.full(4, 0.5, np.float32), "float32")
    args = dict(num_seqs=1, max_len=6)
    _, lse_cap = mine.ragged_attention(q, k, v, cc.ints(mine, qo), 50.0, logit_softcap=1.0, **args)
    n = np.arange(1, 7)[:, None]            # keys each row sees
    lse_cap = mine.to_numpy(lse_cap)
    assert (lse_cap <= np.log(n) + 1.0 + 1e-5).all() and (lse_cap >= np.log(n) - 1.0 - 1e-5).all()
    _, lse = mine.ragged_attention(q, k, v, cc.ints(mine, qo), SCALE, **args)
    _, lse_s = mine.ragged_attention(q, k, v, cc.ints(mine, qo), SCALE, sinks=sinks, **args)
    np.testing.assert_allclose(mine.to_numpy(lse_s), np.logaddexp(mine.to_numpy(lse), 0.5),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------- head_dim_v != head_dim
DIMS_V = [(48, 32), (24, 40)]


@pytest.mark.parametrize("d,dv", DIMS_V)
def test_head_dim_v_append_gather_copy(impl, dtype, d, dv):
    """append_kv (plain and fused RoPE on K), rope_append, gather_kv, copy_page_prefix and
    compact_kv on pages whose rows are max(D, Dv) wide."""
    from kvcache.backend import RopeSpec
    ps, hq, hkv, layers = 4, 4, 2, 2
    cfg = cc.config(hq=hq, hkv=hkv, d=d, ps=ps, dtype=dtype, head_dim_v=dv, layers=layers)
    ref, mine = cc.pair(cfg, impl)
    assert mine.page_shape(3) == (3, 2, hkv, ps, max(d, dv))
    rng = _rng("dv-append", impl, dtype, d, dv)
    pool, t = 6, 9
    pages = [cc.rand(mine, rng, mine.page_shape(pool)) for _ in range(layers)]
    want = [mine.to_numpy(p).astype(np.float64) for p in pages]
    slots = rng.permutation(pool * ps)[:t].astype(np.int32)
    slots[3] = -1
    k, v = cc.rand(mine, rng, (t, hkv, d)), cc.rand(mine, rng, (t, hkv, dv))
    q = cc.rand(mine, rng, (t, hq, d))
    pos = rng.integers(0, 50, t).astype(np.int32)
    rope = RopeSpec(theta=10000.0)
    kn, vn, qn = _np(mine, k, v, q)

    def rotate(x):            # rotate-half over all D dims, float64
        half = d // 2
        ang = pos[:, None].astype(np.float64) * 10000.0 ** (-2.0 * np.arange(half) / d)
        c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def put(p, kk, vv):
        keep = slots >= 0
        pg, row = slots[keep] // ps, slots[keep] % ps
        p[pg, 0, :, row, :d] = kk[keep]
        p[pg, 1, :, row, :dv] = vv[keep]

    mine.append_kv(pages[0], k, v, cc.ints(mine, slots))
    put(want[0], kn, vn)
    q_rot, k_rot = mine.rope_append(pages[1], q, k, v, cc.ints(mine, slots), cc.ints(mine, pos),
                                    rope)
    put(want[1], rotate(kn), vn)
    tol = dtype
    assert_close("q_rot", rotate(qn), mine.to_numpy(q_rot), tol)
    assert_close("k_rot", rotate(kn), mine.to_numpy(k_rot), tol)
    for i in range(layers):
        assert_close(f"pages[{i}] after append", want[i], mine.to_numpy(pages[i]), tol)
    mine.append_kv(pages[0], k, v, cc.ints(mine, slots), cc.ints(mine, pos), rope)   # fused
    put(want[0], rotate(kn), vn)
    assert_close("pages after fused append", want[0], mine.to_numpy(pages[0]), tol)

    gslots = np.array([5, 0, 17, 23, 11], np.int32)
    gk, gv = mine.gather_kv(pages, cc.ints(mine, gslots))
    assert tuple(gk.shape) == (layers, 5, hkv, d) and tuple(gv.shape) == (layers, 5, hkv, dv)
    for i in range(layers):
        assert_close("gathered k", want[i][gslots // ps, 0, :, gslots % ps, :d],
                     mine.to_numpy(gk)[i], dtype)
        assert_close("gathered v", want[i][gslots // ps, 1, :, gslots % ps, :dv],
                     mine.to_numpy(gv)[i], dtype)

    mine.copy_page_prefix(pages, 4, 1, 3)
    src = np.array([3, 5, 9, 10, 20], np.int32)
    dst = np.array([2, 3, 4, 5, 6], np.int32)           # 3 and 5 are read and written
    mine.compact_kv(pages, cc.ints(mine, src), cc.ints(mine, dst))
    for i, w in enumerate(want):
        w[1, :, :, :3] = w[4, :, :, :3]
        rows = w[src // ps, :, :, src % ps].copy()
        w[dst // ps, :, :, dst % ps] = rows
        got = mine.to_numpy(pages[i])
        assert_close("pages after copy / compact (K)", w[:, 0, ..., :d], got[:, 0, ..., :d], dtype)
        assert_close("pages after copy / compact (V)", w[:, 1, ..., :dv], got[:, 1, ..., :dv], dtype)


@pytest.mark.parametrize("d,dv", DIMS_V)
def test_head_dim_v_attention(impl, dtype, d, dv):
    """Ragged, paged prefill, split-K decode (with sinks: the merge of Dv-wide partials) and
    merge_attention with values and outputs Dv wide."""
    _slim(dtype, d < dv)
    _run_ragged(impl, dtype, "none", d=d, dv=dv, lengths=(5, 12))
    _run_paged(impl, dtype, "none", PREFILL, use_decode=False, d=d, dv=dv)
    _run_paged(impl, dtype, "both", DECODE, use_decode=True, splits=3, d=d, dv=dv)
    cfg = cc.config(hq=4, hkv=2, d=d, dtype=dtype, head_dim_v=dv)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("dv-merge", impl, dtype, d, dv)
    oa, ob = cc.rand(mine, rng, (5, 4, dv)), cc.rand(mine, rng, (5, 4, dv))
    la, lb = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(2))
    la[0] = -np.inf
    o, lse = mine.merge_attention(oa, mine.from_numpy(la, "float32"), ob,
                                  mine.from_numpy(lb, "float32"))
    lt = np.logaddexp(la.astype(np.float64), lb)
    oa_n, ob_n = _np(mine, oa, ob)
    want = oa_n * np.exp(la - lt)[..., None] + ob_n * np.exp(lb - lt)[..., None]
    _check(mine, dtype, o, lse, want, lt)


# ---------------------------------------------------------------------- small / odd head dims
@pytest.mark.parametrize("d", [8, 24, 40, 72])
def test_small_and_odd_head_dims(impl, d):
    """Head dims padded inside the kernels (8: below tl.dot's 16; 24 / 40 / 72: RoPE halves of
    12 / 20 / 36): ragged, paged prefill with inline RoPE, split-K decode with softcap."""
    from kvcache.backend import RopeSpec
    _run_ragged(impl, "float32", "none", d=d, lengths=(6, 11))
    cfg = cc.config(hq=6, hkv=2, d=d, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("small-d", impl, d)
    case = cc.paged_case(rng, ref, mine, PREFILL, use_decode=False, row_offset=1, tail_rows=1)
    rope = RopeSpec(theta=10000.0)
    o, lse = mine.paged_attention(case.q, case.pages, case.depth, SCALE, rope=rope,
                                  q_positions=case.q_positions)
    ro, rl = ref.paged_attention(case.ref_q, case.ref_pages, case.ref_depth, SCALE, rope=rope,
                                 q_positions=case.ref_q_positions)
    _check(mine, "float32", o, lse, ref.to_numpy(ro), rl)
    _run_paged(impl, "float32", "softcap", DECODE, use_decode=True, splits=2, d=d, hq=6)
