"""Every kernel of CudaBackend against ReferenceBackend on random inputs with real page tables.

Runs with whichever implementation(s) the mode selects (see conftest): torch on CPU in CI, Triton
through the interpreter, or both on a GPU."""

import dataclasses
import zlib

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.conformance import TOLERANCES, assert_close
from cuda_cases import Entry

GQA = [(2, 2), (8, 2), (6, 2)]          # group 1, 4 and a non-power-of-two group 3
# Grids per mode: the interpreter runs every program in numpy, and on a GPU every distinct
# constexpr combination is a Triton compile; both get a slimmer grid (float32 only in the
# interpreter; page size 16 and groups 4/3 in both), and test_attention_coverage_extras /
# test_head_dims cover the rest. CPU torch mode runs the full grid.
SLIM = cc.INTERPRET or cc.ON_GPU
ATTN_DTYPES = ["float32"] if cc.INTERPRET else cc.DTYPES
GQA_ATTN = [(8, 2), (6, 2)] if SLIM else GQA
PAGE_SIZES = [16] if SLIM else [1, 16]
HEAD_DIMS = [64, 80, 96, 128, 256]


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))  # stable across runs


# ---------------------------------------------------------------------- rope / append
@pytest.mark.parametrize("rope", [cc.ROPE, cc.ROPE_SCALED, cc.ROPE_FREQ, cc.ROPE_PARTIAL],
                         ids=["theta", "scaled", "inv_freq", "partial"])
def test_rope(impl, dtype, rope):
    cfg = cc.config(hq=6, hkv=2, d=64, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("rope", impl, dtype)
    x = cc.rand(mine, rng, (9, 6, 64))
    pos = rng.integers(0, 500, 9).astype(np.int32)
    got = mine.rope(x, cc.ints(mine, pos), rope)
    assert mine.dtype_name(got) == dtype
    cc.assert_close(mine, ref, got, ref.rope(cc.to_ref(ref, mine, x), pos, rope))


@pytest.mark.parametrize("ps", [1, 16])
@pytest.mark.parametrize("with_rope", [False, True, "inv_freq", "partial"])
def test_append_kv(impl, dtype, ps, with_rope):
    cfg = cc.config(hq=8, hkv=2, d=64, ps=ps, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("append", impl, dtype, ps, with_rope)
    pool = 40 // ps + 3
    pages = cc.rand(mine, rng, mine.page_shape(pool))
    t = 12
    slots = rng.permutation(pool * ps)[:t].astype(np.int32)
    slots[[2, 7]] = -1                                   # skipped tokens (slid out)
    k, v = cc.rand(mine, rng, (t, 2, 64)), cc.rand(mine, rng, (t, 2, 64))
    pos = rng.integers(0, 300, t).astype(np.int32)
    rope = {False: None, True: cc.ROPE, "inv_freq": cc.ROPE_FREQ,
            "partial": cc.ROPE_PARTIAL}[with_rope]
    ref_pages = cc.to_ref(ref, mine, pages)
    mine.append_kv(pages, k, v, cc.ints(mine, slots), cc.ints(mine, pos), rope)
    ref.append_kv(ref_pages, cc.to_ref(ref, mine, k), cc.to_ref(ref, mine, v), slots, pos, rope)
    cc.assert_close(mine, ref, pages, ref_pages, "pages")


@pytest.mark.parametrize("d", [64, 80, 96])      # 80 / 96: a RoPE half (40 / 48) padded to 64
def test_rope_append_fused(impl, dtype, d):
    cfg = cc.config(hq=8, hkv=2, d=d, ps=16, dtype=dtype, rope_mode="normal")
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("rope_append", impl, dtype)
    pages = cc.rand(mine, rng, mine.page_shape(6))
    t = 10
    slots = rng.permutation(96)[:t].astype(np.int32)
    slots[4] = -1
    q, k, v = (cc.rand(mine, rng, (t, h, d)) for h in (8, 2, 2))
    pos = rng.integers(0, 1000, t).astype(np.int32)
    ref_pages = cc.to_ref(ref, mine, pages)
    spec = cc.ROPE_FREQ if d == 64 else cc.ROPE      # 64: the model's own frequency table
    q_rot, k_rot = mine.rope_append(pages, q, k, v, cc.ints(mine, slots), cc.ints(mine, pos), spec)
    rq, rk = ref.rope_append(ref_pages, cc.to_ref(ref, mine, q), cc.to_ref(ref, mine, k),
                             cc.to_ref(ref, mine, v), slots, pos, spec)
    # a float32 angle pos * inv_freq is rounded to 2**-24 of itself (6e-5 rad at position 1000),
    # so float32 rotations differ from the float64 reference by up to ~|x| * pos * 2**-23
    tol = dataclasses.replace(TOLERANCES[dtype], atol=TOLERANCES[dtype].atol + 4 * 1000 * 2.0 ** -23)
    for what, got, want in (("q_rot", q_rot, rq), ("k_rot", k_rot, rk), ("pages", pages, ref_pages)):
        assert_close(what, ref.to_numpy(want), mine.to_numpy(got), tol)


def test_append_strided_views(impl):
    """q/k/v split from a fused qkv tensor are strided views; kernels must honour the strides."""
    cfg = cc.config(hq=4, hkv=2, d=64, ps=16, dtype="float32", rope_mode="normal")
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("strided", impl)
    qkv = cc.rand(mine, rng, (5, 8, 64))
    q, k, v = mine.split_qkv(qkv)
    assert not k.is_contiguous()
    pages = mine.allocate_pages(3)[0]
    ref_pages = ref.allocate_pages(3)[0]
    slots = np.array([0, 1, 17, 33, 2], np.int32)
    pos = np.arange(5, dtype=np.int32)
    mine.rope_append(pages, q, k, v, cc.ints(mine, slots), cc.ints(mine, pos), cc.ROPE)
    ref.rope_append(ref_pages, *(cc.to_ref(ref, mine, x) for x in (q, k, v)), slots, pos, cc.ROPE)
    cc.assert_close(mine, ref, pages, ref_pages, "pages")


# ---------------------------------------------------------------------- ragged
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("hq,hkv", GQA_ATTN)
@pytest.mark.parametrize("variant", ["causal", "tree", "rope"])
def test_ragged_attention(impl, dtype, hq, hkv, variant):
    d = 64
    cfg = cc.config(hq=hq, hkv=hkv, d=d, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("ragged", impl, dtype, hq, variant)
    lengths = [5, 1, 37, 0, 12] if variant != "tree" else [6, 1, 19]
    case = cc.ragged_case(rng, ref, mine, lengths, tree=variant == "tree")
    rope = cc.ROPE if variant == "rope" else None
    tree_m = tree_r = None
    if case["tree"] is not None:
        tree_m = cc.TreeMask(cc.ints(mine, case["tree"][0]), cc.ints(mine, case["tree"][1]))
        tree_r = cc.TreeMask(*case["tree"])
    kw = dict(num_seqs=len(lengths), max_len=max(lengths), rope=rope)
    o, lse = mine.ragged_attention(case["q"], case["k"], case["v"], cc.ints(mine, case["qo"]), 0.11,
                                   tree=tree_m, q_positions=cc.ints(mine, case["qpos"]),
                                   k_rope_offset=cc.ints(mine, case["krope"]), **kw)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"), case["qo"], 0.11,
                                  tree=tree_r, q_positions=case["qpos"], k_rope_offset=case["krope"],
                                  **kw)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)


# ---------------------------------------------------------------------- paged
PAGED = {
    "plain": [Entry(3, 40), Entry(0, 17), Entry(1, 0), Entry(7, 1), Entry(2, 100)],
    "sliding": [Entry(3, 40, sink=4, gap=21), Entry(2, 33, sink=0, gap=9), Entry(4, 5, sink=8, gap=8)],
    "tree": [Entry(2, 30, tree=5), Entry(1, 9, tree=9), Entry(3, 20)],
}


def _run_paged(impl, dtype, hq, hkv, d, ps, entries, *, use_decode, rope=False, seed=(),
               row_offset=1, tail_rows=2, tuning=None, window_left=-1, scale=0.13, softcap=0.0):
    cfg = cc.config(hq=hq, hkv=hkv, d=d, ps=ps, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    if tuning:
        mine.tuning = mine.tuning.with_(**tuning)
    rng = _rng("paged", impl, dtype, hq, d, ps, use_decode, rope, *seed)
    case = cc.paged_case(rng, ref, mine, entries, use_decode=use_decode, row_offset=row_offset,
                         tail_rows=tail_rows)
    spec = rope if isinstance(rope, cc.RopeSpec) else cc.ROPE_SCALED if rope else None
    win = {"window_left": window_left} if window_left >= 0 else {}
    if softcap:
        win["logit_softcap"] = softcap
    o, lse = mine.paged_attention(case.q, case.pages, case.depth, scale, rope=spec,
                                  q_positions=case.q_positions, **win)
    ro, rl = ref.paged_attention(case.ref_q, case.ref_pages, case.ref_depth, scale, rope=spec,
                                 q_positions=case.ref_q_positions, **win)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    return lse


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("hq,hkv", GQA_ATTN)
@pytest.mark.parametrize("kind", sorted(PAGED))
def test_paged_prefill(impl, dtype, ps, hq, hkv, kind):
    lse = _run_paged(impl, dtype, hq, hkv, 64, ps, PAGED[kind], use_decode=False, seed=(kind,))
    assert np.isneginf(lse[0].cpu().numpy()).all()          # row 0 belongs to no entry


@pytest.mark.parametrize("kind", sorted(PAGED))
def test_paged_prefill_covering_entries(impl, kind, monkeypatch):
    """Entries that cover every row (``DepthAux.covers_rows``, what the planner's depths
    declare): the launcher skips the o = 0 / lse = -inf fill, so the kernel must write every
    row itself, the rows of an entry without keys too. Fresh float tensors are NaN here: a row
    left unwritten fails."""
    import torch
    real = torch.empty

    def poisoned(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    lse = _run_paged(impl, ATTN_DTYPES[0], 8, 2, 64, 16, PAGED[kind], use_decode=False,
                     seed=("covering", kind), row_offset=0, tail_rows=0)
    if kind == "plain":             # Entry(0, 17) has no rows; Entry(1, 0) is row 3: no keys
        assert np.isneginf(lse[3].cpu().numpy()).all()


# a shared prefix's depth: many rows of one entry over long keys (300: splits of whole key
# tiles, the last one short), an entry without rows, one without keys, a tree entry
SHARED = [Entry(40, 300), Entry(0, 17), Entry(5, 0), Entry(3, 130, tree=6)]


@pytest.mark.parametrize("splits", cc.interpreter_sample([2, 3], keep=[3]))
@pytest.mark.parametrize("kind", ["shared", "sliding", "tree"])
def test_paged_prefill_key_splits(impl, dtype, kind, splits):
    """The paged prefill kernel with each entry's keys split over programs and merged by lse
    (``DepthAux.shared`` depths): the reference's results, rows of no entry o = 0 / lse = -inf."""
    entries = SHARED if kind == "shared" else PAGED[kind]
    lse = _run_paged(impl, dtype, 8, 2, 64, 16, entries, use_decode=False, seed=(kind, splits),
                     tuning={"force_prefill_splits": splits})
    assert np.isneginf(lse[0].cpu().numpy()).all()          # row 0 belongs to no entry


def test_prefill_splits_policy():
    from kvcache_cuda.tuning import CUDA_TUNING as t, prefill_splits
    assert prefill_splits(t, False, 1 << 20) == 1            # only shared depths split
    assert prefill_splits(t, True, 1 << 20) == t.shared_splits
    assert prefill_splits(t, True, 2 * t.split_min_keys) == 2   # each split keeps its keys
    assert prefill_splits(t, True, 10) == 1
    assert prefill_splits(t.with_(force_prefill_splits=3), False, 10) == 3


def test_paged_prefill_inline_rope(impl, dtype):
    _run_paged(impl, dtype, 8, 2, 64, 16, PAGED["sliding"], use_decode=False, rope=True)


DECODE = [Entry(1, 70), Entry(1, 0), Entry(1, 1), Entry(1, 129), Entry(1, 16)]


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("hq,hkv", GQA_ATTN)
@pytest.mark.parametrize("splits", [1, 3] if cc.INTERPRET else [1, 3, 0])   # 0: the heuristic
def test_paged_decode(impl, dtype, ps, hq, hkv, splits):
    _run_paged(impl, dtype, hq, hkv, 64, ps, DECODE, use_decode=True, seed=(splits,),
               tuning={"force_splits": splits, "split_min_keys": 16})


@pytest.mark.parametrize("splits,chunk", [(5, 0), (2, 0), (5, 2)])
def test_split_decode_merges_every_nonempty_split(impl, splits, chunk):
    # DECODE's entries leave most splits empty (a split is whole BLOCK_N tiles); here the
    # first entry fills all of them (5 x 256 keys > 1200 > 4 x 256), the second some, the
    # third one, so a merge that drops or misweighs any split's partial is off by a lot.
    # chunk 2: the merge loads splits 0-1, 2-3, then 4 with 5 masked (the default loads all)
    entries = [Entry(1, 1200), Entry(1, 700), Entry(1, 3)]
    _run_paged(impl, "float32", 8, 2, 64, 16, entries, use_decode=True,
               seed=("every", splits, chunk),
               tuning={"force_splits": splits, "split_min_keys": 16, "split_merge_chunk": chunk})


# under the Triton interpreter (7 s a group) CI runs group 3 only, `make test-all` group 4 too:
# the queueing and the merge counters do not depend on the group, and split-K decode at group 4
# is test_paged_decode[triton-3-8-2-16-float32] of the same run
@pytest.mark.parametrize("hq,hkv", [
    pytest.param(*g, marks=[pytest.mark.slow] if cc.INTERPRET and g == (8, 2) else [])
    for g in GQA_ATTN])
def test_split_decode_queued_and_counters_left_zero(impl, hq, hkv):
    """The fused split-K merge (the last split of a (row, KV head) merges, counted in a shared
    int32 buffer): five launches queued on one stream with different queries, read only at the
    end, each equal to the reference, and the counters all zero again (a counter left behind
    would make the next launch merge too early or never)."""
    cfg = cc.config(hq=hq, hkv=hkv, d=64, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    mine.tuning = mine.tuning.with_(force_splits=4, split_min_keys=16)
    rng = _rng("split-queued", impl, hq)
    case = cc.paged_case(rng, ref, mine, DECODE, use_decode=True, row_offset=1, tail_rows=2)
    qs = [cc.rand(mine, rng, tuple(case.q.shape)) for _ in range(5)]
    outs = [mine.paged_attention(q, case.pages, case.depth, 0.13) for q in qs]
    for q, (o, lse) in zip(qs, outs):
        ro, rl = ref.paged_attention(cc.to_ref(ref, mine, q), case.ref_pages, case.ref_depth, 0.13)
        cc.assert_close(mine, ref, o, ro)
        cc.assert_lse(mine, ref, lse, rl)
    counters = list(mine.launch_cache.counters.values())
    if impl == "triton":
        assert counters, "a split decode on Triton used no merge counters"
    for buf in counters:
        assert int((buf != 0).sum()) == 0


def test_compiled_handle_launch_passes_every_parameter_in_order(monkeypatch):
    """``_Kernel``: after the first launch (through ``JITFunction.run``) the compiled kernel's
    launcher gets the grid, the stream, the bound head and *every* parameter of the kernel in
    signature order, constexprs included; a different ``spec`` goes through ``JITFunction.run``
    again. Checked against the kernel's own signature, for each launcher that uses it."""
    import inspect
    tk = pytest.importorskip("kvcache_cuda.triton_kernels")
    monkeypatch.setattr(tk, "_raw_stream", lambda: "STREAM")
    for jit in (tk._paged_decode_kernel, tk._paged_prefill_kernel, tk._rope_append_kernel,
                tk._ragged_kernel, tk._finite_v_kernel, tk._ragged_nonfinite_kernel,
                tk._merge2_kernel):
        sig = inspect.signature(getattr(jit, "fn", jit))
        names = list(sig.parameters)
        consts = tk.constexpr_names(jit)
        assert consts and consts == names[len(names) - len(consts):]    # constexprs come last
        kw = {n: f"const:{n}" for n in consts}
        kw["num_warps"] = 4
        runtime = [f"arg:{n}" for n in names[:len(names) - len(consts)]]
        calls, launched = [], []

        class Compiled:                     # what JITFunction.run returns after a launch
            function, packed_metadata = "FUNC", "META"

            class run:
                global_scratch_size = profile_scratch_size = 0
                launch_cooperative_grid, launch_pdl = False, False

                @staticmethod
                def launch(*a):
                    launched.append(a)

        class Jit:
            def __getitem__(self, grid):
                def go(*a, **k):
                    calls.append((grid, a, k))
                    return Compiled
                return go

        kern = tk._Kernel(jit, kw)
        kern.jit = Jit()
        kern((2, 3, 4), "spec-a", *runtime)
        assert len(calls) == 1 and calls[0][1] == tuple(runtime) and calls[0][2] == kw
        kern((5, 6, 7), "spec-a", *runtime)
        assert len(calls) == 1 and len(launched) == 1
        a = launched[0]
        assert a[:4] == (5, 6, 7, "STREAM")
        assert a[4:13] == ("FUNC", False, False, None, None, "META", None, None, None)
        bound = sig.bind(*a[13:])
        for n in names:
            want = kw[n] if n in consts else f"arg:{n}"
            assert bound.arguments[n] == want, n
        kern((5, 6, 7), "spec-b", *runtime)                 # new specialisation: the slow path
        assert len(calls) == 2 and len(launched) == 1
        kern((5, 6, 7), "spec-b", *runtime)
        assert len(calls) == 2 and len(launched) == 2
        monkeypatch.setattr(tk, "_no_launch_hooks", lambda: False)   # a profiler's hook
        kern((5, 6, 7), "spec-b", *runtime)
        assert len(calls) == 3 and len(launched) == 2
        monkeypatch.undo()
        monkeypatch.setattr(tk, "_raw_stream", lambda: "STREAM")


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("variant", ["sliding", "tree", "rope"])
def test_paged_decode_variants(impl, dtype, variant):
    entries = {
        "sliding": [Entry(1, 40, sink=4, gap=21), Entry(1, 33, gap=9), Entry(1, 5, sink=8, gap=8)],
        "tree": [Entry(1, 30, tree=5), Entry(1, 9, tree=9), Entry(1, 20)],
        "rope": [Entry(1, 40, sink=3, gap=10), Entry(1, 60)],
    }[variant]
    for splits in (1, 4):
        _run_paged(impl, dtype, 8, 2, 64, 16, entries, use_decode=True, rope=variant == "rope",
                   seed=(variant, splits), tuning={"force_splits": splits}, row_offset=0,
                   tail_rows=0)


@pytest.mark.parametrize("window_left", [0, 5, 30])
def test_ragged_window_left(impl, window_left):
    """Per-query window among new tokens (with a masked NaN/inf V that must stay masked)."""
    from kvcache_cuda.tuning import AttnTiles
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    if impl == "triton":      # small key tiles: the window skips whole tiles
        small = AttnTiles(block_rows=16, block_n=16, num_warps=4, num_stages=1)
        mine.tuning = mine.tuning.with_(prefill=small, by_head_dim={}, float32_by_head_dim={})
    rng = _rng("ragged_window", impl, window_left)
    lengths = [40, 1, 9]
    case = cc.ragged_case(rng, ref, mine, lengths)
    v_host = cc.to_ref(ref, mine, case["v"]).copy()
    v_host[0, 0, 3], v_host[41, 1, 0] = np.nan, np.inf     # row 0 / row 41 (seq 2's first key)
    v = mine.from_numpy(v_host)
    kw = dict(num_seqs=len(lengths), max_len=max(lengths), window_left=window_left)
    o, lse = mine.ragged_attention(case["q"], case["k"], v, cc.ints(mine, case["qo"]), 0.11, **kw)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qk"), v_host,
                                  case["qo"], 0.11, **kw)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    nan_rows = np.flatnonzero(np.isnan(mine.to_numpy(o)[:40]).any(axis=(1, 2)))
    assert nan_rows.tolist() == list(range(window_left + 1))    # key 0's NaN V: its window only
    plain = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qk"), v_host,
                                 case["qo"], 0.11, num_seqs=3, max_len=40)[1]
    assert not np.allclose(plain[:40], rl[:40])          # the window changed something


@pytest.mark.parametrize("window_left", [3, 30])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_paged_window_left(impl, kind, window_left):
    """Per-query window over paged keys: prefill, and decode with and without split-K."""
    if kind == "prefill":
        _run_paged(impl, "float32", 8, 2, 64, 16, PAGED["plain"] + PAGED["sliding"],
                   use_decode=False, seed=("win", window_left), window_left=window_left)
    else:
        for splits in (1, 3):
            _run_paged(impl, "float32", 8, 2, 64, 16, DECODE, use_decode=True,
                       seed=("win", window_left, splits), tuning={"force_splits": splits},
                       window_left=window_left)


# (window_left, scale, softcap, dtype). A large negative scale: the unmasked tiles' row
# maximum taken on qk (right for a positive scale) would be each row's smallest score there,
# and exp2 overflow; with a cap of 50 too (float16: on a GPU the hardware-tanh cap, which takes
# the row maximum through the cap once per row for a positive scale)
# under the interpreter CI keeps a window and the negative scale with the cap (15-25 s each
# there, the ragged ones)
UNMASKED_CASES = cc.interpreter_sample(
    [(-1, 0.11, 0.0, "float32"), (30, 0.11, 0.0, "float32"), (100, 0.11, 0.0, "float32"),
     (-1, -8.0, 0.0, "float32"), (-1, 0.11, 50.0, "float16"), (-1, -8.0, 50.0, "float16")],
    keep=[(30, 0.11, 0.0, "float32"), (-1, -8.0, 50.0, "float16")])


@pytest.mark.parametrize("window_left,scale,softcap,dtype", UNMASKED_CASES)
def test_ragged_unmasked_tiles(impl, window_left, scale, softcap, dtype):
    """The ragged kernel runs the key tiles every row of a query tile sees (before its first
    row, after its last row's window floor) with no mask, the rest masked: 16-key tiles over
    sequences of 150 / 97 / 64 / 1 / 17 tokens (80 / 50 / 32 / 1 / 17 under the interpreter,
    a quarter of the tiles: still whole tiles on both sides of each window), with and without
    a window, a negative scale, a logit cap: the reference's results."""
    from kvcache_cuda.tuning import AttnTiles
    cfg = cc.config(hq=8, hkv=2, d=64, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    if impl == "triton":
        small = AttnTiles(block_rows=16, block_n=16, num_warps=4, num_stages=1)
        mine.tuning = mine.tuning.with_(prefill=small, by_head_dim={}, float32_by_head_dim={})
    rng = _rng("ragged_unmasked", impl, window_left, scale, softcap, dtype)
    lengths = [80, 50, 32, 1, 17] if cc.INTERPRET else [150, 97, 64, 1, 17]
    case = cc.ragged_case(rng, ref, mine, lengths)
    kw = dict(num_seqs=len(lengths), max_len=max(lengths), window_left=window_left,
              **({"logit_softcap": softcap} if softcap else {}))
    o, lse = mine.ragged_attention(case["q"], case["k"], case["v"], cc.ints(mine, case["qo"]),
                                   scale, **kw)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"), case["qo"],
                                  scale, **kw)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)


@pytest.mark.parametrize("window_left,scale,softcap,dtype", UNMASKED_CASES)
def test_paged_prefill_unmasked_tiles(impl, window_left, scale, softcap, dtype):
    """The paged prefill kernel runs the key tiles every row of a query tile sees in full with
    no mask (EDGE False), the rest masked: with 16-key tiles over entries of 150 / 97 / 64 /
    40 keys and random per-query windows, a tile's keys split into masked tiles under some
    row's window floor, unmasked ones, and a partial last one (none at 64); plain and
    sliding-window (sink + gap) entries, with and without key splits, a negative scale, a
    logit cap: the reference's results."""
    from kvcache_cuda.tuning import AttnTiles
    small = {"prefill": AttnTiles(block_rows=16, block_n=16, num_warps=4, num_stages=1),
             "by_head_dim": {}, "float32_by_head_dim": {}}
    entries = [Entry(8, 150), Entry(5, 97), Entry(3, 64), Entry(4, 40, sink=4, gap=21)]
    for splits in (1, 3):
        _run_paged(impl, dtype, 8, 2, 64, 16, entries, use_decode=False,
                   seed=("unmasked", window_left, splits, scale, softcap), window_left=window_left,
                   scale=scale, softcap=softcap,
                   tuning=dict(small, force_prefill_splits=splits) if impl == "triton" else None)


@pytest.mark.skipif(not cc.ON_GPU, reason="inline PTX (shfl.sync) runs on an NVIDIA GPU only; CI "
                    "compiles it (test_the_warp_uniform_prefill_kernel_compiles_for_sm90)")
@pytest.mark.parametrize("kind", sorted(PAGED))
def test_paged_prefill_warp_uniform_scalars(dtype, kind):
    """The paged prefill kernel with its per-entry scalars broadcast from lane 0
    (``warp_uniform_scalars``): the reference's results for every entry kind, and with windows,
    sinks, key splits, a logit cap and a partial last tile (the unmasked-tiles case)."""
    _run_paged("triton", dtype, 8, 2, 64, 16, PAGED[kind], use_decode=False,
               seed=("uniform", kind), tuning={"warp_uniform_scalars": True})
    from kvcache_cuda.tuning import AttnTiles
    small = {"prefill": AttnTiles(block_rows=16, block_n=16, num_warps=4, num_stages=1),
             "by_head_dim": {}, "float32_by_head_dim": {}, "warp_uniform_scalars": True}
    entries = [Entry(8, 150), Entry(5, 97), Entry(3, 64), Entry(4, 40, sink=4, gap=21)]
    for splits, window_left, softcap in ((1, 37, 0.0), (3, -1, 30.0)):
        _run_paged("triton", dtype, 8, 2, 64, 16, entries, use_decode=False,
                   seed=("uniform-unmasked", splits), window_left=window_left, softcap=softcap,
                   tuning=dict(small, force_prefill_splits=splits))


@pytest.mark.parametrize("spec", ["inv_freq", "partial"])
def test_inline_rope_model_frequencies(impl, spec):
    """Inline RoPE with the model's own frequencies / partial rotary: ragged, prefill, decode."""
    rope = {"inv_freq": cc.ROPE_FREQ, "partial": cc.ROPE_PARTIAL}[spec]
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    c = cc.ragged_case(_rng("rope-model", impl, spec), ref, mine, [9, 4])
    args = dict(num_seqs=2, max_len=9, rope=rope)
    o, lse = mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.2,
                                   q_positions=cc.ints(mine, c["qpos"]),
                                   k_rope_offset=cc.ints(mine, c["krope"]), **args)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, c[x]) for x in "qkv"), c["qo"], 0.2,
                                  q_positions=c["qpos"], k_rope_offset=c["krope"], **args)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    _run_paged(impl, "float32", 8, 2, 64, 16, PAGED["plain"], use_decode=False, rope=rope,
               seed=("rope-model", spec))
    _run_paged(impl, "float32", 8, 2, 64, 16, DECODE, use_decode=True, rope=rope,
               seed=("rope-model-dec", spec), tuning={"force_splits": 2})


@pytest.mark.parametrize("case", ["ragged", "prefill", "decode"])
def test_attention_coverage_extras(impl, case):
    """What the slim interpreter grid leaves out, one case each: float16, page size 1, group 1."""
    if case == "ragged":
        cfg = cc.config(hq=2, hkv=2, d=64, ps=1, dtype="float16")
        ref, mine = cc.pair(cfg, impl)
        c = cc.ragged_case(_rng("extra", impl), ref, mine, [9, 4])
        args = dict(num_seqs=2, max_len=9)
        o, lse = mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.2, **args)
        ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, c[x]) for x in "qkv"), c["qo"], 0.2, **args)
        cc.assert_close(mine, ref, o, ro)
        cc.assert_lse(mine, ref, lse, rl)
    elif case == "prefill":
        _run_paged(impl, "float16", 2, 2, 64, 1, PAGED["tree"] + PAGED["sliding"], use_decode=False)
    else:
        _run_paged(impl, "float16", 2, 2, 64, 1, DECODE, use_decode=True,
                   tuning={"force_splits": 2})


@pytest.mark.parametrize("d", cc.interpreter_sample(HEAD_DIMS, keep=[64, 96, 256]))
def test_head_dims(impl, dtype, d):
    """Head dims (powers of two, and 80 / 96 padded to 128 inside the kernels) through ragged, paged prefill and split-K decode (group 4)."""
    if cc.INTERPRET and d == 256:
        pytest.skip("d=256 tiles are slow in the interpreter; covered on CPU torch and GPU")
    cfg = cc.config(hq=8, hkv=2, d=d, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    c = cc.ragged_case(_rng("hd", impl, dtype, d), ref, mine, [7, 20])
    args = dict(num_seqs=2, max_len=20)
    o, lse = mine.ragged_attention(c["q"], c["k"], c["v"], cc.ints(mine, c["qo"]), 0.09, **args)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, c[x]) for x in "qkv"), c["qo"], 0.09, **args)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    _run_paged(impl, dtype, 8, 2, d, 16, PAGED["sliding"], use_decode=False, seed=("hd",))
    _run_paged(impl, dtype, 8, 2, d, 16, DECODE, use_decode=True, seed=("hd",),
               tuning={"force_splits": 2})
    if d in (80, 96):      # inline RoPE rotates the padded halves inside attention
        _run_paged(impl, dtype, 8, 2, d, 16, PAGED["plain"], use_decode=False, rope=True,
                   seed=("hd-rope",))


def test_split_heuristic():
    from kvcache_cuda.tuning import CUDA_TUNING, num_splits
    t = CUDA_TUNING
    assert num_splits(t, 8, 4096, 132) == 16        # B=1, 8 KV heads: split to fill 132 SMs
    assert num_splits(t, 8, 32768, 132) == 33
    assert num_splits(t, 64 * 8, 4096, 132) == 1    # enough programs already
    assert num_splits(t, 8, 300, 132) == 1          # too few keys to be worth a merge pass
    assert num_splits(t.with_(force_splits=5), 512, 10, 132) == 5
    # fp8 pages: at least fp8_min_splits where the keys allow, the heuristic's count above it
    assert num_splits(t, 64 * 8, 4096, 132, fp8=True) == 2
    assert num_splits(t, 8, 4096, 132, fp8=True) == 16
    assert num_splits(t, 64 * 8, 300, 132, fp8=True) == 1
    assert t.tiles("decode", 128, fp8=True) == t.fp8_by_head_dim[128]["decode"] != t.tiles("decode", 128)
    assert t.tiles("decode", 64, fp8=True) == t.tiles("decode", 64)     # no fp8 entry: 16-bit


# ---------------------------------------------------------------------- merge / copies
def test_merge_attention(impl, dtype):
    cfg = cc.config(hq=4, hkv=2, d=64, dtype=dtype)
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("merge", impl, dtype)
    oa, ob = cc.rand(mine, rng, (7, 4, 64)), cc.rand(mine, rng, (7, 4, 64))
    la = rng.standard_normal((7, 4)).astype(np.float32) * 3
    lb = rng.standard_normal((7, 4)).astype(np.float32) * 3
    la[0, :], lb[1, :] = -np.inf, -np.inf            # one side empty
    la[2, 1] = lb[2, 1] = -np.inf                    # both empty: o = 0, lse = -inf
    ra, rb = cc.to_ref(ref, mine, oa), cc.to_ref(ref, mine, ob)
    o, lse = mine.merge_attention(oa, mine.from_numpy(la, "float32"), ob, mine.from_numpy(lb, "float32"))
    ro, rl = ref.merge_attention(ra, la, rb, lb)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    assert not mine.to_numpy(o)[2, 1].any()


def _layers(mine, ref, rng, layers, pool):
    mp = [cc.rand(mine, rng, mine.page_shape(pool)) for _ in range(layers)]
    return mp, [cc.to_ref(ref, mine, p) for p in mp]


@pytest.mark.parametrize("ps", [1, 16])
def test_copy_page_prefix(impl, dtype, ps):
    cfg = cc.config(hq=4, hkv=2, d=64, ps=ps, dtype=dtype, layers=3)
    ref, mine = cc.pair(cfg, impl)
    mp, rp = _layers(mine, ref, _rng("fork", impl, dtype, ps), 3, 6)
    length = max(ps - 3, 1)
    mine.copy_page_prefix(mp, 4, 1, length)
    ref.copy_page_prefix(rp, 4, 1, length)
    for a, b in zip(mp, rp):
        cc.assert_close(mine, ref, a, b, "pages")


@pytest.mark.parametrize("ps", [1, 16])
def test_compact_kv_overlapping(impl, dtype, ps):
    """Destinations that are also sources: every source must be read before any write."""
    cfg = cc.config(hq=4, hkv=2, d=64, ps=ps, dtype=dtype, layers=2)
    ref, mine = cc.pair(cfg, impl)
    mp, rp = _layers(mine, ref, _rng("compact", impl, dtype, ps), 2, 48 // ps + 1)
    src = np.array([3, 5, 9, 10, 20], np.int32)
    dst = np.array([2, 3, 4, 5, 6], np.int32)          # 3 and 5 are read and written
    mine.compact_kv(mp, cc.ints(mine, src), cc.ints(mine, dst))
    ref.compact_kv(rp, src, dst)
    for a, b in zip(mp, rp):
        cc.assert_close(mine, ref, a, b, "pages")


def test_gather_kv(impl, dtype):
    cfg = cc.config(hq=4, hkv=2, d=64, ps=16, dtype=dtype, layers=3)
    ref, mine = cc.pair(cfg, impl)
    mp, rp = _layers(mine, ref, _rng("gather", impl, dtype), 3, 4)
    slots = np.array([17, 0, 63, 5, 40], np.int32)
    k, v = mine.gather_kv(mp, cc.ints(mine, slots))
    rk, rv = ref.gather_kv(rp, slots)
    assert tuple(k.shape) == (3, 5, 2, 64)
    cc.assert_close(mine, ref, k, rk, "k")
    cc.assert_close(mine, ref, v, rv, "v")


def test_tuning_is_data():
    from kvcache_cuda.backend import CudaBackend
    from kvcache_cuda.tuning import AttnTiles, Tuning
    t = CudaBackend.TUNING
    assert isinstance(t, Tuning)
    assert isinstance(t.tiles("decode", 128), AttnTiles)
    assert t.tiles("prefill", 256) != t.tiles("prefill", 128)     # per-head-dim override
    assert dataclasses.is_dataclass(t)


# ---------------------------------------------------------------------- non-finite K / V
def _strict(ref, got, want, blind, clean, what, lse=False):
    """got vs want with NaN / inf at the same places (the conformance comparison); the rows in
    ``blind`` (they see no bad key) also finite and equal to the clean reference ``clean``."""
    from kvcache.conformance import assert_close
    tol = ref.config.dtype
    got, want, clean = (np.asarray(x, np.float64) for x in (got, want, clean))
    assert_close(what, want, got, tol, lse=lse)
    assert np.isfinite(got[blind]).all(), f"{what}: a row that sees no bad key is not finite"
    assert_close(f"{what} (rows that see no bad key) vs the clean reference", clean[blind],
                 got[blind], tol, lse=lse)


# NaN / inf in keys that earlier tokens (causal) or other branches (tree) must not see, inside
# the ragged kernels' query tiles; {token: (k or v, value)} over sequences of 37 and 12 tokens.
# Causal: rows 20-24 see +inf V (o = +inf), rows 25.. also -inf (NaN), 40.. NaN V, 44.. inf K
RAGGED_BAD = {20: ("v", np.inf), 25: ("v", -np.inf), 33: ("k", np.nan), 40: ("v", np.nan),
              44: ("k", np.inf)}


@pytest.mark.parametrize("variant", ["causal", "tree", "causal-small-tiles"])
def test_ragged_masked_nonfinite_keys(impl, variant):
    """A NaN / inf in the K or V of a token reaches only the rows that see it. Small tiles spread
    the bad keys over several query and key tiles of the Triton kernels' put-back pass."""
    from kvcache.reference import tree_visible
    from kvcache_cuda.tuning import AttnTiles
    cfg = cc.config(hq=8, hkv=2, d=64, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    if variant == "causal-small-tiles":
        small = AttnTiles(block_rows=16, block_n=16, num_warps=4, num_stages=1)
        mine.tuning = mine.tuning.with_(prefill=small, by_head_dim={}, float32_by_head_dim={})
    lengths, bad = [37, 12], RAGGED_BAD
    c = cc.ragged_case(_rng("ragged-nonfinite", impl, variant), ref, mine, lengths,
                       tree=variant == "tree")
    tree_r = cc.TreeMask(*c["tree"]) if c["tree"] is not None else None
    tree_m = cc.TreeMask(*(cc.ints(mine, a) for a in c["tree"])) if tree_r else None
    k, v = mine.to_numpy(c["k"]), mine.to_numpy(c["v"])
    kb, vb = k.copy(), v.copy()
    sees = np.zeros(c["total"], bool)
    for tok, (which, value) in bad.items():
        (kb if which == "k" else vb)[tok] = value
        i = int(np.searchsorted(c["qo"], tok, side="right")) - 1
        lo, n = int(c["qo"][i]), lengths[i]
        vis = tree_visible(tree_r, i, n) if tree_r else np.tri(n, dtype=bool)
        sees[lo:lo + n] |= vis[:, tok - lo]
    assert sees.any() and not sees.all()
    args = dict(num_seqs=len(lengths), max_len=max(lengths))
    o, lse = mine.ragged_attention(c["q"], mine.from_numpy(kb), mine.from_numpy(vb),
                                   cc.ints(mine, c["qo"]), 0.11, tree=tree_m, **args)
    q_r = cc.to_ref(ref, mine, c["q"])
    ro, rl = ref.ragged_attention(q_r, ref.from_numpy(kb), ref.from_numpy(vb), c["qo"], 0.11,
                                  tree=tree_r, **args)
    co, cl = ref.ragged_attention(q_r, ref.from_numpy(k), ref.from_numpy(v), c["qo"], 0.11,
                                  tree=tree_r, **args)
    blind = ~sees
    _strict(ref, mine.to_numpy(o), ref.to_numpy(ro), blind, ref.to_numpy(co), "o")
    _strict(ref, mine.to_numpy(lse), rl, blind, cl, "lse", lse=True)
    assert not np.isfinite(mine.to_numpy(o)[sees]).any()
    if variant != "tree":
        assert np.isposinf(mine.to_numpy(o)[20:25]).all()


@pytest.mark.parametrize("kind,splits", [("prefill", 1), ("decode", 1), ("decode", 4)])
def test_paged_masked_nonfinite_tree_keys(impl, kind, splits):
    """NaN / inf in tree keys (read through the page table): only the query nodes that descend
    from them see them, in paged prefill and in split-K decode (where a split may hold nothing
    but masked keys)."""
    from kvcache.reference import tree_visible
    cfg = cc.config(hq=8, hkv=2, d=64, ps=16, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    mine.tuning = mine.tuning.with_(force_splits=splits)
    decode = kind == "decode"
    nq = 1 if decode else 3
    # decode: 260 keys over 4 splits of 128 (the tile) -> the tree (keys 251..259) straddles the
    # last split boundary
    entries = [Entry(nq, 260 if decode else 30, tree=9), Entry(nq, 9, tree=9), Entry(nq, 20)]
    rng = _rng("paged-nonfinite", impl, kind, splits)
    case = cc.paged_case(rng, ref, mine, entries, use_decode=decode, row_offset=0, tail_rows=0)
    d = case.ref_depth
    pool = mine.to_numpy(case.pages)
    clean = case.ref_pages
    sees = np.zeros(case.ref_q.shape[0], bool)
    values = [("v", np.nan), ("k", np.nan), ("v", np.inf)]
    for i, e in enumerate(entries):
        if not e.tree:
            continue
        vis = tree_visible(d.tree, i, e.nq)                     # (nq, tree size)
        for node in range(e.tree - (i == 0)):                   # entry 1: its last query's too
            which, value = values[node % 3]
            key = e.kv_len - e.tree + node
            page = d.page_indices[d.page_indptr[i] + key // 16]
            pool[page, 0 if which == "k" else 1, :, key % 16, :] = value
            sees[d.qo_indptr[i]:d.qo_indptr[i + 1]] |= vis[:, node]
    assert sees.any() and not sees.all()
    pages = mine.from_numpy(pool)
    o, lse = mine.paged_attention(case.q, pages, case.depth, 0.13)
    ro, rl = ref.paged_attention(case.ref_q, cc.to_ref(ref, mine, pages), d, 0.13)
    co, cl = ref.paged_attention(case.ref_q, clean, d, 0.13)
    _strict(ref, mine.to_numpy(o), ref.to_numpy(ro), ~sees, ref.to_numpy(co), "o")
    _strict(ref, mine.to_numpy(lse), rl, ~sees, cl, "lse", lse=True)
    assert not np.isfinite(mine.to_numpy(o)[sees]).any()


def test_merge_attention_nan_lse(impl):
    """A NaN lse (a part saw a NaN K) gives NaN o and lse; -inf parts still add nothing."""
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float32")
    ref, mine = cc.pair(cfg, impl)
    rng = _rng("merge-nan", impl)
    oa, ob = rng.standard_normal((2, 3, 4, 64)).astype(np.float32)
    la, lb = rng.standard_normal((2, 3, 4)).astype(np.float32)
    la[0, 0], lb[0, 0] = np.nan, 0.5                 # NaN with finite
    la[1, 1], lb[1, 1] = np.nan, -np.inf             # NaN with empty
    oa[0, 0] = np.nan
    oa[1, 1] = np.nan
    la[2, 2], lb[2, 2] = -np.inf, 0.25               # empty with finite: finite
    f = lambda x: mine.from_numpy(x, "float32")      # noqa: E731
    o, lse = mine.merge_attention(f(oa), f(la), f(ob), f(lb))
    ro, rl = ref.merge_attention(oa, la, ob, lb)
    nan_rows = np.zeros((3, 4), bool)
    nan_rows[0, 0] = nan_rows[1, 1] = True
    _strict(ref, mine.to_numpy(o), ro, ~nan_rows, ro, "o")
    _strict(ref, mine.to_numpy(lse), rl, ~nan_rows, rl, "lse", lse=True)
    assert np.isnan(mine.to_numpy(lse)[nan_rows]).all()


def test_decode_steady_state_allocates_no_scratch():
    """The Triton launchers build a launch record (grid, split factor, split-K scratch views) on
    the first layer of a forward and reuse it on every later layer; scratch comes from a
    grow-only arena: after a warm-up step, decode steps allocate no scratch at all, and results
    stay right."""
    if "triton" not in cc.IMPLS:
        pytest.skip("Triton launchers run under TRITON_INTERPRET=1 or on a GPU "
                    "(test_cuda_triton_interpreter.py spawns this test in CPU mode)")
    layers = 3
    cfg = cc.config(layers=layers, rope_mode="normal")
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
    b = cache.backend
    b.impl = "triton"
    b.tuning = b.tuning.with_(force_splits=2)        # split-K on, so there is scratch to reuse
    ref = kvcache.PagedKVCache(cfg, backend="reference")
    rng = np.random.default_rng(7)
    ids, lens = [0, 1], [21, 9]
    for c in (cache, ref):
        for i in ids:
            c.add_sequence(i)

    def step(append):
        t = sum(append)
        outs = []
        for c in (cache, ref):
            c.begin_forward(ids, append)
        for layer in range(layers):
            q = rng.standard_normal((t, cfg.num_qo_heads, cfg.head_dim)).astype(np.float32)
            k = rng.standard_normal((t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
            v = rng.standard_normal((t, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32)
            got = cache.attention(layer, *(b.from_numpy(x) for x in (q, k, v)))
            want = ref.attention(layer, *(ref.backend.from_numpy(x) for x in (q, k, v)))
            outs.append((b.to_numpy(got), ref.backend.to_numpy(want)))
        for c in (cache, ref):
            c.end_forward()
        for got, want in outs:
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)

    step(lens)                                       # prefill: ragged record (finite-V scratch)
    after_prefill = b.scratch_allocations
    assert after_prefill > 0
    builds = b.launch_cache.builds
    step([1, 1])                                     # warm-up decode: one record per depth
    assert b.launch_cache.builds - builds <= 2       # per forward, not per layer
    warm = b.scratch_allocations
    for _ in range(3):
        builds = b.launch_cache.builds
        step([1, 1])
        assert b.launch_cache.builds - builds <= 2
    assert b.scratch_allocations == warm             # the arena held; nothing allocated
    assert len(b.launch_cache) <= b.launch_cache.MAX_RECORDS


@pytest.mark.skipif(not cc.INTERPRET, reason="the interpreter's limit (CPU test mode only)")
def test_bfloat16_refused_under_the_interpreter():
    """Triton's interpreter computes in numpy, which has no bfloat16: a bfloat16 cache gave
    attention outputs of 1e8 where the reference gave 0.4, without an error. Now refused."""
    cfg = cc.config(hq=4, hkv=2, d=16, dtype="bfloat16")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="TRITON_INTERPRET.*bfloat16"):
        kvcache.PagedKVCache(cfg, backend="cuda", device="cpu")
