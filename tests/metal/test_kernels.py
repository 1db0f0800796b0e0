"""Every kernel of the metal backend against the reference backend, on random inputs with real
page tables (random page permutations, sliding sink/gap mapping, token trees, inline RoPE)."""

import itertools

import numpy as np
import pytest

import kvcache
from kvcache.backend import DepthAux, RopeSpec, TreeMask
from kvcache.conformance import random_tree
from kvcache.reference import ReferenceBackend
from kvcache_metal.backend import MetalBackend

from metal_testutil import DEVICE, assert_close, quantize

DTYPES = ["float32", "float16", "bfloat16"]
ROPE = RopeSpec(theta=10000.0, scale=1.0)


def make(dtype, page_size=16, group=1, hkv=2, d=16, pages=64, layers=2):
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=hkv * group, num_kv_heads=hkv,
                              head_dim=d, page_size=page_size, max_total_tokens=pages * page_size,
                              dtype=dtype, rope_mode="normal")
    return cfg, MetalBackend(cfg, DEVICE), ReferenceBackend(cfg)


def rand(rng, shape, dtype):
    return quantize(rng.standard_normal(shape), dtype)


def key_slots(arrays, page_size):
    """(page, row) of every key of every entry of a depth (its sink/gap mapping applied)."""
    out = []
    for i in range(len(arrays["kv_len"])):
        s, g = int(arrays["sink_size"][i]), int(arrays["window_offset"][i])
        for j in range(int(arrays["kv_len"][i])):
            off = j if j < s else j - s + g
            out.append((int(arrays["page_indices"][arrays["page_indptr"][i] + off // page_size]),
                        off % page_size))
    return out


def both_pages(cfg, mb, rb, rng, num_pages, poison_except=None):
    """Identical random pages for both backends; with ``poison_except`` (a depth's arrays) every
    row that is not one of its keys is NaN, so a kernel that reads outside the keys fails."""
    host = [rand(rng, mb.page_shape(num_pages), cfg.dtype) for _ in range(cfg.num_layers)]
    if poison_except is not None:
        keep = np.zeros((num_pages, cfg.page_size), bool)
        for page, row in key_slots(poison_except, cfg.page_size):
            keep[page, row] = True
        for h in host:
            h.transpose(0, 3, 1, 2, 4)[~keep] = np.nan
    return [mb.from_numpy(h) for h in host], [rb.from_numpy(h) for h in host]


def make_depth(rng, cfg, num_pages, qlens, klens, sliding=False, tree=False, uncovered=0):
    """Host arrays of a DepthAux; every entry's pages drawn from one random page permutation."""
    ps = cfg.page_size
    perm = rng.permutation(num_pages)
    n = len(qlens)
    page_indptr, page_indices, sink, gap, last = [0], [], [], [], []
    tree_sizes, masks = [], []
    used = 0
    for i in range(n):
        L = int(klens[i])
        s = g = 0
        if sliding and L > 2 and rng.random() < 0.8:
            s = int(rng.integers(0, min(L, 6))) if i % 2 else 0     # no sinks: row 0 slid out
            g = s + int(rng.integers(0, 2 * ps + 3))
        span = g + L - s if (s or g) else L
        npg = -(-span // ps)
        page_indices += list(perm[used:used + npg])
        used += npg
        assert used <= num_pages
        page_indptr.append(len(page_indices))
        sink.append(s)
        gap.append(g)
        last.append((span - 1) % ps + 1 if span else 0)
        t = 0
        if tree and L > 0 and qlens[i] > 0 and rng.random() < 0.8:
            t = int(rng.integers(qlens[i], min(L, qlens[i] + 5) + 1)) if L >= qlens[i] else 0
        tree_sizes.append(t)
        if t:
            masks.append(random_tree(rng, t))
    qo = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    arrays = dict(qo_indptr=qo, page_indptr=np.asarray(page_indptr, np.int32),
                  page_indices=np.asarray(page_indices, np.int32),
                  last_page_len=np.asarray(last, np.int32), kv_len=np.asarray(klens, np.int32),
                  sink_size=np.asarray(sink, np.int32), window_offset=np.asarray(gap, np.int32),
                  k_rope_offset=rng.integers(0, 200, n).astype(np.int32))
    tree_arrays = None
    if tree and any(tree_sizes):
        tree_arrays = (np.concatenate([[0], np.cumsum(tree_sizes)]).astype(np.int32),
                       np.concatenate(masks).astype(np.int32))
    total = int(qo[-1]) + uncovered
    return arrays, tree_arrays, total


def to_depth(backend, arrays, tree_arrays, n, use_decode):
    dev = {k: backend.aux_to_device(v) for k, v in arrays.items()}
    tree = None
    if tree_arrays is not None:
        tree = TreeMask(backend.aux_to_device(tree_arrays[0]), backend.aux_to_device(tree_arrays[1]))
    return DepthAux(dev["qo_indptr"], dev["page_indptr"], dev["page_indices"], dev["last_page_len"],
                    dev["kv_len"], dev["sink_size"], dev["window_offset"], dev["k_rope_offset"],
                    n, use_decode, tree, int(max(arrays["kv_len"], default=0)))


# ------------------------------------------------------------------------------------- rope
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype):
    cfg, mb, rb = make(dtype, d=64)
    rng = np.random.default_rng(1)
    x = rand(rng, (37, 3, 64), dtype)
    pos = rng.integers(0, 5000, 37).astype(np.int32)
    spec = RopeSpec(theta=500000.0, scale=0.5)
    got = mb.rope(mb.from_numpy(x), mb.aux_to_device(pos), spec)
    assert mb.dtype_name(got) == dtype
    assert_close(got, rb.rope(rb.from_numpy(x), pos, spec), dtype, "rope")


# --------------------------------------------------------------------------------- append
@pytest.mark.parametrize("dtype,page_size,fused", list(itertools.product(DTYPES, [1, 16], [False, True])))
def test_append_kv(dtype, page_size, fused):
    cfg, mb, rb = make(dtype, page_size=page_size, pages=40)
    rng = np.random.default_rng(2)
    mp, rp = both_pages(cfg, mb, rb, rng, cfg.num_pages)
    T = 23
    slots = rng.choice(cfg.num_pages * page_size, T, replace=False).astype(np.int32)
    slots[[3, 11]] = -1                                   # slid-out tokens are skipped
    k, v = rand(rng, (T, 2, 16), dtype), rand(rng, (T, 2, 16), dtype)
    pos = rng.integers(0, 300, T).astype(np.int32)
    rope = ROPE if fused else None
    for layer in range(cfg.num_layers):
        obj = mp[layer]
        mb.append_kv(mp[layer], mb.from_numpy(k), mb.from_numpy(v), mb.aux_to_device(slots),
                     mb.aux_to_device(pos) if fused else None, rope)
        assert mp[layer] is obj                           # the core's list sees the write
        rb.append_kv(rp[layer], k, v, slots, pos if fused else None, rope)
    mb.synchronize()
    for layer in range(cfg.num_layers):
        assert_close(mp[layer], rp[layer], dtype, f"pages[{layer}]")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_append(dtype):
    cfg, mb, rb = make(dtype, group=4)
    rng = np.random.default_rng(3)
    mp, rp = both_pages(cfg, mb, rb, rng, cfg.num_pages)
    T = 9
    slots = rng.choice(cfg.num_pages * 16, T, replace=False).astype(np.int32)
    q, k, v = rand(rng, (T, 8, 16), dtype), rand(rng, (T, 2, 16), dtype), rand(rng, (T, 2, 16), dtype)
    pos = rng.integers(0, 300, T).astype(np.int32)
    qm, km = mb.rope_append(mp[0], mb.from_numpy(q), mb.from_numpy(k), mb.from_numpy(v),
                            mb.aux_to_device(slots), mb.aux_to_device(pos), ROPE)
    qr, kr = rb.rope_append(rp[0], q, k, v, slots, pos, ROPE)
    assert_close(qm, qr, dtype, "q_rot")
    assert_close(km, kr, dtype, "k_rot")
    assert_close(mp[0], rp[0], dtype, "pages")


# ------------------------------------------------------------------------------- attention
RAGGED = ["causal", "tree", "inline_rope"]


@pytest.mark.parametrize("dtype,group,mode", list(itertools.product(DTYPES, [1, 4], RAGGED)))
def test_ragged_attention(dtype, group, mode):
    cfg, mb, rb = make(dtype, group=group)
    rng = np.random.default_rng(4)
    lens = np.array([5, 0, 1, 17, 3, 40] if mode != "tree" else [5, 1, 12, 3], np.int64)
    qo = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    T = int(qo[-1])
    hq = cfg.num_qo_heads
    q, k, v = rand(rng, (T, hq, 16), dtype), rand(rng, (T, 2, 16), dtype), rand(rng, (T, 2, 16), dtype)
    tree_m = tree_r = None
    rope = pos = off = None
    if mode == "tree":
        indptr = qo.copy()
        mask = np.concatenate([random_tree(rng, int(n)) for n in lens]).astype(np.int32)
        tree_r = TreeMask(indptr, mask)
        tree_m = TreeMask(mb.aux_to_device(indptr), mb.aux_to_device(mask))
    if mode == "inline_rope":
        rope = ROPE
        pos = rng.integers(0, 500, T).astype(np.int32)
        off = rng.integers(0, 500, len(lens)).astype(np.int32)
    scale = 0.3
    om, lm = mb.ragged_attention(mb.from_numpy(q), mb.from_numpy(k), mb.from_numpy(v),
                                 mb.aux_to_device(qo), scale, num_seqs=len(lens),
                                 max_len=int(lens.max()), tree=tree_m, rope=rope,
                                 q_positions=None if pos is None else mb.aux_to_device(pos),
                                 k_rope_offset=None if off is None else mb.aux_to_device(off))
    orf, lr = rb.ragged_attention(q, k, v, qo, scale, num_seqs=len(lens), max_len=int(lens.max()),
                                  tree=tree_r, rope=rope, q_positions=pos, k_rope_offset=off)
    assert mb.dtype_name(om) == dtype and mb.dtype_name(lm) == "float32"
    assert_close(om, orf, dtype, "o")
    assert_close(lm, lr, dtype, "lse", lse=True)


PAGED = ["plain", "sliding", "tree", "inline_rope", "decode", "sliding_rope"]


@pytest.mark.parametrize("dtype,page_size,group,mode",
                         [(d, p, g, m) for d in DTYPES for p in (1, 16) for g in (1, 4) for m in PAGED
                          if d == "float32" or (p == 16 and g == 4) or m == "plain"])
def test_paged_attention(dtype, page_size, group, mode):
    cfg, mb, rb = make(dtype, page_size=page_size, group=group, pages=400 // page_size + 40)
    rng = np.random.default_rng(5)
    if mode == "decode":
        qlens = np.ones(7, np.int64)
        klens = np.array([1, 0, 37, 16, 5, 2, 30])
    else:
        qlens = np.array([3, 1, 0, 6, 2, 1, 4])
        klens = np.array([20, 0, 9, 33, 7, 1, 12])
    arrays, tree_arrays, T = make_depth(rng, cfg, cfg.num_pages, qlens, klens,
                                        sliding=mode.startswith("sliding"), tree=mode == "tree",
                                        uncovered=3)
    if mode == "tree":
        assert tree_arrays is not None
    mp, rp = both_pages(cfg, mb, rb, rng, cfg.num_pages, poison_except=arrays)
    q = rand(rng, (T, cfg.num_qo_heads, 16), dtype)
    rope = ROPE if mode in ("inline_rope", "sliding_rope") else None
    pos = rng.integers(0, 400, T).astype(np.int32)
    dm = to_depth(mb, arrays, tree_arrays, len(qlens), mode == "decode")
    tr = None if tree_arrays is None else TreeMask(*tree_arrays)
    dr = DepthAux(*[arrays[k] for k in ("qo_indptr", "page_indptr", "page_indices", "last_page_len",
                                        "kv_len", "sink_size", "window_offset", "k_rope_offset")],
                  len(qlens), mode == "decode", tr, int(klens.max()))
    om, lm = mb.paged_attention(mb.from_numpy(q), mp[1], dm, 0.25, rope=rope,
                                q_positions=mb.aux_to_device(pos))
    orf, lr = rb.paged_attention(q, rp[1], dr, 0.25, rope=rope, q_positions=pos)
    assert np.isneginf(kvcache.to_numpy(lm)[-3:]).all()      # rows covered by no entry
    assert_close(om, orf, dtype, "o")
    assert_close(lm, lr, dtype, "lse", lse=True)


def test_paged_attention_bucketing_and_tiling(monkeypatch):
    """Skewed entries (one long prefill, many decodes) split into buckets; tiny logits budget
    forces query tiling; results still match."""
    from kvcache_metal import ops
    monkeypatch.setattr(ops, "LOGITS_BUDGET", 512)
    cfg, mb, rb = make("float32", page_size=4, group=2, pages=200)
    rng = np.random.default_rng(6)
    qlens = np.array([60] + [1] * 9)
    klens = np.array([50] + list(rng.integers(1, 30, 9)))
    assert len(ops.buckets(qlens, klens)) > 1
    arrays, _, T = make_depth(rng, cfg, cfg.num_pages, qlens, klens)
    mp, rp = both_pages(cfg, mb, rb, rng, cfg.num_pages)
    q = rand(rng, (T, 4, 16), "float32")
    dm = to_depth(mb, arrays, None, len(qlens), False)
    dr = DepthAux(*[arrays[k] for k in ("qo_indptr", "page_indptr", "page_indices", "last_page_len",
                                        "kv_len", "sink_size", "window_offset", "k_rope_offset")],
                  len(qlens), False, None, int(klens.max()))
    om, lm = mb.paged_attention(mb.from_numpy(q), mp[0], dm, 0.25)
    orf, lr = rb.paged_attention(q, rp[0], dr, 0.25)
    assert_close(om, orf, "float32", "o")
    assert_close(lm, lr, "float32", "lse", lse=True)


@pytest.mark.parametrize("group", [1, 4])
def test_ragged_sdpa_path(group):
    """The fused-SDPA ragged path (default on Apple GPUs only) checked on MLX's CPU device."""
    cfg, mb, rb = make("float32", group=group)
    mb.use_fast_sdpa = True
    rng = np.random.default_rng(7)
    T = 29
    q, k, v = (rand(rng, (T, h, 16), "float32") for h in (cfg.num_qo_heads, 2, 2))
    qo = np.array([0, T], np.int32)
    om, lm = mb.ragged_attention(mb.from_numpy(q), mb.from_numpy(k), mb.from_numpy(v),
                                 mb.aux_to_device(qo), 0.2, num_seqs=1, max_len=T)
    assert mb.stats["sdpa_ragged"] == 1
    orf, lr = rb.ragged_attention(q, k, v, qo, 0.2, num_seqs=1, max_len=T)
    assert_close(om, orf, "float32", "o")
    assert_close(lm, lr, "float32", "lse", lse=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_attention(dtype):
    cfg, mb, rb = make(dtype, group=4)
    rng = np.random.default_rng(8)
    T = 11
    oa, ob = rand(rng, (T, 8, 16), dtype), rand(rng, (T, 8, 16), dtype)
    la, lb = (rng.standard_normal((T, 8)) * 3).astype(np.float32), rng.standard_normal((T, 8)).astype(np.float32)
    la[0], lb[1] = -np.inf, -np.inf
    la[2] = lb[2] = -np.inf
    oa[0], ob[1], oa[2], ob[2] = 0, 0, 0, 0
    om, lm = mb.merge_attention(mb.from_numpy(oa), mb.from_numpy(la, "float32"),
                                mb.from_numpy(ob), mb.from_numpy(lb, "float32"))
    orf, lr = rb.merge_attention(oa, la, ob, lb)
    assert_close(om, orf, dtype, "o")
    assert_close(lm, lr, dtype, "lse", lse=True)
    assert (kvcache.to_numpy(om)[2] == 0).all()


# ------------------------------------------------------------------------------ page copies
@pytest.mark.parametrize("dtype,page_size", list(itertools.product(DTYPES, [1, 16])))
def test_copy_compact_gather(dtype, page_size):
    cfg, mb, rb = make(dtype, page_size=page_size, pages=30)
    rng = np.random.default_rng(9)
    mp, rp = both_pages(cfg, mb, rb, rng, cfg.num_pages)
    length = max(1, page_size - 5)
    mb.copy_page_prefix(mp, 3, 7, length)
    rb.copy_page_prefix(rp, 3, 7, length)
    n_slots = cfg.num_pages * page_size
    # overlapping sources/destinations: every source must be read before any write
    src = rng.choice(n_slots, 12, replace=False).astype(np.int32)
    dst = np.concatenate([src[6:], rng.choice(np.setdiff1d(np.arange(n_slots), src), 6,
                                              replace=False)]).astype(np.int32)
    mb.compact_kv(mp, mb.aux_to_device(src), mb.aux_to_device(dst))
    rb.compact_kv(rp, src, dst)
    for layer in range(cfg.num_layers):
        assert_close(mp[layer], rp[layer], dtype, f"pages[{layer}]")
    slots = rng.permutation(n_slots)[:25].astype(np.int32)
    km, vm = mb.gather_kv(mp, mb.aux_to_device(slots))
    kr, vr = rb.gather_kv(rp, slots)
    assert km.shape == (cfg.num_layers, 25, 2, 16)
    assert_close(km, kr, dtype, "k")
    assert_close(vm, vr, dtype, "v")
    ke, _ = mb.gather_kv(mp, mb.aux_to_device(np.zeros(0, np.int32)))
    assert ke.shape == (cfg.num_layers, 0, 2, 16)


def test_arrays_roundtrip():
    cfg, mb, _ = make("bfloat16")
    import ml_dtypes
    x = np.arange(6, dtype=np.float32).reshape(2, 3) / 4
    a = mb.from_numpy(x.astype(ml_dtypes.bfloat16))
    assert mb.is_native(a) and mb.dtype_name(a) == "bfloat16"
    assert not mb.is_native(x)
    assert mb.to_numpy(a).dtype == np.float32 and np.array_equal(mb.to_numpy(a), x)
    assert mb.dtype_name(mb.from_numpy(np.arange(3))) == "int32"
    assert mb.dtype_name(mb.from_numpy(x, "float16")) == "float16"
