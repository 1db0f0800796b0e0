"""Each kernel's GPU time in one captured 32-layer decode step (attention only: RoPE append and
paged decode per layer, Hq32/Hkv8/D128 bf16, L=1024), at B = 1, 8, 32, 128. Run on a GPU:

    python tools/graph_step_kernels.py

The workload of ``kvcache bench --backend cuda``'s graphs section (``bench.graph_case``) at a
fixed history length (that section's rows also time eager steps first, which lengthens the
histories it replays at), split by kernel name with the torch profiler: the per-kernel view of
the step that ``tools/kernel_ab.sh`` compares between two trees. Prints the replay's median GPU
time (CUDA events, 20 replays) and, per kernel name, its summed time in a replay and its count
(the median of 5 profiled replays)."""

import collections

import torch
from torch.profiler import ProfilerActivity, profile

from kvcache_cuda import bench as B

BATCHES = (1, 8, 32, 128)


def main() -> None:
    for batch in BATCHES:
        cache, ids, layers, graphs = B.graph_case(torch, "cuda", "cuda", "bfloat16", batch, 64)

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
        del cache, layers, graphs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
