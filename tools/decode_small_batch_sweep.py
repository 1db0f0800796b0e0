"""Small-batch decode (issue 33, item 2): the decode kernel's time for each split count and
decode tile at B=1 L=4096 (and a few neighbours), next to what bounds it on this GPU: an empty
launch, a plain read of the same bytes by a Triton kernel of as many programs, and contiguous
SDPA; all timed the bench's way (one call captured in a CUDA graph and replayed, L2 flushed,
median). Run on a GPU:

    python tools/decode_small_batch_sweep.py [--quick]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import triton
import triton.language as tl

from kvcache_cuda import bench as B
from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.tuning import AttnTiles, num_splits


@triton.jit
def _empty_kernel(x_ptr):
    pass


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_per, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * n_per
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, n_per, BLOCK):
        acc += tl.load(x_ptr + base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, 0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    dev = torch.device("cuda")
    be = B.bench_backend(CudaBackend, "bfloat16", "cuda")
    timer = B.Timer(torch, dev, 30, 3)
    rng = np.random.default_rng(0)
    base = be.tuning
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"# {torch.cuda.get_device_name(dev)}, {sms} SMs; base decode tiles "
          f"{base.tiles('decode', B.D)}, split rule ({base.split_programs_per_sm}, "
          f"{base.split_min_keys})", flush=True)
    x = torch.empty(1, device=dev)
    us, _ = timer.measure(lambda: _empty_kernel[(1,)](x))
    print(f"empty launch: {us:.1f} us")
    cases = ((1, 4096),) if args.quick else ((1, 4096), (1, 8192), (4, 4096))
    tiles = [(16, bn, w, st) for bn in (32, 64, 128) for w in (4, 8) for st in (2, 3, 4)]
    if args.quick:
        tiles = [(16, 64, 4, 3), (16, 128, 8, 2), (16, 32, 4, 4)]
    for batch, kv_len in cases:
        nbytes = batch * kv_len * B.HKV * B.D * 2 * 2
        buf = torch.randn(nbytes // 2, device=dev, dtype=torch.bfloat16)
        for progs in (128, 256, 512, 1024):
            out = torch.empty(progs, device=dev)
            n_per = buf.numel() // progs
            us, _ = timer.measure(lambda: _read_kernel[(progs,)](buf, out, n_per, BLOCK=2048,
                                                                 num_warps=8))
            print(f"B={batch} L={kv_len}: plain read of {nbytes / 1e6:.1f} MB by {progs} programs "
                  f"{us:.1f} us ({nbytes / us / 1e3:.0f} GB/s)", flush=True)
        del buf
        pages, depth, q = B.paged_setup(torch, be, batch, kv_len, 1, rng, dev)
        kc = torch.randn((batch, B.HKV, kv_len, B.D), device=dev, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        qs = q.view(batch, B.HQ, 1, B.D)
        sd, _ = timer.measure(lambda: B.sdpa(torch, qs, kc, vc))
        del kc, vc
        auto = num_splits(base, batch * B.HKV, kv_len, sms)
        us, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, B.D ** -0.5))
        print(f"B={batch} L={kv_len}: sdpa {sd:.1f} us; shipped {us:.1f} us ({auto} splits)",
              flush=True)
        best = []
        for t in tiles:
            table = dict(base.by_head_dim)
            table[B.D] = dict(table.get(B.D, {}), decode=AttnTiles(*t))
            row = []
            for s in (8, 16, 24, 32, 48, 64):
                be.tuning = base.with_(by_head_dim=table, force_splits=s)
                try:
                    us, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, B.D ** -0.5))
                except Exception as exc:
                    row.append(f"s{s}=fail")
                    print(f"  fail {t} s{s}: {type(exc).__name__}: {str(exc)[:80]}")
                    continue
                best.append((us, t, s))
                row.append(f"s{s}={us:5.1f}")
            print(f"B={batch} L={kv_len} tiles={t}: " + " ".join(row), flush=True)
        be.tuning = base
        best.sort()
        print(f"B={batch} L={kv_len} best: " + "; ".join(f"{u:.1f} us {t} s{s}" for u, t, s in best[:6]),
              flush=True)
        del pages
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
