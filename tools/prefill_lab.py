"""Prefill attention variants at the kernel bench's shapes, to find what bounds the paged
prefill kernel on Hopper (issue 33 item 1): a stripped-down paged prefill loop (no window,
tree, sinks, softcap or RoPE; every key visible) with switches for each suspected cost, next
to the shipped kernel and contiguous flash SDPA, each checked against SDPA's output.

Switches (a variant's name lists those on):
  paged / contig / tma   keys through the page table (pointer gathers), from a contiguous
                         [T, Hkv, D] tensor by pointers, or by TMA tensor descriptors
  acc                    ``tl.dot(p, v, acc)``: the PV product accumulates in place
                         (without: ``acc * alpha + tl.dot(p, v)``, as the shipped kernel)
  masked                 the shipped loop's per-score visibility ``where`` and its -inf guard
  ws                     ``tl.range(..., warp_specialize=True)``

  python3 tools/prefill_lab.py [--quick]      (one GPU; prints us, TFLOP/s, x SDPA)
  python3 tools/prefill_lab.py --shipped-tiles [--default-tiles | --tiles 128,64,8,3 ...]
                                  (the shipped paged and ragged kernels over candidate tiles)
  python3 tools/prefill_lab.py --persistent [--tiles ...]
                                  (the stripped paged loop: a program per tile, or persistent)
  python3 tools/prefill_lab.py --uniform    (the shipped paged kernel, warp_uniform_scalars
                                            off against on, alternated)
  ncu --clock-control none --profile-from-start off ... python3 tools/prefill_lab.py --ncu
                                  (hardware counters of the shipped kernel and the stripped loop)
"""
import argparse
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from kvcache_cuda import bench
from kvcache_cuda.backend import CudaBackend

import kvcache


@triton.jit
def _lab_kernel(q_ptr, pages_ptr, k_ptr, v_ptr, o_ptr, pind_ptr, desc_k, desc_v, L, pages_per,
                sq_t, sq_h, sp_page, sp_kv, sp_head, sp_row, sk_t, sk_h, so_t, so_h, qk_scale,
                GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                MODE: tl.constexpr, ACC: tl.constexpr, MASKED: tl.constexpr, WS: tl.constexpr,
                STAGES: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    ri = tl.arange(0, BLOCK_R)
    r = pid * M_TOK + ri // GROUP
    head = kvh * GROUP + ri % GROUP
    tok = (b * L + r).to(tl.int64)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + dd[None, :])
    m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    floor = tl.zeros([BLOCK_R], tl.int32) - 2147483647
    for j0 in tl.range(0, L, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        j = j0 + tl.arange(0, BLOCK_N)
        if MODE == 0:
            pg = tl.load(pind_ptr + b * pages_per + j // PAGE_SIZE).to(tl.int64)
            base = pg * sp_page + kvh * sp_head + (j % PAGE_SIZE).to(tl.int64) * sp_row
            k = tl.load(pages_ptr + base[:, None] + dd[None, :])
        elif MODE == 1:
            kb = (b * L + j).to(tl.int64) * sk_t + kvh * sk_h
            k = tl.load(k_ptr + kb[:, None] + dd[None, :])
        else:
            k = desc_k.load([b * L + j0, kvh * D])
        qk = tl.dot(q, tl.trans(k))
        if MASKED:
            vis = (j < L)[None, :] & (j[None, :] >= floor[:, None])
            s = tl.where(vis, qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MODE == 0:
            v = tl.load(pages_ptr + sp_kv + base[:, None] + dd[None, :])
        elif MODE == 1:
            v = tl.load(v_ptr + kb[:, None] + dd[None, :])
        else:
            v = desc_v.load([b * L + j0, kvh * D])
        if ACC:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dd[None, :],
             o.to(o_ptr.dtype.element_ty))


@triton.jit
def _lab_persistent_kernel(q_ptr, pages_ptr, o_ptr, pind_ptr, L, pages_per, n_tiles, q_tiles,
                           nprog, sq_t, sq_h, sp_page, sp_kv, sp_head, sp_row, so_t, so_h, qk_scale,
                           GROUP: tl.constexpr, M_TOK: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE_SIZE: tl.constexpr,
                           HKV: tl.constexpr, FLATTEN: tl.constexpr, STAGES: tl.constexpr):
    """The stripped paged loop (no masks) as a persistent kernel: one program per SM walks the
    (sequence, KV head, q tile) tiles pid, pid + programs, ...; FLATTEN: the tile and key loops
    flattened into one for the software pipeliner (``tl.range(flatten=True)``), so the next
    tile's first keys load while this tile's output is stored."""
    pid = tl.program_id(0)
    ri = tl.arange(0, BLOCK_R)
    dd = tl.arange(0, D)
    for t in tl.range(pid, n_tiles, nprog, flatten=FLATTEN):
        mt = t % q_tiles
        kvh = (t // q_tiles) % HKV
        b = t // (q_tiles * HKV)
        r = mt * M_TOK + ri // GROUP
        head = kvh * GROUP + ri % GROUP
        tok = (b * L + r).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + dd[None, :])
        m_i = tl.zeros([BLOCK_R], tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for j0 in tl.range(0, L, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            pg = tl.load(pind_ptr + b * pages_per + j // PAGE_SIZE).to(tl.int64)
            base = pg * sp_page + kvh * sp_head + (j % PAGE_SIZE).to(tl.int64) * sp_row
            k = tl.load(pages_ptr + base[:, None] + dd[None, :])
            qk = tl.dot(q, tl.trans(k))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.exp2(qk * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(pages_ptr + sp_kv + base[:, None] + dd[None, :])
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + dd[None, :],
                 o.to(o_ptr.dtype.element_ty))


def _stripped(q, pages, depth, o, batch, n, tiles):
    """Launch ``_lab_kernel``'s unmasked loop over pages (MODE 0), one program per tile."""
    rows, bn, warps, stages = tiles
    G = bench.HQ // bench.HKV
    m_tok = rows // G
    _lab_kernel[(n // m_tok, bench.HKV, batch)](
        q, pages, q, q, o, depth.page_indices, None, None, n, n // bench.PS, q.stride(0),
        q.stride(1), pages.stride(0), pages.stride(1), pages.stride(2), pages.stride(3), 0, 0,
        o.stride(0), o.stride(1), bench.D ** -0.5 * 1.4426950408889634, GROUP=G, M_TOK=m_tok,
        BLOCK_R=rows, BLOCK_N=bn, D=bench.D, PAGE_SIZE=bench.PS, MODE=0, ACC=False,
        MASKED=False, WS=False, STAGES=stages, num_warps=warps, num_stages=stages)


def _persistent(q, pages, depth, o, batch, n, tiles, flatten, programs):
    """Launch ``_lab_persistent_kernel`` over ``programs`` programs (at most one per tile)."""
    rows, bn, warps, stages = tiles
    G = bench.HQ // bench.HKV
    m_tok = rows // G
    q_tiles = n // m_tok
    n_tiles = batch * bench.HKV * q_tiles
    grid = (min(n_tiles, programs),)
    _lab_persistent_kernel[grid](
        q, pages, o, depth.page_indices, n, n // bench.PS, n_tiles, q_tiles, grid[0], q.stride(0),
        q.stride(1), pages.stride(0), pages.stride(1), pages.stride(2), pages.stride(3),
        o.stride(0), o.stride(1), bench.D ** -0.5 * 1.4426950408889634, GROUP=G, M_TOK=m_tok,
        BLOCK_R=rows, BLOCK_N=bn, D=bench.D, PAGE_SIZE=bench.PS, HKV=bench.HKV, FLATTEN=flatten,
        STAGES=stages, num_warps=warps, num_stages=stages)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer variants")
    ap.add_argument("--shipped-tiles", action="store_true",
                    help="only the shipped paged and ragged kernels over candidate tile tables")
    ap.add_argument("--default-tiles", action="store_true",
                    help="with --shipped-tiles: the shipped table only")
    ap.add_argument("--persistent", action="store_true",
                    help="only the stripped paged loop, one program per tile against one per SM "
                         "(persistent, with and without the loops flattened)")
    ap.add_argument("--uniform", action="store_true",
                    help="only the shipped paged kernel with warp_uniform_scalars off and on, "
                         "alternated three times (an A/B in one process)")
    ap.add_argument("--ncu", action="store_true",
                    help="the shipped paged kernel and the stripped loop at (128,128,8,3), each "
                         "run once between cudaProfilerStart / Stop after a warm-up, for "
                         "`ncu --profile-from-start off`")
    ap.add_argument("--tiles", nargs="*", default=None, metavar="R,N,W,S",
                    help="with --shipped-tiles: these prefill tiles (rows, keys, warps, stages) "
                         "after the shipped table, instead of the built-in list")
    args = ap.parse_args()
    from triton.tools.tensor_descriptor import TensorDescriptor
    HQ, HKV, D, PS = bench.HQ, bench.HKV, bench.D, bench.PS
    G = HQ // HKV
    dev = torch.device("cuda")
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                              page_size=PS, dtype="bfloat16", max_total_tokens=16)
    be = CudaBackend(cfg, "cuda")
    timer = bench.Timer(torch, dev, 20, 3)
    rng = np.random.default_rng(0)
    scale = D ** -0.5
    print(torch.cuda.get_device_name(), "triton", triton.__version__, "torch", torch.__version__)
    variants = []
    for mode in ("paged", "contig", "tma"):
        for acc in (False, True):
            for masked in (True, False):
                for ws in (False, True):
                    if ws and mode == "paged" and args.quick:
                        continue
                    variants.append((mode, acc, masked, ws))
    tiles = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (256, 64, 8, 3)]
    if args.quick:
        tiles = tiles[:2]
    for batch, n in bench.PREFILL_CASES:
        pages, depth, q = bench.paged_setup(torch, be, batch, n, n, rng, dev)
        # the same keys, contiguous: [T, Hkv, D] (token-major, as a ragged K)
        pind = depth.page_indices.long()
        kc = pages[pind, 0].permute(0, 2, 1, 3).reshape(batch * n, HKV, D).contiguous()
        vc = pages[pind, 1].permute(0, 2, 1, 3).reshape(batch * n, HKV, D).contiguous()
        qs = q.view(batch, n, HQ, D).transpose(1, 2)
        ks = kc.view(batch, n, HKV, D).transpose(1, 2)
        vs = vc.view(batch, n, HKV, D).transpose(1, 2)
        ref = bench.sdpa(torch, qs, ks, vs).transpose(1, 2).reshape(batch * n, HQ, D)
        flops = 4 * batch * n * n * HQ * D
        sd, _ = timer.measure(lambda: bench.sdpa(torch, qs, ks, vs))
        print(f"\nB={batch} L={n}: sdpa {sd:.1f} us ({flops / sd / 1e6:.0f} TFLOP/s)")
        ship, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, scale))
        got = be.paged_attention(q, pages, depth, scale)[0]
        err = (got.float() - ref.float()).abs().max().item()
        print(f"  shipped paged kernel {ship:8.1f} us {flops / ship / 1e6:5.0f} TFLOP/s "
              f"{sd / ship:.3f}x sdpa  err {err:.3g}")
        if args.uniform:
            base = be.tuning
            for rnd in range(3):
                for on in (False, True):
                    be.tuning = base.with_(warp_uniform_scalars=on)
                    _check_and_time(f"round {rnd + 1}: warp_uniform_scalars={on!s:5}",
                                    lambda: be.paged_attention(q, pages, depth, scale),
                                    None, ref, timer, sd, flops)
            be.tuning = base
            continue
        if args.ncu:
            o = torch.empty_like(q)
            lab = lambda: _stripped(q, pages, depth, o, batch, n, (128, 128, 8, 3))
            lab()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            be.paged_attention(q, pages, depth, scale)
            lab()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
        if args.persistent:
            o = torch.empty_like(q)
            for tiles in ([tuple(int(x) for x in t.split(",")) for t in args.tiles]
                          if args.tiles else [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 3),
                                              (128, 64, 8, 2)]):
                variants = [("one program per tile", lambda t=tiles: _stripped(
                    q, pages, depth, o, batch, n, t))]
                sms = torch.cuda.get_device_properties(dev).multi_processor_count
                for flatten in (False, True):
                    for per_sm in (1, 2):
                        variants.append((f"persistent, {per_sm} per SM, flatten={flatten}",
                                         lambda f=flatten, p=per_sm * sms: _persistent(
                                             q, pages, depth, o, batch, n, tiles, f, p)))
                for name, run in variants:
                    _check_and_time(f"{str(tiles):18} {name:36}", run, o, ref, timer, sd, flops)
            continue
        if args.shipped_tiles:
            _shipped_tiles(be, timer, q, pages, depth, kc, vc, qs, ks, vs, ref, batch, n, flops, sd,
                           [None] if args.default_tiles else
                           [None] + [tuple(int(x) for x in t.split(",")) for t in args.tiles]
                           if args.tiles is not None else SHIPPED_TILES)
            continue
        o = torch.empty_like(q)
        k2, v2 = kc.view(batch * n, HKV * D), vc.view(batch * n, HKV * D)
        for (rows, bn, warps, stages) in tiles:
            m_tok = rows // G
            dk = TensorDescriptor.from_tensor(k2, [bn, D])
            dv = TensorDescriptor.from_tensor(v2, [bn, D])
            some = variants if (rows, bn, warps, stages) == tiles[0] else \
                [v for v in variants if v[1] and (v[0] == "paged" or not v[2])]
            for mode, acc, masked, ws in some:
                name = mode + "".join(f"+{flag}" for flag, on in
                                      (("acc", acc), ("masked", masked), ("ws", ws)) if on)
                grid = (n // m_tok, HKV, batch)
                def run():
                    _lab_kernel[grid](
                        q, pages, kc, vc, o, depth.page_indices, dk, dv, n, n // PS,
                        q.stride(0), q.stride(1), pages.stride(0), pages.stride(1),
                        pages.stride(2), pages.stride(3), kc.stride(0), kc.stride(1),
                        o.stride(0), o.stride(1), scale * 1.4426950408889634,
                        GROUP=G, M_TOK=m_tok, BLOCK_R=rows, BLOCK_N=bn, D=D, PAGE_SIZE=PS,
                        MODE={"paged": 0, "contig": 1, "tma": 2}[mode], ACC=acc, MASKED=masked,
                        WS=ws, STAGES=stages, num_warps=warps, num_stages=stages)
                _check_and_time(f"{str((rows, bn, warps, stages)):18} {name:26}", run, o, ref,
                                timer, sd, flops)
        del pages, kc, vc
        torch.cuda.empty_cache()


def _check_and_time(label, run, o, ref, timer, sd, flops):
    """Run once into a zeroed ``o`` (None: ``run`` returns its output first, as the backend's
    attention calls do), print its time, TFLOP/s, x SDPA and its error against SDPA's output;
    a variant that cannot compile or launch prints why."""
    try:
        if o is not None:
            o.zero_()
        out = run()
        torch.cuda.synchronize()
        err = ((out[0] if o is None else o).float() - ref.float()).abs().max().item()
        us, _ = timer.measure(run)
        print(f"  {label} {us:8.1f} us {flops / us / 1e6:5.0f} TFLOP/s {sd / us:.3f}x sdpa  "
              f"err {err:.3g}", flush=True)
    except Exception as exc:
        print(f"  {label} failed: {type(exc).__name__}: "
              f"{(str(exc) or ' ').splitlines()[0][:120]}", flush=True)


SHIPPED_TILES = [None, (128, 64, 4, 3), (128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 2),
                 (128, 64, 8, 3), (64, 64, 4, 3)]


def _shipped_tiles(be, timer, q, pages, depth, kc, vc, qs, ks, vs, ref, batch, n, flops, sd,
                   candidates):
    """The shipped paged and ragged kernels with each candidate prefill tile table."""
    from kvcache_cuda.tuning import AttnTiles
    base = be.tuning
    scale = bench.D ** -0.5
    qo = torch.arange(0, batch * n + 1, n, device=q.device, dtype=torch.int32)
    sdc, _ = timer.measure(lambda: bench.sdpa(torch, qs, ks, vs, causal=True))
    refc = bench.sdpa(torch, qs, ks, vs, causal=True).transpose(1, 2).reshape(q.shape)
    print(f"  causal sdpa {sdc:.1f} us")
    for tiles in candidates:
        if tiles is None:
            be.tuning = base
        else:
            table = dict(base.by_head_dim)
            table[bench.D] = dict(table.get(bench.D, {}), prefill=AttnTiles(*tiles),
                                  ragged=AttnTiles(*tiles))
            be.tuning = base.with_(by_head_dim=table)
        name = str(be.tuning.tiles("prefill", bench.D)) + (
            "" if tiles is not None else f" (ragged {be.tuning.tiles('ragged', bench.D)})")
        try:
            got = be.paged_attention(q, pages, depth, scale)[0]
            ep = (got.float() - ref.float()).abs().max().item()
            up, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, scale))
            er = (be.ragged_attention(q, kc, vc, qo, scale, num_seqs=batch, max_len=n)[0].float()
                  - refc.float()).abs().max().item()
            ur, _ = timer.measure(lambda: be.ragged_attention(q, kc, vc, qo, scale, num_seqs=batch,
                                                              max_len=n))
            print(f"  {name:60} paged {up:8.1f} us {sd / up:.3f}x sdpa err {ep:.3g} | ragged "
                  f"{ur:8.1f} us {sdc / ur:.3f}x causal sdpa err {er:.3g}", flush=True)
        except Exception as exc:
            print(f"  {name:60} failed: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    be.tuning = base


if __name__ == "__main__":
    sys.exit(main())
