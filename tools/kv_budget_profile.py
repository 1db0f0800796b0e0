"""Where the kv-budget workload's time goes (issue 55: fp8 pages at one KV budget slower than
bf16): the same two Engines as ``kvcache bench --serving --workload kv-budget --kv-dtype
float8_e4m3`` (Llama-3-8B layer shapes, 8 layers, bf16 compute, 256 requests of 128-1024
tokens, 128 new each, batch 64, 704 MiB of pages each), each timed, then its engine counters,
the GPU busy fraction under torch.profiler with the kernels by total time, and cProfile's host
functions by own time. Each Engine is warmed up as the bench does (other prompts, which
calibrate the fp8 scales, then ``Engine.warm_up()``: every graph bucket captured).

    python tools/kv_budget_profile.py [--requests 256] [--kv-dtype float8_e4m3] [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch

from kvcache.bench.serving.kv_budget import PAGE, budget_tokens, token_bytes
from kvcache.bench.serving.model import build_model, random_prompt_range, workload
from kvcache.bench.serving.prefix import Online
from kvcache.bench.serving.measure import union_length
from kvcache.integrations.transformers import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--kv-dtype", default="float8_e4m3")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--no-warm-up", action="store_true",
                   help="no Engine.warm_up() before the warm run (the bench before 2026-11-29)")
    a = p.parse_args()
    net = build_model("llama", 8, False, "cuda", "bfloat16", 0)
    lo, hi = random_prompt_range(False)
    prompts = workload(a.requests, (lo, hi), net.config.vocab_size, 0)
    warm = workload(a.requests, (lo, hi), net.config.vocab_size, 1000)
    tb = {k: token_bytes(net, k, "cache") for k in ("auto", a.kv_dtype)}
    budget = int(a.batch * ((lo + hi) / 2 + a.new) / 2 * tb["auto"])
    for kv in ("auto", a.kv_dtype):
        engine = Engine(net, backend="cuda", device="cuda", page_size=PAGE, max_batch_size=a.batch,
                        max_total_tokens=budget_tokens(budget, tb[kv]), kv_dtype=kv)
        engine.progress = False
        runner = Online(engine, a.new, track_running=True)
        runner.run([warm])
        if not a.no_warm_up:
            engine.warm_up()

        def whole():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.run([prompts])
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        before = dataclasses.asdict(engine.stats)
        wall = whole()
        after = dataclasses.asdict(engine.stats)
        delta = {k: after[k] - before[k] for k in after if isinstance(after[k], (int, float))
                 and after[k] != before[k]}
        print(f"\n=== kv_dtype {engine.config.kv_dtype}: {engine.cache.num_total_pages} pages, "
              f"host tier {engine.host_tier is not None}, graphs {engine.graphs}, mixed "
              f"{engine.mixed_graphs}: {a.requests * a.new / wall:.1f} tokens/s ({wall:.2f} s)")
        print(f"counters: {delta}")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
            pw = whole()
        events = [(e.time_range.start, e.time_range.end) for e in tp.events()
                  if e.device_type.name == "CUDA"]
        busy = union_length(sorted(events)) * 1e-6
        print(f"profiled: {pw:.2f} s, GPU busy {busy:.2f} s ({100 * busy / pw:.0f}%)")
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=a.top))
        prof = cProfile.Profile()
        prof.runcall(whole)
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)
        del engine, runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
