"""``kvcache demo``: a serving workload through the engine, on the best available backend.

Every mode drives the one engine core (``kvcache.integrations.engine.Engine``) through its
online API: requests arrive over time (``add_request`` when their step comes, ``step``
otherwise), share system prompts, ask for parallel samples, and outgrow a tight cache so that
the scheduler preempts; the tokens stream back per request. The model is

* ``--model synthetic``: the toy model (``kvcache.demo.model.ToyAdapter``: numpy or the
  backend's arrays, no torch, no weights), the default without a CUDA GPU;
* ``--model llama|qwen2|mistral|phi3|gemma|PATH``: a real architecture through the transformers
  ``Engine`` (``kvcache.demo.real``; ``llama`` is the default on a CUDA GPU with transformers
  installed: the real path, whole-step decode graphs included).

Afterwards (``--check``, on by default) a sample of requests is replayed alone, without the
engine, and must give the same tokens (``kvcache.demo.check``). ``--disaggregate`` runs prefill
and decode in two processes (``kvcache.demo.disaggregate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import time
from typing import Any, Optional

import kvcache

from .check import CheckResult, choose, replay_toy
from .model import SHAPES, ToyAdapter
from .serve import Served, serve
from .workload import Workload, make_workload

__all__ = ["DemoResult", "build_parser", "main", "pick_backend", "run_demo"]

DEFAULTS = {
    # per model kind: requests, max_output, long_prompt, max_total_tokens, max_batch_size,
    # check_requests (requests, capacity and batch are multiplied by --scale)
    "synthetic": dict(requests=48, max_output=40, long_prompt=1500, max_total_tokens=3072,
                      max_batch_size=32, check_requests=8),
    "model": dict(requests=28, max_output=24, long_prompt=700, max_total_tokens=1536,
                  max_batch_size=16, check_requests=4),
}
SCALED = ("requests", "max_total_tokens", "max_batch_size")


@dataclasses.dataclass
class DemoResult:
    mode: str                        # "synthetic" | "model"
    model: str                       # what ran, for the report
    backend: str
    device: str
    dtype: str
    workload: Workload
    served: Served
    engine: Any
    check: Optional[CheckResult]
    options: argparse.Namespace
    setup_s: float = 0.0             # the model (a real one) and the engine built
    warm_up: Any = None              # the engine's WarmUp before serving (None: not run)

    @property
    def stats(self):
        return self.engine.stats

    @property
    def check_ok(self) -> Optional[bool]:
        return None if self.check is None else self.check.ok

    def distinct(self) -> list:
        """Distinct samples of each parallel-sample request, in request order."""
        return [len({tuple(t) for t in self.served.traces[r.rid].tokens})
                for r in sorted(self.workload.requests, key=lambda r: r.rid) if r.n > 1
                and "parallel samples" in r.features]


def pick_backend(name: str, device: Optional[str]) -> str:
    """``auto`` picks the highest-priority available backend that runs on an accelerator (a
    device other than the host CPU), else the reference backend; a named backend is used as is."""
    if name != "auto":
        return name
    if device is not None:
        return kvcache.available_backends(device)[0] if kvcache.available_backends(device) else "auto"
    from kvcache.plugins import _auto_rows       # auto's listing: no framework imported in vain
    for row in _auto_rows(None):
        cls = row["class"]
        if not row["available"] or cls is None:
            continue
        try:
            devices = list(cls.devices())
        except Exception:
            devices = []
        if any(not str(d).startswith("cpu") for d in devices):
            return row["name"]
    return "reference"


def _number(kind, test, what):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    parse.__name__ = what       # argparse names the type in its messages
    return parse


positive_int = _number(int, lambda v: v >= 1, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "a non-negative integer")
positive_float = _number(float, lambda v: v > 0, "a positive number")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache demo",
        description="A serving workload through the engine's online API (requests arriving over "
                    "time, shared system prompts, parallel samples, chunked prefill, preemption "
                    "in a tight cache, streamed tokens) on the best available backend, checked "
                    "by replaying a sample of requests alone. Defaults in brackets: synthetic "
                    "model / real model. The options below are the single-engine run's, valid "
                    "with the synthetic and the real models alike (--shape: the synthetic "
                    "model's only); --disaggregate runs another demo, with options of its own "
                    "(`kvcache demo --disaggregate --help`).")
    p.add_argument("--model", default=None,
                   help="synthetic (the toy model: no torch, no weights), or a real architecture "
                        "through the transformers Engine: llama, qwen2, mistral, phi3, gemma "
                        "(small random weights) or a checkpoint directory. Default: llama on a "
                        "CUDA GPU when transformers is installed, else synthetic")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill and decode in two processes, each request's KV sent from one "
                        "cache to the other; takes its own options, not those below (`kvcache "
                        "demo --disaggregate --help`)")
    p.add_argument("--backend", default="auto", help="backend name, or 'auto' (default): the best "
                   "accelerator backend available, else the reference backend")
    p.add_argument("--device", default=None, help="device (e.g. cuda:1; a real model's torch "
                   "device, default cuda if available)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="cache (and real model) dtype: float32 on the reference backend and on "
                        "a CPU, bfloat16 on a GPU")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="the synthetic model's layers/heads, not a real model's (default: tiny "
                        "on the reference backend, small elsewhere)")
    p.add_argument("--seed", type=int, default=0, help="workload, model and sampling seed (default 0)")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="number of requests [48 / 28, x --scale]")
    p.add_argument("--max-output", type=positive_int, default=None,
                   help="most new tokens per sample [40 / 24]; the burst generates 3-4 times more")
    p.add_argument("--long-prompt", type=positive_int, default=None,
                   help="tokens of a long prompt [1500 / 700]; system prompts and questions "
                        "are sized from it")
    p.add_argument("--samples", type=positive_int, default=3,
                   help="parallel samples per parallel-sample request (default 3)")
    p.add_argument("--arrival-rate", type=positive_float, default=None,
                   help="requests arriving per engine step on average (default 0.5 x --scale)")
    p.add_argument("--scale", type=positive_float, default=1.0,
                   help="multiply requests, cache capacity and batch size (e.g. --scale 8 on a GPU)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    p.add_argument("--max-total-tokens", type=positive_int, default=None,
                   help="cache capacity in tokens [3072 / 1536, x --scale]: tight, so requests "
                        "get preempted")
    p.add_argument("--no-offload", dest="offload", action="store_false", default=True,
                   help="recompute preempted sequences instead of parking them in the engine's "
                        "host tier (default: parked, on the CPU too)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=256,
                   help="most tokens in one forward (default 256)")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="sequences in one forward [32 / 16, x --scale]")
    p.add_argument("--check", dest="check", action="store_true", default=True,
                   help="replay a sample of requests alone and compare (default)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the replay check")
    p.add_argument("--check-requests", type=non_negative_int, default=None,
                   help="requests the check replays [8 / 4]; 0: all")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="write a PNG of running/waiting requests, pages in use and preemptions "
                        "per step (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON (for machines) instead of a table; implies --quiet")
    return p


def _gpu_model_default(backend: str, device: Optional[str]) -> bool:
    """Whether ``kvcache demo`` without ``--model`` runs the real model: the backend is a CUDA
    (or ROCm) one on a GPU, and torch and transformers are installed."""
    if backend not in ("cuda", "rocm") or (device is not None and str(device).startswith("cpu")):
        return False
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return False
    import torch
    return bool(torch.cuda.is_available())


def resolve(opts: argparse.Namespace) -> argparse.Namespace:
    """Fill in the defaults that depend on the model kind (idempotent). Raises
    ``kvcache.cli.UsageError`` for an option the kind does not take."""
    if getattr(opts, "mode", None):
        return opts
    from kvcache.cli_kit import UsageError
    if opts.model is None:
        backend = pick_backend(opts.backend, opts.device)
        opts.model = "llama" if _gpu_model_default(backend, opts.device) else "synthetic"
    opts.mode = "synthetic" if opts.model == "synthetic" else "model"
    if opts.mode == "model" and opts.shape is not None:
        raise UsageError(f"--shape is the synthetic model's; --model {opts.model} has its own")
    for key, value in DEFAULTS[opts.mode].items():
        if getattr(opts, key, None) is None:
            setattr(opts, key, max(1, int(value * opts.scale)) if key in SCALED else value)
    if opts.arrival_rate is None:
        opts.arrival_rate = 0.5 * max(opts.scale, 1.0)
    return opts


def check_plot_prerequisite(path: Optional[str]) -> None:
    """``--plot FILE`` needs matplotlib and a writable folder: checked before the workload runs.
    Raises ``kvcache.cli.UsageError`` naming the fix."""
    if not path:
        return
    from kvcache.cli_kit import UsageError
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from kvcache.integrations import install_hint
        raise UsageError(f"--plot needs matplotlib: {install_hint('plot')}; or leave out --plot") \
            from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--plot {path}: the folder {folder} does not exist")


def _check_fits(engine, workload: Workload, opts) -> None:
    """Every request must fit the cache alone (else the run could never finish it): a
    ``UsageError`` naming the largest request, the pages it needs, the pages the cache holds
    and a --max-total-tokens that fits every request."""
    from kvcache.cli_kit import UsageError
    total = engine.cache.num_total_pages
    ps, pages = engine.config.page_size, total - 1      # CacheConfig.num_pages: 1 spare page

    def need(r) -> int:        # its prompt and every new token but the last, in pages
        return -(-(len(r.prompt) + r.max_tokens - 1) // ps)
    largest = max(workload.requests, key=need, default=None)
    if largest is not None and need(largest) > pages:
        r, n = largest, need(largest)
        too_large = sum(need(q) > pages for q in workload.requests)
        others = f" (and {too_large - 1} more)" if too_large > 1 else ""
        raise UsageError(
            f"request {r.rid}{others} cannot fit the cache even alone: its {len(r.prompt):,} "
            f"prompt tokens + {r.max_tokens} new tokens need {n} pages of {ps} tokens, more "
            f"than the whole cache holds ({pages} page{'s' if pages != 1 else ''}, "
            f"--max-total-tokens {engine.config.max_total_tokens}; its {total} pages less the 1 "
            f"kept spare); "
            f"raise --max-total-tokens to at least {(n + 1) * ps} or lower --long-prompt / "
            f"--max-output")


def run_demo(opts: argparse.Namespace, tamper=None) -> DemoResult:
    """Run the workload and the check. ``tamper(layer, out, tokens, positions) -> out``: a hook on
    every attention output of the synthetic model (tests plant a wrong value with it)."""
    from kvcache.integrations import SamplingParams
    from kvcache.integrations.engine import Engine
    resolve(opts)
    model = None
    started = time.perf_counter()
    if opts.mode == "synthetic":
        backend = pick_backend(opts.backend, opts.device)
        dtype = opts.dtype or ("float32" if backend == "reference" else "bfloat16")
        shape = opts.shape or ("tiny" if backend == "reference" else "small")
        adapter = ToyAdapter(shape, opts.seed, dtype, tamper=tamper)
        engine = Engine(adapter, backend=backend, device=opts.device, dtype=dtype,
                        page_size=opts.page_size, max_total_tokens=opts.max_total_tokens,
                        max_batch_size=opts.max_batch_size,
                        prefill_chunk_size=opts.prefill_chunk_size, offload=opts.offload)
        what, vocab = adapter.describe(dtype), adapter.vocab_size    # (host logits: numpy draws)
    else:
        from . import real
        engine, model, what, dtype = real.make_engine(opts, opts.seed)
        vocab = model.config.vocab_size
    workload = make_workload(opts.requests, opts.seed, vocab, long_prompt=opts.long_prompt,
                             max_output=opts.max_output, samples=opts.samples,
                             arrival_rate=opts.arrival_rate)
    _check_fits(engine, workload, opts)
    setup_s = time.perf_counter() - started
    # on an accelerator the first step of each shape compiles kernels and captures its graph:
    # paid here, before the first request, and reported apart from serving
    on_host = str(engine.cache.backend.device or "cpu").startswith("cpu")
    warm = engine.warm_up() if engine.graphs or not on_host else None

    def params(r) -> SamplingParams:
        return SamplingParams(max_tokens=r.max_tokens, temperature=0.8 if r.sampled else 0.0,
                              n=r.n, seed=(opts.seed * 1_000_003 + r.rid * 64) % 2 ** 63,
                              ignore_eos=True, logprobs=bool(opts.check))

    backend, device = engine.cache.backend.name, str(engine.cache.backend.device or "cpu")
    served = serve(engine, workload, params, quiet=opts.quiet,
                   title=f"kvcache demo on {backend} ({device})")
    check = None
    if opts.check:
        rids = choose(workload, opts.check_requests, opts.seed)
        if opts.mode == "synthetic":
            check = replay_toy(adapter, workload, served, rids, dtype, opts.page_size)
        else:
            check = real.replay(model, workload, served, rids, dtype)
    return DemoResult(opts.mode, what, backend, device, dtype, workload, served, engine, check,
                      opts, setup_s, warm)


def main(argv=None, tamper=None) -> int:
    """``kvcache demo ARGS``: 0 when the run finished and the check passed, 1 when the check
    failed, 2 when the workload could not run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--disaggregate" in argv:
        from .disaggregate import main as disaggregate_main     # prefill and decode ranks
        return disaggregate_main(argv)
    from kvcache.cli_kit import UsageError, backend_for

    from .report import plot, report, summary
    opts = resolve(build_parser().parse_args(argv))
    check_plot_prerequisite(opts.plot)
    if opts.mode == "synthetic":
        backend_for(pick_backend(opts.backend, opts.device), opts.device)   # before any work
    else:
        from .real import check_model_name
        check_model_name(opts.model)                # a bad --model: usage error, exit 2
        if opts.backend != "auto":
            backend_for(opts.backend, None)         # before the model is built
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            from kvcache.integrations import install_hint
            raise UsageError(f"--model {opts.model} needs torch and transformers: "
                             f"{install_hint('transformers')}")
    if opts.json:
        opts.quiet = True
    try:
        result = run_demo(opts, tamper=tamper)
    except (kvcache.KVCacheError, ImportError) as exc:
        print(f"kvcache demo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if opts.json:
        import json
        print(json.dumps(summary(result), indent=2, default=str))
    else:
        report(result)
    if opts.plot:
        plot(result, opts.plot)
        print(f"plot written to {opts.plot}", file=sys.stderr if opts.json else sys.stdout)
    if result.check_ok is False:
        print("kvcache demo: the check FAILED: replayed requests differ from the run (see above)",
              file=sys.stderr)
        return 1
    return 0
