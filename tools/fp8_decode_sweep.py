"""Decode tile and split sweep over fp8 pages (issue 32): for B=1 L=32768, B=16 L=4096 and
B=64 L=4096 at the bench's head shape, time each decode AttnTiles candidate and split factor
over fp8 pages, next to the bf16 kernel at its default tiles (same run, CUDA-graph replay,
L2 flushed). Prints one line per candidate and the best per case."""

import numpy as np
import torch

from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.bench_kit import Timer, bench_backend, paged_setup
from kvcache_cuda.tuning import AttnTiles

CASES = [(1, 32768), (16, 4096), (64, 4096)]
TILES = [(16, bn, w, st) for bn in (64, 128, 256) for w in (4, 8) for st in (2, 3, 4)]
rng = np.random.default_rng(0)
timer = Timer(torch, torch.device("cuda"), 15, 3)
plain = bench_backend(CudaBackend, "bfloat16", "cuda")
fp8 = bench_backend(CudaBackend, "bfloat16", "cuda", "float8_e4m3")
scales = torch.full((2, 8), 0.02, device="cuda")
base = fp8.tuning
sm = 128 ** -0.5
for batch, n in CASES:
    pages, depth, q = paged_setup(torch, plain, batch, n, 1, rng, "cuda")
    codes = (pages.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
    bf16_us = timer.measure(lambda: plain.paged_attention(q, pages, depth, sm))[0]
    print(f"B={batch} L={n}: bf16 {bf16_us:.1f} us", flush=True)
    best = []
    for t in TILES:
        for mult in (1, 2):
            table = dict(base.fp8_by_head_dim)
            table[128] = dict(table.get(128, {}), decode=AttnTiles(*t))
            # x1: the split heuristic without the fp8 minimum; x2: twice that
            fp8.tuning = base.with_(fp8_by_head_dim=table, fp8_min_splits=1)
            if mult > 1:
                from kvcache_cuda.tuning import num_splits
                s = num_splits(fp8.tuning, batch * 8, n, fp8._num_sms, fp8=True)
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
    us, t, mult = min(best)
    print(f"BEST B={batch} L={n}: {t} splits x{mult}: {us:.1f} us = {us / bf16_us:.3f}x bf16",
          flush=True)
    del pages, codes
    torch.cuda.empty_cache()
