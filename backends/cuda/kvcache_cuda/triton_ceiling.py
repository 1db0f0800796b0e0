"""The Triton ceiling the bench holds our prefill kernels against (issue 55, item 2).

A plain fused attention kernel written for Hopper the way Triton's own fused-attention
tutorial runs there: Q, K and V through TMA tensor descriptors, the key loop optionally warp
specialized (producer warps load, consumer warps compute), exp2 online softmax, causal calls
split into the unmasked blocks below the diagonal and the masked ones on it. It computes
only what the bench's contiguous case needs: sequences of one length ``L`` (a multiple of the
tiles), K/V contiguous and token-major ``(B * L, Hkv, D)``, GQA by head index, no paging,
windows, sinks, softcap or non-finite rules. So it is the best Triton does on the same
arithmetic without our kernels' features: our Triton prefill (kept for those features and for
ROCm) is asked to be within 0.9 of it. ``best_ceiling`` times a few tile variants and keeps
the fastest, as the tutorial's autotuner would.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

VARIANTS = tuple(itertools.product((64, 128), (4, 8), (3,), (False, True)))
"""(BLOCK_N, num_warps, num_stages, warp_specialize) candidates; BLOCK_M is 128."""
BLOCK_M = 128


def ceiling_attention(q, k, v, seq_len: int, sm_scale: float, causal: bool,
                      block_n: int = 128, num_warps: int = 8, num_stages: int = 3,
                      warp_specialize: bool = False):
    """Attention of sequences of one length: ``q`` (B * L, Hq, D), ``k``/``v`` (B * L, Hkv, D),
    contiguous, 16-bit; sequence ``b`` is rows ``b * L .. (b + 1) * L``; ``causal`` aligned at
    the top left (every sequence's queries are its keys). Returns o (B * L, Hq, D)."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    assert t % seq_len == 0 and seq_len % BLOCK_M == 0 and seq_len % block_n == 0, \
        "the ceiling kernel takes sequences of one length, a multiple of its tiles"
    from triton.tools.tensor_descriptor import TensorDescriptor
    o = torch.empty_like(q)
    qd = TensorDescriptor(q.view(t, hq * d), [t, hq * d], [hq * d, 1], [BLOCK_M, d])
    od = TensorDescriptor(o.view(t, hq * d), [t, hq * d], [hq * d, 1], [BLOCK_M, d])
    kd = TensorDescriptor(k.view(t, hkv * d), [t, hkv * d], [hkv * d, 1], [block_n, d])
    vd = TensorDescriptor(v.view(t, hkv * d), [t, hkv * d], [hkv * d, 1], [block_n, d])
    grid = (seq_len // BLOCK_M, (t // seq_len) * hq)
    _ceiling_kernel[grid](qd, kd, vd, od, sm_scale * 1.4426950408889634, seq_len, hq, hq // hkv,
                          HEAD_DIM=d, BLOCK_M=BLOCK_M, BLOCK_N=block_n, CAUSAL=causal,
                          WARP_SPEC=warp_specialize, num_warps=num_warps, num_stages=num_stages)
    return o


def best_ceiling(timer, q, k, v, seq_len: int, sm_scale: float, causal: bool):
    """``(us, variant)``: the fastest of ``VARIANTS`` by ``timer.measure`` (graph replay), or
    ``(None, why)`` where none compiles here."""
    best: tuple = (None, "no variant ran")
    for bn, warps, stages, ws in VARIANTS:
        def run(bn=bn, warps=warps, stages=stages, ws=ws):
            return ceiling_attention(q, k, v, seq_len, sm_scale, causal, bn, warps, stages, ws)
        try:
            us = timer.measure(run)[0]
        except Exception as exc:  # a variant this GPU or Triton cannot build: the others stand
            if best[0] is None:
                best = (None, f"{type(exc).__name__}: {str(exc)[:120]}")
            continue
        if us == us and (best[0] is None or us < best[0]):
            best = (us, dict(block_n=bn, num_warps=warps, num_stages=stages, warp_specialize=ws))
    return best


@triton.jit
def _ceiling_block(acc, l_i, m_i, q, kd, vd, row0, kvcol, lo, hi, offs_m, qk_scale,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPEC: tl.constexpr):
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        k = kd.load([row0 + start, kvcol])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            cols = start + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= cols[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = vd.load([row0 + start, kvcol])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _ceiling_kernel(qd, kd, vd, od, qk_scale, seq_len, n_heads, group, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    WARP_SPEC: tl.constexpr):
    """Grid (query tiles of a sequence, sequences x query heads)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // n_heads
    h = bh % n_heads
    row0 = b * seq_len
    kvcol = (h // group) * HEAD_DIM
    q = qd.load([row0 + pid_m * BLOCK_M, h * HEAD_DIM])
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = tl.zeros([BLOCK_M], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:
        # the key blocks wholly below the diagonal, unmasked; then the diagonal's, masked
        acc, l_i, m_i = _ceiling_block(acc, l_i, m_i, q, kd, vd, row0, kvcol, 0,
                                       pid_m * BLOCK_M, offs_m, qk_scale, BLOCK_N, False,
                                       WARP_SPEC)
        acc, l_i, m_i = _ceiling_block(acc, l_i, m_i, q, kd, vd, row0, kvcol, pid_m * BLOCK_M,
                                       (pid_m + 1) * BLOCK_M, offs_m, qk_scale, BLOCK_N, True,
                                       WARP_SPEC)
    else:
        acc, l_i, m_i = _ceiling_block(acc, l_i, m_i, q, kd, vd, row0, kvcol, 0, seq_len,
                                       offs_m, qk_scale, BLOCK_N, False, WARP_SPEC)
    o = acc / l_i[:, None]
    od.store([row0 + pid_m * BLOCK_M, h * HEAD_DIM], o.to(q.dtype))
