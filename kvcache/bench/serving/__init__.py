"""``kvcache bench --serving --model llama``: serving throughput side by side, in one run.

Systems, on one seeded workload and one randomly initialised model: ``a``, our
``integrations.transformers.Engine`` (continuous batching on a ``PagedKVCache``); ``b``,
transformers' continuous batching (``generate_batch``, attention ``"paged|sdpa"``); ``c``,
transformers' ``generate`` with a static cache, ``--batch`` requests at a time left-padded to the
longest prompt (one static shape). The roofline of one decode step: the bytes it must read (the
weights once, the KV of every sequence) over the device copy rate measured in the same run.

Per system:

* ``tokens_per_s``: new tokens of the whole workload over its wall time, timed on its second run
  (the first warms up: compiles, graph captures and allocations happen once per process);
* ``decode_step_ms``: one decode step at ``--batch`` sequences, as a difference: the same
  ``--batch`` prompts of ``decode_prompt`` tokens generated to ``n1`` and to ``n2`` new tokens,
  ``(wall(n2) - wall(n1)) / (n2 - n1)`` (the added steps are all decode steps of the full batch;
  no system needs instrumenting);
* ``gpu_busy``: under ``torch.profiler``, the share of the longer run's last ``wall(n2) -
  wall(n1)`` that the GPU's activity (kernels, copies, memsets; their union) covers (cuda only);
* ``same_tokens_as_a``: requests whose greedy tokens equal (a)'s.

``--kv-dtype`` (default auto: the compute dtype) is the storage format of (a)'s pages on any
workload; on the random workload a quantized one adds (p), the same Engine at the same batch
with pages of the compute dtype, and judges (a) / (p) tokens/s >= 1.0; ``--workload
kv-budget`` (``kv_budget``) runs (a) with 16-bit and with quantized pages at one KV memory
budget in bytes; ``--workload window-budget`` (``window_budget``) runs (a) on a
Gemma-3-like model with every page kept and with window groups at one budget.
``--workload shared-prefix | multi-turn``: ``prefix``.

``--runs N`` (random and kv-budget workloads; ``rounds``): each system's timed measurement N
times, the systems interleaved round by round (each warmed up once, in its first round), each
value the median of its rounds and each ratio the median of the per-round ratios (one run's
ratios move 10-28% on a GPU); the targets are judged on the medians.

``--tiny`` is the CI smoke run (seconds on a CPU): tiny dims and tiny work (4 requests of 8-32
tokens, 6 new tokens, 1 layer, batch 4, no profiler off the GPU); its targets are not judged.
Progress goes to stderr (``say``), a line per phase; the results to stdout.

The package's modules: ``model`` (the workload, the model, the roofline's inputs), ``runners``
(the systems), ``measure`` (timing one system), ``report`` (the table and its targets),
``rounds`` (``--runs``), ``prefix``, ``kv_budget``, ``window_budget`` and ``tp`` (the other
workloads); this module holds the command (its options, ``run``, ``main``) and re-exports their
names.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from typing import Any, Optional

# the private names too: everything stays importable from kvcache.bench.serving as before
from .measure import (_check, _gpu_spans, _timed, measure, measure_rounds, tail_busy,
                      union_length)
from .model import (LLAMA3_8B_LAYER, MODELS, TINY, _sync, build_model, copy_rate, decode_bytes,
                    random_prompt_range, workload)
from .kv_budget import (KV_BUDGET_SIZES, KV_DTYPES, default_kv_dtype, print_kv_budget_result,
                        run_kv_budget)
from .prefix import PREFIX_SIZES, WORKLOADS, print_prefix_result, run_prefix
from .window_budget import (WINDOW_BUDGET_SIZES, build_window_model, print_window_budget_result,
                            run_window_budget)
from .tp import TP_SIZES, print_tp_result, run_tp
from .rounds import interleave, per_round, put_ratio, put_rows
from .report import TARGET_BUSY, TARGET_ROOFLINE, TARGET_VS_B, print_result
from .runners import (ASKED, SYSTEM_NAMES, SYSTEMS, EngineRunner, GenerateBatchRunner, Runner,
                      StaticRunner, _quiet_transformers, mixed_graphs_arg)

__all__ = ["EngineRunner", "GenerateBatchRunner", "LLAMA3_8B_LAYER", "MODELS", "Runner", "SIZES",
           "SYSTEMS", "SYSTEM_NAMES", "StaticRunner", "TARGET_BUSY", "TARGET_ROOFLINE",
           "TARGET_VS_B", "TINY", "add_arguments", "build_model", "check_device", "copy_rate",
           "decode_bytes", "main", "measure", "parse_skip", "print_result", "run", "say",
           "tail_busy", "union_length", "workload"]

_START = time.perf_counter()
"""When the module was imported (``kvcache bench --serving`` imports it first): progress times."""


# ---------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serving bench's options (on ``kvcache bench``'s parser)."""
    g = p.add_argument_group("serving bench (--serving)")
    g.add_argument("--serving", action="store_true",
                   help="serving throughput side by side: (a) the kvcache Engine, (b) "
                        "transformers generate_batch, (c) transformers static-cache generate, and "
                        "the decode-step roofline (needs torch and transformers)")
    g.add_argument("--model", default="llama", choices=MODELS,
                   help="the random-weight model's family (default llama: Llama-3-8B shapes)")
    g.add_argument("--requests", type=_pos, default=None, metavar="N",
                   help="requests in the whole run (default 256; --tiny: 4)")
    g.add_argument("--new-tokens", type=_pos, default=None, metavar="N",
                   help="new tokens per request (default 128; --tiny: 6)")
    g.add_argument("--layers", type=_pos, default=None, metavar="N",
                   help="decoder layers of the model (default 8; --tiny: 1)")
    g.add_argument("--batch", type=_pos, default=None, metavar="N",
                   help="sequences per forward for (a), batch for (c) and the decode-step "
                        "measurement (default 64; --tiny: 4)")
    g.add_argument("--tiny", action="store_true",
                   help="a smoke run of seconds on a CPU (CI runs it): small dims, prompts and "
                        "work (the sizes above shrink unless given; no profiler off the GPU); "
                        "its targets are not judged")
    g.add_argument("--rope", default="cache", choices=("model", "cache"),
                   help="who rotates q and k in (a): the cache's fused RoPE append (default, "
                        "Engine(rope='cache')) or the model's own rotary (rope='model')")
    g.add_argument("--skip", default="", metavar="LIST",
                   help="systems to skip, comma separated from a,b,c (e.g. --skip b,c)")
    g.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seed of the weights and the workload (default 0)")
    g.add_argument("--no-busy", action="store_true", help="skip the profiled runs that "
                   "measure the GPU busy fraction (a third of the run time; never off the GPU)")
    g.add_argument("--workload", default="random", choices=WORKLOADS,
                   help="random (default): the systems (a), (b), (c) above on random prompts; "
                        "shared-prefix: requests sharing a system prompt, arriving one per step; "
                        "multi-turn: conversations whose turns extend the last; both run the "
                        "Engine with the prefix cache on and off, and (b); kv-budget: the Engine "
                        "with auto and with --kv-dtype pages at one KV memory budget; "
                        "window-budget: the Engine on a Gemma-3-like model with every page kept "
                        "and with window groups at one KV memory budget; tp: the "
                        "Engine at TP=1 and TP=2 (two GPUs; --layers default 32)")
    g.add_argument("--system", type=_pos, default=None, metavar="N",
                   help="shared-prefix: the system prompt's tokens (default 2000; --tiny: 40); "
                        "multi-turn: the first turn's prompt (default 512; --tiny: 24)")
    g.add_argument("--prefix-cache", default="on", choices=("on", "off"),
                   help="(a)'s automatic prefix cache on the random workload (default on, the "
                        "Engine's default; its prompts share nothing and each run starts with "
                        "an empty cache, so this prices the index)")
    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="(a)'s KV storage format on any workload (default auto: the compute "
                        "dtype; a quantized one adds (p), 16-bit pages at the same batch, on the "
                        "random workload); kv-budget's quantized run (auto there: float8_e4m3 "
                        "where the backend declares it, else int8)")
    g.add_argument("--kv-budget-mib", type=_pos_float, default=None, metavar="MIB",
                   help="kv-budget: the KV memory budget of each run in MiB (default: half of "
                        "what --batch sequences need at once, in auto KV); window-budget: the "
                        "same (default: a third of what they need with every page kept)")
    g.add_argument("--static-compile", action="store_true",
                   help="let (c) compile its forward (transformers' auto-compile; off by default)")
    g.add_argument("--deterministic", action="store_true",
                   help="random workload: also run (d), the Engine with deterministic=True "
                        "(batch-invariant steps), on the same work: its decode step and "
                        "tokens/s against (a)'s in the same run (targets: at most 1.3x the "
                        "step, at least 0.75x the tokens/s); shared-prefix and multi-turn: "
                        "both Engines deterministic, every request's tokens equal with the "
                        "cache on and off")
    g.add_argument("--runs", type=_pos, default=1, metavar="N",
                   help="time each system N times (default 1), the systems interleaved round by "
                        "round (each warmed up once, in its first round), and judge the targets "
                        "on the medians (one run's ratios move 10-28%% run to run on a GPU); "
                        "random (default) and kv-budget workloads")
    g.add_argument("--compile-step", action="store_true",
                   help="(a) with Engine(compile_step=True): its captured decode step's model "
                        "code through torch.compile (a GPU)")
    g.add_argument("--mixed-graphs", choices=("on", "off"), nargs="?", const="on", default=None,
                   help="(a) and the prefix workloads' Engines with Engine(mixed_graphs=True) "
                        "(on, or the flag alone) or Engine(mixed_graphs=False) (off): steps "
                        "that prefill captured too, per token bucket; without the flag the "
                        "Engine's default (on where graphs are on)")


def _pos(text: str) -> int:
    from ...cli_kit import positive_int
    return positive_int(text)


def _pos_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return value


def check_device(device: Optional[str]) -> None:
    """Raise ``UsageError`` at once when torch or transformers is missing or ``device`` (None:
    cuda when there is one, else cpu) is a GPU torch cannot reach."""
    from ...cli_kit import UsageError
    say("loading torch and transformers")
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--serving needs torch and transformers: {exc}") from None
    if device is not None and device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch {torch.__version__} sees no CUDA GPU here; "
                         f"use --device cpu (with --tiny for a smoke run)")


def say(msg: str) -> None:
    """A progress line on stderr with the seconds since the bench started (a long run is never a
    silent terminal; the results go to stdout)."""
    print(f"kvcache bench --serving [{time.perf_counter() - _START:5.1f} s] {msg}",
          file=sys.stderr, flush=True)


def parse_skip(text: str) -> set:
    skip = {s.strip() for s in text.split(",") if s.strip()}
    bad = skip - set(SYSTEMS)
    if bad:
        raise ValueError(f"--skip {text!r}: unknown system(s) {', '.join(sorted(bad))}; "
                         f"choose from {', '.join(SYSTEMS)}")
    return skip


RUNS_WORKLOADS = ("random", "kv-budget")
"""The workloads that take ``--runs`` > 1."""

SIZES = {"requests": (256, 4), "new_tokens": (128, 6), "layers": (8, 1), "batch": (64, 4)}
"""Option: (default, default with --tiny)."""


def run(args) -> dict:
    """Run the serving bench for parsed ``args``; returns the JSON-ready result."""
    import torch
    import transformers
    from ...cli_kit import UsageError
    kind = getattr(args, "workload", "random")
    if kind in ("random", "kv-budget", "window-budget") \
            and getattr(args, "system", None) is not None:
        raise ValueError("--system: only with --workload shared-prefix or multi-turn")
    if kind not in ("kv-budget", "window-budget") \
            and getattr(args, "kv_budget_mib", None) is not None:
        raise UsageError("--kv-budget-mib: only with --workload kv-budget or window-budget")
    if kind not in RUNS_WORKLOADS and getattr(args, "runs", 1) > 1:
        raise UsageError(f"--runs {args.runs}: --workload {kind} times each system once; "
                         f"--runs > 1 is for --workload {' or '.join(RUNS_WORKLOADS)}")
    sizes = {**PREFIX_SIZES, "kv-budget": KV_BUDGET_SIZES, "window-budget": WINDOW_BUDGET_SIZES,
             "tp": TP_SIZES}.get(kind, {})
    for name, (full, tiny) in [*sizes.items(), *SIZES.items()]:
        if getattr(args, name, None) is None:
            setattr(args, name, tiny if args.tiny else full)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.startswith("cuda")
    skip = parse_skip(args.skip)
    dtype = "bfloat16" if on_gpu else "float32"
    backend = args.backend or ("cuda" if on_gpu else "reference")
    kv_dtype = _kv_dtype(args, backend, device)
    if kind == "tp":
        res = run_tp(args, backend, say)
        res.update(command="kvcache bench --serving --workload tp",
                   date=time.strftime("%Y-%m-%d %H:%M:%S"), machine=platform.node(),
                   device=(f"{torch.cuda.get_device_name(0)} x2" if res["workload"]["device"] == "cuda"
                           else platform.processor() or platform.machine()),
                   torch=torch.__version__, transformers=transformers.__version__)
        return res
    if kind == "kv-budget":
        return _run_prefix(args, device, backend, dtype, skip, kv_dtype)
    if kind == "window-budget":
        return _run_prefix(args, device, backend, dtype, skip)
    if kind != "random":
        return _run_prefix(args, device, backend, dtype, skip)
    prompt_range = random_prompt_range(args.tiny)
    decode_prompt = 16 if args.tiny else 512
    n2 = args.new_tokens
    n1 = max(1, n2 // 4)
    if n2 <= n1:
        raise ValueError(f"--new-tokens {n2}: the decode-step difference needs at least 2")
    say(f"building the model ({args.model}, {args.layers} layers, "
        f"{'tiny dims' if args.tiny else 'Llama-3-8B layer shapes'}, {dtype} on {device})")
    net = build_model(args.model, args.layers, args.tiny, device, dtype, args.seed)
    vocab = net.config.vocab_size
    prompts = workload(args.requests, prompt_range, vocab, args.seed)
    decode_prompts = workload(args.batch, (decode_prompt, decode_prompt), vocab, args.seed + 1)
    max_len = max(prompt_range[1], decode_prompt) + n2
    say("measuring the device copy rate (the roofline's)")
    rate = copy_rate(device, nbytes=(1 << 30) if on_gpu else (1 << 24))
    # the added steps make tokens n1+1..n2; the one making token k reads prompt + k - 1 tokens
    context = decode_prompt + (n1 + n2 - 1) / 2
    nbytes = decode_bytes(net, args.batch, context)
    roof_s = (nbytes["weight_bytes"] + nbytes["kv_bytes"]) / rate
    result: dict[str, Any] = {
        "command": "kvcache bench --serving", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.node(), "device": (torch.cuda.get_device_name(device) if on_gpu
                                               else platform.processor() or platform.machine()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "workload": {"model": args.model, "tiny": bool(args.tiny), "layers": args.layers,
                     "dtype": dtype, "requests": args.requests, "prompt_range": list(prompt_range),
                     "new_tokens": n2, "seed": args.seed, "batch": args.batch,
                     "decode_prompt": decode_prompt, "decode_n1": n1, "decode_n2": n2,
                     "a_rope": args.rope, "a_prefix_cache": args.prefix_cache,
                     "a_kv_dtype": kv_dtype},
        "roofline": {"copy_rate_Bps": rate, "context": context, **nbytes,
                     "decode_step_ms": roof_s * 1e3, "tokens_per_s": args.batch / roof_s},
        "systems": {}, "skipped": {}, "ratios": {},
    }
    # a system not asked for (ASKED) is not in the table at all
    keys = [key for key in SYSTEMS if key not in ASKED or ASKED[key](args, kv_dtype)]
    result["skipped"].update((key, "--skip") for key in keys if key in skip)
    runs = getattr(args, "runs", 1)

    def rounds(key: str):
        """System ``key``'s rounds (``measure_rounds``); the runner closed when they are."""
        runner: Optional[Runner] = None
        say(f"({key}) {SYSTEM_NAMES[key]}: starting")
        try:
            if key in ("a", "d", "p"):
                runner = EngineRunner(net, backend, device, args.batch, max_len, args.rope,
                                      args.prefix_cache == "on",
                                      "auto" if key == "p" else kv_dtype,
                                      key == "a" and getattr(args, "compile_step", False),
                                      mixed_graphs_arg(args), deterministic=key == "d")
            elif key == "b":
                runner = GenerateBatchRunner(net, None if on_gpu else {
                    "num_blocks": -(-args.batch * max_len // 32) + 8, "block_size": 32,
                    "max_batch_tokens": 256})
            else:
                # (c): the decode measurement at its own width, the whole run at the longest
                # prompt's
                runner = StaticRunner(net, args.batch, args.static_compile, prompt_range[1])
            t0 = time.perf_counter()
            for r, out in measure_rounds(runner, prompts, n2, decode_prompts, n1, n2, device,
                                         on_gpu and not args.no_busy, runs,
                                         lambda msg: say(f"({key}) {msg}")):
                say(f"({key}) done in {time.perf_counter() - t0:.1f} s: "
                    f"{r['tokens_per_s']:.1f} tokens/s")
                if isinstance(runner, EngineRunner):     # the format the Engine stores
                    r["kv_dtype"] = runner.engine.config.kv_dtype
                yield r, out
                t0 = time.perf_counter()
        finally:
            if runner is not None:
                runner.close()
            # the next system sizes itself from the free memory: give back this one's cache
            runner = None
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()

    def failed(key: str, exc: Exception) -> None:
        if key == "a":
            raise exc
        # a peer that cannot run here is reported, not hidden
        result["skipped"][key] = f"failed: {type(exc).__name__}: {exc}"[:300]
        say(f"({key}) {result['skipped'][key]}")

    done = interleave({key: (lambda key=key: rounds(key)) for key in keys if key not in skip},
                      runs, failed)
    put_rows(result, done, ("tokens_per_s", "wall_s", "decode_step_ms", "decode_walls_s"))
    a_out = done["a"][0][1] if "a" in done else None     # the first round's tokens
    for key, r in result["systems"].items():
        if key != "a" and a_out is not None:    # a count, not a verdict: bf16 on a GPU
            r["same_tokens_as_a"] = sum(x == y for x, y in zip(done[key][0][1], a_out))  # ties
        if not on_gpu or args.no_busy:
            r["gpu_busy_note"] = "not measured: " + ("no GPU" if not on_gpu else "--no-busy")
    a, b, d, p = (result["systems"].get(key) for key in ("a", "b", "d", "p"))
    if a is not None:
        a_steps, a_tokens = per_round(a, "decode_step_ms"), per_round(a, "tokens_per_s")
        put_ratio(result, "a_decode_step_over_roofline", a_steps, [roof_s * 1e3] * len(a_steps))
        result["ratios"]["a_gpu_busy"] = a["gpu_busy"]
        if b is not None:
            put_ratio(result, "a_over_b_tokens_per_s", a_tokens, per_round(b, "tokens_per_s"))
        if d is not None:
            put_ratio(result, "d_decode_step_over_a", per_round(d, "decode_step_ms"), a_steps)
            put_ratio(result, "d_over_a_tokens_per_s", per_round(d, "tokens_per_s"), a_tokens)
        if p is not None:
            put_ratio(result, "a_over_p_tokens_per_s", a_tokens, per_round(p, "tokens_per_s"))
            put_ratio(result, "a_decode_step_over_p", a_steps, per_round(p, "decode_step_ms"))
    return result


def _kv_dtype(args, backend: str, device: str) -> str:
    """(a)'s ``kv_dtype`` for ``--kv-dtype``, checked against what ``backend`` declares before
    any work (kv-budget's "auto": ``default_kv_dtype``); a ``UsageError`` names the fix."""
    from ...cli_kit import UsageError
    from ...plugins import resolve_backend
    kv = getattr(args, "kv_dtype", "auto")
    budget = getattr(args, "workload", "random") == "kv-budget"
    if kv == "auto" and not budget:
        return kv
    cls = resolve_backend(backend, device)
    declared = cls.capabilities.kv_dtypes
    try:
        kv = default_kv_dtype(declared) if kv == "auto" else kv
    except ValueError:
        raise UsageError(f"--workload kv-budget: backend {cls.name!r} declares no quantized KV "
                         f"format (kv_dtypes: {', '.join(declared)}); it needs one to compare "
                         f"against 16-bit pages") from None
    if kv not in declared:
        quant = [k for k in declared if k in KV_DTYPES]
        raise UsageError(f"--kv-dtype {kv}: backend {cls.name!r} does not store it (its "
                         f"quantized formats: {', '.join(quant) or 'none'}); pick another "
                         f"--kv-dtype or --backend")
    return kv


def _run_prefix(args, device: str, backend: str, dtype: str, skip: set,
                kv_dtype: Optional[str] = None) -> dict:
    """The workloads other than random (kv-budget when ``kv_dtype`` is given), with the
    run's environment added to the result."""
    import torch
    import transformers
    window = args.workload == "window-budget"
    say(f"building the model ({'Gemma-3-like' if window else args.model}, {args.layers} "
        f"layers, {'tiny dims' if args.tiny else 'Llama-3-8B layer shapes'}, {dtype} on "
        f"{device})")
    if window:
        net = build_window_model(args.layers, args.tiny, device, dtype, args.seed)
        res = run_window_budget(args, net, device, backend, say)
    elif kv_dtype is not None:
        net = build_model(args.model, args.layers, args.tiny, device, dtype, args.seed)
        res = run_kv_budget(args, net, device, backend, kv_dtype, say)
    else:
        net = build_model(args.model, args.layers, args.tiny, device, dtype, args.seed)
        res = run_prefix(args, net, device, backend, skip, say)
    res.update(command=f"kvcache bench --serving --workload {args.workload}",
               date=time.strftime("%Y-%m-%d %H:%M:%S"), machine=platform.node(),
               device=(torch.cuda.get_device_name(device) if device.startswith("cuda")
                       else platform.processor() or platform.machine()),
               torch=torch.__version__, transformers=transformers.__version__)
    res["workload"]["dtype"] = dtype
    return res


def main(args) -> int:
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=2))
    elif res["workload"].get("kind") == "tp":
        print_tp_result(res)
    elif res["workload"].get("kind") == "kv-budget":
        print_kv_budget_result(res)
    elif res["workload"].get("kind") == "window-budget":
        print_window_budget_result(res)
    elif "kind" in res["workload"]:
        print_prefix_result(res)
    else:
        print_result(res)
    return 0
