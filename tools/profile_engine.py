"""Where a decode step of the transformers ``Engine`` spends host time (cProfile), on the serving
bench's model (Llama-3-8B layer shapes, 8 layers, bf16): B prompts of P tokens, after a warm-up
that captures the decode graphs.

    python tools/profile_engine.py [--batch 64] [--prompt 512] [--new 40] [--graphs on|off]
    python tools/profile_engine.py --serve [--requests 256]   # the serving bench's whole run

``--serve`` runs (a) of ``kvcache bench --serving`` (the same requests) three times after a
warm-up: timed alone; under cProfile; under torch.profiler (GPU activity only), printing the
GPU busy fraction of the whole run, the kernels by total time, and the engine's counters.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import numpy as np
import torch

from kvcache.bench.serving import build_model
from kvcache.integrations.transformers import Engine


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--graphs", default="on", choices=["on", "off"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--serve", action="store_true")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--chunks", type=lambda t: [int(x) for x in t.split(",") if x], default=[],
                   help="--serve: also time the whole run with these prefill_chunk_size values")
    a = p.parse_args()
    if a.serve:
        return serve(a)
    net = build_model("llama", a.layers, a.tiny, a.device, "bfloat16", 0)
    eng = Engine(net, backend="cuda", device=a.device, max_batch_size=a.batch,
                 max_total_tokens=a.batch * (a.prompt + a.new + 32), graphs=a.graphs == "on")
    eng.progress = False

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, net.config.vocab_size, a.prompt).tolist() for _ in range(a.batch)]
    eng.generate(prompts, max_new_tokens=8)                  # warm-up, graph capture
    print("graphs", eng.graphs, "decode_graphs", eng.decode_graphs)
    for n in (8, a.new):
        sync()
        t0 = time.perf_counter()
        eng.generate(prompts, max_new_tokens=n)
        sync()
        print(f"new={n}: wall {time.perf_counter() - t0:.3f} s")
    prof = cProfile.Profile()
    prof.enable()
    eng.generate(prompts, max_new_tokens=a.new)
    sync()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(35)


def serve(a) -> None:
    from torch.profiler import ProfilerActivity, profile

    from kvcache.bench.serving import EngineRunner, union_length, workload
    dev = a.device
    net = build_model("llama", a.layers, a.tiny, dev, "bfloat16" if dev != "cpu" else "float32", 0)
    prompts = workload(a.requests, (8, 32) if a.tiny else (128, 1024), net.config.vocab_size, 0)
    runner = EngineRunner(net, "cuda", dev, a.batch, (32 if a.tiny else 1024) + 128)
    eng = runner.engine

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def whole():
        sync()
        t0 = time.perf_counter()
        eng.generate(prompts, max_new_tokens=128)
        sync()
        return time.perf_counter() - t0

    runner.run(prompts[:a.batch], 8)                        # warm-up, graph capture
    s0 = dataclasses.asdict(eng.stats)
    wall = whole()
    s1 = dataclasses.asdict(eng.stats)
    delta = {k: s1[k] - s0[k] for k in s1}
    print(f"whole run: {wall:.3f} s, {a.requests * 128 / wall:.1f} tokens/s; engine counters: {delta}")
    prof = cProfile.Profile()
    prof.enable()
    whole()
    prof.disable()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(25)
    st.sort_stats("cumulative").print_stats(40)
    if torch.cuda.is_available():
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            pw = whole()
        events = sorted(((e.time_range.start, e.time_range.end, e.name) for e in tp.events()
                         if e.device_type.name == "CUDA"))
        busy = union_length([(s, t) for s, t, _ in events]) * 1e-6
        print(f"profiled whole run: {pw:.3f} s, GPU busy {busy:.3f} s ({100 * busy / pw:.0f}%)")
        print(tp.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        idle_gaps(events)
    for chunk in a.chunks:
        eng2 = Engine(net, backend="cuda", device=dev, page_size=16, max_batch_size=a.batch,
                      max_total_tokens=eng.config.max_total_tokens, prefill_chunk_size=chunk)
        eng2.progress = False
        eng2.generate(prompts[:a.batch], max_new_tokens=8)
        sync()
        t0 = time.perf_counter()
        eng2.generate(prompts, max_new_tokens=128)
        sync()
        w = time.perf_counter() - t0
        print(f"prefill_chunk_size={chunk}: whole run {w:.3f} s, {a.requests * 128 / w:.1f} tokens/s")
        del eng2


def idle_gaps(events, top: int = 15) -> None:
    """Where the GPU idles: the gaps between its activity (> 20 us), summed by the names of the
    kernels before and after them."""
    gaps: dict = {}
    sizes = [0, 0, 0, 0]
    end, prev = None, None
    for s, t, name in events:
        if end is not None and s - end > 20:
            g = s - end
            key = (prev[:45], name[:45])
            n, tot = gaps.get(key, (0, 0.0))
            gaps[key] = (n + 1, tot + g)
            sizes[0 if g < 100 else 1 if g < 1000 else 2 if g < 10000 else 3] += g
        if end is None or t > end:
            end, prev = t, name
    total = sum(sizes)
    print(f"idle gaps > 20 us: {total / 1e3:.1f} ms in all; by size: 20-100 us {sizes[0] / 1e3:.1f} ms, "
          f"0.1-1 ms {sizes[1] / 1e3:.1f} ms, 1-10 ms {sizes[2] / 1e3:.1f} ms, > 10 ms {sizes[3] / 1e3:.1f} ms")
    for (a, b), (n, tot) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {tot / 1e3:8.1f} ms {n:6d} gaps  after {a!r:48} before {b!r}")


if __name__ == "__main__":
    main()
