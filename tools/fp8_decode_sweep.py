"""Decode tile and split sweep over fp8 pages (issues 32, 55): for each case (default B=1
L=32768, B=16 L=4096 and B=64 L=4096; ``--cases 64x600,64x1024`` for the serving bench's
shapes) at the bench's head shape, time each decode AttnTiles candidate and split factor over
fp8 pages, next to the bf16 kernel at its default tiles and the fp8 kernel at its shipped
tiles (same run, CUDA-graph replay, L2 flushed). ``--append``: also one token's K/V append per
entry, bf16 pages against fp8 (the quantizing write), at each case's batch. Prints one line per
candidate and the best per case."""

import argparse

import numpy as np
import torch

from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.bench_kit import HKV, D, Timer, bench_backend, paged_setup
from kvcache_cuda.tuning import AttnTiles, num_splits

ap = argparse.ArgumentParser()
ap.add_argument("--cases", default="1x32768,16x4096,64x4096")
ap.add_argument("--block-n", default="64,128,256")
ap.add_argument("--warps", default="4,8")
ap.add_argument("--stages", default="2,3,4")
ap.add_argument("--mults", default="1,2", help="split factors: x the heuristic's splits")
ap.add_argument("--append", action="store_true")
args = ap.parse_args()
CASES = [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
ints = lambda s: [int(x) for x in s.split(",")]
TILES = [(16, bn, w, st) for bn in ints(args.block_n) for w in ints(args.warps)
         for st in ints(args.stages)]
rng = np.random.default_rng(0)
timer = Timer(torch, torch.device("cuda"), 15, 3)
plain = bench_backend(CudaBackend, "bfloat16", "cuda")
fp8 = bench_backend(CudaBackend, "bfloat16", "cuda", "float8_e4m3")
scales = torch.full((2, HKV), 0.02, device="cuda")
base = fp8.tuning
sm = 128 ** -0.5
for batch, n in CASES:
    pages, depth, q = paged_setup(torch, plain, batch, n, 1, rng, "cuda")
    codes = (pages.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    bf16_us = timer.measure(lambda: plain.paged_attention(q, pages, depth, sm))[0]
    shipped = timer.measure(lambda: fp8.paged_attention(q, codes, depth, sm, kv_scale=scales))[0]
    print(f"B={batch} L={n}: bf16 {bf16_us:.1f} us, fp8 shipped {shipped:.1f} us "
          f"({shipped / bf16_us:.3f}x)", flush=True)
    if args.append:
        k = torch.randn((batch, HKV, D), device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        slots = torch.arange(batch, device="cuda", dtype=torch.int64) * 16 + 3
        a16 = timer.measure(lambda: plain.append_kv(pages, k, v, slots))[0]
        a8 = timer.measure(lambda: fp8.append_kv(codes, k, v, slots, kv_scale=scales))[0]
        print(f"  append {batch} tokens: bf16 {a16:.1f} us, fp8 {a8:.1f} us", flush=True)
    best = []
    for t in TILES:
        for mult in ints(args.mults):
            table = dict(base.fp8_by_head_dim)
            table[128] = dict(table.get(128, {}), decode=AttnTiles(*t))
            # x1: the split heuristic without the fp8 minimum; xN: N times that
            fp8.tuning = base.with_(fp8_by_head_dim=table, fp8_min_splits=1)
            if mult > 1:
                s = num_splits(fp8.tuning, batch * HKV, n, fp8._num_sms, fp8=True)
                fp8.tuning = fp8.tuning.with_(force_splits=min(64, s * mult))
            try:
                us = timer.measure(lambda: fp8.paged_attention(q, codes, depth, sm,
                                                               kv_scale=scales))[0]
            except Exception as exc:
                print(f"  {t} x{mult}: failed {type(exc).__name__}", flush=True)
                continue
            best.append((us, t, mult))
            print(f"  {t} splits x{mult}: {us:.1f} us ({us / bf16_us:.3f}x bf16)", flush=True)
    fp8.tuning = base
    if best:
        us, t, mult = min(best)
        print(f"BEST B={batch} L={n}: {t} splits x{mult}: {us:.1f} us = {us / bf16_us:.3f}x bf16"
              f" (shipped {shipped / bf16_us:.3f}x)", flush=True)
    del pages, codes
    torch.cuda.empty_cache()
