"""Where a decode step of the transformers ``Engine`` spends host time (cProfile), on the serving
bench's model (Llama-3-8B layer shapes, 8 layers, bf16): B prompts of P tokens, after a warm-up
that captures the decode graphs.

    python tools/profile_engine.py [--batch 64] [--prompt 512] [--new 40] [--graphs on|off]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from kvcache.bench_serving import build_model
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
    a = p.parse_args()
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


if __name__ == "__main__":
    main()
