"""Host time per layer of the cuda backend's eager decode path (issue: the host must stop being
the bottleneck). Run on a GPU machine:

    python tools/launch_overhead.py                  # B=1 and B=64, 32 layers, L=4096
    python tools/launch_overhead.py --profile        # plus a cProfile of the per-layer calls

For each batch it reports, per layer (medians over --iters steps, no device synchronize inside
the timed region so the host never waits for the GPU):
  * ``attention us``: ``cache.attention`` (validation + fused RoPE-append + paged decode [+ merge]);
  * ``backend us``: the backend calls alone (``rope_append`` + ``paged_attention`` with the
    forward's aux), i.e. the launchers' Python and the launches;
  * ``gpu us``: the step's device time / layers (CUDA events), to compare with the host time;
  * ``records`` / ``arena allocs``: launch records built and scratch arena allocations per step
    (after warm-up: one record per block depth per step, no allocation).

``--device cpu`` (with KVCACHE_CUDA_CPU=1, and TRITON_INTERPRET=1 for the Triton launchers) runs
the same code on CPU tensors with small shapes: a smoke test of the tool, not a measurement.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import numpy as np
import torch

import kvcache


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(batch, args):
    cfg = kvcache.CacheConfig(
        num_layers=args.layers, num_qo_heads=args.hq, num_kv_heads=args.hkv, head_dim=args.d,
        page_size=16, dtype=args.dtype, rope_mode="normal", max_batch_size=max(batch, 1),
        # two timed paths (and a profiled step each) append to every sequence: whole pages each
        max_total_tokens=batch * 16 * (-(-(args.kv + 2 * (args.iters + args.warmup + 1)) // 16) + 1),
        prefill_chunk_size=args.kv)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=args.device)
    b = cache.backend
    dev = b.torch_device
    ids = list(range(batch))
    for sid in ids:                 # histories through the planner only: timing needs no values
        cache.add_sequence(sid)
        cache.planner.begin([sid], [args.kv])
    qkv = [[torch.randn((batch, h, args.d), device=dev).to(b.dtype)
            for h in (args.hq, args.hkv, args.hkv)] for _ in range(args.layers)]

    def step_cache():
        for layer in range(args.layers):
            cache.attention(layer, *qkv[layer])

    def step_backend():
        aux = cache.forward_aux()
        tok = aux.tokens
        pages = cache.pages
        rope = cfg.rope_spec()
        scale = args.d ** -0.5
        for layer in range(args.layers):
            q, k, v = qkv[layer]
            q, k = b.rope_append(pages[layer], q, k, v, tok.append_slots, tok.q_positions, rope)
            for depth in aux.depths:
                b.paged_attention(q, pages[layer], depth, scale)

    rows = {}
    for name, fn in (("attention", step_cache), ("backend", step_backend)):
        host, gpu, builds, allocs = [], [], [], []
        for i in range(args.warmup + args.iters):
            cache.begin_forward(ids, [1] * batch)
            cache.forward_aux()               # the aux upload is begin's work, not a layer's
            _sync(dev)
            b0, a0 = b.launch_cache.builds, b.scratch_allocations
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            if dev.type == "cuda":
                end.record()
                end.synchronize()
            if name == "backend":      # the backend calls appended every layer's K/V
                cache.mark_layers_run(range(args.layers))
            cache.end_forward()
            if i >= args.warmup:
                host.append((t1 - t0) * 1e6 / args.layers)
                if dev.type == "cuda":
                    gpu.append(start.elapsed_time(end) * 1e3 / args.layers)
                builds.append(b.launch_cache.builds - b0)
                allocs.append(b.scratch_allocations - a0)
        rows[name] = (statistics.median(host), statistics.median(gpu) if gpu else float("nan"),
                      max(builds), sum(allocs))
        if args.profile:
            cache.begin_forward(ids, [1] * batch)
            cache.forward_aux()
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            if name == "backend":
                cache.mark_layers_run(range(args.layers))
            cache.end_forward()
            print(f"\n-- cProfile, B={batch}, {name} path, one step of {args.layers} layers")
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,64")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv", type=int, default=4096, help="history length per sequence")
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    print(f"# eager decode host time per layer: {args.layers} layers, L={args.kv}, "
          f"Hq{args.hq}/Hkv{args.hkv}/D{args.d} {args.dtype}, device {args.device}; "
          f"medians of {args.iters} steps (target <= 30 us/layer)")
    print(f"{'batch':>6} {'path':>10} {'host us/layer':>14} {'gpu us/layer':>13} "
          f"{'records/step':>13} {'arena allocs':>13}")
    for batch in (int(x) for x in args.batches.split(",")):
        for name, (host, gpu, builds, allocs) in run(batch, args).items():
            print(f"{batch:>6} {name:>10} {host:14.1f} {gpu:13.1f} {builds:13d} {allocs:13d}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
