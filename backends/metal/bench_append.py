"""Append cost must not grow with the cache size: MLX scatter assignment into a page array whose
buffer has no other reference is done in place (buffer donation), so one append touches only
the appended rows.

    python backends/metal/bench_append.py [--device cpu|gpu] [--iters 300]

Times ``MetalBackend.append_kv`` (one decode step of a batch, synchronised after every call) on
caches of 1k and 100k pages with small heads, and reports whether the page buffer moved and how
much the peak memory grew (a copy of the cache would add one cache-sized buffer per call).
"""

from __future__ import annotations

import argparse
import platform
import time

import mlx.core as mx
import numpy as np

import kvcache
from kvcache_metal.backend import MetalBackend


def data_ptr(a):
    view = np.array(a, copy=False)
    ptr = view.__array_interface__["data"][0]
    del view
    return ptr


def bench(num_pages, device, iters, batch, page_size=16, heads=1, head_dim=16):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=heads, num_kv_heads=heads,
                              head_dim=head_dim, page_size=page_size,
                              max_total_tokens=(num_pages - 1) * page_size, dtype="float16")
    be = MetalBackend(cfg, device)
    [pages] = be.allocate_pages(cfg.num_pages)
    rng = np.random.default_rng(0)
    k = be.from_numpy(rng.standard_normal((batch, heads, head_dim)))
    v = be.from_numpy(rng.standard_normal((batch, heads, head_dim)))
    slot_sets = [be.aux_to_device(rng.choice(cfg.num_pages * page_size, batch, replace=False))
                 for _ in range(16)]
    for i in range(10):                                   # warm-up
        be.append_kv(pages, k, v, slot_sets[i % 16])
    be.synchronize()
    ptr0 = data_ptr(pages)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        be.append_kv(pages, k, v, slot_sets[i % 16])
        mx.eval(pages)
        be.synchronize()
        times.append(time.perf_counter() - t0)
    row = {"pages": cfg.num_pages, "cache_mb": pages.nbytes / 2**20,
            "median_us": 1e6 * float(np.median(times)), "p90_us": 1e6 * float(np.percentile(times, 90)),
            "same_buffer": data_ptr(pages) == ptr0,
            "peak_growth_kb": (mx.get_peak_memory() - base) / 1024}
    t0 = time.perf_counter()
    copy = mx.array(pages) * 1                           # what one full copy of the cache costs
    mx.eval(copy)
    copy_us = 1e6 * (time.perf_counter() - t0)
    del copy
    row["copy_us"] = copy_us
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="tokens per append (decode batch)")
    args = ap.parse_args(argv)
    print(f"MLX {mx.__version__} device={args.device} machine={platform.machine()} "
          f"{platform.processor() or platform.platform()}")
    rows = [bench(n, args.device, args.iters, args.batch) for n in (1000, 100_000)]
    for r in rows:
        print(f"pages={r['pages']:>7} cache={r['cache_mb']:8.1f} MiB  append median "
              f"{r['median_us']:7.1f} us  p90 {r['p90_us']:7.1f} us  same buffer: {r['same_buffer']}"
              f"  peak growth {r['peak_growth_kb']:.1f} KiB  (one full copy: {r['copy_us']:.0f} us)")
    ratio = rows[1]["median_us"] / rows[0]["median_us"]
    print(f"100k/1k median ratio: {ratio:.2f} (a per-append copy of the cache would be ~100x)")
    ok = all(r["same_buffer"] for r in rows) and ratio < 3.0
    print("OK: append time does not grow with the cache size" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
