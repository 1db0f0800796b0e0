"""Where a deterministic decode step's time goes (issue 54 item 4): the serving bench's model
(Llama-3-8B layer shapes, bf16, ``--layers``), ``--batch`` prompts of 512 tokens prefilled, then
``--steps`` decode steps through the online API timed (wall per step) and profiled: the GPU's
busy time per step, the kernels by time, and the host's time per step (cProfile), for the
default Engine and ``Engine(deterministic=True)`` one after the other on one GPU.

    python tools/det_step_profile.py [--layers 8] [--batch 64] [--steps 16] [--rope model|cache]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_step_profile import _profile  # noqa: E402  (the same measurement as the TP profile)


def main() -> None:
    import torch

    from kvcache.bench.serving.model import build_model, workload
    from kvcache.integrations.transformers import Engine
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--only", choices=("default", "deterministic"), default=None)
    p.add_argument("--rope", choices=("model", "cache"), default="model",
                   help="Engine(rope=...): the serving bench runs rope=cache")
    a = p.parse_args()
    net = build_model("llama", a.layers, False, "cuda", "bfloat16", 0)
    prompts = workload(a.batch, (512, 512), net.config.vocab_size, 1)
    res = {}
    for name, det in (("default", False), ("deterministic", True)):
        if a.only not in (None, name):
            continue
        engine = Engine(net, backend="cuda", max_batch_size=a.batch, deterministic=det,
                        rope=a.rope)
        res[name] = _profile(engine, prompts, a.steps, f"{name} (graphs {bool(engine.graphs)})", 0)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    if len(res) == 2:
        d, s = res["deterministic"], res["default"]
        print(f"\ndeterministic / default: wall {d['wall_ms'] / s['wall_ms']:.2f}x, GPU busy "
              f"{d['busy_ms'] / s['busy_ms']:.2f}x")


if __name__ == "__main__":
    main()
