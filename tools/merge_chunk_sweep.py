"""Decode kernel time (graph replay, L2 flushed) for each split-K factor and merge chunk
(``Tuning.split_merge_chunk``: splits whose partials the fused merge loads at once; 0 = the
default budget of about 32 registers a thread). Run on a GPU:

    python tools/merge_chunk_sweep.py

Shapes: B=1 L=4096, B=1 L=32768, B=4 L=8192 (Hq32/Hkv8/D128 bf16); split counts 8/16/32/64
and the heuristic's (marked *)."""

import numpy as np
import torch

from kvcache_cuda import bench as B
from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.tuning import num_splits

CASES = ((1, 4096), (1, 32768), (4, 8192))
CHUNKS = (0, 1, 2, 4, 8, 16, 32)


def main() -> None:
    dev = torch.device("cuda")
    be = B.bench_backend(CudaBackend, "bfloat16", "cuda")
    timer = B.Timer(torch, dev, 50, 5)
    rng = np.random.default_rng(0)
    base = be.tuning
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for batch, kv_len in CASES:
        pages, depth, q = B.paged_setup(torch, be, batch, kv_len, 1, rng, dev)
        auto = num_splits(base, batch * B.HKV, kv_len, sms)
        for s in sorted({auto, 8, 16, 32, 64}):
            row = []
            for chunk in CHUNKS:
                be.tuning = base.with_(force_splits=s, split_merge_chunk=chunk)
                us, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, B.D ** -0.5))
                row.append(f"c{chunk}={us:6.1f}")
            print(f"B={batch} L={kv_len} splits={s:<3}{'*' if s == auto else ' '} " + " ".join(row),
                  flush=True)
        be.tuning = base
        del pages
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
