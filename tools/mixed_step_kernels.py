"""GPU time of one layer's attention in a mixed step, eager plan against the static-shape mixed
plan (``CacheConfig.static_mixed``: one paged pass, chain trees): each case's kernels summed by
the torch profiler over 20 layers (bf16, Hq32/Hkv8/D128, page 16). Cases: ``P`` prompts of
``N`` new tokens beside ``D`` decode rows whose histories are ``H`` tokens; ``shared``: every
sequence (the prompts too) forked from one sequence of ``H`` tokens outside the batch, as
requests hitting a cached system prompt are (the static plan then reads it once: two depths).

    python tools/mixed_step_kernels.py [--shared-splits N ...] [--only-shared] [--per-kernel]
    python tools/mixed_step_kernels.py --depth-tiles     # the shared step's depths, tile by tile

``--shared-splits``: run the shared case once per value of the cuda tuning's ``shared_splits``
(the paged prefill kernel's key splits over a shared prefix; 1: no split), an A/B on one GPU.
"""

from __future__ import annotations

import numpy as np
import torch

import kvcache

CASES = [(1, 2040, 63, 2000, False), (1, 40, 63, 2040, False), (1, 40, 62, 2000, True),
         (4, 512, 0, 0, False), (1, 2048, 0, 0, False)]
LAYERS = 20


SPLITS = [None]           # the tuning's shared_splits for build (None: the backend's)
PER_KERNEL = [False]      # --per-kernel: list each kernel's time


def build(static: bool):
    cfg = kvcache.CacheConfig(num_layers=LAYERS, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              page_size=16, max_batch_size=64, max_total_tokens=64 * 4200,
                              prefill_chunk_size=2048 + 64, dtype="bfloat16", rope_mode="normal",
                              static_decode=static, static_mixed=static)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device="cuda")
    if SPLITS[0] is not None:
        cache.backend.tuning = cache.backend.tuning.with_(shared_splits=SPLITS[0])
    return cache


def run_case(static, prompts, new, decodes, hist, shared):
    cache = build(static)
    dev = torch.device("cuda")
    ids = list(range(prompts + decodes))
    root = len(ids)
    for s in ([root] if shared else ids):
        cache.add_sequence(s)
    if decodes or shared:                  # histories, written without attention
        k = torch.randn((hist, 8, 128), device=dev, dtype=torch.bfloat16)
        for s in [root] if shared else ids[prompts:]:
            cache.begin_forward([s], [hist])
            rows = cache.static_bucket or hist
            kk = torch.cat([k, k.new_zeros((rows - hist, 8, 128))]) if rows != hist else k
            for layer in range(LAYERS):
                cache.append_kv(layer, kk, kk)
            cache.end_forward()
    if shared:
        for s in ids:
            cache.fork_sequence(root, s)
    lens = [new] * prompts + [1] * decodes
    t = sum(lens)
    q = torch.randn((t, 32, 128), device=dev, dtype=torch.bfloat16)
    k = torch.randn((t, 8, 128), device=dev, dtype=torch.bfloat16)
    from torch.profiler import ProfilerActivity, profile
    for rep in range(2):                   # the first compiles
        cache.begin_forward(ids, lens)
        bucket = cache.static_bucket
        depths = len(cache.open_plan.depths)
        rows = bucket if bucket and cache.open_plan.static_mixed else t
        qq, kk = q, k
        if rows != t:
            qq = torch.cat([q, q.new_zeros((rows - t, 32, 128))])
            kk = torch.cat([k, k.new_zeros((rows - t, 8, 128))])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for layer in range(LAYERS):
                cache.attention(layer, qq, kk, kk)
            torch.cuda.synchronize()
        cache.abort_forward()
    us = sum(e.self_device_time_total for e in prof.key_averages()) / LAYERS
    names = sorted({e.key[:24] for e in prof.key_averages() if e.self_device_time_total > 0})
    if PER_KERNEL[0]:          # each kernel's time per layer and calls per layer
        names = [f"{e.key[:28]} {e.self_device_time_total / LAYERS:.1f}us x{e.count // LAYERS}"
                 for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
                 if e.self_device_time_total > 0]
    return us, f"{bucket}, {depths} depths", names


def depth_tiles():
    """The shared case's static plan, each depth's paged attention timed alone (CUDA events,
    median of 50) under several prefill tiles (block_rows, block_n, warps, stages)."""
    from kvcache_cuda.tuning import AttnTiles
    cache = build(True)
    dev = torch.device("cuda")
    ids = list(range(63))
    root = 63
    cache.add_sequence(root)
    cache.begin_forward([root], [2000])
    rows = cache.static_bucket or 2000
    k = torch.randn((rows, 8, 128), device=dev, dtype=torch.bfloat16)
    for layer in range(LAYERS):
        cache.append_kv(layer, k, k)
    cache.end_forward()
    for s in ids:
        cache.fork_sequence(root, s)
    cache.begin_forward(ids, [40] + [1] * 62)
    bucket = cache.static_bucket
    q = torch.randn((bucket, 32, 128), device=dev, dtype=torch.bfloat16)
    aux, pages, base = cache.forward_aux(), cache.pages[0], cache.backend.tuning
    for tiles in [None, AttnTiles(64, 128, 4, 3), AttnTiles(64, 64, 4, 2), AttnTiles(32, 64, 4, 2),
                  AttnTiles(16, 64, 4, 2), AttnTiles(128, 64, 8, 2)]:
        cache.backend.tuning = base if tiles is None else base.with_(prefill=tiles, by_head_dim={})
        times = []
        for d in aux.depths:
            for _ in range(3):
                cache.backend.paged_attention(q, pages, d, 0.08)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(100)]
            for i in range(50):
                ev[2 * i].record()
                cache.backend.paged_attention(q, pages, d, 0.08)
                ev[2 * i + 1].record()
            torch.cuda.synchronize()
            t = sorted(ev[2 * i].elapsed_time(ev[2 * i + 1]) * 1e3 for i in range(50))
            times.append(f"{t[25]:.1f}")
        print(f"tiles {tiles or 'default'}: depth 0 (shared, {aux.depths[0].shared}) {times[0]} us, "
              f"depth 1 {times[1]} us", flush=True)
    cache.backend.tuning = base
    cache.abort_forward()


def main():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--shared-splits", type=int, nargs="*", default=[None])
    p.add_argument("--only-shared", action="store_true")
    p.add_argument("--per-kernel", action="store_true")
    p.add_argument("--depth-tiles", action="store_true")
    args = p.parse_args()
    if args.depth_tiles:
        return depth_tiles()
    PER_KERNEL[0] = args.per_kernel
    for prompts, new, decodes, hist, shared in CASES:
        if args.only_shared and not shared:
            continue
        for splits in args.shared_splits if shared else [None]:
            SPLITS[0] = splits
            e_us, _, e_names = run_case(False, prompts, new, decodes, hist, shared)
            s_us, bucket, s_names = run_case(True, prompts, new, decodes, hist, shared)
            print(f"{prompts} x {new} new + {decodes} decode rows (history {hist}"
                  f"{', shared' if shared else ''}"
                  f"{'' if splits is None else f', shared_splits {splits}'}): eager "
                  f"{e_us:8.1f} us/layer, static mixed (bucket {bucket}) {s_us:8.1f} us/layer "
                  f"({s_us / e_us:.2f}x); kernels eager {e_names} static {s_names}", flush=True)


if __name__ == "__main__":
    main()
