"""Where ``kvcache demo``'s time goes on a GPU (issue 53 item 9): the default real-model run
(``--model llama``) split into engine set-up, serving steps and the check, each serving step
tagged with what it did (Triton compiles, whole-step graph captures, prefill and decode tokens);
then a second workload (another seed) on the same engine, its kernels compiled and graphs
captured: the steady state a warm-up would give.

    python tools/demo_profile.py [demo args, e.g. --backend cuda]
"""

from __future__ import annotations

import sys
import time

import numpy as np


class Compiles:
    """Triton compiles (a cold cache's run compiles; a warm disk cache loads), timed by hooks."""

    def __init__(self):
        self.n, self.seconds, self._t = 0, 0.0, None
        self.names: dict = {}
        self.log = None
        try:
            from triton import knobs
        except ImportError:
            return
        knobs.runtime.jit_cache_hook = self._start
        knobs.runtime.jit_post_compile_hook = self._end

    def _start(self, *a, **kw):
        self._t = time.perf_counter()
        return None

    def _end(self, *a, **kw):
        if self._t is not None:
            dt = time.perf_counter() - self._t
            self.n += 1
            self.seconds += dt
            name = str(kw.get("repr", "?")).split("[", 1)[0]
            n, s = self.names.get(name, (0, 0.0))
            self.names[name] = (n + 1, s + dt)
            if self.log is not None:
                self.log.append((name, round(dt, 2), str(kw.get("repr", ""))[:400]))
        self._t = None


def main(argv) -> None:
    from kvcache.demo import build_parser, real, resolve
    from kvcache.demo.check import choose
    from kvcache.demo.serve import serve
    from kvcache.demo.workload import make_workload
    from kvcache.integrations import SamplingParams
    from kvcache.integrations.engine import Engine

    compiles = Compiles()
    opts = resolve(build_parser().parse_args(argv))
    steps: list = []
    inner = Engine.step

    def timed(self):
        s = self.stats
        before = (s.prefill_tokens, s.decode_tokens, s.graph_captures, compiles.n,
                  compiles.seconds)
        t = time.perf_counter()
        out = inner(self)
        dt = time.perf_counter() - t
        steps.append(dict(dt=dt, prefill=s.prefill_tokens - before[0],
                          decode=s.decode_tokens - before[1],
                          captures=s.graph_captures - before[2], compiles=compiles.n - before[3],
                          compile_s=compiles.seconds - before[4]))
        return out
    Engine.step = timed

    t0 = time.perf_counter()
    import torch  # noqa: F401
    t_torch = time.perf_counter() - t0
    import transformers  # noqa: F401
    t_tf = time.perf_counter() - t0 - t_torch
    import cProfile
    import pstats
    prof = cProfile.Profile()
    engine, model, what, dtype = prof.runcall(real.make_engine, opts, opts.seed)
    t_setup = time.perf_counter() - t0
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)
    print(f"set-up split: import torch {t_torch:.2f} s, import transformers {t_tf:.2f} s, "
          f"model and engine {t_setup - t_torch - t_tf:.2f} s")
    c0 = compiles.n
    warm = engine.warm_up()
    print(f"warm-up: {warm.text()}; compiles {compiles.n - c0}; steps {warm.steps}")
    compiles.log = []
    print(f"model: {what}; dtype {dtype}; backend {engine.cache.backend.name}; graphs "
          f"{engine.graphs} mixed {engine.mixed_graphs}; overlap {engine.engine_config.overlap}")
    print(f"set-up: {t_setup:.2f} s ({compiles.n} compiles, {compiles.seconds:.2f} s)")

    def params_for(logprobs):
        def params(r):
            return SamplingParams(max_tokens=r.max_tokens, temperature=0.8 if r.sampled else 0.0,
                                  n=r.n, seed=(opts.seed * 1_000_003 + r.rid * 64) % 2 ** 63,
                                  ignore_eos=True, logprobs=logprobs)
        return params

    def run(seed, label, logprobs=True):
        steps.clear()
        wl = make_workload(opts.requests, seed, model.config.vocab_size,
                           long_prompt=opts.long_prompt, max_output=opts.max_output,
                           samples=opts.samples, arrival_rate=opts.arrival_rate)
        c0, cs0 = compiles.n, compiles.seconds
        served = serve(engine, wl, params_for(logprobs), quiet=True)
        dts = np.array([s["dt"] for s in steps])
        cap = [s for s in steps if s["captures"]]
        comp = [s for s in steps if s["compiles"] and not s["captures"]]
        plain = [s for s in steps if not s["compiles"] and not s["captures"]]
        ttft = [tr.first_s - tr.added_s for tr in served.traces.values() if tr.first_s is not None]
        print(f"\n== {label}: {served.new_tokens} tokens in {served.wall_s:.2f} s "
              f"({served.new_tokens / served.wall_s:,.0f} tokens/s), {served.steps} steps, "
              f"ttft median {1e3 * np.median(ttft):.0f} ms p99 {1e3 * np.percentile(ttft, 99):.0f}"
              f" ms; steps sum {dts.sum():.2f} s, median {1e3 * np.median(dts):.2f} ms")
        print(f"  compiles {compiles.n - c0} ({compiles.seconds - cs0:.2f} s); steps with a "
              f"capture {len(cap)} ({sum(s['dt'] for s in cap):.2f} s, their compiles "
              f"{sum(s['compile_s'] for s in cap):.2f} s); steps compiling only {len(comp)} "
              f"({sum(s['dt'] for s in comp):.2f} s); other steps {len(plain)} "
              f"({sum(s['dt'] for s in plain):.2f} s, median "
              f"{1e3 * np.median([s['dt'] for s in plain] or [0]):.2f} ms)")
        for kind in ("decode-only", "with prefill"):
            sel = [s for s in plain if (s["prefill"] == 0) == (kind == "decode-only")]
            if sel:
                print(f"  plain {kind}: {len(sel)} steps, median "
                      f"{1e3 * np.median([s['dt'] for s in sel]):.2f} ms, max "
                      f"{1e3 * max(s['dt'] for s in sel):.2f} ms")
        top = sorted(steps, key=lambda s: -s["dt"])[:8]
        print("  slowest: " + "; ".join(
            f"{1e3 * s['dt']:.0f} ms (p{s['prefill']} d{s['decode']} cap{s['captures']} "
            f"comp{s['compiles']})" for s in top))
        return wl, served

    wl, served = run(opts.seed, "cold (the demo as a user runs it)")
    for entry in compiles.log:
        print("  compiled while serving:", entry)
    t = time.perf_counter()
    rids = choose(wl, opts.check_requests, opts.seed)
    check = real.replay(model, wl, served, rids, dtype)
    print(f"check: {time.perf_counter() - t:.2f} s: {check.text()}")
    run(opts.seed + 1, "warm (another workload, same engine)")
    run(opts.seed + 2, "warm, no logprobs", logprobs=False)
    print("\ncompiles by kernel: " + ", ".join(
        f"{k} {n} ({s:.1f} s)" for k, (n, s) in sorted(compiles.names.items(),
                                                         key=lambda kv: -kv[1][1])[:12]))
    print(f"captures {engine.stats.graph_captures}; graph buckets "
          f"{sorted(map(str, engine.decode_graphs.buckets)) if engine.decode_graphs else None}")


if __name__ == "__main__":
    main(sys.argv[1:])
