"""Where the shared-prefix serving workload spends its steps (``kvcache bench --serving
--workload shared-prefix``'s Engine, prefix cache on or off): the measured run timed, under
cProfile (host time by function) and under torch.profiler (the GPU busy fraction).

    python tools/profile_prefix.py [--off] [--requests 128] [--mixed-graphs]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kvcache.bench.serving import build_model
from kvcache.bench.serving.measure import union_length
from kvcache.bench.serving.prefix import Online, shared_prefix_prompts
from kvcache.integrations.transformers import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--off", action="store_true")
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mixed-graphs", action="store_true")
    args = p.parse_args()
    net = build_model("llama", args.layers, False, "cuda", "bfloat16", 0)
    eng = Engine(net, backend="cuda", page_size=16, max_batch_size=64,
                 max_total_tokens=64 * 136 * 16, prefix_cache=not args.off,
                 mixed_graphs=args.mixed_graphs)
    eng.progress = False
    runner = Online(eng, 32)
    groups = lambda seed: [[q] for q in shared_prefix_prompts(args.requests, 2000, (16, 64), net.config.vocab_size, seed)]
    runner.run(groups(100))
    t0 = time.perf_counter()
    steps0 = eng.stats.forwards
    _, ttft, wall = runner.run(groups(101))
    steps = eng.stats.forwards - steps0
    print(f"prefix cache {'off' if args.off else 'on'}: {wall:.2f} s, {steps} forwards, "
          f"{wall / steps * 1e3:.2f} ms/forward, graph forwards {eng.stats.graph_forwards}")
    graphs = eng.runner.decode_graphs
    if graphs is not None:      # the captured steps: ((mixed, depths), bucket)
        print("captured steps:", sorted(graphs.buckets))
    pr = cProfile.Profile()
    pr.enable()
    runner.run(groups(102))
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(22)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        runner.run(groups(103))
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"GPU busy {union_length(spans) / 1e6 / wall:.2f} of {wall:.2f} s")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
