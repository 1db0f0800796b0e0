"""Paged and ragged prefill at the bench's shapes for a few tile tables (H100 tuning aid):
`python3 tools/prefill_tiles.py` prints us and the ratio to contiguous flash SDPA per table."""
import numpy as np
import torch

import kvcache
from kvcache_cuda import bench
from kvcache_cuda.backend import CudaBackend
from kvcache_cuda.tuning import AttnTiles

CANDIDATES = [None, (256, 64, 16, 3), (256, 64, 16, 4), (256, 128, 16, 2), (256, 64, 8, 3),
              (128, 64, 8, 3)]
cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=bench.HQ, num_kv_heads=bench.HKV,
                          head_dim=bench.D, page_size=bench.PS, dtype="bfloat16", max_total_tokens=16)
be = CudaBackend(cfg, "cuda")
dev = torch.device("cuda")
timer = bench.Timer(torch, dev, 20, 3)
rng = np.random.default_rng(0)
base = be.tuning
scale = bench.D ** -0.5
setups = []
for batch, n in bench.PREFILL_CASES:
    pages, depth, q = bench.paged_setup(torch, be, batch, n, n, rng, dev)
    qs = q.view(batch, n, bench.HQ, bench.D).transpose(1, 2)
    kc = torch.randn((batch, bench.HKV, n, bench.D), device=dev, dtype=be.dtype)
    vc = torch.randn_like(kc)
    k = torch.randn((batch * n, bench.HKV, bench.D), device=dev).to(be.dtype)
    v = torch.randn_like(k)
    qo = torch.arange(0, batch * n + 1, n, device=dev, dtype=torch.int32)
    sd, _ = timer.measure(lambda: bench.sdpa(torch, qs, kc, vc))
    sdc, _ = timer.measure(lambda: bench.sdpa(torch, qs, kc, vc, causal=True))
    setups.append((batch, n, pages, depth, q, k, v, qo, sd, sdc))
for tiles in CANDIDATES:
    if tiles is None:
        be.tuning = base
        name = f"default {base.tiles('prefill', bench.D)}"
    else:
        table = dict(base.by_head_dim)
        table[bench.D] = dict(table.get(bench.D, {}), prefill=AttnTiles(*tiles))
        be.tuning = base.with_(by_head_dim=table)
        name = str(tiles)
    cells = []
    for batch, n, pages, depth, q, k, v, qo, sd, sdc in setups:
        try:
            us, _ = timer.measure(lambda: be.paged_attention(q, pages, depth, scale))
            ur, _ = timer.measure(lambda: be.ragged_attention(q, k, v, qo, scale, num_seqs=batch, max_len=n))
            cells.append(f"B={batch},L={n}: paged {us:7.1f} us ({sd / us:.3f} sdpa)  ragged {ur:7.1f} us ({sdc / ur:.3f})")
        except Exception as exc:
            cells.append(f"B={batch},L={n}: failed {type(exc).__name__}")
    print(f"{name:<34} " + " | ".join(cells), flush=True)
