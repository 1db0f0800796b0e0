"""One paged decode launch over bf16 pages and one over fp8 pages (B=16, L=4096, the bench's
head shape), after warm-up, for a profiler: run under
``ncu --kernel-name regex:_paged_decode --launch-skip 4 --launch-count 2 --section ...``
(issue 32: where fp8 decode's time goes)."""

import numpy as np
import torch

from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.bench_kit import bench_backend, paged_setup

B, L = 16, 4096
rng = np.random.default_rng(0)
plain = bench_backend(CudaBackend, "bfloat16", "cuda")
fp8 = bench_backend(CudaBackend, "bfloat16", "cuda", "float8_e4m3")
pages, depth, q = paged_setup(torch, plain, B, L, 1, rng, "cuda")
codes = (pages.float() / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn)
scales = torch.full((2, 8), 0.02, device="cuda")
for _ in range(2):       # launches 0-1: bf16 warm-up, 2-3: fp8 warm-up
    plain.paged_attention(q, pages, depth, 128 ** -0.5)
for _ in range(2):
    fp8.paged_attention(q, codes, depth, 128 ** -0.5, kv_scale=scales)
plain.paged_attention(q, pages, depth, 128 ** -0.5)                    # launch 4: bf16
fp8.paged_attention(q, codes, depth, 128 ** -0.5, kv_scale=scales)     # launch 5: fp8
torch.cuda.synchronize()
print("done")
