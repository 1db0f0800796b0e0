"""The cuda backend's prefill dispatch to torch's FlashAttention (``kvcache_cuda.flash``).

* the rule: which calls go to the library (plain 16-bit ones above the tuning table's
  thresholds) and which stay on Triton (softcap, sinks, trees, inline RoPE, fp8, the
  batch-invariant mode, a paged window, rows no entry covers, small calls), and the table's
  thresholds read per architecture;
* the plumbing, through a stand-in with the library's conventions (lse (Hq, T), +inf for a row
  with no key, causal aligned to the last key, masked keys' zero weights times V): ragged and
  paged calls give the reference's results, a NaN / inf in a V no row sees stays out, sliding
  entries' sinks and gaps are gathered in order. Under the interpreter (CI) the page gather is
  the real Triton kernel; on a GPU (``KVCACHE_CUDA_TEST_DEVICE=cuda``) the same cases also run
  the real library (float16 / bfloat16);
* the library made unavailable (``KVCACHE_CUDA_FLASH=off``, or its probe failing: ROCm, an old
  GPU or torch): the backend runs the Triton kernels, with the same results.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import cuda_cases as cc
from cuda_cases import Entry

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if cc.INTERPRET:
    import kvcache_cuda.triton_kernels  # noqa: F401  (mends the interpreter under numpy 2.4)
from kvcache_cuda import flash  # noqa: E402
from kvcache_cuda.tuning import Tuning, for_arch  # noqa: E402

TRITON = cc.INTERPRET or cc.ON_GPU
needs_triton = pytest.mark.skipif(not TRITON, reason="the Triton kernels run under the "
                                  "interpreter or on a GPU only")
# the stand-in computes in float32; float16 where the interpreter runs (no bfloat16 there)
DTYPES = ["float16", "bfloat16"] if cc.ON_GPU else ["float16"]


def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, uniform=False):
    """``flash.Attend`` written out with the library's conventions, in float32. ``uniform``:
    the caller's promise, checked here (the library then reads the rows at fixed strides)."""
    hq, hkv = q.shape[1], k.shape[1]
    if uniform:
        n = len(cu_q) - 1
        assert cu_q.tolist() == [i * max_q for i in range(n + 1)], "not uniform queries"
        assert cu_k.tolist() == [i * max_k for i in range(n + 1)], "not uniform keys"
    o = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((hq, q.shape[0]), math.inf, device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cq) - 1):
        qs = q[cq[i]:cq[i + 1]].float()
        ks = k[ck[i]:ck[i + 1]].float().repeat_interleave(hq // hkv, 1)
        vs = v[ck[i]:ck[i + 1]].float().repeat_interleave(hq // hkv, 1)
        nq, nk = len(qs), len(ks)
        if nq == 0 or nk == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        diag = torch.arange(nq, device=q.device)[:, None] + nk - nq
        key = torch.arange(nk, device=q.device)[None, :]
        seen = torch.ones((nq, nk), dtype=torch.bool, device=q.device)
        if causal:
            seen &= key <= diag
        if window_left >= 0:
            seen &= key >= diag - window_left
        s = s.masked_fill(~seen, -math.inf)
        m = torch.logsumexp(s, -1)
        p = torch.exp(s - m[..., None]).nan_to_num(0.0)
        o[cq[i]:cq[i + 1]] = torch.einsum("hqk,khd->qhd", p, vs)   # 0 * NaN: NaN, as there
        lse[:, cq[i]:cq[i + 1]] = torch.where(m == -math.inf, math.inf, m)
    return o.to(q.dtype), lse


def nan_blind(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, uniform=False):
    """A stand-in with other NaN rules than ours: a NaN score counts as a masked key (a
    ``fmaxf``-style max), an inf one as 0. Its results for rows that see a non-finite q or k
    are wrong for us; the guarded kernel must replace them."""
    def clean(x):
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    return stand_in(clean(q), clean(k), v, cu_q, cu_k, max_q, max_k, causal, scale,
                    window_left, uniform)


class Counted:
    def __init__(self, fn):
        self.fn, self.n = fn, 0
        if hasattr(fn, "keeps_nonfinite"):       # the declaration travels with the function
            self.keeps_nonfinite = fn.keeps_nonfinite

    def __call__(self, *a, **kw):
        self.n += 1
        self.uniform = kw.get("uniform", False)
        return self.fn(*a, **kw)


def _backend(dtype, attend, **kw):
    cfg = cc.config(hq=4, hkv=2, d=64, dtype=dtype, **kw)
    ref, mine = cc.pair(cfg, "triton")
    fn = Counted(attend)
    mine.flash = flash.FlashPrefill(fn, force="on")
    return ref, mine, fn


def _attends():
    yield "stand-in", stand_in
    if cc.ON_GPU:
        yield "library", flash.aten_attend


ATTENDS = [name for name, _ in _attends()]


def _attend(name):
    return dict(_attends())[name]


# ---------------------------------------------------------------------- the rule
def test_rule_takes_plain_calls_and_leaves_the_rest():
    from kvcache_cuda.backend import KernelCtx
    from kvcache_cuda.launch import LaunchCache

    def ctx(**kw):
        base = dict(page_size=16, num_qo_heads=4, num_kv_heads=2, head_dim=64, group=2,
                    dtype=torch.float16, tuning=Tuning(
                        flash_ragged_min_rows=64, flash_paged_min_rows=32,
                        flash_batch_min_len=20, flash_batch_min_rows=80),
                    num_sms=4, launch=LaunchCache())
        base.update(kw)
        return KernelCtx(**base)

    auto = flash.FlashPrefill(stand_in, force="auto")
    q = torch.zeros((100, 4, 64), dtype=torch.float16)
    kv = torch.zeros((100, 2, 64), dtype=torch.float16)
    plain = dict(num_seqs=1, max_len=100, tree=None, rope=None, softcap=0.0, sinks=None)
    assert auto.ragged_ok(ctx(), q, kv, kv, **plain)
    for change, why in [(dict(tree=object()), "tree"), (dict(rope=cc.ROPE), "inline RoPE"),
                        (dict(softcap=30.0), "softcap"),
                        (dict(max_len=1), "one row per sequence"),
                        (dict(num_seqs=2), "several sequences of several lengths: not by the rule"),
                        (dict(window_left=9), "a window: not by the rule")]:
        assert not auto.ragged_ok(ctx(), q, kv, kv, **dict(plain, **change)), why
    for c, why in [(ctx(batch_invariant=True), "batch-invariant"), (ctx(kv_quant=True), "fp8"),
                   (ctx(dtype=torch.float32), "float32"), (ctx(head_dim_v=32), "Dv != D"),
                   (ctx(head_dim=288), "D > 256"),
                   (ctx(tuning=Tuning()), "the base table's threshold 0: never")]:
        qq = q.to(c.dtype)
        kk = kv.to(c.dtype)
        assert not auto.ragged_ok(c, qq, kk, kk, **plain), why
    assert not auto.ragged_ok(ctx(), q[:63], kv[:63], kv[:63], **plain)      # under 64 rows
    assert auto.ragged_ok(ctx(), q, kv, kv, **dict(plain, sinks=torch.zeros(4)))   # joined after
    assert auto.ragged_ok(ctx(kv_quant=True), q, kv, kv, **plain,              # fp8, scaled
                          kv_scale=torch.ones((2, 2)))
    # several sequences of one length (their rows add up to num_seqs * max_len): cuDNN's
    # batch, from flash_batch_min_len rows each and flash_batch_min_rows in all
    for seqs, length, want, why in [(4, 25, True, "4 x 25"), (5, 20, True, "5 x 20"),
                                    (4, 26, False, "lengths differ (rows < 4 x 26)"),
                                    (10, 10, False, "under 20 rows each")]:
        assert auto.ragged_ok(ctx(), q, kv, kv, **dict(plain, num_seqs=seqs,
                                                        max_len=length)) == want, why
    assert not auto.ragged_ok(ctx(), q[:60], kv[:60], kv[:60],
                              **dict(plain, num_seqs=3, max_len=20))     # under 80 rows in all
    assert not auto.ragged_ok(ctx(), q, kv, kv, **dict(plain, num_seqs=4, max_len=25,
                                                       window_left=3))
    assert not auto.ragged_ok(ctx(tuning=Tuning(flash_ragged_min_rows=64)), q, kv, kv,
                              **dict(plain, num_seqs=4, max_len=25))     # batch threshold 0
    assert flash.FlashPrefill(stand_in, force="on").ragged_ok(
        ctx(tuning=Tuning()), q[:2], kv[:2], kv[:2], **dict(plain, max_len=2))
    assert not flash.FlashPrefill(stand_in, force="off").ragged_ok(ctx(), q, kv, kv, **plain)

    from kvcache.backend import DepthAux
    z = torch.zeros(3, dtype=torch.int32)
    depth = dict(qo_indptr=z, page_indptr=z, page_indices=z, last_page_len=z, kv_len=z,
                 sink_size=z, window_offset=z, k_rope_offset=z, num_entries=2, use_decode=False,
                 max_kv_len=40, max_qo_len=50, covers_rows=True)
    paged = dict(rope=None, window_left=-1, softcap=0.0, sinks=None)
    assert not auto.paged_ok(ctx(), q, DepthAux(**depth), **paged)     # two entries
    assert auto.paged_ok(ctx(), q, DepthAux(**depth, uniform=True), **paged)    # of one shape
    assert not auto.paged_ok(ctx(), q[:60], DepthAux(**depth, uniform=True), **paged)  # < 80
    assert not auto.paged_ok(ctx(), q, DepthAux(**dict(depth, max_qo_len=19), uniform=True),
                             **paged)                                  # under 20 queries each
    assert flash.FlashPrefill(stand_in, force="on").paged_ok(ctx(), q, DepthAux(**depth), **paged)
    depth["num_entries"] = 1
    assert auto.paged_ok(ctx(), q, DepthAux(**depth), **paged)
    for change, why in [(dict(covers_rows=False), "rows no entry covers"),
                        (dict(num_entries=2), "several entries: not by the rule"),
                        (dict(use_decode=True), "decode"), (dict(max_qo_len=31), "small"),
                        (dict(tree=object()), "tree"), (dict(max_kv_len=0), "no keys")]:
        assert not auto.paged_ok(ctx(), q, DepthAux(**dict(depth, **change)), **paged), why
    assert not auto.paged_ok(ctx(), q, DepthAux(**depth), **dict(paged, window_left=8))


def test_thresholds_come_from_the_architecture_table():
    table = {"sm_90": {"flash_ragged_min_rows": 512, "flash_paged_min_rows": 1024}}
    t = for_arch(Tuning(), "sm_90", table)
    assert (t.flash_ragged_min_rows, t.flash_paged_min_rows) == (512, 1024)
    assert Tuning().flash_ragged_min_rows == Tuning().flash_paged_min_rows == 0
    with pytest.raises(ValueError, match="flash_paged_min_rows"):
        for_arch(Tuning(), "sm_90", {"sm_90": {"flash_paged_min_rows": 0}})


def test_mode_and_probe(monkeypatch):
    monkeypatch.setenv(flash.FLASH_ENV, "sometimes")
    with pytest.raises(ValueError, match="KVCACHE_CUDA_FLASH='sometimes'"):
        flash.mode()
    monkeypatch.setenv(flash.FLASH_ENV, "off")
    assert flash.flash_problem("cpu") == "KVCACHE_CUDA_FLASH=off"
    monkeypatch.delenv(flash.FLASH_ENV)
    assert "not a CUDA device" in flash.flash_problem("cpu")
    # ROCm's torch: its FlashAttention returns the lse per padded batch; the Triton path runs
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert "ROCm" in flash.flash_problem("cuda")


# ---------------------------------------------------------------------- the plumbing
@needs_triton
@pytest.mark.parametrize("attend", ATTENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window_left", [-1, 5])
@pytest.mark.parametrize("lengths", [[40, 1, 0, 23], [57], [40, 40, 40]],
                         ids=["several", "one", "uniform"])
def test_ragged_through_the_library(attend, dtype, window_left, lengths):
    """Causal (and windowed) ragged attention equals the reference's; a NaN / inf in the V of
    a key some rows do not see stays out of them (the library multiplies masked keys' zero
    weights by V: the finite-V pass around it keeps them out)."""
    ref, mine, fn = _backend(dtype, _attend(attend))
    rng = np.random.default_rng(7)
    case = cc.ragged_case(rng, ref, mine, lengths)
    v_host = cc.to_ref(ref, mine, case["v"]).copy()
    v_host[30, 0, 3], v_host[41, 1, 0] = np.nan, np.inf    # seq 0's key 30, seq 3's key 0 (or 41)
    v = mine.from_numpy(v_host)
    kw = dict(num_seqs=len(lengths), max_len=max(lengths), window_left=window_left)
    o, lse = mine.ragged_attention(case["q"], case["k"], v, cc.ints(mine, case["qo"]), 0.11, **kw)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qk"), v_host,
                                  case["qo"], 0.11, **kw)
    assert fn.n == 1
    assert fn.uniform == (len(set(lengths)) == 1)     # the promise, checked by the stand-in
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    got = mine.to_numpy(o).astype(np.float32)
    nan_rows = np.flatnonzero(np.isnan(got[:40, 0]).any(axis=1)).tolist()
    assert nan_rows == list(range(30, 40 if window_left < 0 else 36))   # key 30's rows only
    assert np.isfinite(got[:30]).all()


@needs_triton
@pytest.mark.parametrize("attend", ATTENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["plain", "sliding", "one entry", "uniform"])
def test_paged_through_the_library(attend, dtype, kind):
    """Paged prefill through the page gather and the library equals the reference's, over
    pages in a random order with NaN in every row no entry holds (a wrong gather reads one),
    sliding entries (sinks, then the window after a gap), an entry with no key, and entries
    of one shape (``uniform``: the library's batch over views of the gathered rows)."""
    ref, mine, fn = _backend(dtype, _attend(attend))
    entries = {"plain": [Entry(3, 40), Entry(5, 0), Entry(7, 1), Entry(20, 100)],
               "sliding": [Entry(3, 40, sink=4, gap=21), Entry(2, 33, sink=0, gap=9),
                           Entry(4, 5, sink=8, gap=8)],
               "one entry": [Entry(64, 130)],
               "uniform": [Entry(6, 37)] * 3}[kind]
    rng = np.random.default_rng(11)
    case = cc.paged_case(rng, ref, mine, entries)
    case.depth = replace(case.depth, max_qo_len=max(e.nq for e in entries),
                         uniform=kind == "uniform")
    o, lse = mine.paged_attention(case.q, case.pages, case.depth, 0.125)
    ro, rl = ref.paged_attention(case.ref_q, case.ref_pages, case.ref_depth, 0.125)
    assert fn.n == 1 and fn.uniform == (kind == "uniform")
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)


@needs_triton
def test_gather_entries_follows_sinks_and_gaps():
    """The page gather alone, key by key against the depth's offsets (float32: exact)."""
    ref, mine, _ = _backend("float32", stand_in)
    entries = [Entry(1, 40, sink=4, gap=21), Entry(1, 0), Entry(1, 17), Entry(1, 33, gap=9)]
    case = cc.paged_case(np.random.default_rng(3), ref, mine, entries)
    flag = torch.zeros(1, dtype=torch.int32, device=cc.DEVICE)
    k, v, cu = flash.gather_entries(case.pages, case.depth, 64, flag)
    assert flag.item() == 0          # NaN fills only the rows no entry holds: none read
    pages = mine.to_numpy(case.pages)
    k, v, cu = mine.to_numpy(k), mine.to_numpy(v), mine.to_numpy(cu)
    assert cu.tolist() == [0, 40, 40, 57, 90]
    d = case.ref_depth
    for i, e in enumerate(entries):
        for j in range(e.kv_len):
            off = j if j < e.sink else j - e.sink + e.gap
            page = d.page_indices[d.page_indptr[i] + off // 16]
            np.testing.assert_array_equal(k[cu[i] + j], pages[page, 0, :, off % 16])
            np.testing.assert_array_equal(v[cu[i] + j], pages[page, 1, :, off % 16])


@needs_triton
def test_calls_the_library_cannot_compute_stay_on_triton():
    """Soft-capping, a token tree, a paged window and rows no entry covers: the stand-in is
    never called and the results are the reference's (sinks go to the library:
    ``test_sinks_joined_to_the_library_result``)."""
    ref, mine, fn = _backend("float16", stand_in)
    rng = np.random.default_rng(5)
    lengths = [9, 14]
    case = cc.ragged_case(rng, ref, mine, lengths)
    qo = cc.ints(mine, case["qo"])
    args = [cc.to_ref(ref, mine, case[x]) for x in "qkv"]
    for kw in (dict(logit_softcap=20.0),):
        o, _ = mine.ragged_attention(case["q"], case["k"], case["v"], qo, 0.2, num_seqs=2,
                                     max_len=14, **kw)
        ro, _ = ref.ragged_attention(*args, case["qo"], 0.2, num_seqs=2, max_len=14, **kw)
        cc.assert_close(mine, ref, o, ro)
    pc = cc.paged_case(rng, ref, mine, [Entry(5, 30), Entry(4, 20)], row_offset=2)
    pc.depth = replace(pc.depth, max_qo_len=5)
    o, _ = mine.paged_attention(pc.q, pc.pages, pc.depth, 0.2)
    ro, _ = ref.paged_attention(pc.ref_q, pc.ref_pages, pc.ref_depth, 0.2)
    cc.assert_close(mine, ref, o, ro)
    pc = cc.paged_case(rng, ref, mine, [Entry(5, 30), Entry(4, 20)])
    pc.depth = replace(pc.depth, max_qo_len=5)
    o, _ = mine.paged_attention(pc.q, pc.pages, pc.depth, 0.2, window_left=6,
                                q_positions=pc.q_positions)
    ro, _ = ref.paged_attention(pc.ref_q, pc.ref_pages, pc.ref_depth, 0.2, window_left=6,
                                q_positions=pc.ref_q_positions)
    cc.assert_close(mine, ref, o, ro)
    assert fn.n == 0


@needs_triton
@pytest.mark.parametrize("attend", ATTENDS)
def test_queued_prefills_read_at_the_end(attend):
    """Several ragged and paged calls queued before any output is read (no sync between
    them), against the reference: sequences of several lengths, of one shape (the library's
    batch over views; on a GPU cuDNN's, unchecked) and with sinks (joined after it)."""
    ref, mine, fn = _backend("float16", _attend(attend))
    rng = np.random.default_rng(9)
    outs, wants = [], []
    sinks_np = np.array([0.3, -1.0, 2.0, 0.0], np.float32)
    sinks = mine.from_numpy(sinks_np, "float32")
    for i in range(4):
        case = cc.ragged_case(rng, ref, mine, [16 + i] * 3)
        kw = dict(num_seqs=3, max_len=16 + i)
        outs.append(mine.ragged_attention(case["q"], case["k"], case["v"],
                                          cc.ints(mine, case["qo"]), 0.1, sinks=sinks, **kw)[0])
        wants.append(ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"),
                                          case["qo"], 0.1, sinks=sinks_np, **kw)[0])
        pc = cc.paged_case(rng, ref, mine, [Entry(4 + i, 21)] * 2)
        pc.depth = replace(pc.depth, max_qo_len=4 + i, uniform=True)
        outs.append(mine.paged_attention(pc.q, pc.pages, pc.depth, 0.1)[0])
        wants.append(ref.paged_attention(pc.ref_q, pc.ref_pages, pc.ref_depth, 0.1)[0])
        case = cc.ragged_case(rng, ref, mine, [12 + i, 30 - i])
        outs.append(mine.ragged_attention(case["q"], case["k"], case["v"],
                                          cc.ints(mine, case["qo"]), 0.1, num_seqs=2,
                                          max_len=30)[0])
        wants.append(ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"),
                                          case["qo"], 0.1, num_seqs=2, max_len=30)[0])
        pc = cc.paged_case(rng, ref, mine, [Entry(6 + i, 50), Entry(3, 17 + i)])
        pc.depth = replace(pc.depth, max_qo_len=6 + i)
        outs.append(mine.paged_attention(pc.q, pc.pages, pc.depth, 0.1)[0])
        wants.append(ref.paged_attention(pc.ref_q, pc.ref_pages, pc.ref_depth, 0.1)[0])
    assert fn.n == 16
    for o, want in zip(outs, wants):
        cc.assert_close(mine, ref, o, want)


# ---------------------------------------------------------------------- the library made unavailable
@pytest.mark.skipif(not cc.ON_GPU, reason="the library is probed on a GPU only")
@pytest.mark.parametrize("how", ["env", "probe"])
def test_without_the_library_the_triton_kernels_run(monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(flash.FLASH_ENV, "off")
    else:    # what ROCm, an sm_7x GPU or a torch without the op report
        monkeypatch.setattr(flash, "flash_problem", lambda device: "no FlashAttention (test)")
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float16")
    ref, mine = cc.pair(cfg, "triton")
    assert mine.flash is None and mine.flash_problem
    rng = np.random.default_rng(2)
    case = cc.ragged_case(rng, ref, mine, [50, 70])
    o, lse = mine.ragged_attention(case["q"], case["k"], case["v"], cc.ints(mine, case["qo"]),
                                   0.1, num_seqs=2, max_len=70)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"), case["qo"],
                                  0.1, num_seqs=2, max_len=70)
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)


@pytest.mark.skipif(not cc.ON_GPU, reason="the library is probed on a GPU only")
def test_the_gpu_backend_finds_the_library():
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="bfloat16")
    _, mine = cc.pair(cfg, "triton")
    assert mine.flash is not None, mine.flash_problem


def test_tune_takes_the_smallest_size_from_which_the_library_always_wins():
    from kvcache_cuda.tune import crossover
    sizes = (64, 128, 256, 512)
    assert crossover(sizes, [5, 5, 5, 5], [6, 4, 6, 4]) == 512    # a loss at 256: from 512
    assert crossover(sizes, [5, 5, 5, 5], [4, 4, 4, 4]) == 64
    assert crossover(sizes, [5, 5, 5, 5], [6, 6, 6, 6]) is None
    assert crossover(sizes, [5, 5, 5, 5], [4, 4, 4, None]) is None   # failed at the top


@needs_triton
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_q_or_k_recomputed_by_the_kernel(where, bad):
    """A NaN / inf in q or k: the library's NaN rules differ from ours (``nan_blind``), so the
    guard flags the call and the Triton kernel recomputes it: ragged and paged, the bits of
    the Triton kernels alone, and for a NaN the reference's results (an infinite score is
    where the Triton kernels and the reference already part: lse NaN against inf)."""
    ref, mine, fn = _backend("float16", nan_blind)
    _, alone = cc.pair(ref.config, "triton")
    alone.flash = None
    rng = np.random.default_rng(13)
    case = cc.ragged_case(rng, ref, mine, [20, 9])
    host = {x: cc.to_ref(ref, mine, case[x]).copy() for x in "qkv"}
    host[where][12, 1, 5] = bad
    args = {x: mine.from_numpy(host[x]) for x in "qkv"}
    pc = cc.paged_case(rng, ref, mine, [Entry(6, 40), Entry(4, 19)])
    pc.depth = replace(pc.depth, max_qo_len=6)
    q = cc.to_ref(ref, mine, pc.q).copy()
    pages = cc.to_ref(ref, mine, pc.pages).copy()
    if where == "q":
        q[2, 1, 5] = bad
    else:       # the first key of entry 0
        pages[pc.ref_depth.page_indices[0], 0, 0, 0, 5] = bad
    for backend in (mine, alone):
        got = [backend.ragged_attention(args["q"], args["k"], args["v"],
                                        cc.ints(mine, case["qo"]), 0.1, num_seqs=2, max_len=20),
               backend.paged_attention(mine.from_numpy(q), mine.from_numpy(pages), pc.depth,
                                       0.1)]
        if backend is mine:
            with_library = got
    assert fn.n == 2
    for (o, lse), (o_t, lse_t) in zip(with_library, got):
        np.testing.assert_array_equal(mine.to_numpy(o), mine.to_numpy(o_t))
        np.testing.assert_array_equal(mine.to_numpy(lse), mine.to_numpy(lse_t))
    if np.isnan(bad):
        wants = [ref.ragged_attention(host["q"], host["k"], host["v"], case["qo"], 0.1,
                                      num_seqs=2, max_len=20),
                 ref.paged_attention(q, pages, pc.ref_depth, 0.1)]
        for (o, lse), (ro, rl) in zip(with_library, wants):
            cc.assert_close(mine, ref, o, ro)
            cc.assert_lse(mine, ref, lse, rl)


def _bad_q_cases(ref, mine, bad):
    """A ragged case (three sequences of 24 rows) and a paged one (one entry, 6 queries over 40
    keys) with ``bad`` in q's row 12 / 2: (ragged args, paged args) for ``mine``."""
    rng = np.random.default_rng(17)
    case = cc.ragged_case(rng, ref, mine, [24, 24, 24])
    q = cc.to_ref(ref, mine, case["q"]).copy()
    q[12, 1, 5] = bad
    ragged = (mine.from_numpy(q), case["k"], case["v"], cc.ints(mine, case["qo"]))
    pc = cc.paged_case(rng, ref, mine, [Entry(6, 40)])
    pc.depth = replace(pc.depth, max_qo_len=6)
    pq = cc.to_ref(ref, mine, pc.q).copy()
    pq[2, 1, 5] = bad
    return ragged, (mine.from_numpy(pq), pc.pages, pc.depth)


def _both_calls(backend, ragged, paged):
    q, k, v, qo = ragged
    return [backend.ragged_attention(q, k, v, qo, 0.1, num_seqs=3, max_len=24),
            backend.paged_attention(*paged, 0.1)]


@needs_triton
def test_a_library_that_keeps_our_rules_is_not_checked(monkeypatch):
    """An ``Attend`` that declares ``keeps_nonfinite`` for a call gets no pass over q or k and
    no guarded recompute: its result stands as it returned it. Shown with ``nan_blind``
    declared as keeping them (a false declaration, so that the difference shows): the rows of
    the NaN q keep its finite results, where the checked path gives NaN."""
    checks = []
    real = flash.flag_nonfinite
    monkeypatch.setattr(flash, "flag_nonfinite", lambda x, f: (checks.append(x.shape), real(x, f)))

    def blind(*a, **kw):
        return nan_blind(*a, **kw)
    blind.keeps_nonfinite = lambda *call: True
    ref, mine, fn = _backend("float16", blind)
    ragged, paged = _bad_q_cases(ref, mine, np.nan)
    got = _both_calls(mine, ragged, paged)
    assert fn.n == 2 and checks == []
    for (o, _), row in zip(got, (12, 2)):
        assert np.isfinite(mine.to_numpy(o)[row]).all()
    # the same calls through the checked path: flagged, recomputed, NaN in those rows
    blind.keeps_nonfinite = lambda *call: False
    _, checked, _ = _backend("float16", blind)
    for (o, _), row in zip(_both_calls(checked, ragged, paged), (12, 2)):
        assert np.isnan(mine.to_numpy(o)[row]).any()
    assert len(checks) == 3                 # ragged: q and k; paged: q (the gather flags keys)


@pytest.mark.skipif(not cc.ON_GPU, reason="the library runs on a GPU only")
@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_the_library_keeps_our_nonfinite_rows(where, bad):
    """What ``aten_attend.keeps_nonfinite`` declares, on this GPU's cuDNN: a NaN / inf in q or
    in a key, at a sequence's first, middle and last row (ragged causal, three sequences of one
    length) or in one entry's q / keys (paged): unchecked, the library marks non-finite exactly
    the (row, head)s that our Triton kernels alone mark, and every other row agrees with them
    to rounding."""
    ref, mine, fn = _backend("float16", flash.aten_attend)
    _, alone = cc.pair(ref.config, "triton")
    alone.flash = None
    rng = np.random.default_rng(19)
    case = cc.ragged_case(rng, ref, mine, [24, 24, 24])
    pc = cc.paged_case(rng, ref, mine, [Entry(6, 40)])
    pc.depth = replace(pc.depth, max_qo_len=6)
    for row in (24, 36, 47):
        host = {x: cc.to_ref(ref, mine, case[x]).copy() for x in "qkv"}
        host[where][row, 1, 5] = bad
        q = cc.to_ref(ref, mine, pc.q).copy()
        pages = cc.to_ref(ref, mine, pc.pages).copy()
        if where == "q":
            q[row % 6, 1, 5] = bad
        else:
            pages[pc.ref_depth.page_indices[row % 3], 0, 0, row % 8, 5] = bad
        args = ({x: mine.from_numpy(host[x]) for x in "qkv"}, mine.from_numpy(q),
                mine.from_numpy(pages))
        calls = [_both_calls(b, (args[0]["q"], args[0]["k"], args[0]["v"],
                                 cc.ints(mine, case["qo"])), (args[1], args[2], pc.depth))
                 for b in (mine, alone)]
        for (o, lse), (o_t, lse_t) in zip(*calls):
            o, o_t = mine.to_numpy(o).astype(np.float32), mine.to_numpy(o_t).astype(np.float32)
            lse, lse_t = mine.to_numpy(lse), mine.to_numpy(lse_t)
            marks = ~np.isfinite(o).all(-1) | ~np.isfinite(lse)
            marks_t = ~np.isfinite(o_t).all(-1) | ~np.isfinite(lse_t)
            assert marks_t.any() and (marks == marks_t).all(), (where, bad, row)
            np.testing.assert_allclose(o[~marks], o_t[~marks_t], atol=2e-3, rtol=2e-3)
    assert fn.n == 6


@needs_triton
@pytest.mark.parametrize("attend", ATTENDS)
def test_paged_fp8_pages_through_the_library(attend):
    """fp8 pages: the gather writes ``code * scale`` (K's scale for K, V's for V, per head)
    and the library attends over them: the reference's results over the same codes; with the
    scales swapped between K and V the result is far off (the check has teeth)."""
    from kvcache import kv_quant
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float16", kv_dtype="float8_e4m3")
    ref, mine = cc.pair(cfg, "triton")
    fn = Counted(_attend(attend))
    mine.flash = flash.FlashPrefill(fn, force="on")
    rng = np.random.default_rng(17)
    case = cc.paged_case(rng, ref, mine, [Entry(9, 70, sink=4, gap=12)])
    case.depth = replace(case.depth, max_qo_len=9)
    sc = np.array([[0.01, 0.03], [0.05, 0.02]], np.float32)
    pool = np.nan_to_num(mine.to_numpy(case.pages).astype(np.float32)) * 0.05
    codes = np.empty(pool.shape, dtype=kv_quant.ml_dtypes.float8_e4m3fn)
    values = np.empty(pool.shape, np.float32)
    for which in (0, 1):
        part = pool[:, which].transpose(0, 2, 1, 3)                       # (P, ps, Hkv, D)
        c = kv_quant.fp8_quantize(part.reshape(-1, *part.shape[-2:]), sc[which])
        codes[:, which] = c.reshape(part.shape).transpose(0, 2, 1, 3)
        values[:, which] = kv_quant.fp8_dequantize(c, sc[which]).reshape(
            part.shape).transpose(0, 2, 1, 3)
    pages = torch.from_numpy(codes.view(np.uint8)).view(torch.float8_e4m3fn).to(mine.torch_device)
    o, lse = mine.paged_attention(case.q, pages, case.depth, 0.125,
                                  kv_scale=mine.from_numpy(sc, "float32"))
    ro, rl = ref.paged_attention(case.ref_q, values, case.ref_depth, 0.125, kv_scale=sc)
    assert fn.n == 1
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    wrong, _ = mine.paged_attention(case.q, pages, case.depth, 0.125,
                                    kv_scale=mine.from_numpy(sc[::-1].copy(), "float32"))
    got = mine.to_numpy(o).astype(np.float32)
    assert np.abs(mine.to_numpy(wrong).astype(np.float32) - got).max() > 0.2 * np.abs(got).max()


def _declared_keeping(fn):
    """``fn`` with ``keeps_nonfinite`` declared for every call."""
    def keeping(*a, **kw):
        return fn(*a, **kw)
    keeping.keeps_nonfinite = lambda *call: True
    return keeping


@needs_triton
@pytest.mark.parametrize("attend", ATTENDS + ["keeping stand-in"])
def test_ragged_in_an_fp8_cache_through_the_library(attend, monkeypatch):
    """An fp8 cache's ragged call: the kernel's passes round K and V to their codes, the
    library attends over ``code * scale``: the reference's results for the same call. Where
    the kernel may recompute the call (it reads the codes) ``scale_heads`` makes the values,
    and the codes unscaled (``scale_heads`` a no-op) are far off; where the library keeps our
    NaN rules (cuDNN's batch on a GPU, a stand-in declaring it) the passes write the values
    themselves and ``scale_heads`` is not called."""
    cfg = cc.config(hq=4, hkv=2, d=64, dtype="float16", kv_dtype="float8_e4m3")
    ref, mine = cc.pair(cfg, "triton")
    fn = Counted(_declared_keeping(stand_in) if attend == "keeping stand-in"
                 else _attend(attend))
    mine.flash = flash.FlashPrefill(fn, force="on")
    values = mine.flash.keeps_nonfinite(3, 99, 99, 33, 33, True, -1, True)
    assert values == (attend == "keeping stand-in" or (attend == "library" and cc.ON_GPU))
    rng = np.random.default_rng(19)
    lengths = [33, 33, 33]
    case = cc.ragged_case(rng, ref, mine, lengths)
    sc = np.array([[0.01, 0.03], [0.05, 0.02]], np.float32)
    kw = dict(num_seqs=3, max_len=33)
    o, lse = mine.ragged_attention(case["q"], case["k"], case["v"], cc.ints(mine, case["qo"]),
                                   0.11, kv_scale=mine.from_numpy(sc, "float32"), **kw)
    ro, rl = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"), case["qo"],
                                  0.11, kv_scale=sc, **kw)
    assert fn.n == 1 and fn.uniform
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    monkeypatch.setattr(flash, "scale_heads", lambda x, scale: x)
    wrong, _ = mine.ragged_attention(case["q"], case["k"], case["v"], cc.ints(mine, case["qo"]),
                                     0.11, kv_scale=mine.from_numpy(sc, "float32"), **kw)
    assert fn.n == 2
    got = mine.to_numpy(o).astype(np.float32)
    if values:
        np.testing.assert_array_equal(mine.to_numpy(wrong), mine.to_numpy(o))
    else:
        assert (np.abs(mine.to_numpy(wrong).astype(np.float32) - got).max()
                > 0.2 * np.abs(got).max())


@needs_triton
def test_scale_heads_multiplies_each_head_in_float32():
    x = torch.tensor(np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5) - 7.0)
    x = x.to(torch.float16).to(cc.DEVICE)
    scale = torch.tensor([0.5, 3.0, 1e-3], dtype=torch.float32, device=x.device)
    out = flash.scale_heads(x[:, :, :4], scale)       # a view: last dim contiguous, rows strided
    want = (x[:, :, :4].float() * scale[None, :, None]).to(torch.float16)
    assert out.dtype == torch.float16 and torch.equal(out.cpu(), want.cpu())


@needs_triton
@pytest.mark.parametrize("attend", ATTENDS)
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_sinks_joined_to_the_library_result(attend, kind, monkeypatch):
    """Attention sinks: the library attends, ``apply_sinks`` joins each head's sink logit to
    its result (one more denominator term): the reference's results, an entry with no key
    included (o = 0, lse = the sink); without the join the results are far off."""
    ref, mine, fn = _backend("float16", _attend(attend))
    rng = np.random.default_rng(23)
    sinks_np = np.array([0.5, 3.0, -1.0, 2.0], np.float32)
    sinks = mine.from_numpy(sinks_np, "float32")

    def run():
        if kind == "ragged":
            case = cc.ragged_case(rng, ref, mine, [40, 1, 23])
            kw = dict(num_seqs=3, max_len=40)
            got = mine.ragged_attention(case["q"], case["k"], case["v"],
                                        cc.ints(mine, case["qo"]), 0.11, sinks=sinks, **kw)
            want = ref.ragged_attention(*(cc.to_ref(ref, mine, case[x]) for x in "qkv"),
                                        case["qo"], 0.11, sinks=sinks_np, **kw)
            return got, want
        case = cc.paged_case(rng, ref, mine, [Entry(3, 40), Entry(5, 0), Entry(20, 100)])
        case.depth = replace(case.depth, max_qo_len=20)
        got = mine.paged_attention(case.q, case.pages, case.depth, 0.125, sinks=sinks)
        want = ref.paged_attention(case.ref_q, case.ref_pages, case.ref_depth, 0.125,
                                   sinks=sinks_np)
        return got, want

    (o, lse), (ro, rl) = run()
    assert fn.n == 1
    cc.assert_close(mine, ref, o, ro)
    cc.assert_lse(mine, ref, lse, rl)
    if kind == "paged":                            # entry 1 (rows 3..7) has no key
        assert np.allclose(mine.to_numpy(lse)[3:8], sinks_np[None, :])
        assert not np.abs(mine.to_numpy(o)[3:8].astype(np.float32)).any()
    monkeypatch.setattr(flash, "apply_sinks", lambda o, lse, sinks: None)
    rng = np.random.default_rng(23)
    (o2, _), (ro2, _) = run()
    got = mine.to_numpy(o2).astype(np.float32)
    want = np.asarray(ro2, np.float32)
    assert np.abs(got - want).max() > 0.05


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_the_triton_ceiling_computes_attention(causal):
    """The bench's Triton ceiling (``triton_ceiling``: TMA descriptors, warp-specialized key
    loop) computes attention of sequences of one length, GQA by head index, causal from the
    top left: SDPA's result in float32 for every tile variant that builds. Without warp
    specialization every variant must build; with it Triton 3.6's pass fails on some shapes
    on an H200 (the bench then keeps the other variants), so there a build failure is allowed,
    a wrong result never."""
    from kvcache_cuda.triton_ceiling import ceiling_attention
    gen = torch.Generator().manual_seed(3)
    b, n, hq, hkv, d = 2, 128, 4, 2, 64
    q, k, v = (torch.randn((b * n, h, d), generator=gen).to(torch.float16).to(cc.DEVICE)
               for h in (hq, hkv, hkv))
    qs, ks, vs = (x.float().view(b, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    ks, vs = ks.repeat_interleave(2, 1), vs.repeat_interleave(2, 1)
    want = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    want = want.transpose(1, 2).reshape(b * n, hq, d)
    for block_n, ws in ((64, False), (128, False), (64, True), (128, True)):
        try:
            o = ceiling_attention(q, k, v, n, d ** -0.5, causal, block_n=block_n, num_warps=4,
                                  num_stages=2, warp_specialize=ws)
        except Exception:
            if ws and cc.ON_GPU:
                continue
            raise
        assert (o.float() - want).abs().max().item() < 2e-3, (block_n, ws)
    with pytest.raises(AssertionError, match="one length"):
        ceiling_attention(q[:200], k[:200], v[:200], 100, 0.1, causal)
