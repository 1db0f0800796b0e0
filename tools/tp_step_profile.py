"""Where a TP decode step's time goes (issue 50 item 1): the tp bench's model (Llama-3-8B layer
shapes, bf16) at TP=1 on rank 0 and at TP=2 on two GPUs, B prompts of 512 tokens prefilled,
then ``--steps`` decode steps through the online API timed (wall per step) and profiled on
rank 0 (torch.profiler, CUDA activity): the GPU's busy time per step, the kernels by total time,
and the host's time per step in ``engine.step`` (cProfile, the top functions).

    python tools/tp_step_profile.py [--layers 32] [--batch 64] [--steps 20] [--compile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time


def _busy(events) -> float:
    """Microseconds the GPU ran kernels (merged intervals)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _profile(engine, prompts, steps: int, label: str, rank: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvcache.integrations import SamplingParams
    engine.progress = False
    engine.generate(prompts, max_new_tokens=steps + 8, ignore_eos=True)        # warm
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=3 * steps + 16, ignore_eos=True))
    while engine.stats.decode_tokens == 0 or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    prof.disable()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished():
        engine.step()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = _busy(kernels) / steps
    by: dict = {}
    for e in kernels:
        n, s = by.get(e.name, (0, 0.0))
        by[e.name] = (n + 1, s + e.time_range.elapsed_us())
    if rank == 0:
        print(f"\n== {label}: wall {wall * 1e3:.3f} ms a step, GPU busy {busy / 1e3:.3f} ms a step "
              f"({100 * busy / 1e3 / (wall * 1e3):.0f}%)", flush=True)
        for name, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1])[:16]:
            print(f"  {s / steps / 1e3:8.3f} ms  {n // steps:4d}x  {name[:110]}")
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
        print("  host (cProfile, tottime, all steps):")
        print("\n".join("    " + line for line in out.getvalue().splitlines()[6:26]))
    return dict(wall_ms=wall * 1e3, busy_ms=busy / 1e3)


def _rank(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    from kvcache.bench.serving.model import build_model, workload
    from kvcache.integrations.tp import shard_model
    from kvcache.integrations.transformers import Engine
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)

    def model():
        return build_model("llama", opts["layers"], False, device, "bfloat16", 0)
    net = model()
    prompts = workload(opts["batch"], (512, 512), net.config.vocab_size, 1)
    kw = dict(backend="cuda", max_batch_size=opts["batch"], compile_step=opts["compile"])
    out: dict = {}
    if rank == 0 and not opts["skip_tp1"]:
        one = Engine(net, **kw)
        out["tp1"] = _profile(one, prompts, opts["steps"], "TP=1", rank)
        del one
    del net
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()
    net = model()
    shard_model(net, method="integration")
    two = Engine(net, tp=world, **kw)
    out["tp2"] = _profile(two, prompts, opts["steps"], "TP=2", rank)
    return out


def main() -> None:
    from kvcache.distributed.tp import spawn
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-tp1", action="store_true")
    p.add_argument("--compile", action="store_true", help="Engine(compile_step=True)")
    a = p.parse_args()
    res = spawn(_rank, 2, args=(dict(layers=a.layers, batch=a.batch, steps=a.steps,
                                     skip_tp1=a.skip_tp1, compile=a.compile),), backend="nccl", timeout_s=900)
    r = res[0]
    if "tp1" in r:
        print(f"\nTP=2 / TP=1 step: {r['tp2']['wall_ms'] / r['tp1']['wall_ms']:.3f}; GPU busy "
              f"{r['tp2']['busy_ms'] / r['tp1']['busy_ms']:.3f}")


if __name__ == "__main__":
    main()
