"""Logit soft-capping, attention sinks and a value head dim other than head_dim (MLA in expanded
form) on the metal backend (MLX's CPU device here), each against an independent float64 numpy
computation written below (not ``kvcache.reference``): a row-by-row, head-by-head softmax.

Pages are built on the host with every row that is not a key of the depth set to NaN, and with
the unused tail of every K row (``D < max(D, Dv)``) and V row (``Dv < max(D, Dv)``) set to NaN,
so a kernel that reads outside the keys or past a row's K / V width fails."""

import numpy as np
import pytest

import mlx.core as mx

import kvcache
from kvcache.backend import DepthAux, RopeSpec
from kvcache.conformance import assert_close
from kvcache_metal.backend import MetalBackend

from metal_testutil import DEVICE, quantize


def make(dtype="float32", d=16, dv=None, hkv=2, group=2, page_size=4, pages=48, layers=2):
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=hkv * group, num_kv_heads=hkv,
                              head_dim=d, head_dim_v=dv, page_size=page_size,
                              max_total_tokens=pages * page_size, dtype=dtype, rope_mode="normal")
    return cfg, MetalBackend(cfg, DEVICE)


def rand(rng, shape, dtype, scale=1.0):
    return quantize(rng.standard_normal(shape) * scale, dtype)


def host(mb, x):
    return np.asarray(mb.to_numpy(x), np.float64)


# ------------------------------------------------------------------------ the float64 oracle
def oracle(q, k, v, visible, sm_scale, group, softcap=0.0, sinks=None):
    """q (n, Hq, D), k (m, Hkv, D), v (m, Hkv, Dv), visible (n, m) -> o (n, Hq, Dv), lse (n, Hq)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    n, hq, _ = q.shape
    dv = v.shape[-1]
    o = np.zeros((n, hq, dv))
    lse = np.full((n, hq), -np.inf)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = (q[:, h] @ kh.T) * sm_scale if len(kh) else np.zeros((n, 0))
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        for r in range(n):
            logits, values = scores[r, visible[r]], vh[visible[r]]
            if sinks is not None:        # one more logit, with a zero value
                logits = np.append(logits, float(sinks[h]))
                values = np.concatenate([values, np.zeros((1, dv))])
            if len(logits) == 0:
                continue
            top = logits.max()
            w = np.exp(logits - top)
            lse[r, h] = top + np.log(w.sum())
            o[r, h] = w @ values / w.sum()
    return o, lse


def ragged_oracle(q, k, v, lens, sm_scale, group, softcap=0.0, sinks=None):
    outs, lses = [], []
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        o, lse = oracle(q[sl], k[sl], v[sl], np.tril(np.ones((n, n), bool)), sm_scale, group,
                        softcap, sinks)
        outs.append(o)
        lses.append(lse)
        start += n
    return np.concatenate(outs), np.concatenate(lses)


def rotate64(x, pos, theta=10000.0):
    """Rotate-half RoPE over all dims, float64."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    ang = pos[:, None].astype(np.float64) * theta ** (-2.0 * np.arange(half) / x.shape[-1])
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


# ---------------------------------------------------------------------- pages and page tables
def build_depth(rng, cfg, qlens, klens, uncovered=0):
    """Host arrays of a depth over a random page permutation (entry 1 with a sink/gap mapping
    when it is long enough), the (page, row) of every key per entry, and the number of q rows."""
    ps = cfg.page_size
    perm = rng.permutation(cfg.num_pages)
    page_indptr, page_indices, sink, gap, last, keys = [0], [], [], [], [], []
    for i, L in enumerate(int(x) for x in klens):
        s = g = 0
        if i == 1 and L > 3:
            s, g = 2, 2 + ps + 1
        span = g + L - s if (s or g) else L
        npg = -(-span // ps)
        pids = perm[len(page_indices):len(page_indices) + npg]
        page_indices += list(pids)
        page_indptr.append(len(page_indices))
        sink.append(s)
        gap.append(g)
        last.append((span - 1) % ps + 1 if span else 0)
        offs = [j if j < s else j - s + g for j in range(L)]
        keys.append([(int(pids[o // ps]), o % ps) for o in offs])
    qo = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    arrays = dict(qo_indptr=qo, page_indptr=np.asarray(page_indptr, np.int32),
                  page_indices=np.asarray(page_indices, np.int32),
                  last_page_len=np.asarray(last, np.int32), kv_len=np.asarray(klens, np.int32),
                  sink_size=np.asarray(sink, np.int32), window_offset=np.asarray(gap, np.int32),
                  k_rope_offset=rng.integers(0, 50, len(qlens)).astype(np.int32))
    return arrays, keys, int(qo[-1]) + uncovered


def to_depth(mb, arrays, use_decode):
    a = {k: mb.aux_to_device(v) for k, v in arrays.items()}
    return DepthAux(a["qo_indptr"], a["page_indptr"], a["page_indices"], a["last_page_len"],
                    a["kv_len"], a["sink_size"], a["window_offset"], a["k_rope_offset"],
                    len(arrays["kv_len"]), use_decode, None, int(max(arrays["kv_len"])),
                    int(np.diff(arrays["qo_indptr"]).max()))


def poisoned_pages(rng, cfg, mb, keys):
    """Random host pages (page_shape of the backend): rows that are no key and the tails of key
    rows beyond D (K) / Dv (V) are NaN."""
    shape = mb.page_shape(cfg.num_pages)
    assert shape == (cfg.num_pages, 2, cfg.num_kv_heads, cfg.page_size,
                     max(cfg.head_dim, cfg.head_dim_v))
    h = rand(rng, shape, cfg.dtype)
    keep = np.zeros((cfg.num_pages, cfg.page_size), bool)
    for entry in keys:
        for page, row in entry:
            keep[page, row] = True
    h.transpose(0, 3, 1, 2, 4)[~keep] = np.nan
    h[:, 0, :, :, cfg.head_dim:] = np.nan
    h[:, 1, :, :, cfg.head_dim_v:] = np.nan
    return h


def entry_kv(cfg, h, entry):
    """K (L, Hkv, D) and V (L, Hkv, Dv) of one entry's keys, read from host pages."""
    d, dv, hkv = cfg.head_dim, cfg.head_dim_v, cfg.num_kv_heads
    kk = np.array([h[p, 0, :, r, :d] for p, r in entry]).reshape(len(entry), hkv, d)
    vv = np.array([h[p, 1, :, r, :dv] for p, r in entry]).reshape(len(entry), hkv, dv)
    return kk, vv


def paged_oracle(cfg, h, arrays, keys, q, total, sm_scale, softcap=0.0, sinks=None,
                 window_left=-1, q_pos=None):
    o = np.zeros((total, cfg.num_qo_heads, cfg.head_dim_v))
    lse = np.full((total, cfg.num_qo_heads), -np.inf)
    if sinks is not None:
        lse[:] = np.asarray(sinks, np.float64)[None, :]
    qo = arrays["qo_indptr"]
    for i, entry in enumerate(keys):
        lo, hi = int(qo[i]), int(qo[i + 1])
        if hi == lo:
            continue
        kk, vv = entry_kv(cfg, h, entry)
        visible = np.ones((hi - lo, len(entry)), bool)
        if window_left >= 0:
            kpos = int(arrays["k_rope_offset"][i]) + np.arange(len(entry))
            visible &= kpos[None, :] >= (q_pos[lo:hi] - window_left)[:, None]
        o[lo:hi], lse[lo:hi] = oracle(q[lo:hi], kk, vv, visible, sm_scale, cfg.group_size,
                                      softcap, sinks)
    return o, lse


def check(mb, dtype, got, want):
    (om, lm), (ow, lw) = got, want
    assert mb.dtype_name(om) == dtype and mb.dtype_name(lm) == "float32"
    assert_close("o", ow, host(mb, om), dtype)
    assert_close("lse", lw, host(mb, lm), dtype, lse=True)


# ------------------------------------------------------------------------------ soft-capping
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_ragged(dtype):
    cfg, mb = make(dtype)
    mb.use_fast_sdpa = True                 # the fused-SDPA path must step aside for softcap
    rng = np.random.default_rng(11)
    lens = [5, 1, 13, 7]
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qo[-1])
    q, k = rand(rng, (T, 4, 16), dtype), rand(rng, (T, 2, 16), dtype)
    v = rand(rng, (T, 2, 16), dtype)
    for lens_, qo_ in ((lens, qo), ([T], np.array([0, T], np.int32))):
        got = mb.ragged_attention(mb.from_numpy(q), mb.from_numpy(k), mb.from_numpy(v),
                                  mb.aux_to_device(qo_), 2.0, num_seqs=len(lens_),
                                  max_len=max(lens_), logit_softcap=1.5)
        check(mb, dtype, got, ragged_oracle(q, k, v, lens_, 2.0, 2, softcap=1.5))
    assert mb.stats["sdpa_ragged"] == 0


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_softcap_paged(mode):
    cfg, mb = make("float32")
    mb.use_metal_kernels = True             # the Metal decode kernel must step aside for softcap
    rng = np.random.default_rng(12)
    if mode == "decode":
        qlens, klens = [1, 1, 1, 1], [9, 14, 0, 3]
    else:
        qlens, klens = [3, 4, 2, 0], [9, 14, 5, 4]
    arrays, keys, T = build_depth(rng, cfg, qlens, klens, uncovered=2)
    h = poisoned_pages(rng, cfg, mb, keys)
    q = rand(rng, (T, 4, 16), "float32")
    got = mb.paged_attention(mb.from_numpy(q), mb.from_numpy(h), to_depth(mb, arrays, mode == "decode"),
                             2.0, logit_softcap=1.5)
    check(mb, "float32", got, paged_oracle(cfg, h, arrays, keys, q, T, 2.0, softcap=1.5))
    assert mb.stats["metal_decode"] == 0


# ------------------------------------------------------------------------------------- sinks
def test_sinks_ragged_and_merge():
    """Sinks on the ragged pass; merged with a paged pass without sinks (the core passes sinks
    to one call of a layer) it equals one softmax over all keys plus the sink."""
    cfg, mb = make("float32")
    mb.use_fast_sdpa = True
    rng = np.random.default_rng(13)
    sinks = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
    lens = [1, 6, 3]
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qo[-1])
    q, k, v = rand(rng, (T, 4, 16), "float32"), rand(rng, (T, 2, 16), "float32"), rand(rng, (T, 2, 16), "float32")
    got_r = mb.ragged_attention(mb.from_numpy(q), mb.from_numpy(k), mb.from_numpy(v),
                                mb.aux_to_device(qo), 0.4, num_seqs=3, max_len=6,
                                sinks=mb.from_numpy(sinks, "float32"))
    check(mb, "float32", got_r, ragged_oracle(q, k, v, lens, 0.4, 2, sinks=sinks))
    assert mb.stats["sdpa_ragged"] == 0
    # history of the same three sequences (the first one has none)
    arrays, keys, _ = build_depth(rng, cfg, lens, [0, 7, 5])
    h = poisoned_pages(rng, cfg, mb, keys)
    got_p = mb.paged_attention(mb.from_numpy(q), mb.from_numpy(h), to_depth(mb, arrays, False), 0.4)
    o, lse = mb.merge_attention(got_p[0], got_p[1], *got_r)
    want_o, want_lse = [], []
    for i, n in enumerate(lens):
        sl = slice(int(qo[i]), int(qo[i + 1]))
        kh, vh = entry_kv(cfg, h, keys[i])
        vis = np.concatenate([np.ones((n, len(keys[i])), bool), np.tril(np.ones((n, n), bool))], 1)
        ow, lw = oracle(q[sl], np.concatenate([kh, k[sl]]), np.concatenate([vh, v[sl]]), vis,
                        0.4, 2, sinks=sinks)
        want_o.append(ow)
        want_lse.append(lw)
    check(mb, "float32", (o, lse), (np.concatenate(want_o), np.concatenate(want_lse)))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_sinks_paged(mode):
    """Sinks (given in bfloat16: any float dtype) with an entry of no keys, rows covered by no
    entry, and (prefill) rows whose window hides every key; all of those get o = 0,
    lse = sinks[h]. Combined with soft-capping in the prefill case."""
    cfg, mb = make("float32")
    mb.use_metal_kernels = True
    rng = np.random.default_rng(14)
    sinks = quantize(rng.standard_normal(4) * 2, "bfloat16")
    if mode == "decode":
        qlens, klens = [1, 1, 1], [6, 0, 11]
    else:
        qlens, klens = [4, 2, 3], [6, 0, 11]
    arrays, keys, T = build_depth(rng, cfg, qlens, klens, uncovered=2)
    h = poisoned_pages(rng, cfg, mb, keys)
    q = rand(rng, (T, 4, 16), "float32")
    kw = dict(sinks=mb.from_numpy(sinks, "bfloat16"))
    want_kw = dict(sinks=sinks)
    if mode == "prefill":
        # entry 0's keys sit at k_rope_offset[0] + 0..5: its first two queries see none of them
        top = int(arrays["k_rope_offset"][0]) + 5
        pos = rng.integers(0, 80, T).astype(np.int32)
        pos[:4] = [top + 10, top + 9, top + 1, top]
        kw.update(window_left=2, q_positions=mb.aux_to_device(pos), logit_softcap=3.0)
        want_kw.update(window_left=2, q_pos=pos, softcap=3.0)
    om, lm = mb.paged_attention(mb.from_numpy(q), mb.from_numpy(h),
                                to_depth(mb, arrays, mode == "decode"), 0.5, **kw)
    want = paged_oracle(cfg, h, arrays, keys, q, T, 0.5, **want_kw)
    check(mb, "float32", (om, lm), want)
    empty = [int(arrays["qo_indptr"][1])] + [T - 2, T - 1]      # entry 1 (no keys), uncovered
    if mode == "prefill":
        empty += [0, 1]                                          # window hides every key
    lse = host(mb, lm)
    for r in empty:
        assert np.array_equal(lse[r], sinks.astype(np.float64)), r
        assert not host(mb, om)[r].any(), r
    assert mb.stats["metal_decode"] == 0


# ------------------------------------------------------------------------ head_dim_v != head_dim
@pytest.mark.parametrize("d,dv,dtype", [(48, 32, "float32"), (24, 40, "float32"), (24, 40, "bfloat16")])
def test_head_dim_v(d, dv, dtype):
    cfg, mb = make(dtype, d=d, dv=dv, page_size=4, pages=24)
    mb.use_metal_kernels = mb.use_fast_sdpa = True       # both must step aside for Dv != D
    rng = np.random.default_rng(15)
    w = max(d, dv)
    ps, hkv, n_slots = cfg.page_size, 2, cfg.num_pages * cfg.page_size
    pages = mb.allocate_pages(cfg.num_pages)
    assert pages[0].shape == (cfg.num_pages, 2, hkv, ps, w)
    # random host pages with NaN tails past D (K) / Dv (V): appends must leave the tails alone
    h = [rand(rng, (cfg.num_pages, 2, hkv, ps, w), dtype) for _ in range(cfg.num_layers)]
    for x in h:
        x[:, 0, :, :, d:] = np.nan
        x[:, 1, :, :, dv:] = np.nan
    mp = [mb.from_numpy(x) for x in h]

    # append_kv (one skipped token), fused-RoPE append_kv, rope_append
    T = 9
    slots = rng.choice(n_slots, 3 * T, replace=False).astype(np.int32)
    k, v = rand(rng, (3, T, hkv, d), dtype), rand(rng, (3, T, hkv, dv), dtype)
    q = rand(rng, (T, 4, d), dtype)
    pos = rng.integers(0, 300, T).astype(np.int32)
    s0, s1, s2 = slots[:T].copy(), slots[T:2 * T], slots[2 * T:]
    s0[4] = -1
    spec = RopeSpec()
    for layer in range(cfg.num_layers):
        obj = mp[layer]
        mb.append_kv(mp[layer], mb.from_numpy(k[0]), mb.from_numpy(v[0]), mb.aux_to_device(s0))
        mb.append_kv(mp[layer], mb.from_numpy(k[1]), mb.from_numpy(v[1]), mb.aux_to_device(s1),
                     mb.aux_to_device(pos), spec)
        qm, km = mb.rope_append(mp[layer], mb.from_numpy(q), mb.from_numpy(k[2]),
                                mb.from_numpy(v[2]), mb.aux_to_device(s2), mb.aux_to_device(pos), spec)
        assert mp[layer] is obj
        assert_close("q_rot", rotate64(q, pos), host(mb, qm), dtype)
        assert_close("k_rot", rotate64(k[2], pos), host(mb, km), dtype)
        for s, kk, vv in ((s0, k[0], v[0]), (s1, quantize(rotate64(k[1], pos), dtype), v[1]),
                          (s2, quantize(rotate64(k[2], pos), dtype), v[2])):
            keep = s >= 0
            h[layer][s[keep] // ps, 0, :, s[keep] % ps, :d] = kk[keep]
            h[layer][s[keep] // ps, 1, :, s[keep] % ps, :dv] = vv[keep]
    mb.synchronize()
    for layer in range(cfg.num_layers):
        assert_close(f"pages[{layer}]", h[layer], host(mb, mp[layer]), dtype)

    # fork copy and tree-commit compaction move whole rows
    mb.copy_page_prefix(mp, 3, 7, 3)
    src = rng.choice(n_slots, 6, replace=False).astype(np.int32)
    dst = np.concatenate([src[3:], rng.choice(np.setdiff1d(np.arange(n_slots), src), 3,
                                              replace=False)]).astype(np.int32)
    mb.compact_kv(mp, mb.aux_to_device(src), mb.aux_to_device(dst))
    for x in h:
        x[7, :, :, :3] = x[3, :, :, :3]
        rows = x[src // ps, :, :, src % ps].copy()
        x[dst // ps, :, :, dst % ps] = rows
    for layer in range(cfg.num_layers):
        assert_close(f"pages[{layer}] after copy", h[layer], host(mb, mp[layer]), dtype)

    # gather_kv: K (L, n, Hkv, D), V (L, n, Hkv, Dv)
    g = rng.permutation(n_slots)[:11].astype(np.int32)
    kg, vg = mb.gather_kv(mp, mb.aux_to_device(g))
    assert kg.shape == (cfg.num_layers, 11, hkv, d) and vg.shape == (cfg.num_layers, 11, hkv, dv)
    assert_close("k", np.stack([x[g // ps, 0, :, g % ps, :d] for x in h]), host(mb, kg), dtype)
    assert_close("v", np.stack([x[g // ps, 1, :, g % ps, :dv] for x in h]), host(mb, vg), dtype)

    # ragged attention: v (T, Hkv, Dv) -> o (T, Hq, Dv); one sequence (the SDPA shape) and three
    for lens in ([T], [2, 4, 3]):
        qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        got = mb.ragged_attention(mb.from_numpy(q), mb.from_numpy(k[0]), mb.from_numpy(v[0]),
                                  mb.aux_to_device(qo), 0.3, num_seqs=len(lens), max_len=max(lens))
        assert got[0].shape == (T, 4, dv)
        check(mb, dtype, got, ragged_oracle(q, k[0], v[0], lens, 0.3, 2))

    # paged attention (prefill and decode) over poisoned pages, rows covered by no entry
    for qlens, klens in (([3, 2, 4], [7, 10, 2]), ([1, 1, 1, 1], [5, 12, 0, 1])):
        arrays, keys, Tq = build_depth(rng, cfg, qlens, klens, uncovered=1)
        hp = poisoned_pages(rng, cfg, mb, keys)
        qp = rand(rng, (Tq, 4, d), dtype)
        got = mb.paged_attention(mb.from_numpy(qp), mb.from_numpy(hp),
                                 to_depth(mb, arrays, len(set(qlens)) == 1), 0.3)
        assert got[0].shape == (Tq, 4, dv)
        check(mb, dtype, got, paged_oracle(cfg, hp, arrays, keys, qp, Tq, 0.3))
        o_b = rand(rng, (Tq, 4, dv), dtype)
        l_b = rng.standard_normal((Tq, 4)).astype(np.float32)
        om, lm = mb.merge_attention(got[0], got[1], mb.from_numpy(o_b), mb.from_numpy(l_b, "float32"))
        oa, la = host(mb, got[0]), host(mb, got[1])
        lse = np.logaddexp(la, l_b)
        want_o = oa * np.exp(la - lse)[..., None] + o_b * np.exp(l_b - lse)[..., None]
        check(mb, dtype, (om, lm), (want_o, lse))
    assert mb.stats == {"metal_decode": 0, "sdpa_ragged": 0}
