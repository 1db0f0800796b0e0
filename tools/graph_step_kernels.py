"""Each kernel's GPU time in one captured 32-layer decode step (attention only: RoPE append and
paged decode per layer, Hq32/Hkv8/D128 bf16, L=1024), at B = 1, 8, 32, 128. Run on a GPU:

    python tools/graph_step_kernels.py

The workload of ``kvcache bench --backend cuda``'s graphs section at a fixed history length
(that section's rows also time eager steps first, which lengthens the histories it replays at),
split by kernel name with the torch profiler: the per-kernel view of the step that
``tools/kernel_ab.sh`` compares between two trees. Prints the replay's median GPU time (CUDA
events, 20 replays) and, per kernel name, its summed time in a replay and its count (the median
of 5 profiled replays)."""

import collections

import torch
from torch.profiler import ProfilerActivity, profile

import kvcache
from kvcache_cuda.graphs import DecodeGraphs

HQ, HKV, D, PS, LAYERS, L = 32, 8, 128, 16, 32, 1024
BATCHES = (1, 8, 32, 128)


def main() -> None:
    for batch in BATCHES:
        cfg = kvcache.CacheConfig(
            num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PS,
            dtype="bfloat16", rope_mode="normal", max_batch_size=max(BATCHES),
            max_total_tokens=batch * (L + 64) + PS, prefill_chunk_size=L, static_decode=True,
            static_decode_batch_sizes=BATCHES)
        cache = kvcache.PagedKVCache(cfg, backend="cuda", device="cuda")
        ids = list(range(batch))
        for sid in ids:              # histories through the planner only: timing needs no values
            cache.add_sequence(sid)
            cache.planner.begin([sid], [L])
        static = [[torch.randn((batch, h, D), device="cuda").to(torch.bfloat16)
                   for h in (HQ, HKV, HKV)] for _ in range(LAYERS)]
        graphs = DecodeGraphs(cache, warmup=2)
        cache.begin_forward(ids, [1] * batch)
        graphs.capture(lambda: [cache.attention(i, *static[i]) for i in range(LAYERS)])
        cache.end_forward()

        def replay(body):
            cache.begin_forward(ids, [1] * batch)
            torch.cuda.synchronize()
            out = body()
            cache.end_forward()
            return out

        for _ in range(5):
            replay(graphs.replay)
        per_kernel = collections.defaultdict(list)
        for _ in range(5):
            def profiled():
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graphs.replay()
                    torch.cuda.synchronize()
                return prof
            total, count = collections.Counter(), collections.Counter()
            for ev in replay(profiled).events():
                if str(ev.device_type).endswith("CUDA"):
                    total[ev.name[:40]] += ev.device_time
                    count[ev.name[:40]] += 1
            for name in total:
                per_kernel[name].append((total[name], count[name]))

        def timed():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs.replay()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        times = sorted(replay(timed) for _ in range(20))
        print(f"B={batch} replay median {times[10]:.1f} us; per kernel (median of 5, count):")
        for name, runs in sorted(per_kernel.items()):
            us, n = sorted(runs)[len(runs) // 2]
            print(f"    {name:40s} {us:8.1f} us  x{n}")
        del cache, graphs, static
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
