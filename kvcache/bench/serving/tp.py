"""``kvcache bench --serving --workload tp``: the Engine at TP=1 and TP=2 in one run.

Two local processes (``kvcache.distributed.tp.spawn``; NCCL with rank r on ``cuda:r`` where the
host has two GPUs, else gloo on CPUs). Rank 0 first runs the whole model alone (TP=1: one
GPU), frees it, then both ranks split the same model (``shard_model(method="integration")``: each
holds half of the heads and of the MLP) and run the same work through ``Engine(tp=2)``. Each side builds the seeded random model of the
serving bench (Llama-3-8B layer shapes, ``--layers``, default 32 here), warms up, then times
``--batch`` prompts of 512 tokens generated to ``n1`` and ``n2`` new tokens: the decode step is
``(wall(n2) - wall(n1)) / (n2 - n1)`` as in the random workload, tokens/s is ``batch * n2 /
wall(n2)``. Target: the TP=2 step at most ``TARGET_TP_STEP`` of the TP=1 step (B=64, 32 layers).
"""

from __future__ import annotations

import gc
from typing import Callable

__all__ = ["TARGET_TP_STEP", "TP_SIZES", "print_tp_result", "run_tp"]

TARGET_TP_STEP = 0.6
"""TP=2 decode step over TP=1's: at most this."""
TP_SIZES = {"layers": (32, 1)}
"""The tp workload's own defaults (full, --tiny) where it differs from the random one."""


def _decode(engine, prompts: list, n1: int, n2: int, device: str) -> dict:
    from .measure import _timed
    engine.progress = False
    engine.generate(prompts, max_new_tokens=n2, ignore_eos=True)       # compiles, captures
    walls = {}
    for n in (n1, n2):
        walls[n], out = _timed(lambda: engine.generate(prompts, max_new_tokens=n,
                                                       ignore_eos=True), device)
        assert all(len(o[0]) == n for o in out)
    step = (walls[n2] - walls[n1]) / (n2 - n1)
    return dict(decode_step_ms=step * 1e3, tokens_per_s=len(prompts) * n2 / walls[n2],
                graphs=bool(engine.graphs), max_total_tokens=engine.config.max_total_tokens,
                walls_s={str(k): v for k, v in walls.items()})


def _rank(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    from ...integrations.tp import shard_model
    from ...integrations.transformers import Engine
    from .model import build_model, workload
    gpu = opts["device"] == "cuda"
    device = f"cuda:{rank}" if gpu else "cpu"
    if not gpu:
        torch.set_num_threads(1)

    def model():
        return build_model(opts["model"], opts["layers"], opts["tiny"], device, opts["dtype"],
                           opts["seed"])
    net = model()
    prompts = workload(opts["batch"], (opts["prompt"], opts["prompt"]), net.config.vocab_size,
                       opts["seed"] + 1)
    kw = dict(backend=opts["backend"], max_batch_size=opts["batch"], rope=opts["rope"])
    out: dict = {}
    if rank == 0:
        one = Engine(net, **kw)
        out["tp1"] = _decode(one, prompts, opts["n1"], opts["n2"], device)
        del one
    del net
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    dist.barrier()
    net = model()
    shard_model(net, method="integration")     # the all-reduces as plain hooks, captured with the step
    two = Engine(net, tp=world, **kw)
    out["tp2"] = _decode(two, prompts, opts["n1"], opts["n2"], device)
    return out


def run_tp(args, backend: str, say: Callable) -> dict:
    """Both sides of the tp workload for parsed ``args``; the JSON-ready result."""
    import torch

    from ...distributed.tp import spawn
    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    device = "cuda" if gpu else "cpu"
    n2 = args.new_tokens
    opts = dict(device=device, backend=backend if gpu or backend != "cuda" else "reference",
                model=args.model, layers=args.layers, tiny=bool(args.tiny), seed=args.seed,
                dtype="bfloat16" if gpu else "float32", batch=args.batch,
                prompt=16 if args.tiny else 512, n1=max(1, n2 // 4), n2=n2, rope=args.rope)
    if n2 <= opts["n1"]:
        raise ValueError(f"--new-tokens {n2}: the decode-step difference needs at least 2")
    say(f"TP=1 on rank 0, then TP=2 on two {'GPUs (NCCL)' if gpu else 'CPU processes (gloo)'}: "
        f"{args.layers} layers, batch {args.batch}, {n2} new tokens")
    ranks = spawn(_rank, 2, args=(opts,), backend="nccl" if gpu else "gloo", timeout_s=1200)
    one, two = ranks[0]["tp1"], ranks[0]["tp2"]
    return {"workload": {"kind": "tp", **opts},
            "tp1": one, "tp2": two,
            "step_ratio": two["decode_step_ms"] / one["decode_step_ms"],
            "tokens_ratio": two["tokens_per_s"] / one["tokens_per_s"]}


def print_tp_result(res: dict) -> None:
    """The tp workload's table and its target."""
    w = res["workload"]
    print(f"kvcache bench --serving --workload tp: {res.get('device', '')}, {w['layers']} "
          f"layers, {w['dtype']}, batch {w['batch']}, prompts of {w['prompt']} tokens, "
          f"decode step from {w['n1']} to {w['n2']} new tokens; {res.get('date', '')}")
    print(f"  {'':6} {'decode step ms':>15} {'tokens/s':>10} {'graphs':>7}")
    for name in ("tp1", "tp2"):
        r = res[name]
        print(f"  {name.upper():6} {r['decode_step_ms']:15.3f} {r['tokens_per_s']:10.1f} "
              f"{'on' if r['graphs'] else 'off':>7}")
    ok = res["step_ratio"] <= TARGET_TP_STEP
    judged = not w["tiny"] and w["device"] == "cuda"
    print(f"target: TP=2 decode step / TP=1 {res['step_ratio']:.3f} (target <= "
          f"{TARGET_TP_STEP}) {('met' if ok else 'MISSED') if judged else 'not judged here'}; "
          f"tokens/s x{res['tokens_ratio']:.2f}")
