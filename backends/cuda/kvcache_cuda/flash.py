"""Prefill through the attention kernels that torch ships, where they compute what the call asks.

torch's CUDA wheels carry cuDNN's attention (``aten._scaled_dot_product_cudnn_attention``, what
SDPA runs on Hopper) and FlashAttention-2 (``aten._flash_attention_forward``, what
``torch.nn.attention.varlen.varlen_attn`` runs). On one long sequence cuDNN is faster than our
Triton prefill, so ``CudaBackend`` sends a prefill call here when

* the library is there (``flash_problem``: a CUDA build of torch with the ops, an sm_80+ GPU,
  ``KVCACHE_CUDA_FLASH`` not ``off``; ROCm's build returns another lse layout and runs the
  Triton kernels),
* the call asks only for what the library computes (``FlashPrefill.ragged_ok`` / ``paged_ok``):
  16-bit compute, 16-bit or fp8 pages (fp8: the paged gather writes ``code * scale``, and a
  ragged call's codes go through ``scale_heads``),
  ``head_dim == head_dim_v <= 256``, no inline RoPE,
  soft-capping or token tree, not the batch-invariant mode (whose point is one
  arithmetic for prefill and decode); paged calls without a window, over a depth whose entries
  cover every query row,
* the rule takes it: one sequence (a ragged call's ``num_seqs``, a paged call's entries) or
  several of one shape (every sequence as many rows as the longest; a paged depth's
  ``uniform``: as many queries and as many keys), no window, and big enough: the tuning
  table's ``flash_ragged_min_rows`` (rows of a ragged call) and ``flash_paged_min_rows``
  (queries of a paged call's entry: the page gather below costs per key, the attention per
  key and query), for several sequences ``flash_batch_min_len`` rows each (queries an entry)
  and ``flash_batch_min_rows`` in all, measured per architecture by ``python -m
  kvcache_cuda.tune --only flash``; 0 (the base tables): never. Such calls run cuDNN on (n, H, len, D) views of the rows, no
  copy. Sequences of several lengths would need FlashAttention-2's varlen kernel (or padding
  copies), slower than our Triton kernels on Hopper, so the rule leaves them to Triton.
  ``KVCACHE_CUDA_FLASH=on`` takes every call the library can compute, mixed lengths and
  windows through FlashAttention-2 (tests), ``off`` none.

Paged calls gather the entries' keys into contiguous K/V (``gather_entries``, one Triton
kernel: pages are ``(2, Hkv, page, D)``, head-major, which the library's page tables cannot
read). Ragged calls run inside ``triton_kernels.ragged_attention``, after its finite-V pass and
before its non-finite fix-up, so a NaN or inf in the V of a key a row does not see stays out of
that row (the library multiplies masked keys' zero weights by V). On FlashAttention-2's calls a
NaN / inf in q or in a key read sets a flag (``flag_nonfinite``, the gather), and the Triton
kernel, launched with ``GUARD``, recomputes the call where it is set: its NaN rules are not
ours. cuDNN's batch follows them for q and the keys (``cudnn_route``'s note), so its calls
skip the checks and the guarded launch (B=8 L=2048 on an H200: ragged 0.86 -> 0.95 of
SDPA's speed, paged 0.94 -> 0.93-0.99 in four runs).

The results differ from the Triton kernels' by rounding only (both accumulate in float32); the
conformance suite runs with ``KVCACHE_CUDA_FLASH=on`` on a GPU.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from .triton_kernels import _widen

FLASH_ENV = "KVCACHE_CUDA_FLASH"       # "auto" (default): the tuning table; "on": always; "off"
_MODES = ("auto", "on", "off")
MAX_HEAD_DIM = 256                    # FlashAttention-2's largest head dim

Attend = Callable[..., tuple]
"""``attend(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window_left, uniform=False)
-> (o, lse)``: varlen attention with FlashAttention's conventions: ``q`` (Tq, Hq, D), ``k``/``v``
(Tk, Hkv, D) (Hkv dividing Hq), ``cu_q``/``cu_k`` (n+1,) int32 prefix sums, ``causal`` aligned
to the last key, ``window_left`` -1 or the keys before a query's diagonal it sees; ``uniform``
(a host promise): every sequence has ``max_q`` queries and ``max_k`` keys, so ``cu_q`` is
``arange * max_q`` and ``cu_k`` ``arange * max_k``; ``o`` (Tq, Hq, D) in q's dtype, ``lse``
(Hq, Tq) float32 natural log, +inf for a row that sees no key. It may carry
``keeps_nonfinite(n, q_rows, k_rows, max_q, max_k, causal, window_left, uniform) -> bool``:
on such a call its result already follows our NaN / inf rules for q and the keys (a row that
reads a non-finite one is non-finite, no other row changes), so the checks and the guarded
recompute are skipped (V's rule is the ragged finite-V pass's either way)."""


def _never(*_args) -> bool:
    return False


def mode() -> str:
    """``KVCACHE_CUDA_FLASH``: "auto" (default), "on" or "off"; ValueError for anything else."""
    value = os.environ.get(FLASH_ENV, "auto")
    if value not in _MODES:
        raise ValueError(f"{FLASH_ENV}={value!r}: want one of {', '.join(_MODES)}")
    return value


def flash_problem(device) -> Optional[str]:
    """Why torch's attention kernels cannot serve ``device`` (None: they can)."""
    if mode() == "off":
        return f"{FLASH_ENV}=off"
    dev = torch.device(device)
    if dev.type != "cuda":
        return f"{device} is not a CUDA device"
    if getattr(torch.version, "hip", None):
        return "torch is built for ROCm (its FlashAttention returns lse per padded batch)"
    if getattr(torch.ops.aten, "_flash_attention_forward", None) is None:
        return f"torch {torch.__version__} has no aten._flash_attention_forward"
    if not torch.backends.cuda.is_flash_attention_available():
        return f"torch {torch.__version__} was built without FlashAttention"
    major, _ = torch.cuda.get_device_capability(dev)
    if major < 8:
        return f"FlashAttention-2 needs sm_80 or newer, {torch.cuda.get_device_name(dev)} is sm_{major}x"
    return None


def aten_attend(q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale, window_left,
                uniform=False):
    """``Attend`` through torch's kernels: sequences of one shape (``uniform``, or one sequence
    holding every row of q and k), no window, through cuDNN's attention
    (``aten._scaled_dot_product_cudnn_attention``, what SDPA runs on Hopper: 1.9x
    FlashAttention-2 there) on (n, H, len, D) views of the rows; the rest through
    FlashAttention-2 varlen (``aten._flash_attention_forward``). Both take GQA natively (K/V
    are not repeated per query head)."""
    n = cu_q.shape[0] - 1
    if cudnn_route(n, q.shape[0], k.shape[0], max_q, max_k, causal, window_left, uniform):
        def batch(x, rows):        # rows i*rows .. of sequence i -> (n, H, rows, D), a view
            return x[:n * rows].view(n, rows, x.shape[1], x.shape[2]).transpose(1, 2)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            batch(q, max_q), batch(k, max_k), batch(v, max_k), None, True, 0.0, causal, False,
            scale=sm_scale)
        o = out[0].transpose(1, 2).reshape(n * max_q, q.shape[1], out[0].shape[-1])
        lse = out[1][..., 0]                                   # (n, Hq, max_q)
        lse = lse[0] if n == 1 else lse.transpose(0, 1).reshape(q.shape[1], n * max_q)
        return (o if o.is_contiguous() else o.contiguous()), lse
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=sm_scale,
        window_size_left=int(window_left), window_size_right=0 if causal else -1)
    return out[0], out[1]


def cudnn_route(n: int, q_rows: int, k_rows: int, max_q: int, max_k: int, causal: bool,
                window_left: int, uniform: bool) -> bool:
    """Whether ``aten_attend`` runs a call through cuDNN's batch (else FlashAttention-2 varlen):
    sequences of one shape (``uniform``, or one sequence holding all ``q_rows`` / ``k_rows``),
    no window, causal only over as many keys as queries, cuDNN there and on."""
    one = n == 1 and q_rows == max_q and k_rows == max_k
    return bool((uniform or one) and n > 0 and int(window_left) < 0
                and (not causal or max_q == max_k) and _cudnn_ok())


aten_attend.keeps_nonfinite = cudnn_route      # type: ignore[attr-defined]
"""cuDNN's batch turns a NaN / inf in q or in a key a row reads into that row's non-finite
result, and leaves every other row as it is: the rows our kernels mark, every one (a NaN, +inf
and -inf at a sequence's first, middle and last row of q and of k, ragged causal and paged
calls: ``tools/flash_nonfinite_probe.py`` and ``test_the_library_keeps_our_nonfinite_rows`` on
an H200). FlashAttention-2 does not (a NaN key it reads gave a finite lse), so its calls keep
the checks."""

_CUDNN: list = []


def _cudnn_ok() -> bool:
    """torch has cuDNN's attention and it is on (``torch.backends.cuda.enable_cudnn_sdp``)."""
    if not _CUDNN:
        _CUDNN.append(getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention", None)
                      is not None and torch.backends.cudnn.is_available())
    return _CUDNN[0] and torch.backends.cuda.cudnn_sdp_enabled()


class FlashPrefill:
    """The dispatch rule and the calls (see the module docstring). ``attend``: the library
    function (``aten_attend``; tests pass a stand-in with its conventions); ``force``: "on"
    takes every call it can compute, whatever the thresholds."""

    def __init__(self, attend: Attend = aten_attend, force: Optional[str] = None):
        self.attend = attend
        self.keeps_nonfinite = getattr(attend, "keeps_nonfinite", _never)
        self.force = mode() if force is None else force
        self.calls = 0
        """Calls served (tests and benches read it)."""

    def _plain(self, ctx, q, rope, softcap, sinks, fp8_ok=False) -> bool:
        """The parts of the rule common to both kinds of call (``fp8_ok``: fp8 pages allowed,
        the paged call's gather dequantizes them)."""
        return (self.force != "off" and not ctx.batch_invariant and (fp8_ok or not ctx.kv_quant)
                and rope is None and not softcap
                and ctx.dtype in (torch.float16, torch.bfloat16) and q.dtype == ctx.dtype
                and ctx.head_dim == ctx.head_dim_v and ctx.head_dim <= MAX_HEAD_DIM
                and ctx.head_dim % 8 == 0)

    def _big_enough(self, rows: int, threshold: int) -> bool:
        if self.force == "on":
            return rows > 1
        return threshold > 0 and rows >= threshold

    def _batch_big_enough(self, tuning, length: int, rows: int) -> bool:
        """Several sequences of one shape: long enough each and enough rows in all (cuDNN's
        batch loses to the Triton kernels on many short sequences)."""
        return (self._big_enough(length, tuning.flash_batch_min_len)
                and self._big_enough(rows, tuning.flash_batch_min_rows))

    def ragged_ok(self, ctx, q, k, v, *, num_seqs, max_len, tree, rope, softcap, sinks,
                  window_left=-1, kv_scale=None) -> bool:
        """Whether a ragged call (causal over the forward's own rows) goes to the library: by
        the rule, one sequence or several of one length, without a window (cuDNN's path;
        FlashAttention-2 varlen, which takes the rest under ``KVCACHE_CUDA_FLASH=on``, ran
        1.4-1.9x our Triton kernel's time on an H200). In an fp8 cache (with its
        ``kv_scale``) too: the library attends over ``code * scale``."""
        return (tree is None and self._plain(ctx, q, rope, softcap, sinks,
                                             fp8_ok=kv_scale is not None)
                and k.dtype == ctx.dtype and v.dtype == ctx.dtype
                and (self.force == "on" or int(window_left) < 0) and max_len > 1
                and (self._big_enough(int(q.shape[0]), ctx.tuning.flash_ragged_min_rows)
                     if num_seqs == 1 or self.force == "on" else
                     _uniform_rows(q, num_seqs, max_len) and self._batch_big_enough(
                         ctx.tuning, int(max_len), int(q.shape[0]))))

    def ragged_attend(self, qo_indptr, max_len: int, sm_scale: float, window_left: int,
                      num_seqs: int, rows: int, kv_scale=None, sinks=None):
        """The attention step ``triton_kernels.ragged_attention`` runs instead of its kernel:
        ``(q, k, v) -> (o (T, Hq, D), lse (T, Hq) contiguous, guard)``, ``guard`` a (1,) int32
        flag set where q or k holds a NaN / inf (the kernel then recomputes the call), or None
        where the library keeps our rules for them (``Attend``'s ``keeps_nonfinite``: its
        result stands, no check, no recompute). ``rows``: the call's query rows.
        ``kv_scale``: an fp8 cache's (2, Hkv) scales; k and v then hold the codes (the kernel's
        passes rounded them), and the library gets ``code * scale``: made by ``scale_heads``
        where the kernel may recompute the call (it reads the codes), else by the passes
        themselves (``run.wants_values``, read by ``triton_kernels.ragged_attention``).
        ``sinks``: (Hq,) sink logits, joined to the library's result by ``apply_sinks``."""
        uniform = num_seqs > 0 and rows == num_seqs * int(max_len)
        keeps = self.keeps_nonfinite(num_seqs, rows, rows, max_len, max_len, True, window_left,
                                     uniform)

        def run(q, k, v):
            self.calls += 1
            guard = None
            if not keeps:
                guard = torch.zeros(1, dtype=torch.int32, device=q.device)
                flag_nonfinite(q, guard)
                flag_nonfinite(k, guard)
                if kv_scale is not None:
                    k, v = scale_heads(k, kv_scale[0]), scale_heads(v, kv_scale[1])
            o, lse = self.attend(q, k, v, qo_indptr, qo_indptr, max_len, max_len, True, sm_scale,
                                 window_left, uniform=uniform)
            lse = lse.t().contiguous()              # every row sees itself: no empty rows
            if sinks is not None:
                apply_sinks(o, lse, sinks)
            return o, lse, guard
        run.wants_values = keeps and kv_scale is not None     # type: ignore[attr-defined]
        return run

    def paged_ok(self, ctx, q, depth, *, rope, window_left, softcap, sinks,
                 kv_scale=None) -> bool:
        """Whether a paged call (every key of an entry visible to its queries) goes to the
        library: no window (the library's is relative to the last key, ours to positions),
        no tree, entries covering every row (the library writes only the entries' rows); by
        the rule, one entry or a ``uniform`` depth (cuDNN's path, as for ragged calls). fp8
        pages too (with their ``kv_scale``): the gather writes ``code * scale`` in the compute
        dtype."""
        return (depth.tree is None and int(window_left) < 0 and depth.covers_rows
                and not depth.use_decode and depth.num_entries > 0 and depth.max_kv_len > 0
                and self._plain(ctx, q, rope, softcap, sinks, fp8_ok=kv_scale is not None)
                and (self._big_enough(int(depth.max_qo_len), ctx.tuning.flash_paged_min_rows)
                     if depth.num_entries == 1 or self.force == "on" else
                     bool(depth.uniform) and self._batch_big_enough(
                         ctx.tuning, int(depth.max_qo_len), int(q.shape[0]))))

    def paged_attend(self, ctx, q, pages, depth, sm_scale: float, kv_scale=None, sinks=None):
        """The attention step ``triton_kernels.paged_attention`` runs instead of its kernel for a
        call ``paged_ok`` took: ``() -> (o (T, Hq, D), lse (T, Hq), guard)``, the entries' keys
        gathered, then varlen attention (not causal) over them; ``guard`` as for
        ``ragged_attend`` (q, or a key the gather read; None where the library keeps our
        rules)."""
        def run():
            self.calls += 1
            n, max_q, max_k = depth.num_entries, int(depth.max_qo_len), int(depth.max_kv_len)
            guard = None
            if not self.keeps_nonfinite(n, int(q.shape[0]), n * max_k, max_q, max_k, False, -1,
                                        bool(depth.uniform)):
                guard = torch.zeros(1, dtype=torch.int32, device=q.device)
                flag_nonfinite(q, guard)
            k, v, cu_k = gather_entries(pages, depth, ctx.head_dim, guard, kv_scale, q.dtype)
            o, lse = self.attend(q, k, v, depth.qo_indptr, cu_k, max_q, max_k, False, sm_scale,
                                 -1, uniform=bool(depth.uniform))
            # an entry with no key: the library's lse is +inf, ours -inf (o is 0 in both);
            # (T, Hq) contiguous, as the kernels write it (the guarded one may)
            lse = lse.t().contiguous().masked_fill_(lse.t() == float("inf"), float("-inf"))
            if sinks is not None:
                apply_sinks(o, lse, sinks)
            return o, lse, guard
        return run


def _uniform_rows(q, num_seqs: int, max_len: int) -> bool:
    """A ragged call's sequences all hold ``max_len`` rows (none holds more, so the rows add
    up only then)."""
    return num_seqs > 0 and int(q.shape[0]) == num_seqs * int(max_len)


def apply_sinks(o, lse, sinks) -> None:
    """Join each head's sink logit to an attention result, in place: ``lse' = log(exp(lse) +
    exp(sink))`` and ``o' = o * exp(lse - lse')`` (one more term of the softmax's denominator
    with no value, as the kernels' ``_finish`` adds it). ``o`` (T, Hq, D) contiguous, ``lse``
    (T, Hq) float32 contiguous, ``sinks`` (Hq,) any float dtype. A row with no key (lse -inf)
    gets lse = sink and keeps o = 0; a NaN stays NaN."""
    t, h, d = o.shape
    if t == 0:
        return
    assert o.is_contiguous() and lse.is_contiguous(), "apply_sinks: contiguous o and lse"
    block_d = max(16, triton.next_power_of_2(d))
    block_t = max(1, min(64, 8192 // block_d))
    _apply_sinks_kernel[(triton.cdiv(t, block_t), h)](
        o, lse, sinks, t, h, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=4)


def scale_heads(x, scale):
    """``x * scale`` per head: x (T, H, D) (last dim contiguous), scale (H,) float32; the
    product in float32, written in x's dtype (fp8 codes held in a 16-bit dtype to their
    values)."""
    t, h, d = x.shape
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t:
        block_d = max(16, triton.next_power_of_2(d))
        block_t = max(1, min(64, 8192 // block_d))
        _scale_heads_kernel[(triton.cdiv(t, block_t), h)](
            x, scale, out, t, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_T=block_t, num_warps=4)
    return out


def flag_nonfinite(x, flag) -> None:
    """Set ``flag`` (a (1,) int32 tensor) where ``x`` ((T, H, D), last dim contiguous) holds a
    NaN or an inf; leave it otherwise. One pass over x, no host sync."""
    t, h, d = x.shape
    if t == 0:
        return
    block_d = max(16, triton.next_power_of_2(d))
    block_t = max(1, min(64, 8192 // block_d))
    _flag_nonfinite_kernel[(triton.cdiv(t, block_t), h)](
        x, flag, t, x.stride(0), x.stride(1), HEAD_DIM=d, BLOCK_D=block_d, BLOCK_T=block_t,
        num_warps=4)


def gather_entries(pages, depth, head_dim: int, flag=None, kv_scale=None, dtype=None) -> tuple:
    """The keys of each entry of ``depth`` out of ``pages`` (``(P, 2, Hkv, page, W)``, W >= D),
    in key order (sinks, then the window after its gap: ``DepthAux``'s offsets).

    Returns ``(k, v, cu_k)``: k and v ``(n * max_kv_len, Hkv, head_dim)`` with entry ``i``'s
    keys at rows ``cu_k[i]:cu_k[i+1]`` (the rows after ``cu_k[n]`` are not written), ``cu_k``
    ``(n+1,)`` int32 prefix sums of ``kv_len``. No host sync: the sizes are host ints of the
    depth and the offsets a device prefix sum. ``flag``: a (1,) int32 tensor set where a key
    read holds a NaN or an inf. ``kv_scale``: fp8 pages' (2, Hkv) float32 scales (K's, then
    V's): k and v are ``code * scale`` in ``dtype`` (the compute dtype)."""
    n, max_kv = depth.num_entries, int(depth.max_kv_len)
    hkv, page_size = pages.shape[2], pages.shape[3]
    out_dtype = pages.dtype if kv_scale is None else dtype
    k = torch.empty((n * max_kv, hkv, head_dim), dtype=out_dtype, device=pages.device)
    v = torch.empty_like(k)
    cu_k = torch.zeros(n + 1, dtype=torch.int32, device=pages.device)
    torch.cumsum(depth.kv_len[:n], 0, out=cu_k[1:])
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_t = max(1, min(64, 8192 // block_d))
    sp = pages.stride()
    _gather_entries_kernel[(triton.cdiv(max_kv, block_t), n, hkv)](
        pages, depth.page_indptr, depth.page_indices, depth.kv_len, depth.sink_size,
        depth.window_offset, cu_k, k, v, cu_k if flag is None else flag,
        cu_k if kv_scale is None else kv_scale, sp[0], sp[1], sp[2], sp[3], k.stride(0),
        k.stride(1), PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_T=block_t,
        FLAG=flag is not None, QUANT=kv_scale is not None, num_warps=4)
    return k, v, cu_k


@triton.jit
def _gather_entries_kernel(pages_ptr, pindptr_ptr, pind_ptr, kvlen_ptr, sink_ptr, gap_ptr,
                           cuk_ptr, ok_ptr, ov_ptr, flag_ptr, scale_ptr, sp_page, sp_kv,
                           sp_head, sp_row, so_t, so_h, PAGE_SIZE: tl.constexpr,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                           FLAG: tl.constexpr, QUANT: tl.constexpr):
    """Grid (key tiles of the longest entry, entries, Hkv): BLOCK_T keys of one entry and head.
    FLAG: ``flag_ptr[0] = 1`` where a key read holds a NaN / inf. QUANT: the pages hold fp8
    codes, written out as ``code * scale`` (``scale_ptr``: (2, Hkv), K's then V's) in the
    outputs' dtype."""
    e = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    kv_len = tl.load(kvlen_ptr + e)
    t0 = tl.program_id(0) * BLOCK_T
    if t0 < kv_len:
        j = t0 + tl.arange(0, BLOCK_T)
        j_ok = j < kv_len
        sink = tl.load(sink_ptr + e)
        gap = tl.load(gap_ptr + e)
        off = tl.where(j < sink, j, j - sink + gap)
        page = tl.load(pind_ptr + tl.load(pindptr_ptr + e) + off // PAGE_SIZE, mask=j_ok,
                       other=0).to(tl.int64)
        src = page * sp_page + h * sp_head + (off % PAGE_SIZE).to(tl.int64) * sp_row
        dst = (tl.load(cuk_ptr + e) + j).to(tl.int64) * so_t + h * so_h
        d = tl.arange(0, BLOCK_D)
        m = j_ok[:, None] & (d < HEAD_DIM)[None, :]
        kk = tl.load(pages_ptr + src[:, None] + d[None, :], mask=m, other=0.0)
        vv = tl.load(pages_ptr + sp_kv + src[:, None] + d[None, :], mask=m, other=0.0)
        if QUANT:
            kk = _widen(kk, tl.float32) * tl.load(scale_ptr + h)
            vv = _widen(vv, tl.float32) * tl.load(scale_ptr + tl.num_programs(2) + h)
        kk = kk.to(ok_ptr.dtype.element_ty)
        tl.store(ok_ptr + dst[:, None] + d[None, :], kk, mask=m)
        if FLAG:
            if tl.max(tl.max((((kk - kk) != 0) & m).to(tl.int32), 1), 0) > 0:
                tl.atomic_max(flag_ptr, 1)
        tl.store(ov_ptr + dst[:, None] + d[None, :], vv.to(ov_ptr.dtype.element_ty), mask=m)


@triton.jit
def _flag_nonfinite_kernel(x_ptr, flag_ptr, n_rows, sx_t, sx_h, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid (row tiles, heads): ``flag_ptr[0] = 1`` where a row of the tile holds a NaN / inf."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = (t < n_rows)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t.to(tl.int64)[:, None] * sx_t + h * sx_h + d[None, :], mask=m, other=0.0)
    if tl.max(tl.max(((x - x) != 0).to(tl.int32), 1), 0) > 0:
        tl.atomic_max(flag_ptr, 1)


@triton.jit
def _scale_heads_kernel(x_ptr, scale_ptr, o_ptr, n_rows, sx_t, sx_h, so_t, so_h,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid (row tiles, heads): ``o = x * scale[head]`` in float32, stored in o's dtype."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    m = (t < n_rows)[:, None] & (d < HEAD_DIM)[None, :]
    x = tl.load(x_ptr + t[:, None] * sx_t + h * sx_h + d[None, :], mask=m, other=0.0)
    y = x.to(tl.float32) * tl.load(scale_ptr + h)
    tl.store(o_ptr + t[:, None] * so_t + h * so_h + d[None, :], y.to(o_ptr.dtype.element_ty),
             mask=m)


@triton.jit
def _apply_sinks_kernel(o_ptr, lse_ptr, sinks_ptr, n_rows, n_heads, HEAD_DIM: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Grid (row tiles, heads): ``apply_sinks`` on rows of one head."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    h = tl.program_id(1)
    t_ok = t < n_rows
    lse = tl.load(lse_ptr + t * n_heads + h, mask=t_ok, other=0.0)
    sink = tl.load(sinks_ptr + h).to(tl.float32)
    top = tl.maximum(lse, sink)
    top_use = tl.where(top == float("-inf"), 0.0, top)
    total = tl.exp(lse - top_use) + tl.exp(sink - top_use)
    new = tl.where(total == 0, float("-inf"), top_use + tl.log(total))
    factor = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - new))
    d = tl.arange(0, BLOCK_D)
    m = t_ok[:, None] & (d < HEAD_DIM)[None, :]
    ptr = o_ptr + (t * n_heads + h)[:, None] * HEAD_DIM + d[None, :]
    o = tl.load(ptr, mask=m, other=0.0).to(tl.float32) * factor[:, None]
    tl.store(ptr, o.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(lse_ptr + t * n_heads + h, new, mask=t_ok)
