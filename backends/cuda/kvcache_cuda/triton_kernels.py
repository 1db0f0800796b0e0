"""Triton kernels: one source for CUDA and (through the ROCm package) HIP.

Imported lazily by ``CudaBackend`` the first time a Triton kernel is needed, so that
``TRITON_INTERPRET=1`` (set before this import) runs the very same kernels on CPU tensors.

Layout conventions shared by the attention kernels
--------------------------------------------------
* A program owns one KV head and a tile of ``BLOCK_R`` *rows*; row ``ri`` is query token
  ``ri // GROUP`` of the tile and query head ``kvh * GROUP + ri % GROUP``. The whole GQA group of a
  KV head therefore shares every K/V tile load.
* Head dims are split into halves (``q1 = x[:D/2]``, ``q2 = x[D/2:]``) and ``q.k = q1.k1 + q2.k2``,
  so inline RoPE is elementwise on the halves (rotate-half needs no permutes). Non-power-of-two
  halves are masked.
* Online softmax in fp32 in the log2 domain (``exp2``); ``lse`` is stored as a natural log. A row
  that sees no key ends with ``l == 0``: o = 0, lse = -inf.
* ``HEAD_DIM`` (D) is the width of q and k, ``HEAD_DIM_V`` (Dv) the width of v and o; a page row
  holds K in its first D entries and V in its first Dv. Blocks are powers of two of at least 16
  (``tl.dot``'s minimum), masked.
* Optional features are constexpr flags, so the default kernels are the plain ones:
  ``SOFTCAP`` (scores ``c * tanh(s / c)``: the hardware tanh on 16-bit caches, an exact exp2
  form on float32 ones: ``_scores``) and ``SINKS``
  (a per-head logit joins the denominator: folded into ``_finish``'s normalisation, or into the
  split-K merge, never into a partial, so it counts once).
* ``QUANT``: fp8 e4m3 pages (``kvcache.kv_quant``'s rule, one float32 scale per (layer, KV
  head) for K and one for V, passed as ``kv_scale`` (2, Hkv)). The append kernel quantizes
  on the way in (``_fp8_code``); the paged kernels load the codes, widen them exactly to
  float16 operands (16-bit caches: the query too, ``_operand``; float32 caches: float32) and
  fold the scales out of the inner loop: K's into ``qk_scale``, V's into the accumulator
  before the normalisation. The ragged pass reads the forward's own K/V as their codes,
  written once per call by ``_finite_v_kernel``.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import replace
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from . import torch_kernels
from .tuning import prefill_splits, num_splits

LOG2E = 1.4426950408889634
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def _interpreter_numpy24_shim():
    """Triton 3.6's interpreter converts 1-element arrays with int(), which numpy >= 2.4 rejects,
    so every runtime-bound ``range`` loop fails (triton-lang/triton#9171). Re-patch ``__index__``
    with the upstream fix; only under TRITON_INTERPRET=1 and only where the bug exists."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except Exception:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_kvcache_shim", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    setattr(patched, "_kvcache_shim", True)     # (a function attribute mypy does not know)
    interpreter._patch_lang_tensor = patched


_interpreter_numpy24_shim()


# ====================================================================== jit helpers
@triton.jit
def _inv_freq(freq_ptr, dh, dh_ok, HEAD_DIM: tl.constexpr, log2_theta, FREQ: tl.constexpr):
    """Per half-dim lane, the RoPE angle per unit position: the model's frequencies (FREQ: a
    float32 table, scale already in it) or theta ** (-2i/D)."""
    if FREQ:
        return tl.load(freq_ptr + dh, mask=dh_ok, other=0.0)
    # computed as exp2 so only one transcendental per lane
    return tl.exp2(-(2.0 * dh.to(tl.float32) / HEAD_DIM) * log2_theta)


@triton.jit
def _rotate(x1, x2, pos, inv_freq):
    """Rotate-half of halves x1, x2 (rows, half) at positions pos (rows,) already scaled."""
    ang = pos[:, None] * inv_freq[None, :]
    c = tl.cos(ang)
    s = tl.sin(ang)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 caches must not silently drop to tf32
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _fp8_code(x, scale):
    """e4m3fn codes of ``x`` (values of the compute dtype) for ``scale`` (float32, broadcast):
    ``clip(x / scale, -448, 448)`` with an IEEE divide, then round to nearest even; NaN stays
    NaN (a clamp through min / max would turn it into a bound)."""
    y = tl.div_rn(x.to(tl.float32), scale)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -448.0), 448.0))
    if _INTERPRETED:
        # Triton 3.6's interpreter rounds float32 -> e4m3 without carrying a rounded-up mantissa
        # into the exponent (31.7 -> 16): round to the e4m3 grid here (quantum 2^(e-3), 2^-9
        # below the normal range; round half to even through 1.5 * 2^23) so its cast is exact
        e = tl.maximum(((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6) - 3
        quantum = ((e + 127) << 23).to(tl.float32, bitcast=True)
        steps = y * ((127 - e) << 23).to(tl.float32, bitcast=True)
        r = ((steps + 12582912.0) - 12582912.0) * quantum
        r = tl.where(r == 0.0, y * 0.0, r)          # keeps the sign of a zero (-0 -> 0x80)
        # its cast of NaN gives a number: NaN's code (0x7F) by its bits
        bits = tl.where(y != y, 0x7F, r.to(tl.float8e4nv).to(tl.uint8, bitcast=True))
        return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return y.to(tl.float8e4nv)


@triton.jit
def _widen(codes, dtype: tl.constexpr):
    """fp8 ``codes`` as ``dtype`` values (exact: every e4m3 value is a float16 / bfloat16 one).
    The interpreter's cast reads NaN's codes (0x7F / 0xFF) as numbers: NaN is put back there."""
    x = codes.to(dtype)
    if _INTERPRETED:
        x = tl.where((codes.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), x)
    return x


@triton.jit
def _operand(x):
    """A 16-bit value as the paged kernels' dots over fp8 pages take it: float16, whose wider
    mantissa holds every e4m3 code and every bfloat16 value of magnitude 2^-14 .. 65504 exactly
    (Triton widens e4m3 to float16 in one instruction per pair, to bfloat16 through float32:
    bfloat16 operands made fp8 decode 1.17-1.21x slower on the H200); float32 stays float32."""
    if x.dtype == tl.float32:
        return x
    else:
        return x.to(tl.float16)


@triton.jit
def _kv_scales(scale_ptr, kvh, hkv, QUANT: tl.constexpr):
    """(K scale, V scale) of KV head ``kvh`` from the layer's (2, hkv) float32 ``kv_scale``;
    1.0 without QUANT (nothing loaded)."""
    ks = 1.0
    vs = 1.0
    if QUANT:
        ks = tl.load(scale_ptr + kvh)
        vs = tl.load(scale_ptr + hkv + kvh)
    return ks, vs


@triton.jit
def _warp_uniform(x, ON: tl.constexpr):
    """``x`` (an int32 scalar every thread of the program holds) as lane 0's copy (ON): the
    same value, but ptxas then knows it is one per warp and keeps what derives from it (loop
    bounds, addresses, pipeline-stage descriptors) in uniform registers, instead of per-thread
    registers moved to uniform ones every key tile. A loaded value is per-thread to ptxas."""
    if ON:
        x = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, 0, 0x1f, 0xffffffff;", "=r,r",
                                      [x], dtype=tl.int32, is_pure=True, pack=1)
    return x


@triton.jit
def _tanh_approx(x):
    # one MUFU instruction (sm_75+); relative error about 2^-11, below bfloat16/float16 rounding
    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _scores(qk, vis, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """Scores in the log2 domain, -inf where not visible. Plain (SOFTCAP 0, and 3: the same
    with a scale that is not positive): ``qk * qk_scale`` (qk_scale = sm_scale * log2 e).
    SOFTCAP 1 (exact, float32 caches and the interpreter): ``c * tanh(s / c)`` with
    ``tanh(x) = 2 / (1 + e^{-2x}) - 1``: qk_scale = -2 * sm_scale * log2 e / c (so e^{-2x} =
    exp2(qk * qk_scale)) and softcap_log2 = c * log2 e; one exp2, one fast divide and no extra
    live value per score (exp2 overflowing to inf gives -c, underflowing to 0 gives +c; NaN
    stays NaN). SOFTCAP 2 (16-bit caches on a GPU; 4: the same with a scale that is not
    positive): the hardware's tanh.approx, qk_scale = sm_scale / c: one MUFU op per score
    instead of two (the exp2 + divide form made prefill 1.25x slower than without a cap on
    the H100)."""
    return tl.where(vis, _all_scores(qk, qk_scale, softcap_log2, SOFTCAP), float("-inf"))


@triton.jit
def _all_scores(qk, qk_scale, softcap_log2, SOFTCAP: tl.constexpr):
    """``_scores`` where every key is visible (no select per score)."""
    if SOFTCAP == 2 or SOFTCAP == 4:
        s = softcap_log2 * _tanh_approx(qk * qk_scale)
    elif SOFTCAP == 1:
        s = tl.fdiv(2.0 * softcap_log2, 1.0 + tl.exp2(qk * qk_scale)) - softcap_log2
    else:
        s = qk * qk_scale
    return s


@triton.jit
def _softmax_step(qk, vis, m_i, l_i, acc, v, qk_scale, softcap_log2, IEEE: tl.constexpr,
                  MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EDGE: tl.constexpr = True):
    """One online-softmax step over a tile of keys. EDGE False: every row sees every key of
    the tile (``vis`` unused): no select per score, and with SOFTCAP 0 or 2 (a positive scale:
    the largest qk gives the largest score) the row maximum is taken on qk, once per row
    through the cap, and each score is shifted in a multiply-add."""
    if not EDGE and SOFTCAP == 0:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk * qk_scale - m_use[:, None])
    elif not EDGE and SOFTCAP == 2:
        m_new = tl.maximum(m_i, softcap_log2 * _tanh_approx(tl.max(qk, 1) * qk_scale))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(softcap_log2 * _tanh_approx(qk * qk_scale) - m_use[:, None])
    else:
        if EDGE:
            qk = _scores(qk, vis, qk_scale, softcap_log2, SOFTCAP)
        else:
            qk = _all_scores(qk, qk_scale, softcap_log2, SOFTCAP)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)     # all-masked so far: no inf-inf
        p = tl.exp2(qk - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        # a masked key's p is 0 but its V may hold NaN/inf (a later token, a sibling branch),
        # and 0 * NaN = NaN in the dot: non-finite V values stay out of it; the rare tiles
        # holding one add them back to the rows that see them. (Without MASKED every loaded
        # key is visible to every row and out-of-range V loads are 0: the plain dot is exact.)
        bad = (v - v) != 0.0                                   # NaN or +-inf
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), tl.where(bad, 0.0, v).to(v.dtype), IEEE)
        key_bad = tl.max(bad.to(tl.int32), 1)
        if tl.max(key_bad, 0) > 0:
            seen = _nonfinite_codes(tl.zeros(acc.shape, tl.int32), tl.broadcast_to(vis, qk.shape),
                                    v, key_bad)
            acc = _apply_nonfinite(acc, seen)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _nonfinite_codes(seen, vis, v, key_bad):
    """seen | the non-finite V values of the visible keys (vis: rows x keys) per (row, dim):
    bit 1 NaN, 2 +inf, 4 -inf; visits only the keys that hold one (key_bad). No dot: a second
    dot's shared memory does not fit beside a pipelined attention loop at head_dim 128."""
    keys = tl.arange(0, v.shape[0])
    code = tl.where(v != v, 1, tl.where(v == float("inf"), 2, tl.where(v == float("-inf"), 4, 0)))
    for j in range(0, v.shape[0]):
        if tl.sum(tl.where(keys == j, key_bad, 0), 0) > 0:
            row_sees = tl.max(tl.where((keys == j)[None, :] & vis, 1, 0), 1)          # (rows,)
            code_j = tl.max(tl.where((keys == j)[:, None], code, 0), 0)               # (dims,)
            seen = seen | (row_sees[:, None] * code_j[None, :])
    return seen


@triton.jit
def _apply_nonfinite(x, seen):
    """x (rows, dims) with the NaN / +-inf that ``seen`` codes put there (a NaN in x stays)."""
    y = tl.where((seen & 2) != 0, float("inf"), x)
    y = tl.where((seen & 4) != 0, float("-inf"), y)
    y = tl.where(((seen & 1) != 0) | ((seen & 6) == 6), float("nan"), y)
    return tl.where(x != x, x, y)


@triton.jit
def _finish(acc, m_i, l_i, sink2, SINKS: tl.constexpr):
    # l == 0: the row saw no key; a NaN l (a NaN K it saw) gives NaN o and lse
    if SINKS:
        # sink2: each row's sink logit in log2 units, one more denominator term with no value;
        # rescaling acc and dividing by l is one per-row factor, no extra pass
        m_new = tl.maximum(m_i, sink2)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.exp2(sink2 - m_use)
        empty = l_i == 0
        o = acc * (alpha / tl.where(empty, 1.0, l_i))[:, None]
        lse = tl.where(empty, float("-inf"),
                       (m_use + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    else:
        empty = l_i == 0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return o, lse


@triton.jit
def _segment_result(acc, m_i, l_i):
    """A key segment's result alone (batch-invariant mode): (o, lse2), o = acc / l and lse2 =
    m + log2(l) in log2 units, float32; a row that saw no key of it: o 0, lse2 -inf (it then
    folds in as nothing, bit for bit)."""
    empty = l_i == 0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse2 = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return o, lse2


@triton.jit
def _segment_fold(m_f, l_f, acc_f, o_s, lse2_s):
    """Fold one segment's (o_s, lse2_s) into a row's running (m, l, acc), segments in key order.
    The one definition of the fold: the paged prefill kernel folds a row's segments in its
    program, the segment merge folds the partials of a decode step's programs, and a token
    gets the same bits either way (explicit FMAs: no contraction the two kernels could do
    differently)."""
    m_new = tl.maximum(m_f, lse2_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_f - m_use)
    w = tl.exp2(lse2_s - m_use)
    acc_f = tl.fma(acc_f, alpha[:, None], o_s * w[:, None])
    l_f = tl.fma(l_f, alpha, w)
    return m_new, l_f, acc_f


@triton.jit
def _row_sinks(sinks_ptr, head, row_ok, SINKS: tl.constexpr):
    """Per row, its head's sink logit in log2 units (any float dtype in memory); 0 unused."""
    sink2 = tl.zeros(head.shape, tl.float32)
    if SINKS:
        sink2 = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    return sink2


@triton.jit
def _load_query(q_ptr, qpos_ptr, tok, head, row_ok, sq_t, sq_h, dh, dh_ok, dd, dd_ok, inv,
                rope_scale, HALF: tl.constexpr, ROPE: tl.constexpr):
    """Query rows (token ``tok``, head ``head``) of a program. Inline RoPE: the rotated halves
    (q1, q2) for two half-width dots; otherwise the whole row as q1 (q2 = q1, unused) for one
    full-width dot."""
    if ROPE:
        qb = q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + dh[None, :]
        qm = row_ok[:, None] & dh_ok[None, :]
        qpos = tl.load(qpos_ptr + tok, mask=row_ok, other=0).to(tl.float32) * rope_scale
        r1, r2 = _rotate(tl.load(qb, mask=qm, other=0.0), tl.load(qb + HALF, mask=qm, other=0.0),
                         qpos, inv)
        q1 = r1.to(q_ptr.dtype.element_ty)
        q2 = r2.to(q_ptr.dtype.element_ty)
    else:
        q1 = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + dd[None, :],
                     mask=row_ok[:, None] & dd_ok[None, :], other=0.0)
        q2 = q1
    return q1, q2


@triton.jit
def _window_floor(qpos_ptr, tok, row_ok, window_left, BLOCK_R: tl.constexpr):
    """Per row, the lowest key position it sees: q_position - window_left, or a bound below
    every position when window_left < 0 (no window; q positions are then not read)."""
    floor = tl.zeros([BLOCK_R], tl.int32) - 2147483647
    if window_left >= 0:
        floor = tl.load(qpos_ptr + tok, mask=row_ok, other=0).to(tl.int32) - window_left
    return floor


@triton.jit
def _lean_tiles(lo, seen_hi, top, BLOCK_N: tl.constexpr):
    """The whole BLOCK_N key tiles from ``lo`` that every row of a query tile sees in full, as
    ``(lean_lo, lean_hi)``: from the first tile at or above ``top`` (the lowest key every row
    sees) to the last one ending at or below ``seen_hi`` (every row sees the keys below it);
    an empty run at ``lo`` where there is none. The prefill kernels run them with EDGE False
    and the rest (``_edge_tiles``) masked."""
    lean_hi = tl.maximum(lo, lo + (seen_hi - lo) // BLOCK_N * BLOCK_N)
    lean_lo = tl.minimum(lo + tl.cdiv(tl.maximum(top - lo, 0), BLOCK_N) * BLOCK_N, lean_hi)
    return lean_lo, lean_hi


@triton.jit
def _edge_tiles(lo, hi, lean_lo, lean_hi, BLOCK_N: tl.constexpr):
    """The masked tiles around ``_lean_tiles``' run over keys lo .. hi: ``(count, heads)``;
    masked tile ``i`` starts at ``_edge_tile(i, heads, lo, lean_hi, BLOCK_N)``: the tiles
    before the run (``heads`` of them), then those from its end (at most a partial one, or
    the diagonal's), in one loop."""
    heads = (lean_lo - lo) // BLOCK_N
    return heads + tl.cdiv(hi - lean_hi, BLOCK_N), heads


@triton.jit
def _edge_tile(i, heads, lo, lean_hi, BLOCK_N: tl.constexpr):
    return tl.where(i < heads, lo + i * BLOCK_N, lean_hi + (i - heads) * BLOCK_N)


@triton.jit
def _paged_step(q1, q2, m_i, l_i, acc, j0, kv_len, sink, gap, pind_ptr, pages_ptr, kvh,
                sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok, qk_scale,
                softcap_log2, krope, inv_freq, rope_scale, tmask_ptr, tlo, tree_start, q_order,
                kfloor, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                ROPE: tl.constexpr, TREE: tl.constexpr, IEEE: tl.constexpr,
                SOFTCAP: tl.constexpr, QUANT: tl.constexpr, EDGE: tl.constexpr = True):
    """One BLOCK_N step over keys j0.. of a paged entry (sliding-window mapping, tree, RoPE);
    keys from ``kv_len`` on (the entry's length, or a loop's bound) are neither read nor seen.
    QUANT: the pages hold fp8 codes, widened here; the caller applies the scales.
    EDGE False (the caller's promise): all BLOCK_N keys are below ``kv_len``, at or after the
    entry's sinks, and every row sees each of them (no window floor, tree or bound inside the
    tile), so nothing is masked per key: the loads only by the head dims, the scores not at
    all; and the keys' page offsets are one run (no select per key)."""
    j = j0 + tl.arange(0, BLOCK_N)
    j_ok = j < kv_len
    if EDGE:
        off = tl.where(j < sink, j, j - sink + gap)           # sinks, then window after a gap
        pg = tl.load(pind_ptr + off // PAGE_SIZE, mask=j_ok, other=0).to(tl.int64)
        kmask = j_ok[:, None] & dd_ok[None, :]
        hmask = j_ok[:, None] & dh_ok[None, :]
        vmask = j_ok[:, None] & dv_ok[None, :]
    else:                                   # by the head dims only (all true at 64 / 128 / 256)
        off = j + (gap - sink)
        pg = tl.load(pind_ptr + off // PAGE_SIZE).to(tl.int64)
        kmask = dd_ok[None, :]
        hmask = dh_ok[None, :]
        vmask = dv_ok[None, :]
    base = pg * sp_page + kvh * sp_head + (off % PAGE_SIZE).to(tl.int64) * sp_row
    if ROPE:       # halves, rotated here: q1 / q2 are the query's rotated halves
        k1 = tl.load(pages_ptr + base[:, None] + dh[None, :], mask=hmask, other=0.0)
        k2 = tl.load(pages_ptr + base[:, None] + HALF + dh[None, :], mask=hmask, other=0.0)
        if QUANT:
            k1 = _widen(k1, q1.dtype)
            k2 = _widen(k2, q1.dtype)
        kpos = (krope + j).to(tl.float32) * rope_scale
        r1, r2 = _rotate(k1, k2, kpos, inv_freq)
        qk = _dot(q1, tl.trans(r1.to(q1.dtype)), IEEE) + _dot(q2, tl.trans(r2.to(q1.dtype)), IEEE)
    else:          # one full-width dot: q1 is the whole query row (q2 unused)
        k = tl.load(pages_ptr + base[:, None] + dd[None, :], mask=kmask, other=0.0)
        if QUANT:
            k = _widen(k, q1.dtype)
        qk = _dot(q1, tl.trans(k), IEEE)
    vis = j_ok[None, :]
    if EDGE:
        vis = vis & ((krope + j)[None, :] >= kfloor[:, None])     # per-query window
    if TREE:
        in_tree = j_ok & (j >= tree_start)
        node = tlo + j - tree_start
        k_order = tl.load(tmask_ptr + 2 * node, mask=in_tree, other=0)
        k_upper = tl.load(tmask_ptr + 2 * node + 1, mask=in_tree, other=0)
        anc = (k_order[None, :] <= q_order[:, None]) & (q_order[:, None] < k_upper[None, :])
        vis = vis & (anc | (~in_tree)[None, :])
    v = tl.load(pages_ptr + sp_kv + base[:, None] + dv[None, :], mask=vmask, other=0.0)
    if QUANT:
        v = _widen(v, q1.dtype)
    return _softmax_step(qk, vis, m_i, l_i, acc, v, qk_scale, softcap_log2, IEEE, TREE, SOFTCAP,
                         EDGE)


# ====================================================================== append / rope
@triton.jit
def _rope_append_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, pages_ptr, slots_ptr, pos_ptr,
                        sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sqo_t, sqo_h, sko_t, sko_h,
                        sp_page, sp_kv, sp_head, sp_row, HQ, HKV, log2_theta, rope_scale, freq_ptr,
                        scale_ptr,
                        HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                        HB: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_Q: tl.constexpr,
                        STORE_KV: tl.constexpr, ROPE: tl.constexpr, FREQ: tl.constexpr, K_OUT: tl.constexpr,
                        HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, QUANT: tl.constexpr):
    """One token per program: rotate q (HAS_Q), rotate k and write k/v to its slot (STORE_KV),
    optionally returning rotated k (K_OUT). slot -1 skips the store. V is copied as two halves
    like K (HEAD_DIM_V == HEAD_DIM) or as one BLOCK_DV-wide row (another width). QUANT: K and V
    are stored as fp8 codes of their values in the compute dtype (K rotated and rounded to it
    first) with the per-head scales of ``scale_ptr`` (2, HKV)."""
    t = tl.program_id(0).to(tl.int64)
    dh = tl.arange(0, BLOCK_HALF)
    dh_ok = dh < HALF
    hb = tl.arange(0, HB)
    inv = _inv_freq(freq_ptr, dh, dh_ok, HEAD_DIM, log2_theta, FREQ)
    pos = 0.0
    if ROPE:
        pos = tl.load(pos_ptr + t).to(tl.float32) * rope_scale
    if HAS_Q:
        for h0 in range(0, HQ, HB):
            h = h0 + hb
            m = (h < HQ)[:, None] & dh_ok[None, :]
            src = q_ptr + t * sq_t + h[:, None] * sq_h + dh[None, :]
            x1 = tl.load(src, mask=m, other=0.0)
            x2 = tl.load(src + HALF, mask=m, other=0.0)
            if ROPE:
                y1, y2 = _rotate(x1, x2, tl.zeros([HB], tl.float32) + pos, inv)
            else:
                y1, y2 = x1, x2
            dst = qo_ptr + t * sqo_t + h[:, None] * sqo_h + dh[None, :]
            tl.store(dst, y1.to(qo_ptr.dtype.element_ty), mask=m)
            tl.store(dst + HALF, y2.to(qo_ptr.dtype.element_ty), mask=m)
    if STORE_KV:
        slot = tl.load(slots_ptr + t).to(tl.int64)
        keep = slot >= 0
        pbase = (slot // PAGE_SIZE) * sp_page + (slot % PAGE_SIZE) * sp_row
        for h0 in range(0, HKV, HB):
            h = h0 + hb
            m = (h < HKV)[:, None] & dh_ok[None, :]
            src = k_ptr + t * sk_t + h[:, None] * sk_h + dh[None, :]
            x1 = tl.load(src, mask=m, other=0.0)
            x2 = tl.load(src + HALF, mask=m, other=0.0)
            if ROPE:
                y1, y2 = _rotate(x1, x2, tl.zeros([HB], tl.float32) + pos, inv)
            else:
                y1, y2 = x1, x2
            if K_OUT:
                dst = ko_ptr + t * sko_t + h[:, None] * sko_h + dh[None, :]
                tl.store(dst, y1.to(ko_ptr.dtype.element_ty), mask=m)
                tl.store(dst + HALF, y2.to(ko_ptr.dtype.element_ty), mask=m)
            if QUANT:
                ks = tl.load(scale_ptr + h, mask=h < HKV, other=1.0)[:, None]
                y1 = _fp8_code(y1.to(k_ptr.dtype.element_ty), ks)
                y2 = _fp8_code(y2.to(k_ptr.dtype.element_ty), ks)
            pk = pages_ptr + pbase + h[:, None] * sp_head + dh[None, :]
            tl.store(pk, y1.to(pages_ptr.dtype.element_ty), mask=m & keep)
            tl.store(pk + HALF, y2.to(pages_ptr.dtype.element_ty), mask=m & keep)
            vsc = 1.0
            if QUANT:
                vsc = tl.load(scale_ptr + HKV + h, mask=h < HKV, other=1.0)[:, None]
            if HEAD_DIM_V == HEAD_DIM:
                vs = v_ptr + t * sv_t + h[:, None] * sv_h + dh[None, :]
                v1 = tl.load(vs, mask=m & keep, other=0.0)
                v2 = tl.load(vs + HALF, mask=m & keep, other=0.0)
                if QUANT:
                    v1 = _fp8_code(v1, vsc)
                    v2 = _fp8_code(v2, vsc)
                tl.store(pk + sp_kv, v1.to(pages_ptr.dtype.element_ty), mask=m & keep)
                tl.store(pk + sp_kv + HALF, v2.to(pages_ptr.dtype.element_ty), mask=m & keep)
            else:
                dv = tl.arange(0, BLOCK_DV)
                mv = (h < HKV)[:, None] & (dv < HEAD_DIM_V)[None, :] & keep
                vr = tl.load(v_ptr + t * sv_t + h[:, None] * sv_h + dv[None, :], mask=mv, other=0.0)
                if QUANT:
                    vr = _fp8_code(vr, vsc)
                tl.store(pages_ptr + pbase + sp_kv + h[:, None] * sp_head + dv[None, :],
                         vr.to(pages_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _gather_rows_kernel(pages_ptr, slots_ptr, ok_ptr, ov_ptr, scale_ptr, HKV,
                        sp_page, sp_kv, sp_head, sp_row, so_t, so_h, sov_t, sov_h,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr,
                        PAGE_SIZE: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                        DEQUANT: tl.constexpr):
    """Row ``slots[i]`` of K (its first HEAD_DIM) and V (its first HEAD_DIM_V), all heads, into
    out_k[i], out_v[i]; DEQUANT: fp8 codes times the per-head scales of ``scale_ptr`` (2, HKV),
    in float32, then the outputs' dtype (otherwise the rows as stored)."""
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    pbase = (slot // PAGE_SIZE) * sp_page + (slot % PAGE_SIZE) * sp_row
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    hb = tl.arange(0, HB)
    for h0 in range(0, HKV, HB):
        h = h0 + hb
        m = (h < HKV)[:, None] & (d < HEAD_DIM)[None, :]
        src = pages_ptr + pbase + h[:, None] * sp_head
        kr = tl.load(src + d[None, :], mask=m)
        mv = (h < HKV)[:, None] & (dv < HEAD_DIM_V)[None, :]
        vr = tl.load(src + sp_kv + dv[None, :], mask=mv)
        if DEQUANT:
            kr = _widen(kr, tl.float32) * tl.load(scale_ptr + h, mask=h < HKV, other=1.0)[:, None]
            vr = _widen(vr, tl.float32) * tl.load(scale_ptr + HKV + h, mask=h < HKV,
                                                  other=1.0)[:, None]
        tl.store(ok_ptr + i * so_t + h[:, None] * so_h + d[None, :],
                 kr.to(ok_ptr.dtype.element_ty), mask=m)
        tl.store(ov_ptr + i * sov_t + h[:, None] * sov_h + dv[None, :],
                 vr.to(ov_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _copy_rows_kernel(pages_ptr, src_base, dst_base, HKV,
                      sp_kv, sp_head, sp_row,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr):
    """Row ``program_id`` of the page at element offset src_base -> same row of the page at
    dst_base (offsets computed on the host so they are 64-bit where they need to be)."""
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    hb = tl.arange(0, HB)
    for h0 in range(0, HKV, HB):
        h = h0 + hb
        m = (h < HKV)[:, None] & (d < HEAD_DIM)[None, :]
        off = r * sp_row + h[:, None] * sp_head + d[None, :]
        s = pages_ptr + src_base + off
        t = pages_ptr + dst_base + off
        tl.store(t, tl.load(s, mask=m), mask=m)
        tl.store(t + sp_kv, tl.load(s + sp_kv, mask=m), mask=m)


# Rows of every layer in one launch (a transfer's export and import: one launch per layer was a
# fixed few ms of host time for 32 layers). The layers' page arrays are separate allocations of
# one shape, strides and dtype: program (i, l) reaches layer l at layer 0's pointer plus
# ``loff[l]``, that layer's element offset from it (``_layer_offsets``; int64, may be negative).
@triton.jit
def _layer_base(loff_ptr, layer, ALIGNED: tl.constexpr):
    off = tl.load(loff_ptr + layer)
    if ALIGNED:
        # every offset is a multiple of 16 elements (checked on the host): without the hint the
        # compiler knows nothing of a loaded offset and loads / stores one element at a time
        off = tl.multiple_of(off, 16)
    return off


@triton.jit
def _gather_layers_kernel(pages_ptr, loff_ptr, slots_ptr, ok_ptr, ov_ptr, HKV,
                          sp_page, sp_kv, sp_head, sp_row,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                          BLOCK_DV: tl.constexpr, ALIGNED: tl.constexpr):
    """Row ``slots[i]`` of layer ``l`` (program (i, l)), K's first HEAD_DIM and V's first
    HEAD_DIM_V of every head, as stored, into ``out_k[l, i]`` / ``out_v[l, i]``: fresh contiguous
    (L, n, HKV, HEAD_DIM) / (L, n, HKV, HEAD_DIM_V) arrays (n is the grid's first axis, so no
    per-call size reaches the kernel's specialisation)."""
    i = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    row = layer * tl.num_programs(0).to(tl.int64) + i
    slot = tl.load(slots_ptr + i).to(tl.int64)
    pbase = (_layer_base(loff_ptr, layer, ALIGNED) + (slot // PAGE_SIZE) * sp_page
             + (slot % PAGE_SIZE) * sp_row)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    hb = tl.arange(0, HB)
    for h0 in range(0, HKV, HB):
        h = h0 + hb
        m = (h < HKV)[:, None] & (d < HEAD_DIM)[None, :]
        mv = (h < HKV)[:, None] & (dv < HEAD_DIM_V)[None, :]
        src = pages_ptr + pbase + h[:, None] * sp_head
        kr = tl.load(src + d[None, :], mask=m)
        vr = tl.load(src + sp_kv + dv[None, :], mask=mv)
        tl.store(ok_ptr + row * HKV * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :], kr, mask=m)
        tl.store(ov_ptr + row * HKV * HEAD_DIM_V + h[:, None] * HEAD_DIM_V + dv[None, :], vr,
                 mask=mv)


@triton.jit
def _append_layers_kernel(k_ptr, v_ptr, pages_ptr, loff_ptr, slots_ptr,
                          sk_l, sk_t, sk_h, sv_l, sv_t, sv_h, HKV,
                          sp_page, sp_kv, sp_head, sp_row,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HB: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                          BLOCK_DV: tl.constexpr, ALIGNED: tl.constexpr):
    """``k[l, t]`` / ``v[l, t]`` (program (t, l)) into layer ``l``'s row ``slots[t]`` (-1: skip),
    cast to the pages' dtype: what ``_rope_append_kernel`` stores without RoPE or fp8 scales
    (same slot address, same single cast), for every layer at once."""
    t = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    keep = slot >= 0
    pbase = (_layer_base(loff_ptr, layer, ALIGNED) + (slot // PAGE_SIZE) * sp_page
             + (slot % PAGE_SIZE) * sp_row)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    hb = tl.arange(0, HB)
    for h0 in range(0, HKV, HB):
        h = h0 + hb
        m = (h < HKV)[:, None] & (d < HEAD_DIM)[None, :] & keep
        mv = (h < HKV)[:, None] & (dv < HEAD_DIM_V)[None, :] & keep
        kr = tl.load(k_ptr + layer * sk_l + t * sk_t + h[:, None] * sk_h + d[None, :], mask=m)
        vr = tl.load(v_ptr + layer * sv_l + t * sv_t + h[:, None] * sv_h + dv[None, :], mask=mv)
        dst = pages_ptr + pbase + h[:, None] * sp_head
        tl.store(dst + d[None, :], kr.to(pages_ptr.dtype.element_ty), mask=m)
        tl.store(dst + sp_kv + dv[None, :], vr.to(pages_ptr.dtype.element_ty), mask=mv)


# ====================================================================== attention
@triton.jit
def _ragged_visible(c, c_ok, r, window_left, tlo, q_order, tmask_ptr, TREE: tl.constexpr):
    """Which new keys c each row r sees: causal, and (window_left >= 0) no key more than
    window_left rows before it (new tokens of a sequence sit at consecutive positions); with a
    tree, only its ancestors. The attention kernel and the non-finite pass share it, so both
    mask alike."""
    lo_key = tl.where(window_left >= 0, r - window_left, -2147483647)
    vis = c_ok[None, :] & (c[None, :] <= r[:, None]) & (c[None, :] >= lo_key[:, None])
    if TREE:
        k_order = tl.load(tmask_ptr + 2 * (tlo + c), mask=c_ok, other=0)
        k_upper = tl.load(tmask_ptr + 2 * (tlo + c) + 1, mask=c_ok, other=0)
        vis = vis & (k_order[None, :] <= q_order[:, None]) & (q_order[:, None] < k_upper[None, :])
    return vis


@triton.jit
def _ragged_rows(qo_ptr, GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr):
    """This program's sequence, KV head, the sequence's first token and length, its first query
    row m0, and per row: the token r within the sequence, the query head, and whether it is real.
    Grid (q tiles, seqs, Hkv); a row is (token, head of the KV head's group)."""
    seq = tl.program_id(1)
    kvh = tl.program_id(2)
    lo = tl.load(qo_ptr + seq)
    n = tl.load(qo_ptr + seq + 1) - lo
    m0 = tl.program_id(0) * M_TOK
    ri = tl.arange(0, BLOCK_R)
    r = m0 + ri // GROUP
    head = kvh * GROUP + ri % GROUP
    row_ok = (ri < M_TOK * GROUP) & (r < n)
    return seq, kvh, lo, n, m0, r, head, row_ok


@triton.jit
def _out_rows(lo, m0, nq, kvh, GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr):
    """A prefill program's output rows again, after its key loops: per row its token (int64),
    query head and whether it is real (``_ragged_rows``' rows from the scalars ``lo`` (first
    token), ``m0`` (first row), ``nq`` (rows of the entry)). Written as other expressions than
    the ones before the loops, so the compiler does not keep those vectors alive through them
    (at the loops' register peak: 45 more registers and spills in the masked loop on sm_90 at
    128-row tiles); here they cost a few integer ops."""
    rs = tl.arange(0, BLOCK_R)
    head = rs % GROUP + kvh * GROUP
    ok = (rs // GROUP < nq - m0) & (rs < M_TOK * GROUP)
    tok = (rs // GROUP).to(tl.int64) + (lo + m0).to(tl.int64)
    return tok, head, ok


@triton.jit
def _ragged_tile(q1, q2, m_i, l_i, acc, c0, end, lo, r, kvh, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                 krope, inv, rope_scale, dh, dh_ok, dd, dd_ok, dv, dv_ok, tlo, q_order, tmask_ptr,
                 window_left, qk_scale, softcap_log2, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROPE: tl.constexpr, TREE: tl.constexpr, IEEE: tl.constexpr,
                 SOFTCAP: tl.constexpr, EDGE: tl.constexpr = True):
    """One BLOCK_N step over the new keys c0.. of a sequence (rows r: its query tokens). V holds
    no non-finite value here (``ragged_attention`` zeroes them and puts them back afterwards), so
    the plain dot is exact although masked keys sit in the tile. (With fp8 pages K and V come
    as their codes, from ``_finite_v_kernel``; the caller applies the scales.) EDGE False (the
    caller's promise): every row sees all BLOCK_N keys (below ``end``, causal and window
    satisfied, no tree): nothing is masked per key or score."""
    c = c0 + tl.arange(0, BLOCK_N)
    c_ok = c < end
    kt = (lo + c).to(tl.int64)
    if EDGE:
        km = c_ok[:, None] & dh_ok[None, :]
        kfm = c_ok[:, None] & dd_ok[None, :]
        vm = c_ok[:, None] & dv_ok[None, :]
    else:                                   # by the head dims only (all true at 64 / 128 / 256)
        km = dh_ok[None, :]
        kfm = dd_ok[None, :]
        vm = dv_ok[None, :]
    if ROPE:
        kb = k_ptr + kt[:, None] * sk_t + kvh * sk_h + dh[None, :]
        kpos = (krope + c).to(tl.float32) * rope_scale
        kr1, kr2 = _rotate(tl.load(kb, mask=km, other=0.0),
                           tl.load(kb + HALF, mask=km, other=0.0), kpos, inv)
        qk = (_dot(q1, tl.trans(kr1.to(q1.dtype)), IEEE)
              + _dot(q2, tl.trans(kr2.to(q1.dtype)), IEEE))
    else:
        kf = tl.load(k_ptr + kt[:, None] * sk_t + kvh * sk_h + dd[None, :], mask=kfm, other=0.0)
        qk = _dot(q1, tl.trans(kf), IEEE)
    vis = c_ok[None, :]
    if EDGE:
        vis = _ragged_visible(c, c_ok, r, window_left, tlo, q_order, tmask_ptr, TREE)
    v = tl.load(v_ptr + kt[:, None] * sv_t + kvh * sv_h + dv[None, :], mask=vm, other=0.0)
    return _softmax_step(qk, vis, m_i, l_i, acc, v, qk_scale, softcap_log2, IEEE, False, SOFTCAP,
                         EDGE)


@triton.jit
def _ragged_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, qo_ptr, qpos_ptr, krope_ptr,
                   tind_ptr, tmask_ptr, sinks_ptr, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
                   sl_t, qk_scale, softcap_log2, log2_theta, rope_scale, freq_ptr, window_left,
                   scale_ptr, guard_ptr,
                   GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, TREE: tl.constexpr,
                   ROPE: tl.constexpr, FREQ: tl.constexpr, IEEE: tl.constexpr,
                   HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
                   SINKS: tl.constexpr, QUANT: tl.constexpr, GUARD: tl.constexpr):
    """Causal (or tree) attention among one sequence's new tokens; grid (q tiles, seqs, Hkv).
    QUANT: K and V are fp8 codes (in the compute dtype, from ``_finite_v_kernel``) with the scales
    of ``scale_ptr``. GUARD: every program returns at once unless ``guard_ptr[0]`` is set (the
    library's result stands unless its inputs held a non-finite q or k: ``kvcache_cuda.flash``)."""
    seq, kvh, lo, n, m0, r, head, row_ok = _ragged_rows(qo_ptr, GROUP, M_TOK, BLOCK_R)
    go = m0 < n
    if GUARD:
        go = go & (tl.load(guard_ptr) != 0)
    if go:
        ks, vs = _kv_scales(scale_ptr, kvh, tl.num_programs(2), QUANT)
        tok = (lo + r).to(tl.int64)
        dh = tl.arange(0, BLOCK_HALF)
        dh_ok = dh < HALF
        dd = tl.arange(0, BLOCK_D)
        dd_ok = dd < HEAD_DIM
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < HEAD_DIM_V
        inv = _inv_freq(freq_ptr, dh, dh_ok, HEAD_DIM, log2_theta, FREQ)
        q1, q2 = _load_query(q_ptr, qpos_ptr, tok, head, row_ok, sq_t, sq_h, dh, dh_ok, dd, dd_ok,
                             inv, rope_scale, HALF, ROPE)
        krope = 0
        if ROPE:
            krope = tl.load(krope_ptr + seq)
        tlo = 0
        q_order = tl.zeros([BLOCK_R], tl.int32)
        if TREE:
            tlo = tl.load(tind_ptr + seq)                      # tree size == n: node of row r is r
            q_order = tl.load(tmask_ptr + 2 * (tlo + r), mask=row_ok, other=0)
        m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        end = tl.minimum(m0 + M_TOK, n)                        # causal: no key past the last row
        start = 0
        if window_left >= 0:        # tiles wholly before the first row's window hold no visible key
            start = (tl.maximum(m0 - window_left, 0) // BLOCK_N) * BLOCK_N
        # whole tiles every row sees (at or before the first row: causal; at or after the
        # last row's window floor; none with a tree) run with no mask per key or score; the
        # rest (before the floor, the diagonal's tiles) masked, in one loop
        seen = start
        if not TREE:
            seen = tl.minimum(m0 + 1, end)
        top = start
        if window_left >= 0:
            top = end - 1 - window_left                        # the last row's lowest key
        lean_lo, lean_hi = _lean_tiles(start, seen, top, BLOCK_N)
        for c0 in range(lean_lo, lean_hi, BLOCK_N):
            m_i, l_i, acc = _ragged_tile(
                q1, q2, m_i, l_i, acc, c0, end, lo, r, kvh, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                krope, inv, rope_scale, dh, dh_ok, dd, dd_ok, dv, dv_ok, tlo, q_order, tmask_ptr,
                window_left, qk_scale * ks, softcap_log2, HALF, BLOCK_N, ROPE, TREE, IEEE,
                SOFTCAP, False)
        edges, heads = _edge_tiles(start, end, lean_lo, lean_hi, BLOCK_N)
        for i in range(0, edges):
            c0 = _edge_tile(i, heads, start, lean_hi, BLOCK_N)
            m_i, l_i, acc = _ragged_tile(
                q1, q2, m_i, l_i, acc, c0, end, lo, r, kvh, k_ptr, v_ptr, sk_t, sk_h, sv_t, sv_h,
                krope, inv, rope_scale, dh, dh_ok, dd, dd_ok, dv, dv_ok, tlo, q_order, tmask_ptr,
                window_left, qk_scale * ks, softcap_log2, HALF, BLOCK_N, ROPE, TREE, IEEE,
                SOFTCAP)
        if QUANT:
            acc = acc * vs
        tok, head, row_ok = _out_rows(lo, m0, n, kvh, GROUP, M_TOK, BLOCK_R)
        o, lse = _finish(acc, m_i, l_i, _row_sinks(sinks_ptr, head, row_ok, SINKS), SINKS)
        tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
        tl.store(lse_ptr + tok * sl_t + head, lse, mask=row_ok)


@triton.jit
def _finite_v_kernel(v_ptr, out_ptr, bad_ptr, any_ptr, n_tok, sv_t, sv_h, so_t, so_h, HKV,
                     scale_ptr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FLAGS: tl.constexpr,
                     VALUES: tl.constexpr):
    """out = v with NaN / +-inf set to 0; bad[t, h] = 1 where v[t, h] held one; any = 1 if one
    did anywhere (any must be 0 before). Grid (T tiles, Hkv). QUANT: out holds the fp8 codes
    of v (in its dtype; V's per-head scales from the (2, HKV) ``scale_ptr``; they saturate, so
    only NaN is non-finite); with VALUES their values, ``code * scale`` in float32 stored in
    v's dtype (what ``flash.scale_heads`` makes of the codes: the library's operand where no
    kernel reads the codes). Without FLAGS the input is K: out is its codes (K's scales), NaN
    kept, and bad / any are not written."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    t_ok = t < n_tok
    m = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    t64 = t.to(tl.int64)
    x = tl.load(v_ptr + t64[:, None] * sv_t + h * sv_h + d[None, :], mask=m, other=0.0)
    sc = 1.0
    if QUANT:
        row = HKV if FLAGS else 0                 # V's scales, or K's
        sc = tl.load(scale_ptr + row + h)
        x = _widen(_fp8_code(x, sc), v_ptr.dtype.element_ty)
    if FLAGS:
        bad = (x - x) != 0.0                                      # NaN or +-inf
        y = tl.where(bad, 0.0, x)
        if VALUES:
            y = (y.to(tl.float32) * sc).to(v_ptr.dtype.element_ty)
        tl.store(out_ptr + t64[:, None] * so_t + h * so_h + d[None, :], y, mask=m)
        row_bad = tl.max(bad.to(tl.int32), 1)
        tl.store(bad_ptr + t64 * HKV + h, row_bad, mask=t_ok)
        if tl.max(row_bad, 0) > 0:
            tl.atomic_max(any_ptr, 1)
    else:
        if VALUES:
            x = (x.to(tl.float32) * sc).to(v_ptr.dtype.element_ty)
        tl.store(out_ptr + t64[:, None] * so_t + h * so_h + d[None, :], x, mask=m)


@triton.jit
def _ragged_nonfinite_kernel(v_ptr, bad_ptr, any_ptr, o_ptr, qo_ptr, tind_ptr, tmask_ptr,
                             sv_t, sv_h, so_t, so_h, HKV, window_left, scale_ptr,
                             GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                             TREE: tl.constexpr, QUANT: tl.constexpr):
    """Put the non-finite V values that ``_ragged_kernel`` ran without back into the outputs of
    the rows that see their keys (same grid and rows as ``_ragged_kernel``). Without any such
    value (``any`` 0: nearly always) a program reads one flag and stops. QUANT: V as its fp8
    codes (an infinite value saturated, only NaN left)."""
    seq, kvh, lo, n, m0, r, head, row_ok = _ragged_rows(qo_ptr, GROUP, M_TOK, BLOCK_R)
    if (tl.load(any_ptr) > 0) & (m0 < n):
        dd = tl.arange(0, BLOCK_D)
        dd_ok = dd < HEAD_DIM
        tlo = 0
        q_order = tl.zeros([BLOCK_R], tl.int32)
        if TREE:
            tlo = tl.load(tind_ptr + seq)
            q_order = tl.load(tmask_ptr + 2 * (tlo + r), mask=row_ok, other=0)
        end = tl.minimum(m0 + M_TOK, n)
        seen = tl.zeros([BLOCK_R, BLOCK_D], tl.int32)
        for c0 in range(0, end, BLOCK_N):
            c = c0 + tl.arange(0, BLOCK_N)
            c_ok = c < end
            kt = (lo + c).to(tl.int64)
            key_bad = tl.load(bad_ptr + kt * HKV + kvh, mask=c_ok, other=0)
            if tl.max(key_bad, 0) > 0:
                vis = _ragged_visible(c, c_ok, r, window_left, tlo, q_order, tmask_ptr, TREE)
                v = tl.load(v_ptr + kt[:, None] * sv_t + kvh * sv_h + dd[None, :],
                            mask=c_ok[:, None] & dd_ok[None, :], other=0.0)
                if QUANT:
                    v = _widen(_fp8_code(v, tl.load(scale_ptr + HKV + kvh)), tl.float32)
                seen = _nonfinite_codes(seen, vis, v, key_bad)
        if tl.max(tl.max(seen, 1), 0) > 0:
            tok = (lo + r).to(tl.int64)
            ptr = o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dd[None, :]
            m = row_ok[:, None] & dd_ok[None, :]
            o = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
            tl.store(ptr, _apply_nonfinite(o, seen).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _paged_segment(q1, q2, seg_lo, seg_hi, sink, gap, pind_ptr, pages_ptr, kvh, sp_page, sp_kv,
                   sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok, qk_scale, v_scale,
                   softcap_log2, krope, inv_freq, rope_scale, tmask_ptr, tlo, tree_start, q_order,
                   kfloor, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, ROPE: tl.constexpr,
                   TREE: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr,
                   QUANT: tl.constexpr):
    """One key segment of batch-invariant attention (keys ``seg_lo`` .. ``seg_hi``): its own
    online softmax over BLOCK_N masked steps in key order, as ``_segment_result``'s (o, lse2);
    QUANT: V's scale applied per segment. The one body of both ways of computing segments."""
    m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for j0 in range(seg_lo, seg_hi, BLOCK_N):
        m_i, l_i, acc = _paged_step(
            q1, q2, m_i, l_i, acc, j0, seg_hi, sink, gap, pind_ptr, pages_ptr, kvh, sp_page,
            sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok, qk_scale, softcap_log2,
            krope, inv_freq, rope_scale, tmask_ptr, tlo, tree_start, q_order, kfloor, HALF,
            PAGE_SIZE, BLOCK_N, ROPE, TREE, IEEE, SOFTCAP, QUANT)
    if QUANT:
        acc = acc * v_scale
    return _segment_result(acc, m_i, l_i)


@triton.jit
def _paged_prefill_kernel(q_ptr, pages_ptr, o_ptr, lse_ptr, qo_ptr, pindptr_ptr, pind_ptr,
                          kvlen_ptr, sink_ptr, gap_ptr, krope_ptr, qpos_ptr, tind_ptr, tmask_ptr,
                          sinks_ptr, n_entries, sq_t, sq_h, sp_page, sp_kv, sp_head, sp_row, so_t,
                          so_h, so_s, sl_t, sl_s, qk_scale, softcap_log2, log2_theta, rope_scale,
                          freq_ptr, window_left, scale_ptr, guard_ptr,
                          GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, HEAD_DIM: tl.constexpr,
                          HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                          PAGE_SIZE: tl.constexpr, TREE: tl.constexpr, ROPE: tl.constexpr, FREQ: tl.constexpr,
                          IEEE: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                          SOFTCAP: tl.constexpr, SINKS: tl.constexpr, QUANT: tl.constexpr,
                          CHAINS: tl.constexpr, KV_SPLITS: tl.constexpr, UNIFORM: tl.constexpr,
                          INVARIANT: tl.constexpr = False, GUARD: tl.constexpr = False,
                          SEG: tl.constexpr = 0, SEG_SPLIT: tl.constexpr = False,
                          SEG_K: tl.constexpr = 1):
    """Entries with many queries; grid (sum of q tiles upper bound, Hkv, KV_SPLITS). Tile ->
    entry by a vector prefix sum over all entries (no host-side tile plan, no extra launches).
    UNIFORM: the entry's scalars and the lean loop's bounds through ``_warp_uniform``.
    KV_SPLITS > 1: program ``s`` of a tile covers the ``s``-th of KV_SPLITS equal runs of its
    keys (whole BLOCK_N steps) and stores fp32 partial o / lse at split ``s`` (strides so_s /
    sl_s), merged by ``_merge_splits_kernel`` (a shared prefix's entry holds few row tiles over
    many keys: without the split it fills a few SMs).
    TREE: a tile's queries see no tree key after its last query node (ancestors come first),
    so the loop stops there; the keys every row of the tile sees (the history before the tree,
    and with CHAINS, causal chains, the tree keys up to the tile's first query) run unmasked,
    only the rest through the tree mask and the masked non-finite V handling.
    INVARIANT (``CacheConfig(batch_invariant=True)``, KV_SPLITS 1): a row's keys fall in
    segments of SEG keys (a multiple of BLOCK_N) from key 0, whatever the batch; each segment
    is its own online softmax over BLOCK_N tiles in key order, masked per key, and the
    segments' results fold in key order (``_segment_result``, ``_segment_fold``). A row's
    steps do not depend on the other rows of its tile (the tiles past its last key change
    nothing: p = 0, alpha = 1; a segment past it folds in as nothing), so a token gets the
    same bits in a prompt chunk (the program folds its segments itself) and in a decode step
    (SEG_SPLIT: grid 0 is entries x SEG_K, program k of an entry takes its segments k, k +
    SEG_K, ... and stores each one's fp32 (o, lse2) at row (the entry's first partial + the
    segment) of ``o_ptr`` / ``lse_ptr``, the entries' segments in entry order, folded by
    ``_fold_segments_kernel``): a fixed split size, whatever programs compute the segments.
    GUARD (KV_SPLITS 1): as the ragged kernel's."""
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    ei = tl.arange(0, BLOCK_E)
    e_ok = ei < n_entries
    e_lo = tl.load(qo_ptr + ei, mask=e_ok, other=0)
    e_hi = tl.load(qo_ptr + ei + 1, mask=e_ok, other=0)
    if SEG_SPLIT:       # SEG_K programs an entry; nb: the entries' key segments
        nb = (tl.load(kvlen_ptr + ei, mask=e_ok, other=0) + SEG - 1) // SEG
        e = _warp_uniform(pid // SEG_K, UNIFORM)
    else:               # a program per query tile of an entry
        nb = (e_hi - e_lo + M_TOK - 1) // M_TOK
        cum = tl.cumsum(nb, 0)
        e = _warp_uniform(tl.sum((cum <= pid).to(tl.int32), 0), UNIFORM)
    go = e < n_entries
    if GUARD:
        go = go & (tl.load(guard_ptr) != 0)
    if go:
        if SEG_SPLIT:
            first = _warp_uniform(tl.sum(tl.where(ei < e, nb, 0), 0), UNIFORM)
            m0 = 0
        else:
            m0 = _warp_uniform((pid - tl.sum(tl.where(ei < e, nb, 0), 0)) * M_TOK, UNIFORM)
        lo = _warp_uniform(tl.load(qo_ptr + e), UNIFORM)
        nq = _warp_uniform(tl.load(qo_ptr + e + 1), UNIFORM) - lo
        kv_len = _warp_uniform(tl.load(kvlen_ptr + e), UNIFORM)
        sink = _warp_uniform(tl.load(sink_ptr + e), UNIFORM)
        gap = _warp_uniform(tl.load(gap_ptr + e), UNIFORM)
        pstart = _warp_uniform(tl.load(pindptr_ptr + e), UNIFORM)
        ri = tl.arange(0, BLOCK_R)
        r = m0 + ri // GROUP
        head = kvh * GROUP + ri % GROUP
        row_ok = (ri < M_TOK * GROUP) & (r < nq)
        tok = (lo + r).to(tl.int64)
        dh = tl.arange(0, BLOCK_HALF)
        dh_ok = dh < HALF
        dd = tl.arange(0, BLOCK_D)
        dd_ok = dd < HEAD_DIM
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < HEAD_DIM_V
        inv = _inv_freq(freq_ptr, dh, dh_ok, HEAD_DIM, log2_theta, FREQ)
        q1, q2 = _load_query(q_ptr, qpos_ptr, tok, head, row_ok, sq_t, sq_h, dh, dh_ok, dd, dd_ok,
                             inv, rope_scale, HALF, ROPE)
        if QUANT:            # the pages' codes are widened to float16 (_operand)
            q1, q2 = _operand(q1), _operand(q2)
        # inline RoPE and the per-query window use it
        krope = _warp_uniform(tl.load(krope_ptr + e), UNIFORM)
        kfloor = _window_floor(qpos_ptr, tok, row_ok, window_left, BLOCK_R)
        tlo = 0
        tree_start = kv_len
        q_order = tl.zeros([BLOCK_R], tl.int32)
        if TREE:
            tlo = tl.load(tind_ptr + e)
            ts = tl.load(tind_ptr + e + 1) - tlo
            tree_start = kv_len - ts
            q_node = ts - nq + r
            q_order = tl.load(tmask_ptr + 2 * (tlo + q_node), mask=row_ok & (ts > 0), other=0)
        ks, vs = _kv_scales(scale_ptr, kvh, tl.num_programs(1), QUANT)
        m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
        hi = kv_len             # keys any row of this tile may see
        full = kv_len           # keys before this one every row sees (unmasked loop)
        if TREE:
            q_lo = ts - nq + m0                                # the tile's first query node
            q_hi = ts - nq + tl.minimum(m0 + M_TOK, nq) - 1    # and its last
            hi = tl.where(ts > 0, tl.minimum(kv_len, tree_start + q_hi + 1), kv_len)
            if CHAINS:
                full = tree_start + q_lo + 1
            else:
                full = tree_start
            full = tl.where(ts > 0, tl.minimum(full, hi), kv_len)
        if INVARIANT:
            # fixed key segments from key 0, each a masked online softmax of its own, folded
            # in key order (the docstring); no unmasked run, no split by count
            # SEG_SPLIT: segments k, k + SEG_K, ... of one decode entry, each stored as a
            # partial; else every segment of the tile's rows, folded here
            seg0 = 0
            step = 1
            if SEG_SPLIT:
                seg0 = pid % SEG_K
                step = SEG_K
            rs = tl.arange(0, BLOCK_R)
            m_f = tl.zeros([BLOCK_R], tl.float32) - float("inf")
            l_f = tl.zeros([BLOCK_R], tl.float32)
            acc_f = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
            for seg in range(seg0, (hi + SEG - 1) // SEG, step):
                seg_lo = seg * SEG
                seg_hi = tl.minimum(hi, seg_lo + SEG)
                o_s, lse2 = _paged_segment(
                    q1, q2, seg_lo, seg_hi, sink, gap, pind_ptr + pstart, pages_ptr, kvh,
                    sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok,
                    qk_scale * ks, vs, softcap_log2, krope, inv, rope_scale, tmask_ptr, tlo,
                    tree_start, q_order, kfloor, HALF, PAGE_SIZE, BLOCK_N, BLOCK_R, BLOCK_DV,
                    ROPE, TREE, IEEE, SOFTCAP, QUANT)
                if SEG_SPLIT:
                    head = rs % GROUP + kvh * GROUP
                    row_ok = rs < GROUP                 # the entry's one query
                    part = (first + seg).to(tl.int64)
                    tl.store(o_ptr + part * so_t + head[:, None] * so_h + dv[None, :], o_s,
                             mask=row_ok[:, None] & dv_ok[None, :])
                    tl.store(lse_ptr + part * sl_t + head, lse2, mask=row_ok)
                else:
                    m_f, l_f, acc_f = _segment_fold(m_f, l_f, acc_f, o_s, lse2)
            if not SEG_SPLIT:
                tok, head, row_ok = _out_rows(lo, m0, nq, kvh, GROUP, M_TOK, BLOCK_R)
                o, lse = _finish(acc_f, m_f, l_f, _row_sinks(sinks_ptr, head, row_ok, SINKS),
                                 SINKS)
                tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dv[None, :],
                         o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
                tl.store(lse_ptr + tok * sl_t + head, lse, mask=row_ok)
        else:
            # this program's run of the keys (all of them without a split)
            s_lo = 0
            s_hi = hi
            if KV_SPLITS > 1:
                span = tl.cdiv(hi, KV_SPLITS * BLOCK_N) * BLOCK_N
                s_lo = tl.program_id(2) * span
                s_hi = tl.minimum(hi, s_lo + span)
            u_hi = tl.minimum(full, s_hi)
            # keys s_lo .. u_hi need no tree mask. Of them, whole tiles every row of this tile
            # sees (below u_hi, at or above every row's window floor, none of the sinks) run with
            # no mask per key or score (EDGE False); the tiles before (under some row's floor,
            # holding sinks) and the last, partial one (keys past u_hi load as 0 and are not
            # seen) run masked, in one loop. The masked tree loop starts at ``full``: a decode
            # row's chain ends in its only query, so it never takes that loop.
            top = sink               # the lowest key every row sees in full
            if window_left >= 0:     # at or above the highest floor
                top = tl.maximum(top, tl.max(tl.where(row_ok, kfloor, -1073741824), 0) - krope)
            lean_lo, lean_hi = _lean_tiles(s_lo, u_hi, top, BLOCK_N)
            # (a window's top comes from the rows' floors, a vector: broadcast again)
            lean_lo = _warp_uniform(lean_lo, UNIFORM)
            lean_hi = _warp_uniform(lean_hi, UNIFORM)
            for j0 in range(lean_lo, lean_hi, BLOCK_N):
                m_i, l_i, acc = _paged_step(
                    q1, q2, m_i, l_i, acc, j0, u_hi, sink, gap, pind_ptr + pstart, pages_ptr, kvh,
                    sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok, qk_scale * ks,
                    softcap_log2, krope, inv, rope_scale, tmask_ptr, tlo, tree_start, q_order, kfloor,
                    HALF, PAGE_SIZE, BLOCK_N, ROPE, False, IEEE, SOFTCAP, QUANT, False)
            edges, heads = _edge_tiles(s_lo, u_hi, lean_lo, lean_hi, BLOCK_N)
            # the guard skips the masked loop's pipeline prologue (its first stages' address and
            # mask arithmetic run even for no trip): where every tile is lean (keys a multiple of
            # BLOCK_N, no window or sinks) that was most of a program's fixed instructions
            if edges > 0:
                for i in range(0, edges):
                    j0 = _edge_tile(i, heads, s_lo, lean_hi, BLOCK_N)
                    m_i, l_i, acc = _paged_step(
                        q1, q2, m_i, l_i, acc, j0, u_hi, sink, gap, pind_ptr + pstart, pages_ptr,
                        kvh, sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok,
                        qk_scale * ks, softcap_log2, krope, inv, rope_scale, tmask_ptr, tlo,
                        tree_start, q_order, kfloor, HALF, PAGE_SIZE, BLOCK_N, ROPE, False, IEEE,
                        SOFTCAP, QUANT)
            if TREE:
                for j0 in range(tl.maximum(full, s_lo), s_hi, BLOCK_N):
                    m_i, l_i, acc = _paged_step(
                        q1, q2, m_i, l_i, acc, j0, s_hi, sink, gap, pind_ptr + pstart, pages_ptr,
                        kvh, sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok,
                        qk_scale * ks, softcap_log2, krope, inv, rope_scale, tmask_ptr, tlo,
                        tree_start, q_order, kfloor, HALF, PAGE_SIZE, BLOCK_N, ROPE, TREE, IEEE,
                        SOFTCAP, QUANT)
            if QUANT:
                acc = acc * vs
            tok, head, row_ok = _out_rows(lo, m0, nq, kvh, GROUP, M_TOK, BLOCK_R)
            o, lse = _finish(acc, m_i, l_i, _row_sinks(sinks_ptr, head, row_ok, SINKS), SINKS)
            split = tl.program_id(2).to(tl.int64)
            tl.store(o_ptr + tok[:, None] * so_t + split * so_s + head[:, None] * so_h + dv[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
            tl.store(lse_ptr + tok * sl_t + split * sl_s + head, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(po_ptr, pl_ptr, o_ptr, lse_ptr, sinks_ptr, n_heads, so_t, so_h, so_s,
                         sl_t, sl_s, HEADS: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                         BLOCK_DV: tl.constexpr, KV_SPLITS: tl.constexpr, SINKS: tl.constexpr):
    """o (T, Hq, Dv) / lse (T, Hq) of the paged prefill kernel's KV_SPLITS fp32 partials, by
    lse; grid (T, heads / HEADS). A split that saw no key (lse -inf, its partial o never
    written: rows no entry covers) adds nothing, so such a row reads o = 0 / lse = -inf (the
    sink with SINKS, which joins here once); a NaN lse (a NaN K seen) stays NaN."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < n_heads
    d = tl.arange(0, BLOCK_DV)
    hd_ok = h_ok[:, None] & (d < HEAD_DIM_V)[None, :]
    peak = tl.full([HEADS], float("-inf"), tl.float32)
    for s in tl.static_range(KV_SPLITS):
        ls = tl.load(pl_ptr + t * sl_t + s * sl_s + h, mask=h_ok, other=float("-inf"))
        peak = tl.maximum(peak, ls)
    if SINKS:
        sk = tl.load(sinks_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, sk)
    peak_use = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, BLOCK_DV], tl.float32)
    for s in tl.static_range(KV_SPLITS):
        ls = tl.load(pl_ptr + t * sl_t + s * sl_s + h, mask=h_ok, other=float("-inf"))
        w = tl.exp(ls - peak_use)
        po = tl.load(po_ptr + t * so_t + s * so_s + h[:, None] * so_h + d[None, :],
                     mask=hd_ok & (ls != float("-inf"))[:, None], other=0.0)
        acc += po * w[:, None]
        total += w
    if SINKS:
        total += tl.exp(sk - peak_use)
    ok = total != 0
    o = acc / tl.where(ok, total, 1.0)[:, None]
    lse = tl.where(ok, peak_use + tl.log(tl.where(ok, total, 1.0)), float("-inf"))
    tl.store(o_ptr + t * n_heads * HEAD_DIM_V + h[:, None] * HEAD_DIM_V + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=hd_ok)
    tl.store(lse_ptr + t * n_heads + h, lse, mask=h_ok)


@triton.jit
def _fold_segments_kernel(po_ptr, pl_ptr, o_ptr, lse_ptr, qo_ptr, kvlen_ptr, sinks_ptr,
                          n_entries, n_heads, spo_p, spo_h, spl_p,
                          SEG: tl.constexpr, BLOCK_E: tl.constexpr, HEADS: tl.constexpr,
                          HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SINKS: tl.constexpr):
    """o (T, Hq, Dv) / lse (T, Hq) of a batch-invariant decode step's one query an entry: its
    segments' fp32 partials (the paged prefill kernel's SEG_SPLIT programs, one per (entry,
    segment) in entry order) folded in key order by ``_segment_fold``, as the prefill kernel
    folds a prompt row's segments in its program; grid (entries, heads / HEADS). The sink
    joins once, in ``_finish``. Rows no entry covers are not written (the caller's fill)."""
    e = tl.program_id(0)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    h_ok = h < n_heads
    d = tl.arange(0, BLOCK_DV)
    hd_ok = h_ok[:, None] & (d < HEAD_DIM_V)[None, :]
    if e < n_entries:
        lo = tl.load(qo_ptr + e)
        if tl.load(qo_ptr + e + 1) > lo:
            ei = tl.arange(0, BLOCK_E)
            nb = (tl.load(kvlen_ptr + ei, mask=ei < n_entries, other=0) + SEG - 1) // SEG
            first = tl.sum(tl.where(ei < e, nb, 0), 0)
            count = (tl.load(kvlen_ptr + e) + SEG - 1) // SEG
            m_f = tl.zeros([HEADS], tl.float32) - float("inf")
            l_f = tl.zeros([HEADS], tl.float32)
            acc_f = tl.zeros([HEADS, BLOCK_DV], tl.float32)
            for i in range(0, count):
                part = (first + i).to(tl.int64)
                o_s = tl.load(po_ptr + part * spo_p + h[:, None] * spo_h + d[None, :],
                              mask=hd_ok, other=0.0)
                lse2 = tl.load(pl_ptr + part * spl_p + h, mask=h_ok, other=float("-inf"))
                m_f, l_f, acc_f = _segment_fold(m_f, l_f, acc_f, o_s, lse2)
            o, lse = _finish(acc_f, m_f, l_f, _row_sinks(sinks_ptr, h, h_ok, SINKS), SINKS)
            tok = lo.to(tl.int64)
            tl.store(o_ptr + tok * n_heads * HEAD_DIM_V + h[:, None] * HEAD_DIM_V + d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=hd_ok)
            tl.store(lse_ptr + tok * n_heads + h, lse, mask=h_ok)


@triton.jit
def _paged_decode_kernel(q_ptr, pages_ptr, o_ptr, lse_ptr, fo_ptr, flse_ptr, sem_ptr, sinks_ptr,
                         qo_ptr, pindptr_ptr, pind_ptr,
                         kvlen_ptr, sink_ptr, gap_ptr, krope_ptr, qpos_ptr, tind_ptr, tmask_ptr,
                         n_entries, sq_t, sq_h, sp_page, sp_kv, sp_head, sp_row,
                         so_t, so_s, so_h, sl_t, sl_s, sfo_t, sfo_h, sfl_t,
                         qk_scale, softcap_log2, log2_theta, rope_scale, freq_ptr, window_left,
                         scale_ptr,
                         GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, MERGE_CHUNK: tl.constexpr,
                         TREE: tl.constexpr, ROPE: tl.constexpr, FREQ: tl.constexpr, IEEE: tl.constexpr,
                         HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
                         SINKS: tl.constexpr, QUANT: tl.constexpr):
    """One query per entry; grid (rows T, Hkv, splits). Row t belongs to entry t - qo[0] (every
    decode entry holds exactly one row), so rows no entry covers get o = 0 / lse = -inf here too.
    With NUM_SPLITS > 1 each program covers one contiguous key chunk and writes an fp32 partial
    (o, lse) to the scratch ``o_ptr``/``lse_ptr``; the last program of a (row, KV head) to finish
    (a counter in ``sem_ptr``, one int32 per (row, KV head), found zero and left zero) merges
    the partials by lse into the outputs ``fo_ptr``/``flse_ptr``: one launch, no merge pass.
    SINKS: the sink joins the normalisation once, in ``_finish`` (one split) or in the merge
    (partials never hold it)."""
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    e = t - tl.load(qo_ptr)
    covered = (e >= 0) & (e < n_entries)
    e = tl.where(covered, e, 0)
    kv_len = tl.where(covered, tl.load(kvlen_ptr + e), 0)
    sink = tl.load(sink_ptr + e)
    gap = tl.load(gap_ptr + e)
    pstart = tl.load(pindptr_ptr + e)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    j_lo = s * chunk
    j_hi = tl.minimum(j_lo + chunk, kv_len)
    g = tl.arange(0, BLOCK_R)
    row_ok = g < GROUP
    head = kvh * GROUP + g
    t64 = t.to(tl.int64)
    dh = tl.arange(0, BLOCK_HALF)
    dh_ok = dh < HALF
    dd = tl.arange(0, BLOCK_D)
    dd_ok = dd < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_ok = dv < HEAD_DIM_V
    inv = _inv_freq(freq_ptr, dh, dh_ok, HEAD_DIM, log2_theta, FREQ)
    # one token, GROUP heads: every row reads token t (a broadcast index for the shared loader)
    q1, q2 = _load_query(q_ptr, qpos_ptr, tl.zeros([BLOCK_R], tl.int64) + t64, head, row_ok,
                         sq_t, sq_h, dh, dh_ok, dd, dd_ok, inv, rope_scale, HALF, ROPE)
    if QUANT:                # the pages' codes are widened to float16 (_operand)
        q1, q2 = _operand(q1), _operand(q2)
    krope = tl.load(krope_ptr + e)             # inline RoPE and the per-query window use it
    kfloor = _window_floor(qpos_ptr, tl.zeros([BLOCK_R], tl.int64) + t64, row_ok & covered,
                           window_left, BLOCK_R)
    tlo = 0
    tree_start = kv_len
    q_order = tl.zeros([BLOCK_R], tl.int32)
    if TREE:
        tlo = tl.load(tind_ptr + e)
        ts = tl.where(covered, tl.load(tind_ptr + e + 1) - tlo, 0)
        tree_start = kv_len - ts
        q_order = tl.zeros([BLOCK_R], tl.int32) + tl.load(tmask_ptr + 2 * (tlo + ts - 1), mask=ts > 0, other=0)
    ks, vs = _kv_scales(scale_ptr, kvh, tl.num_programs(1), QUANT)
    m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        m_i, l_i, acc = _paged_step(
            q1, q2, m_i, l_i, acc, j0, j_hi, sink, gap, pind_ptr + pstart, pages_ptr, kvh,
            sp_page, sp_kv, sp_head, sp_row, dh, dh_ok, dd, dd_ok, dv, dv_ok, qk_scale * ks,
            softcap_log2, krope, inv, rope_scale, tmask_ptr, tlo, tree_start, q_order, kfloor,
            HALF, PAGE_SIZE, BLOCK_N, ROPE, TREE, IEEE, SOFTCAP, QUANT)
    if QUANT:
        acc = acc * vs
    if NUM_SPLITS == 1:
        o, lse = _finish(acc, m_i, l_i, _row_sinks(sinks_ptr, head, row_ok, SINKS), SINKS)
    else:
        o, lse = _finish(acc, m_i, l_i, m_i, False)         # a partial: the merge adds the sink
    od_ok = row_ok[:, None] & dv_ok[None, :]
    tl.store(o_ptr + t64 * so_t + s * so_s + head[:, None] * so_h + dv[None, :],
             o.to(o_ptr.dtype.element_ty), mask=od_ok)
    tl.store(lse_ptr + t64 * sl_t + s * sl_s + head, lse, mask=row_ok)
    if NUM_SPLITS > 1:
        # every thread's partial is stored before one thread's release-acquire increment; the
        # program that brings the count to NUM_SPLITS sees every other program's partial
        tl.debug_barrier()
        sem = sem_ptr + t64 * tl.num_programs(1) + kvh
        done = tl.atomic_add(sem, 1, sem="acq_rel", scope="gpu")
        if done == NUM_SPLITS - 1:
            _merge_partials(o_ptr, lse_ptr, fo_ptr, flse_ptr, sinks_ptr, t64, kvh, dv, dv_ok,
                            so_t, so_s, so_h, sl_t, sl_s, sfo_t, sfo_h, sfl_t,
                            GROUP, BLOCK_G, BLOCK_DV, NUM_SPLITS, BLOCK_S, MERGE_CHUNK, SINKS)
            tl.atomic_xchg(sem, 0, sem="relaxed", scope="gpu")     # zero again for the next launch


@triton.jit
def _merge_partials(po_ptr, pl_ptr, o_ptr, lse_ptr, sinks_ptr, t64, kvh, dd, dd_ok,
                    so_t, so_s, so_h, sl_t, sl_s, sfo_t, sfo_h, sfl_t,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
                    SINKS: tl.constexpr):
    """Combine the NUM_SPLITS fp32 partials of one row's GROUP heads by lse. Only one program
    of each (row, KV head) runs this, at the end of the launch, so its time is the launch's
    tail: it loads the partials as (GROUP, CHUNK splits, D) tiles, CHUNK * GROUP * D of them
    at once (about 32 registers a thread), each chunk's loads independent of the others.
    (A (rows, D) tile per split padded the GROUP heads to the decode's 16 rows and loaded
    split after split: +12-19% on B=1 decode, whose 16-64 splits all merge here.) Partials
    are read through L2 (``.cg``): other programs wrote them, so no L1 line may serve them.
    SINKS: each head's sink (natural log) joins the peak and the total here, once. (``dd`` /
    BLOCK_D here span the value head dim.)"""
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    head = kvh * GROUP + g
    sidx = tl.arange(0, BLOCK_S)
    lse_s = tl.load(pl_ptr + t64 * sl_t + head[:, None] + sidx[None, :] * sl_s,
                    mask=g_ok[:, None] & (sidx < NUM_SPLITS)[None, :], other=float("-inf"),
                    cache_modifier=".cg")
    peak = tl.max(lse_s, 1)
    if SINKS:
        sk = tl.load(sinks_ptr + head, mask=g_ok, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, sk)
    peak_use = tl.where(peak == float("-inf"), 0.0, peak)
    total = tl.sum(tl.exp(lse_s - peak_use[:, None]), 1)
    if SINKS:
        total += tl.exp(sk - peak_use)
    c = tl.arange(0, CHUNK)
    gd_ok = g_ok[:, None] & dd_ok[None, :]
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, CHUNK):
        s = s0 + c
        gs_ok = g_ok[:, None] & (s < NUM_SPLITS)[None, :]
        # this chunk's lse again, beside its partials: slicing columns out of lse_s would be
        # a cross-thread shuffle
        ls = tl.load(pl_ptr + t64 * sl_t + head[:, None] + s[None, :] * sl_s, mask=gs_ok,
                     other=float("-inf"), cache_modifier=".cg")
        po = tl.load(po_ptr + t64 * so_t + head[:, None, None] * so_h + s[None, :, None] * so_s
                     + dd[None, None, :], mask=gs_ok[:, :, None] & dd_ok[None, None, :],
                     other=0.0, cache_modifier=".cg")
        acc += tl.sum(po * tl.exp(ls - peak_use[:, None])[:, :, None], 1)
    ok = total != 0                  # a NaN partial lse (a NaN K seen) stays NaN
    o = acc / tl.where(ok, total, 1.0)[:, None]
    lse = tl.where(ok, peak_use + tl.log(tl.where(ok, total, 1.0)), float("-inf"))
    tl.store(o_ptr + t64 * sfo_t + head[:, None] * sfo_h + dd[None, :],
             o.to(o_ptr.dtype.element_ty), mask=gd_ok)
    tl.store(lse_ptr + t64 * sfl_t + head, lse, mask=g_ok)


@triton.jit
def _merge2_kernel(oa_ptr, la_ptr, ob_ptr, lb_ptr, o_ptr, l_ptr, n_rows,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """Merge two partial states over disjoint keys; rows are flattened (token, head)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = rows < n_rows
    rows = rows.to(tl.int64)
    la = tl.load(la_ptr + rows, mask=r_ok, other=float("-inf"))
    lb = tl.load(lb_ptr + rows, mask=r_ok, other=float("-inf"))
    peak = tl.maximum(la, lb)
    peak_use = tl.where(peak == float("-inf"), 0.0, peak)
    wa = tl.exp(la - peak_use)
    wb = tl.exp(lb - peak_use)
    tot = wa + wb
    ok = tot != 0                    # a NaN lse (a NaN K seen) stays NaN
    inv = 1.0 / tl.where(ok, tot, 1.0)
    d = tl.arange(0, BLOCK_D)
    m = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    off = rows[:, None] * HEAD_DIM + d[None, :]
    oa = tl.load(oa_ptr + off, mask=m, other=0.0).to(tl.float32)
    ob = tl.load(ob_ptr + off, mask=m, other=0.0).to(tl.float32)
    o = oa * (wa * inv)[:, None] + ob * (wb * inv)[:, None]
    tl.store(o_ptr + off, o.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(l_ptr + rows, tl.where(ok, peak_use + tl.log(tl.where(ok, tot, 1.0)), float("-inf")),
             mask=r_ok)


# ====================================================================== launchers
def _p2(x: int) -> int:
    return triton.next_power_of_2(max(int(x), 1))


def _merge_chunk(tuning, splits: int, group: int, block_d: int, num_warps: int) -> int:
    """Splits the decode launch's merge loads at once: (group, chunk, D) fp32 partials of about
    32 registers a thread (or ``tuning.split_merge_chunk``), never more than the launch has."""
    chunk = tuning.split_merge_chunk or num_warps * 32 * 32 // (_p2(group) * block_d)
    return max(1, min(_p2(splits), _p2(chunk)))


def _block(n: int) -> int:
    """A power-of-two block of at least 16 (tl.dot's minimum) covering ``n`` lanes, masked."""
    return max(16, _p2(n))


def _dims(head_dim: int):
    half = head_dim // 2
    return half, _block(half), _block(head_dim)


def _score_scales(sm_scale: float, softcap: float, mode: int):
    """(qk_scale, softcap_log2) of ``_scores`` for its SOFTCAP ``mode`` (``_softcap_mode``)."""
    if mode == 2 or mode == 4:
        return sm_scale / softcap, softcap * LOG2E
    if mode == 1:
        return -2.0 * sm_scale * LOG2E / softcap, softcap * LOG2E
    return sm_scale * LOG2E, 0.0


def _inline_ptx() -> bool:
    """Whether the kernels launched now are compiled for an NVIDIA GPU, so that inline PTX may
    reach them: not under Triton's interpreter (it runs no PTX), not on ROCm (HIP compiles
    none; the ROCm backend runs these kernels)."""
    return torch.version.hip is None and os.environ.get("TRITON_INTERPRET") != "1"


def _softcap_mode(rec, softcap: float, sm_scale: float) -> int:
    """``_scores``' SOFTCAP for a record's kernel: 0 without a cap; 2 (tanh.approx, inline
    PTX) for 16-bit caches on an NVIDIA GPU; 1 (exact) for float32 caches, under the
    interpreter and on ROCm. 0 and 2 become 3 and 4 for a scale that is not positive: the
    largest qk then does not give the largest score, which ``_softmax_step`` assumes for 0
    and 2."""
    if not softcap > 0:
        return 0 if sm_scale > 0 else 3
    if rec.run.kw["IEEE"] or not _inline_ptx():
        return 1
    return 2 if sm_scale > 0 else 4


@functools.lru_cache(maxsize=32)
def _freq_table(freqs: tuple, device: str):
    return torch.tensor(freqs, dtype=torch.float32, device=device)


def _rope_args(rope_spec, head_dim: int, dummy):
    """(log2_theta, position scale, frequency table, FREQ) of a ``RopeSpec`` (None: no RoPE).
    Plain theta RoPE computes its frequencies in the kernel; the model's own ``inv_freq`` comes
    as a float32 table with the scale folded in. (Partial rotary never gets here: the launchers
    hand it to the torch kernels.)"""
    if rope_spec is None:
        return 0.0, 1.0, dummy, False
    if rope_spec.default_frequencies:
        return math.log2(rope_spec.theta), float(rope_spec.scale), dummy, False
    table = _freq_table(tuple(rope_spec.frequencies(head_dim).tolist()), str(dummy.device))
    return 0.0, 1.0, table, True


def _partial(rope_spec) -> bool:
    """Partial rotary (RoPE on the first R < D dims): the kernels here pair dim i with i + D/2,
    so such specs run the torch kernels (also on the GPU; correct, not tuned)."""
    return rope_spec is not None and bool(rope_spec.rotary_dim)


def _ieee(dtype) -> bool:
    return dtype == torch.float32


def _last_dim_contig(x):
    return x if x.stride(-1) == 1 else x.contiguous()


class _Cfg:
    """Launch values that depend only on the config and the tuning (one per ``LaunchCache``)."""

    __slots__ = ("half", "block_half", "block_d", "dv", "block_dv", "ieee", "rope_hb", "ew_warps",
                 "dec_tiles", "dec_block_r", "pre_tiles", "pre_block_r", "pre_m_tok", "rag_tiles",
                 "rag_block_r", "rag_m_tok", "merge_rows", "inv_tiles", "inv_block_r", "inv_m_tok",
                 "inv_seg", "rope_runs", "merge", "quant", "uniform")

    def __init__(self, ctx):
        d = ctx.head_dim
        self.half, self.block_half, self.block_d = _dims(d)
        self.dv = ctx.head_dim_v
        self.block_dv = _block(self.dv)
        self.ieee = _ieee(ctx.dtype)
        self.quant = ctx.kv_quant          # fp8 pages: every attention kernel reads codes
        self.rope_hb = min(_p2(max(ctx.num_qo_heads, ctx.num_kv_heads)), ctx.tuning.elementwise_heads)
        self.ew_warps = ctx.tuning.elementwise_warps
        # tiles by the wider of D and Dv (both tiles of a step share the shared-memory budget)
        tile_d = max(d, self.dv)
        self.dec_tiles = ctx.tuning.tiles("decode", tile_d, self.ieee, ctx.kv_quant)
        self.dec_block_r = max(self.dec_tiles.block_rows, _p2(ctx.group), ctx.tuning.min_dot_rows)
        self.pre_tiles = ctx.tuning.tiles("prefill", tile_d, self.ieee, ctx.kv_quant)
        self.pre_block_r, self.pre_m_tok = _prefill_rows(self.pre_tiles, ctx.group)
        # batch-invariant decode steps: the prefill kernel with fewer rows, the same key step
        rows = ctx.tuning.invariant_decode_rows
        t = self.pre_tiles
        self.inv_tiles = t if not rows else replace(
            t, block_rows=min(t.block_rows, max(rows, _p2(ctx.group))),
            num_warps=min(t.num_warps, 4))
        self.inv_block_r, self.inv_m_tok = _prefill_rows(self.inv_tiles, ctx.group)
        # batch-invariant key segments: whole key steps (both tiles share the prefill's step)
        self.inv_seg = -(-max(ctx.tuning.invariant_segment_keys, 1) // t.block_n) * t.block_n
        # the ragged kernel's own tiles (16-bit pages; over fp8 ones it keeps the prefill tiles)
        self.rag_tiles = (self.pre_tiles if ctx.kv_quant else
                          ctx.tuning.tiles("ragged", tile_d, self.ieee))
        self.rag_block_r, self.rag_m_tok = _prefill_rows(self.rag_tiles, ctx.group)
        self.merge_rows = ctx.tuning.merge_rows
        self.uniform = bool(ctx.tuning.warp_uniform_scalars and _inline_ptx())
        self.rope_runs = {}   # the rope/append launcher's _Kernel, by flag tuple
        self.merge = None     # the merge launcher's _Kernel


def _prefill_rows(tiles, group: int) -> tuple:
    """(BLOCK_R, M_TOK) of a prefill kernel's tiles: rows a program holds (at least one token's
    group of heads) and the tokens they are."""
    block_r = max(tiles.block_rows, _p2(group))
    return block_r, block_r // group


def _cfg(ctx) -> _Cfg:
    cfg = ctx.launch.static.get("cfg")
    if cfg is None:
        cfg = ctx.launch.static["cfg"] = _Cfg(ctx)
    return cfg


def _rope_cached(ctx, rope_spec, dummy):
    """``_rope_args`` memoised per spec object (a model's frequency table is built once); a
    missing table is returned as None (the caller passes any tensor in its place)."""
    if rope_spec is None:
        return 0.0, 1.0, None, False
    static = ctx.launch.static
    key = ("rope", id(rope_spec), dummy.device)
    hit = static.get(key)
    if hit is None or hit[0] is not rope_spec:
        log2_theta, scale, table, has_freq = _rope_args(rope_spec, ctx.head_dim, dummy)
        hit = static[key] = (rope_spec, (log2_theta, scale, table if has_freq else None, has_freq))
    return hit[1]


def _capturing(x) -> bool:
    """A CUDA graph is being captured on the current stream: scratch is then allocated per call
    (into the graph's pool) instead of taken from a launch record (launch.py says why)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _capturing_on(device) -> bool:
    return device.type != "cpu" and torch.cuda.is_current_stream_capturing()


def _keep(launch, key, anchor, rec, x):
    """Store a freshly built record: during graph capture among the capture's own records (its
    scratch lives in the graph's pool and must not serve eager calls; launch.py)."""
    return launch.put(key, anchor, rec, captured=_capturing(x))


def _stream_key(device):
    if device.type == "cpu":
        return device, None
    return device, torch.cuda.current_stream(device).cuda_stream


def _scratch(ctx, device, specs):
    """Tensors of ``specs`` ((shape, dtype), ...) carved from the current stream's grow-only arena
    (launch.py: why reuse across calls and forwards is safe); called when a record is built.
    While a graph is captured: fresh tensors from the graph's pool, the arena untouched."""
    if _capturing_on(device):
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in specs]
    sizes, total = [], 0
    for shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        sizes.append((total, nbytes))
        total += -(-nbytes // 256) * 256              # keep every slice 256-byte aligned
    launch = ctx.launch
    key = _stream_key(device)
    arena = launch.arenas.get(key)
    if arena is None or arena.numel() < total:
        grow = max(total, 0 if arena is None else 2 * arena.numel())
        with torch.inference_mode(False):     # it outlives the call (backend.allocate_pages)
            arena = launch.arenas[key] = torch.empty(grow, dtype=torch.uint8, device=device)
        launch.allocations += 1
    return [arena[off:off + n].view(dtype).view(shape)
            for (off, n), (shape, dtype) in zip(sizes, specs)]


def _counters(ctx, device, n):
    """``n`` int32 zeros for the fused split-K merge (one per (row, KV head)), from the current
    stream's grow-only counter buffer: every decode launch leaves the counters it used at zero,
    and launches on one stream run in order, so the buffer is zeroed once, when it is made.
    While a graph is captured: zeros in the graph's pool, made with the capture's record, so a
    replay zeroes them once, before its first layer, not once per layer."""
    if _capturing_on(device):
        return torch.zeros(n, dtype=torch.int32, device=device)
    launch = ctx.launch
    key = _stream_key(device)
    buf = launch.counters.get(key)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):
            buf = launch.counters[key] = torch.zeros(max(n, 2 * (0 if buf is None else buf.numel())),
                                                     dtype=torch.int32, device=device)
        launch.allocations += 1
    return buf[:n]


class _Kernel:
    """One kernel's launches through its compiled handle, for a launch record.

    ``JITFunction.run`` binds the arguments, specialises every one of them (types, the value 1,
    16-divisibility of ints and pointers) and looks the compiled kernel up on every call: about
    two thirds of a launch's host time. The constexprs and launch options (``kw``) are fixed per
    record, so the first launch goes through ``JITFunction.run`` and keeps the compiled kernel;
    later launches hand the arguments straight to its launcher, as long as ``spec`` (the caller's
    tuple of everything per call that the specialisation could see differently: strides, dtypes,
    pointer alignment, small ints) is the one of that first launch. Anything else, a launch hook
    (profilers) or the interpreter (which compiles nothing), takes ``JITFunction.run``."""

    __slots__ = ("jit", "kw", "tail", "spec", "launch", "head")

    def __init__(self, jit, kw):
        self.jit, self.kw = jit, kw
        # the launcher takes every parameter positionally, constexprs included (it skips them);
        # ours all come last, after the runtime arguments the caller passes
        self.tail = tuple(kw[n] for n in constexpr_names(jit))
        self.spec: Any = None
        self.launch: Any = None
        self.head: Any = None       # the leading launcher arguments, set with ``launch``

    def __call__(self, grid, spec, *args):
        launch = self.launch
        if launch is not None and spec == self.spec and _no_launch_hooks():
            launch(grid[0], grid[1], grid[2], _raw_stream(), *self.head, *args, *self.tail)
            return
        compiled = self.jit[grid](*args, **self.kw)
        self.spec = spec
        self.launch, self.head = _bind_launcher(compiled)


def _bind_launcher(compiled):
    """(callable, leading arguments) that launch ``compiled`` given the grid, the stream and the
    kernel's arguments; (None, None) for anything that is not a compiled kernel (the
    interpreter, a compile-only run)."""
    if getattr(compiled, "function", None) is None:          # never loaded, so never launched
        return None, None
    run = compiled.run
    launch = getattr(run, "launch", None)
    if (launch is not None and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0):
        # the C launcher itself: what ``run.__call__`` passes when no scratch is needed
        return launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


def _no_launch_hooks() -> bool:
    """No launch hook is installed (profilers install one; ``JITFunction.run`` calls it)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is None or not getattr(hook, "calls", (hook,))


def constexpr_names(jit) -> list:
    """The constexpr parameters of a ``@triton.jit`` function (compiled or interpreted), in order."""
    params = getattr(jit, "params", None)
    if params is not None:
        return [p.name for p in params if p.is_constexpr]
    sig = inspect.signature(getattr(jit, "fn", jit))
    return [n for n, p in sig.parameters.items() if "constexpr" in str(p.annotation)]


try:        # what Triton's own launch path asks torch for
    from torch._C import _cuda_getCurrentRawStream, _cuda_getDevice

    def _raw_stream():
        return _cuda_getCurrentRawStream(_cuda_getDevice())
except ImportError:          # a torch without CUDA: the interpreter never takes the fast path
    def _raw_stream():
        return torch.cuda.current_stream().cuda_stream


def _launch_rope_append(ctx, *, q=None, k=None, v=None, pages=None, slots=None, positions=None,
                        rope_spec=None, want_k=False, kv_scale=None):
    """kv_scale: quantize K/V to the fp8 pages with these (2, Hkv) scales (None: store the
    values as they come, e.g. codes that compaction moves)."""
    cfg = _cfg(ctx)
    has_q, store = q is not None, pages is not None
    dummy = q if has_q else k
    t_total = dummy.shape[0]
    q_out: Any = None
    k_out: Any = None
    if has_q:
        q = _last_dim_contig(q)
        q_out = torch.empty(q.shape, dtype=ctx.dtype, device=q.device)
    if store:
        k, v = _last_dim_contig(k), _last_dim_contig(v)
    if want_k:
        k_out = torch.empty(k.shape, dtype=ctx.dtype, device=k.device)
    if t_total == 0:
        return q_out, k_out
    log2_theta, scale, freq, has_freq = _rope_cached(ctx, rope_spec, dummy)
    quant = kv_scale is not None
    flags = (has_q, store, rope_spec is not None, has_freq, want_k, quant)
    run = cfg.rope_runs.get(flags)
    if run is None:
        run = cfg.rope_runs[flags] = _Kernel(_rope_append_kernel, dict(
            HEAD_DIM=ctx.head_dim, HALF=cfg.half, BLOCK_HALF=cfg.block_half, HB=cfg.rope_hb,
            PAGE_SIZE=ctx.page_size, HAS_Q=has_q, STORE_KV=store, ROPE=flags[2], FREQ=has_freq,
            K_OUT=want_k, HEAD_DIM_V=cfg.dv, BLOCK_DV=cfg.block_dv, QUANT=quant,
            num_warps=cfg.ew_warps))
    qq, qo = (q, q_out) if has_q else (dummy, dummy)
    sq: tuple[int, ...] = (0, 0)
    sqo: tuple[int, ...] = (0, 0)
    if has_q:
        sq, sqo = q.stride(), q_out.stride()
    if store:
        kk, vv, pg, sl, sk, sv, sp = k, v, pages, slots, k.stride(), v.stride(), pages.stride()
        hkv = k.shape[1]
    else:
        kk = vv = pg = sl = dummy
        sk = sv = sp = (0, 0, 0, 0)
        hkv = 0
    ko, sko = (k_out, k_out.stride()) if want_k else (dummy, (0, 0))
    pos = positions if flags[2] else dummy
    hq = q.shape[1] if has_q else 0
    # what Triton's specialisation sees per call beyond the config (``_Kernel``); the outputs
    # are fresh, contiguous and aligned, their strides follow from hq and hkv
    spec = (sq, sk, sv, sp, hq, hkv, qq.dtype, kk.dtype, vv.dtype, qq.data_ptr() & 15,
            kk.data_ptr() & 15, vv.data_ptr() & 15, pg.data_ptr() & 15, sl.data_ptr() & 15,
            pos.data_ptr() & 15, sl.dtype, pos.dtype, quant and kv_scale.data_ptr() & 15)
    run((t_total, 1, 1), spec, qq, kk, vv, qo, ko, pg, sl, pos,
        sq[0], sq[1], sk[0], sk[1], sv[0], sv[1], sqo[0], sqo[1], sko[0], sko[1],
        sp[0], sp[1], sp[2], sp[3], hq, hkv, log2_theta, scale,
        dummy if freq is None else freq, kv_scale if quant else dummy)
    return q_out, k_out


def rope(ctx, x, positions, rope_spec):
    if _partial(rope_spec):
        return torch_kernels.rope(ctx, x, positions, rope_spec)
    q_out, _ = _launch_rope_append(ctx, q=x, positions=positions, rope_spec=rope_spec)
    return q_out


def append_kv(ctx, pages, k, v, slots, positions=None, rope_spec=None, kv_scale=None):
    if _partial(rope_spec):
        return torch_kernels.append_kv(ctx, pages, k, v, slots, positions, rope_spec, kv_scale)
    _launch_rope_append(ctx, k=k, v=v, pages=pages, slots=slots, positions=positions,
                        rope_spec=rope_spec, kv_scale=kv_scale)


def rope_append(ctx, pages, q, k, v, slots, positions, rope_spec, kv_scale=None):
    if _partial(rope_spec):
        return torch_kernels.rope_append(ctx, pages, q, k, v, slots, positions, rope_spec,
                                         kv_scale)
    return _launch_rope_append(ctx, q=q, k=k, v=v, pages=pages, slots=slots, positions=positions,
                               rope_spec=rope_spec, want_k=True, kv_scale=kv_scale)


def _tree_args(tree, fallback):
    if tree is None:
        return fallback, fallback
    return tree.indptr, tree.mask


class _Record:
    """One launch record (attributes set by the builder; see launch.py)."""

    __slots__ = ("grid", "pre", "post", "rope", "o_shape", "lse_shape", "so", "sl", "mrun",
                 "po", "pl", "splits", "sem", "sf", "run", "fgrid", "frun", "nrun",
                 "v_out", "bad", "any_bad", "variants", "kgrid", "krun", "k_in", "decode",
                 "seg_split", "parts", "passes")
    # the slots' types, for mypy (annotations only: no class attributes next to the slots)
    grid: Any
    pre: Any
    post: Any
    rope: Any
    o_shape: Any
    lse_shape: Any
    so: Any
    sl: Any
    mrun: Any
    po: Any
    pl: Any
    splits: Any
    sem: Any
    sf: Any
    run: Any
    fgrid: Any
    frun: Any
    nrun: Any
    v_out: Any
    bad: Any
    any_bad: Any
    variants: Any
    kgrid: Any
    krun: Any
    k_in: Any
    decode: Any
    seg_split: Any
    parts: Any
    passes: Any


def _variant(rec, mode, sinks, guard=False, seg_k=1):
    """The record's attention kernel for a call with softcap and / or sinks: the same constexprs
    as ``rec.run`` plus SOFTCAP / SINKS, built on first use (one record serves a forward's calls
    with and without them: the core passes sinks to one call of each layer). ``guard``: the
    GUARD variant (the fallback behind the library, ``kvcache_cuda.flash``); ``seg_k``: a
    batch-invariant decode step's programs an entry (the paged prefill kernel's SEG_K)."""
    flags = (mode, sinks is not None, guard, seg_k)
    if flags == (0, False, False, 1):
        return rec.run
    run = rec.variants.get(flags)
    if run is None:
        base = rec.run
        kw = dict(base.kw, SOFTCAP=flags[0], SINKS=flags[1])
        if guard:                   # the decode kernel has no GUARD
            kw["GUARD"] = True
        if seg_k != 1:              # nor SEG_K
            kw["SEG_K"] = seg_k
        run = rec.variants[flags] = _Kernel(base.jit, kw)
    return run


def _sinks_spec(sinks):
    return () if sinks is None else (sinks.dtype, sinks.data_ptr() & 15)


def _ragged_record(ctx, q, v, qo_indptr, num_seqs, max_len, tree, rope):
    launch = ctx.launch
    key = (id(qo_indptr), q.shape[0], v.dtype, num_seqs, max_len, id(tree), id(rope))
    rec = launch.get(key, captured=_capturing(v))
    if rec is not None:
        return rec
    cfg = _cfg(ctx)
    t_total, hq, d = q.shape
    dv = cfg.dv
    rec = _Record()
    tiles = cfg.rag_tiles
    rec.grid = (triton.cdiv(max_len, cfg.rag_m_tok), num_seqs, ctx.num_kv_heads)
    log2_theta, scale, freq, has_freq = _rope_cached(ctx, rope, qo_indptr)
    rec.rope = (log2_theta, scale, qo_indptr if freq is None else freq)
    rec.post = _tree_args(tree, qo_indptr)
    rec.o_shape, rec.lse_shape = (t_total, hq, dv), (t_total, hq)
    rec.run = _Kernel(_ragged_kernel, dict(
        GROUP=ctx.group, M_TOK=cfg.rag_m_tok, BLOCK_R=cfg.rag_block_r, BLOCK_N=tiles.block_n,
        HEAD_DIM=d, HALF=cfg.half, BLOCK_HALF=cfg.block_half, BLOCK_D=cfg.block_d,
        TREE=tree is not None, ROPE=rope is not None, FREQ=has_freq, IEEE=cfg.ieee,
        HEAD_DIM_V=dv, BLOCK_DV=cfg.block_dv, SOFTCAP=0, SINKS=False, QUANT=cfg.quant,
        GUARD=False, num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    rec.variants = {}
    rec.nrun = _Kernel(_ragged_nonfinite_kernel, dict(
        GROUP=ctx.group, M_TOK=cfg.rag_m_tok, BLOCK_R=cfg.rag_block_r, BLOCK_N=tiles.block_n,
        HEAD_DIM=dv, BLOCK_D=cfg.block_dv, TREE=tree is not None, QUANT=cfg.quant,
        num_warps=cfg.ew_warps))
    rec.v_out = rec.bad = rec.any_bad = rec.frun = rec.krun = rec.k_in = None
    rec.passes = {}
    if _finite_pass(cfg, max_len):
        hkv = v.shape[1]
        block_t = max(1, 4096 // cfg.block_dv)
        rec.fgrid = (triton.cdiv(t_total, block_t), hkv, 1)
        # (V's pass, K's pass) writing codes (the kernels read them) or, with fp8 pages,
        # values (``code * scale``: for a library that no kernel recomputes after)
        for values in (False, True) if cfg.quant else (False,):
            rec.passes[values] = (
                _Kernel(_finite_v_kernel, dict(HEAD_DIM=dv, BLOCK_T=block_t, BLOCK_D=cfg.block_dv,
                                               QUANT=cfg.quant, FLAGS=True, VALUES=values,
                                               num_warps=cfg.ew_warps)),
                _Kernel(_finite_v_kernel, dict(HEAD_DIM=d, BLOCK_T=max(1, 4096 // cfg.block_d),
                                               BLOCK_D=cfg.block_d, QUANT=True, FLAGS=False,
                                               VALUES=values, num_warps=cfg.ew_warps))
                if cfg.quant else None)
        rec.frun, rec.krun = rec.passes[False]
        specs = _finite_v_specs(v)
        if cfg.quant:     # K's codes too, once per call (not once per query tile)
            rec.kgrid = (triton.cdiv(t_total, max(1, 4096 // cfg.block_d)), hkv, 1)
            specs += (((t_total, hkv, d), v.dtype),)
        rec.v_out, rec.bad, rec.any_bad, *k_in = _scratch(ctx, v.device, specs)
        rec.k_in = k_in[0] if k_in else None
    return _keep(launch, key, (qo_indptr, tree, rope), rec, v)


def _finite_pass(cfg, max_len) -> bool:
    """Whether a ragged call runs the finite-V pass first: when a row may see masked keys
    (max_len > 1), and always with fp8 pages, where the pass also rounds V to its codes."""
    return max_len > 1 or cfg.quant


def _finite_v_specs(v):
    t_total, hkv, d = v.shape
    return ((t_total, hkv, d), v.dtype), ((t_total, hkv), torch.int32), ((1,), torch.int32)


def _scale_arg(ctx, kv_scale, dummy):
    """The kernels' ``scale_ptr``: the layer's (2, Hkv) float32 scales with fp8 pages (which
    must come with them), any tensor otherwise (not read)."""
    if not ctx.kv_quant:
        return dummy
    if kv_scale is None:
        raise ValueError("fp8 pages need kv_scale (the core passes the layer's scales)")
    return kv_scale


def ragged_attention(ctx, q, k, v, qo_indptr, sm_scale, *, num_seqs, max_len, tree=None,
                     rope=None, q_positions=None, k_rope_offset=None, window_left=-1,
                     logit_softcap=0.0, sinks=None, kv_scale=None, attend=None):
    """``Backend.ragged_attention``. ``attend``: ``(q, k, v) -> (o, lse)`` run instead of the
    attention kernel, between the finite-V pass and the non-finite fix-up (``kvcache_cuda.flash``
    for a plain call; its caller checked that the call has no tree, RoPE or soft-cap; it joins
    sinks itself, and in an fp8 cache it gets the passes' codes and applies the scales)."""
    softcap = float(logit_softcap or 0.0)
    if _partial(rope):
        return torch_kernels.ragged_attention(
            ctx, q, k, v, qo_indptr, sm_scale, num_seqs=num_seqs, max_len=max_len, tree=tree,
            rope=rope, q_positions=q_positions, k_rope_offset=k_rope_offset,
            window_left=window_left, logit_softcap=softcap, sinks=sinks, kv_scale=kv_scale)
    q, k, v = _last_dim_contig(q), _last_dim_contig(k), _last_dim_contig(v)
    t_total = q.shape[0]
    if t_total == 0 or num_seqs == 0 or max_len == 0:
        hq = q.shape[1]
        return (torch.empty((t_total, hq, v.shape[2]), dtype=ctx.dtype, device=q.device),
                torch.empty((t_total, hq), dtype=torch.float32, device=q.device))
    rec = _ragged_record(ctx, q, v, qo_indptr, num_seqs, max_len, tree, rope)
    scales = _scale_arg(ctx, kv_scale, qo_indptr)
    qpos = q_positions if rope is not None else qo_indptr
    krope = k_rope_offset if rope is not None else qo_indptr
    tind, tmask = rec.post
    v_in, k_in = v, k
    sq, sk, sv = q.stride(), k.stride(), v.stride()
    window_left = int(window_left)
    # what Triton's specialisation sees per call beyond the record (``_Kernel``); outputs and
    # scratch are fresh or the record's, contiguous and aligned
    spec = (sq, sk, sv, q.dtype, k.dtype, v.dtype, window_left, q.data_ptr() & 15,
            k.data_ptr() & 15, v.data_ptr() & 15, qpos.data_ptr() & 15, krope.data_ptr() & 15,
            scales.data_ptr() & 15, *_sinks_spec(sinks))
    finite = rec.frun is not None
    if finite:
        # a row's causal / tree mask hides later keys of its own forward, and a masked key's
        # p = 0 times a NaN / inf V is NaN: the kernel runs on V with those zeroed, and a second
        # pass (it reads only flags unless one is set) puts them back where a row sees the key
        v_in, bad, any_bad = rec.v_out, rec.bad, rec.any_bad
        any_bad.zero_()
        svi = v_in.stride()
        frun, krun = rec.passes[bool(getattr(attend, "wants_values", False)) and ctx.kv_quant]
        frun(rec.fgrid, spec, v, v_in, bad, any_bad, t_total, sv[0], sv[1], svi[0], svi[1],
             v.shape[1], scales)
        if krun is not None:
            k_in = rec.k_in
            ski = k_in.stride()
            krun(rec.kgrid, spec, k, k_in, bad, any_bad, t_total, sk[0], sk[1], ski[0], ski[1],
                 k.shape[1], scales)
            sk = ski
    svi = v_in.stride()
    # with the library (``attend``) its result stands and the kernel, guarded, recomputes the
    # call only where the library's inputs held a non-finite q or k (where its NaN rules are
    # not ours; guard None: they are, and the kernel does not run)
    guard = None
    if attend is not None:
        o, lse, guard = attend(q, k_in, v_in)
    else:
        o = torch.empty(rec.o_shape, dtype=ctx.dtype, device=q.device)
        lse = torch.empty(rec.lse_shape, dtype=torch.float32, device=q.device)
    so = o.stride()
    if attend is None or guard is not None:
        mode = _softcap_mode(rec, softcap, sm_scale)
        _variant(rec, mode, sinks, guard is not None)(
            rec.grid, spec, q, k_in, v_in, o, lse, qo_indptr, qpos, krope, tind, tmask,
            qo_indptr if sinks is None else sinks, sq[0], sq[1], sk[0], sk[1], svi[0], svi[1],
            so[0], so[1], lse.stride(0), *_score_scales(sm_scale, softcap, mode), *rec.rope,
            window_left, scales, qo_indptr if guard is None else guard)
    if finite:
        rec.nrun(rec.grid, spec, v, bad, any_bad, o, qo_indptr, tind, tmask, sv[0], sv[1], so[0],
                 so[1], ctx.num_kv_heads, window_left, scales)
    return o, lse


def _paged_record(ctx, q, depth, rope, use_qpos):
    launch = ctx.launch
    t_total = q.shape[0]
    key = (id(depth), t_total, id(rope), use_qpos)
    rec = launch.get(key, captured=_capturing(q))
    if rec is not None:
        return rec
    cfg = _cfg(ctx)
    hq, d = q.shape[1], q.shape[2]
    dv = cfg.dv
    n = depth.num_entries
    rec = _Record()
    rec.variants = {}
    log2_theta, scale, freq, has_freq = _rope_cached(ctx, rope, depth.qo_indptr)
    rec.rope = (log2_theta, scale, depth.qo_indptr if freq is None else freq)
    tind, tmask = _tree_args(depth.tree, depth.qo_indptr)
    rec.pre = (depth.qo_indptr, depth.page_indptr, depth.page_indices, depth.kv_len,
               depth.sink_size, depth.window_offset, depth.k_rope_offset)
    rec.post = (tind, tmask, n)
    rec.o_shape, rec.lse_shape = (t_total, hq, dv), (t_total, hq)
    flags = dict(HEAD_DIM=d, HALF=cfg.half, BLOCK_HALF=cfg.block_half, BLOCK_D=cfg.block_d,
                 PAGE_SIZE=ctx.page_size, TREE=depth.tree is not None, ROPE=rope is not None,
                 FREQ=has_freq, IEEE=cfg.ieee, HEAD_DIM_V=dv, BLOCK_DV=cfg.block_dv,
                 SOFTCAP=0, SINKS=False, QUANT=cfg.quant)
    rec.po = rec.pl = rec.sem = None
    rec.splits = 1
    # batch-invariant: every entry, decode ones too, through the prefill kernel's one loop
    rec.decode = depth.use_decode and not ctx.batch_invariant
    rec.seg_split = False
    if rec.decode:
        tiles = cfg.dec_tiles
        splits = rec.splits = num_splits(ctx.tuning, n * ctx.num_kv_heads, int(depth.max_kv_len),
                                         ctx.num_sms, cfg.quant)
        rec.grid = (t_total, ctx.num_kv_heads, splits)
        # outputs are contiguous (T, Hq, Dv) / (T, Hq)
        rec.sf = (hq * dv, dv, hq)
        if splits > 1 and t_total:
            po, pl = rec.po, rec.pl = _scratch(ctx, q.device, (
                ((t_total, splits, hq, dv), torch.float32), ((t_total, splits, hq), torch.float32)))
            rec.sem = _counters(ctx, q.device, t_total * ctx.num_kv_heads)
            rec.so = (po.stride(0), po.stride(1), po.stride(2))
            rec.sl = (pl.stride(0), pl.stride(1))
        else:
            rec.so = (hq * dv, 0, dv)
            rec.sl = (hq, 0)
        rec.run = _Kernel(_paged_decode_kernel, dict(
            GROUP=ctx.group, BLOCK_R=cfg.dec_block_r, BLOCK_N=tiles.block_n, NUM_SPLITS=splits,
            BLOCK_S=_p2(splits), BLOCK_G=_p2(ctx.group),
            MERGE_CHUNK=_merge_chunk(ctx.tuning, splits, ctx.group, cfg.block_dv, tiles.num_warps),
            **flags, num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    else:
        tiles, block_r, m_tok = cfg.pre_tiles, cfg.pre_block_r, cfg.pre_m_tok
        # batch-invariant steps of one query an entry (decode; also where the planner chose
        # the prefill kernel for them) take the smaller tiles and (Tuning says when) a program
        # per (entry, key segment), then the fold kernel. The segments are fixed, so where
        # they are computed changes no bit
        one_query = ctx.batch_invariant and (depth.use_decode or depth.max_qo_len == 1)
        if one_query:
            tiles, block_r, m_tok = cfg.inv_tiles, cfg.inv_block_r, cfg.inv_m_tok
        below = ctx.tuning.invariant_split_programs
        rec.seg_split = one_query and (not below or n * ctx.num_kv_heads < below)
        splits = rec.splits = 1 if ctx.batch_invariant else \
            prefill_splits(ctx.tuning, depth.shared, int(depth.max_kv_len))
        rec.grid = (triton.cdiv(t_total, m_tok) + n, ctx.num_kv_heads, splits)
        if rec.seg_split:
            rec.parts = 0           # partial rows held; sized per call (_segment_partials)
            heads = min(_p2(hq), 16)
            rec.mrun = ({sinks: _Kernel(_fold_segments_kernel, dict(
                SEG=cfg.inv_seg, BLOCK_E=_p2(n), HEADS=heads, HEAD_DIM_V=dv,
                BLOCK_DV=cfg.block_dv, SINKS=sinks, num_warps=cfg.ew_warps))
                for sinks in (False, True)}, (n, triton.cdiv(hq, heads), 1))
        if splits > 1:         # fp32 partials (T, splits, Hq, Dv) / (T, splits, Hq), merged
            rec.so = (splits * hq * dv, dv, hq * dv)
            rec.sl = (splits * hq, hq)
            heads = min(_p2(hq), 16)
            # the merge's launchers without and with sinks, and its grid
            rec.mrun = ({sinks: _Kernel(_merge_splits_kernel, dict(
                HEADS=heads, HEAD_DIM_V=dv, BLOCK_DV=cfg.block_dv, KV_SPLITS=splits,
                SINKS=sinks, num_warps=cfg.ew_warps)) for sinks in (False, True)},
                (t_total, triton.cdiv(hq, heads), 1))
        else:
            rec.so = (hq * dv, dv, 0)
            rec.sl = (hq, 0)
        rec.run = _Kernel(_paged_prefill_kernel, dict(
            GROUP=ctx.group, M_TOK=m_tok, BLOCK_R=block_r, BLOCK_N=tiles.block_n,
            BLOCK_E=_p2(n), **flags, CHAINS=depth.tree is not None and depth.tree.chains,
            KV_SPLITS=splits, UNIFORM=cfg.uniform, INVARIANT=ctx.batch_invariant, GUARD=False,
            SEG=cfg.inv_seg if ctx.batch_invariant else 0, SEG_SPLIT=rec.seg_split, SEG_K=1,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages))
    return _keep(launch, key, (depth, rope), rec, q)


def _segment_partials(ctx, rec, depth, q):
    """(programs an entry, partial o, partial lse) of a batch-invariant decode step's segment
    programs. Programs an entry: as many as its longest sequence has segments (the host's
    ``max_kv_len``; a static cache's is its capacity), at most enough for entries x KV heads x
    programs to fill the GPU ``split_programs_per_sm`` times over. The partials number at most
    the entries plus their keys over the segment size, and an entry's keys are at most its
    pages' slots: ``page_indices`` bounds them on the host with no read of the lengths (a
    static cache's buffer bounds every replay of its graph alike); that many rows of (Hq, Dv)
    float32, about 1% of a layer's KV bytes."""
    cfg, n = _cfg(ctx), depth.num_entries
    fill = ctx.tuning.split_programs_per_sm * ctx.num_sms
    k = max(1, min(triton.cdiv(int(depth.max_kv_len), cfg.inv_seg),
                   triton.cdiv(fill, max(n * ctx.num_kv_heads, 1))))
    parts = triton.cdiv(depth.page_indices.numel() * ctx.page_size, cfg.inv_seg) + n
    if parts > rec.parts or _capturing(q):
        hq, dv = rec.o_shape[1], rec.o_shape[2]
        rec.po, rec.pl = _scratch(ctx, q.device, (((parts, hq, dv), torch.float32),
                                                  ((parts, hq), torch.float32)))
        rec.parts = parts
    return k, rec.po, rec.pl


def paged_attention(ctx, q, pages, depth, sm_scale, *, rope=None, q_positions=None,
                    window_left=-1, logit_softcap=0.0, sinks=None, kv_scale=None, attend=None):
    """``Backend.paged_attention``. ``attend``: ``() -> (o, lse, guard)``, the library's result
    for a prefill call its caller checked it computes (``kvcache_cuda.flash``): it stands, and
    the kernel, guarded, recomputes the call where ``guard`` is set (None: never). Taken where
    the kernel would run one key split (decode calls and split shared prefixes keep the kernel)."""
    softcap = float(logit_softcap or 0.0)
    if _partial(rope):
        return torch_kernels.paged_attention(ctx, q, pages, depth, sm_scale, rope=rope,
                                             q_positions=q_positions, window_left=window_left,
                                             logit_softcap=softcap, sinks=sinks,
                                             kv_scale=kv_scale)
    q = _last_dim_contig(q)
    # window_left is a plain int argument (not a compile-time constant): a captured static decode
    # step replays with the window of its capture, and a new window needs no recompile
    use_qpos = rope is not None or window_left >= 0
    rec = _paged_record(ctx, q, depth, rope, use_qpos)
    qpos = q_positions if use_qpos else depth.qo_indptr
    t_total = q.shape[0]
    # what Triton's specialisation sees per call beyond the record (``_Kernel``)
    sq, sp = q.stride(), pages.stride()
    scale_arg = _scale_arg(ctx, kv_scale, qpos)
    spec = (sq, sp, q.dtype, int(window_left), q.data_ptr() & 15, pages.data_ptr() & 15,
            qpos.data_ptr() & 15, scale_arg.data_ptr() & 15, *_sinks_spec(sinks))
    mode = _softcap_mode(rec, softcap, sm_scale)
    run = _variant(rec, mode, sinks)
    scales = _score_scales(sm_scale, softcap, mode)
    sinks_arg = depth.qo_indptr if sinks is None else sinks
    if rec.decode:
        o = torch.empty(rec.o_shape, dtype=ctx.dtype, device=q.device)
        lse = torch.empty(rec.lse_shape, dtype=torch.float32, device=q.device)
        if t_total == 0:
            return o, lse
        if rec.splits > 1:
            dst, dstl, sem = rec.po, rec.pl, rec.sem
        else:
            dst, dstl, sem = o, lse, lse
        run(rec.grid, spec, q, pages, dst, dstl, o, lse, sem, sinks_arg, *rec.pre, qpos,
            *rec.post, sq[0], sq[1], sp[0], sp[1], sp[2], sp[3], *rec.so, *rec.sl, *rec.sf,
            *scales, *rec.rope, int(window_left), scale_arg)
        return o, lse
    guard = None
    if attend is not None and rec.splits == 1:
        o, lse, guard = attend()
        if guard is None:           # the library keeps our NaN rules: its result stands
            return o, lse
        run = _variant(rec, mode, sinks, True)
    # prefill: rows no entry covers must read o = 0 / lse = -inf (the sink with sinks); where
    # the entries cover every row the kernel writes them all, and the fill (a pass over o as
    # long as a short prefill's attention) is skipped
    elif depth.covers_rows and t_total and depth.num_entries:
        o = torch.empty(rec.o_shape, dtype=ctx.dtype, device=q.device)
        lse = torch.empty(rec.lse_shape, dtype=torch.float32, device=q.device)
    else:
        o = torch.zeros(rec.o_shape, dtype=ctx.dtype, device=q.device)
        if sinks is None:
            lse = torch.full(rec.lse_shape, float("-inf"), dtype=torch.float32, device=q.device)
        else:
            lse = torch.empty(rec.lse_shape, dtype=torch.float32, device=q.device)
            lse.copy_(sinks[None, :])
        if t_total == 0 or depth.num_entries == 0:
            return o, lse
    tind, tmask, n = rec.post
    if rec.seg_split:
        k, po, pl = _segment_partials(ctx, rec, depth, q)
        no_sinks = spec[:len(spec) - len(_sinks_spec(sinks))]
        _variant(rec, mode, None, seg_k=k)(
            (n * k,) + rec.grid[1:], no_sinks, q, pages, po, pl, *rec.pre, qpos, tind, tmask,
            depth.qo_indptr, n, sq[0], sq[1], sp[0], sp[1], sp[2], sp[3], po.stride(0),
            po.stride(1), 0, pl.stride(0), 0, *scales, *rec.rope, int(window_left), scale_arg,
            scale_arg)
        folds, fgrid = rec.mrun
        folds[sinks is not None](fgrid, (o.dtype, *_sinks_spec(sinks)), po, pl, o, lse,
                                 depth.qo_indptr, depth.kv_len, sinks_arg, n, rec.o_shape[1],
                                 po.stride(0), po.stride(1), pl.stride(0))
        return o, lse
    if rec.splits > 1:
        # the partials carry no sink (the merge adds it once); a split that sees no key of a
        # row leaves lse -inf, and rows no entry covers keep the fill: the merge skips both
        po = torch.empty((t_total, rec.splits) + rec.o_shape[1:], dtype=torch.float32,
                         device=q.device)
        pl = torch.full((t_total, rec.splits, rec.lse_shape[1]), float("-inf"),
                        dtype=torch.float32, device=q.device)
        run = _variant(rec, mode, None)
        no_sinks = spec[:len(spec) - len(_sinks_spec(sinks))]
        run(rec.grid, no_sinks, q, pages, po, pl, *rec.pre, qpos, tind, tmask, depth.qo_indptr,
            n, sq[0], sq[1], sp[0], sp[1], sp[2], sp[3], *rec.so, *rec.sl, *scales, *rec.rope,
            int(window_left), scale_arg, scale_arg)
        merges, grid = rec.mrun
        merges[sinks is not None](grid, (o.dtype, *_sinks_spec(sinks)), po, pl, o, lse,
                                  sinks_arg, rec.o_shape[1], *rec.so, *rec.sl)
        return o, lse
    run(rec.grid, spec, q, pages, o, lse, *rec.pre, qpos, tind, tmask, sinks_arg, n, sq[0],
        sq[1], sp[0], sp[1], sp[2], sp[3], *rec.so, *rec.sl, *scales, *rec.rope,
        int(window_left), scale_arg, scale_arg if guard is None else guard)
    return o, lse


def merge_attention(ctx, o_a, lse_a, o_b, lse_b):
    o_a, o_b = o_a.contiguous(), o_b.contiguous()
    lse_a, lse_b = lse_a.contiguous(), lse_b.contiguous()
    n_rows = lse_a.numel()
    if n_rows == 0:
        return o_a, lse_a
    cfg = _cfg(ctx)
    # fresh outputs (no launch, the caching allocator serves them): aliasing an input as the
    # output would be fine on a GPU but not under the interpreter, which copies each argument
    o = torch.empty(o_a.shape, dtype=ctx.dtype, device=o_a.device)
    lse = torch.empty(lse_a.shape, dtype=torch.float32, device=o_a.device)
    run = cfg.merge
    if run is None:
        run = cfg.merge = _Kernel(_merge2_kernel, dict(HEAD_DIM=cfg.dv, BLOCK_D=cfg.block_dv,
                                                       ROWS=cfg.merge_rows, num_warps=cfg.ew_warps))
    # n_rows varies per call: only its specialisation (the value 1, 16-divisibility) is keyed
    spec = (o_a.dtype, o_b.dtype, n_rows == 1, n_rows % 16 == 0, o_a.data_ptr() & 15,
            lse_a.data_ptr() & 15, o_b.data_ptr() & 15, lse_b.data_ptr() & 15)
    run((triton.cdiv(n_rows, cfg.merge_rows), 1, 1), spec, o_a, lse_a, o_b, lse_b, o, lse, n_rows)
    return o, lse


def _row_kernel_args(ctx, pages):
    sp = pages.stride()
    return (ctx.num_kv_heads, sp[0], sp[1], sp[2], sp[3])


def copy_page_prefix(ctx, pages_per_layer, src_page, dst_page, length):
    if length <= 0:
        return
    hb = min(_p2(ctx.num_kv_heads), ctx.tuning.elementwise_heads)
    for pages in pages_per_layer:
        sp = pages.stride()
        row = pages.shape[-1]          # the whole page row: max(D, Dv)
        _copy_rows_kernel[(length,)](pages, src_page * sp[0], dst_page * sp[0], ctx.num_kv_heads,
                                     sp[1], sp[2], sp[3], HEAD_DIM=row, BLOCK_D=_p2(row), HB=hb,
                                     num_warps=ctx.tuning.elementwise_warps)


def gather_rows(ctx, pages, slots, out_k=None, out_v=None, kv_scale=None):
    """(k, v) rows at ``slots`` of one layer as stored (fp8 codes stay codes), or with
    ``kv_scale`` dequantized into the cache dtype."""
    n = slots.shape[0]
    d, dv = ctx.head_dim, ctx.head_dim_v
    dtype = pages.dtype if kv_scale is None else ctx.dtype
    if out_k is None:
        out_k = torch.empty((n, ctx.num_kv_heads, d), dtype=dtype, device=pages.device)
    if out_v is None:
        out_v = torch.empty((n, ctx.num_kv_heads, dv), dtype=dtype, device=pages.device)
    if n:
        hb = min(_p2(ctx.num_kv_heads), ctx.tuning.elementwise_heads)
        _gather_rows_kernel[(n,)](pages, slots, out_k, out_v,
                                  slots if kv_scale is None else kv_scale,
                                  *_row_kernel_args(ctx, pages),
                                  out_k.stride(0), out_k.stride(1), out_v.stride(0),
                                  out_v.stride(1), HEAD_DIM=d, BLOCK_D=_p2(d), HB=hb,
                                  PAGE_SIZE=ctx.page_size, HEAD_DIM_V=dv, BLOCK_DV=_p2(dv),
                                  DEQUANT=kv_scale is not None,
                                  num_warps=ctx.tuning.elementwise_warps)
    return out_k, out_v


def compact_kv(ctx, pages_per_layer, src_slots, dst_slots):
    # gather every source row first (scratch), then scatter: a destination may be another
    # pair's source, and programs of one launch run in no particular order
    for pages in pages_per_layer:
        k, v = gather_rows(ctx, pages, src_slots)
        append_kv(ctx, pages, k, v, dst_slots)


def gather_kv(ctx, pages_per_layer, slots, kv_scale=None):
    """kv_scale: with fp8 pages, one (2, Hkv) scale array per page array: values come back
    dequantized in the cache dtype (one launch per layer). Without it, one launch for every
    layer (``_gather_layers_kernel``)."""
    n = slots.shape[0]
    layers = len(pages_per_layer)
    p0 = pages_per_layer[0]
    dtype = p0.dtype if kv_scale is None else ctx.dtype
    if ctx.head_dim == ctx.head_dim_v:
        # V right behind K in one allocation: a transfer sends both as one message, no copy
        out_k, out_v = torch.empty((2, layers, n, ctx.num_kv_heads, ctx.head_dim), dtype=dtype,
                                   device=p0.device).unbind(0)
    else:
        out_k = torch.empty((layers, n, ctx.num_kv_heads, ctx.head_dim), dtype=dtype,
                            device=p0.device)
        out_v = torch.empty((layers, n, ctx.num_kv_heads, ctx.head_dim_v), dtype=dtype,
                            device=p0.device)
    if kv_scale is not None:
        for i, pages in enumerate(pages_per_layer):
            gather_rows(ctx, pages, slots, out_k[i], out_v[i], kv_scale[i])
        return out_k, out_v
    if n:
        loff, aligned = _layer_offsets(ctx, pages_per_layer)
        run = _layers_kernel(ctx, _gather_layers_kernel, aligned)
        sp = p0.stride()
        spec = (p0.dtype, sp, slots.dtype, p0.data_ptr() & 15, loff.data_ptr() & 15,
                slots.data_ptr() & 15, out_k.data_ptr() & 15, out_v.data_ptr() & 15)
        run((n, layers, 1), spec, p0, loff, slots, out_k, out_v, ctx.num_kv_heads,
            sp[0], sp[1], sp[2], sp[3])
    return out_k, out_v


def append_kv_layers(ctx, pages_per_layer, k, v, slots):
    """``k[l]`` / ``v[l]`` ((L, T, Hkv, D) / (L, T, Hkv, Dv)) into ``pages_per_layer[l]`` at
    ``slots`` (-1: skip), no RoPE, no fp8 scales: what ``append_kv`` does per layer, in one
    launch (``_append_layers_kernel``)."""
    t_total, layers = k.shape[1], len(pages_per_layer)
    if t_total == 0 or layers == 0:
        return
    k, v = _last_dim_contig(k), _last_dim_contig(v)
    p0 = pages_per_layer[0]
    loff, aligned = _layer_offsets(ctx, pages_per_layer)
    run = _layers_kernel(ctx, _append_layers_kernel, aligned)
    sk, sv, sp = k.stride(), v.stride(), p0.stride()
    spec = (k.dtype, v.dtype, p0.dtype, slots.dtype, sk, sv, sp, k.data_ptr() & 15,
            v.data_ptr() & 15, p0.data_ptr() & 15, loff.data_ptr() & 15, slots.data_ptr() & 15)
    run((t_total, layers, 1), spec, k, v, p0, loff, slots, sk[0], sk[1], sk[2], sv[0], sv[1],
        sv[2], ctx.num_kv_heads, sp[0], sp[1], sp[2], sp[3])


_MAX_OFFSET_TABLES = 16      # a cache's whole layer list and the layer groups of its transfers


def _layer_offsets(ctx, pages_per_layer):
    """(int64 device tensor, aligned): each page array's element offset from the first one's
    pointer, and whether all are multiples of 16 elements. Built once per list of page arrays
    (keyed by their addresses, which alone fix the table) and uploaded without a host sync."""
    p0 = pages_per_layer[0]
    ptrs = tuple(p.data_ptr() for p in pages_per_layer)
    tables = ctx.launch.static.get("layer_offsets")
    if tables is None:
        tables = ctx.launch.static["layer_offsets"] = {}
    key = (p0.device, ptrs)
    hit = tables.get(key)
    if hit is not None:
        return hit
    size = p0.element_size()
    for p in pages_per_layer:
        # one stride and dtype for all: the kernels address every layer with layer 0's
        if (p.shape != p0.shape or p.stride() != p0.stride() or p.dtype != p0.dtype
                or p.device != p0.device or (p.data_ptr() - ptrs[0]) % size):
            raise ValueError("the layers' page arrays differ in shape, strides, dtype, device or "
                             "element alignment; one-launch row kernels need them alike")
    offsets = [(ptr - ptrs[0]) // size for ptr in ptrs]
    # a pinned staging copy and a non-blocking upload (as aux_to_device): a pageable copy
    # would wait for the stream
    host = torch.tensor(offsets, dtype=torch.int64, pin_memory=p0.is_cuda)
    hit = (host.to(p0.device, non_blocking=True), all(o % 16 == 0 for o in offsets))
    tables[key] = hit
    while len(tables) > _MAX_OFFSET_TABLES:
        del tables[next(iter(tables))]          # oldest first (dicts keep insertion order)
    return hit


def _layers_kernel(ctx, jit, aligned: bool) -> _Kernel:
    """The ``_Kernel`` of a one-launch row kernel, once per config, tuning and alignment."""
    key = (jit, aligned)
    static = ctx.launch.static
    run = static.get(key)
    if run is None:
        d, dv = ctx.head_dim, ctx.head_dim_v
        run = static[key] = _Kernel(jit, dict(
            HEAD_DIM=d, BLOCK_D=_p2(d), HB=min(_p2(ctx.num_kv_heads), ctx.tuning.elementwise_heads),
            PAGE_SIZE=ctx.page_size, HEAD_DIM_V=dv, BLOCK_DV=_p2(dv), ALIGNED=aligned,
            num_warps=ctx.tuning.elementwise_warps))
    return run
