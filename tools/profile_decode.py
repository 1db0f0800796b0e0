"""Kernel-level breakdown of one B=1 paged decode call (H100 investigation of the 15 us target):
prints each kernel's own time from the torch profiler for a few split/tile settings."""
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import kvcache
from kvcache_cuda import bench
from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.tuning import AttnTiles

cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                          dtype="bfloat16", max_total_tokens=16)
be = CudaBackend(cfg, "cuda")
rng = np.random.default_rng(0)
kv_len = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
pages, depth, q = bench.paged_setup(torch, be, 1, kv_len, 1, rng, torch.device("cuda"))
base = be.tuning
for splits in (16, 32):
    for tiles in ((16, 64, 4, 2), (16, 128, 8, 3), (16, 128, 4, 4)):
        be.tuning = base.with_(force_splits=splits, by_head_dim={128: {"decode": AttnTiles(*tiles)}})
        fn = lambda: be.paged_attention(q, pages, depth, 128 ** -0.5)
        for _ in range(5):
            fn()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g.replay()
            torch.cuda.synchronize()
        ks = {}
        for ev in prof.events():
            if str(ev.device_type).endswith("CUDA"):
                ks.setdefault(ev.name[:40], []).append(ev.device_time)
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(50):
            g.replay()
        en.record(); en.synchronize()
        print(f"splits={splits} tiles={tiles}: replay {st.elapsed_time(en) * 1e3 / 50:.1f} us (back to back); "
              + ", ".join(f"{k} {np.median(v):.1f} us" for k, v in ks.items()))
