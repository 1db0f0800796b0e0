"""``kvcache demo``: an inference engine's KV traffic on the best available backend.

A continuous-batching serving loop, written against the public API only, drives two caches:

* the **main cache** (RoPE "normal"): chunked prefill mixed with decodes in one forward, shared
  system-prompt prefixes (a nested one too, so several block depths are live), parallel samples
  forked after the prompt, one round of speculative decoding for some requests (a draft token
  tree, sometimes grown over two forwards, then ``commit_accepted_token_tree_nodes``), and
  preemption of the youngest request when a forward does not fit;
* the **sliding-window cache** (``support_sliding_window=True``): requests with a window and
  attention sinks. Such a cache stores K unrotated (inline RoPE) and does not run token trees, so
  an engine serving windowed requests keeps them in a cache of their own, as this demo does. Both
  caches are stepped in the same loop, on the same clock.

Afterwards (``--check``, on by default) a sample of requests (always including preempted ones) is
replayed alone on the reference backend and every attention output is compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Optional

import numpy as np

import kvcache

from .check import CheckResult, replay_check
from .engine import Engine, SchedulerError
from .model import ToyModel
from .workload import Workload, make_workload

MODELS = {
    # name: (num_layers, num_qo_heads, num_kv_heads, head_dim)
    "tiny": (2, 4, 2, 32),
    "small": (4, 8, 2, 128),
    "llama-8b-heads": (4, 32, 8, 128),
}

__all__ = ["DemoResult", "SchedulerError", "build_parser", "main", "pick_backend", "report", "run_demo",
           "summary"]


@dataclasses.dataclass
class DemoResult:
    backend: str
    device: str
    engines: list
    checks: list
    wall_s: float
    steps: int
    workload: Workload
    options: argparse.Namespace

    @property
    def check_ok(self) -> Optional[bool]:
        return None if not self.checks else all(c.ok for c in self.checks)


def pick_backend(name: str, device: Optional[str]) -> str:
    """``auto`` picks the highest-priority available backend that runs on an accelerator (a
    device other than the host CPU), else the reference backend; a named backend is used as is."""
    if name != "auto":
        return name
    if device is not None:
        return kvcache.available_backends(device)[0] if kvcache.available_backends(device) else "auto"
    for row in kvcache.list_backends():
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


def check_plot_prerequisite(path: Optional[str]) -> None:
    """``--plot FILE`` needs matplotlib and a writable folder: checked before the workload runs.
    Raises ``kvcache.cli.UsageError`` naming the fix."""
    if not path:
        return
    from kvcache.cli import UsageError
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'kvcache[plot]' "
                         "(or leave out --plot)") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"--plot {path}: the folder {folder} does not exist")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache demo",
        description="A continuous-batching serving workload (chunked prefill, shared prefixes, "
                    "parallel samples, speculative token trees, sliding windows, preemption) on "
                    "the best available backend, checked against the reference backend.")
    p.add_argument("--backend", default="auto", help="backend name, or 'auto' (default): the best "
                   "accelerator backend available, else the reference backend")
    p.add_argument("--device", default=None, help="device for the backend (e.g. cuda:1)")
    p.add_argument("--requests", type=positive_int, default=None, help="number of requests (default 48, x --scale)")
    p.add_argument("--seed", type=int, default=0, help="workload and model seed (default 0)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="write a PNG of batch size, pages in use and preemptions per step (needs matplotlib)")
    p.add_argument("--check", dest="check", action="store_true", default=True,
                   help="replay a sample of requests on the reference backend (default)")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the replay check")
    p.add_argument("--check-requests", type=non_negative_int, default=8,
                   help="requests replayed by the check, plus up to 4 preempted ones (0: all)")
    p.add_argument("--scale", type=positive_float, default=1.0,
                   help="multiply requests, cache capacity and batch size (e.g. --scale 8 on a GPU)")
    p.add_argument("--model", default="synthetic",
                   help="synthetic (default: the toy model below, every cache feature), or a real "
                        "architecture through the transformers Engine: llama, qwen2, mistral, "
                        "phi3, gemma (small random weights) or a checkpoint directory")
    p.add_argument("--disaggregate", action="store_true",
                   help="prefill and decode in two processes, each request's KV sent from one "
                        "cache to the other (`kvcache demo --disaggregate --help`)")
    p.add_argument("--shape", choices=sorted(MODELS), default=None,
                   help="synthetic model's layer/head shape (default: tiny on the reference "
                        "backend, small elsewhere)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="cache dtype (default: float32 on the reference backend, bfloat16 elsewhere)")
    p.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    p.add_argument("--max-total-tokens", type=positive_int, default=None,
                   help="main cache capacity in tokens (default 4096 x scale: tight, so requests get preempted)")
    p.add_argument("--window-max-total-tokens", type=positive_int, default=None,
                   help="sliding-window cache capacity in tokens (default 1024 x scale)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=256,
                   help="most tokens in one forward (default 256)")
    p.add_argument("--max-batch-size", type=positive_int, default=None, help="sequences in one forward (default 32 x scale)")
    p.add_argument("--max-prompt", type=positive_int, default=3000,
                   help="longest prompt in tokens (default 3000)")
    p.add_argument("--max-output", type=positive_int, default=40,
                   help="longest output in tokens (default 40)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON (for machines) instead of a table; implies --quiet")
    return p


def _configs(opts, backend: str) -> tuple:
    ref = backend == "reference"
    model = opts.shape or ("tiny" if ref else "small")
    layers, hq, hkv, d = MODELS[model]
    dtype = opts.dtype or ("float32" if ref else "bfloat16")
    scale = opts.scale
    batch = opts.max_batch_size or max(8, int(32 * scale))
    common = dict(num_layers=layers, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d,
                  page_size=opts.page_size, max_batch_size=batch,
                  prefill_chunk_size=opts.prefill_chunk_size, dtype=dtype)
    main = kvcache.CacheConfig(max_total_tokens=opts.max_total_tokens or int(4096 * scale),
                               rope_mode="normal", **common)
    window = kvcache.CacheConfig(max_total_tokens=opts.window_max_total_tokens or int(1024 * scale),
                                 rope_mode="normal", support_sliding_window=True, **common)
    return main, window


def _choose_checked(workload: Workload, k: int, seed: int) -> set:
    """Up to ``k`` requests to replay: one per feature first, then random ones (0: all)."""
    reqs = workload.requests
    if k <= 0 or k >= len(reqs):
        return {r.rid for r in reqs}
    rng = np.random.default_rng([seed, 0xC4EC])
    by_rid = {r.rid: r for r in reqs}
    chosen: list = []
    for feature in sorted({f for r in reqs for f in r.features}):
        with_f = [r.rid for r in reqs if feature in r.features and r.rid not in chosen]
        if with_f and len(chosen) < k:
            chosen.append(int(rng.choice(with_f)))
    # the sliding-window cache gets at least two
    windowed = [r.rid for r in reqs if r.sliding and r.rid not in chosen]
    if windowed and sum(by_rid[c].sliding for c in chosen) < 2:
        chosen.append(int(rng.choice(windowed)))
    rest = [r.rid for r in reqs if r.rid not in chosen]
    rng.shuffle(rest)
    return set(chosen + rest[:max(k - len(chosen), 0)])


class _Progress:
    """A rich progress bar on stderr (plain lines if rich is missing; nothing if quiet)."""

    def __init__(self, total: int, quiet: bool, title: str):
        self.bar = None
        self.total = total
        if quiet:
            return
        try:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                       TextColumn, TimeElapsedColumn)
        except ImportError:  # pragma: no cover - rich is in the 'demo' extra
            print(f"{title}: running {total} requests ...", file=sys.stderr)
            return
        self.bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.task = self.bar.add_task(title, total=total, info="")
        self.bar.start()

    def update(self, done: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, info=info)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_demo(opts: argparse.Namespace, tamper=None) -> DemoResult:
    """Run the workload; raises ``SchedulerError`` if it cannot make progress. ``tamper(engine,
    layer, entries, output) -> output`` lets tests plant a wrong attention output."""
    backend_name = pick_backend(opts.backend, opts.device)
    main_cfg, window_cfg = _configs(opts, backend_name)
    n = opts.requests if opts.requests is not None else max(8, int(48 * opts.scale))
    workload = make_workload(n, opts.seed, max_prompt=opts.max_prompt, max_output=opts.max_output,
                             arrival_rate=1.0 * max(opts.scale, 1.0),
                             long_fraction=0.0 if opts.scale <= 1 else 0.05)
    main_cache = kvcache.PagedKVCache(main_cfg, backend=backend_name, device=opts.device)
    window_cache = kvcache.PagedKVCache(window_cfg, backend=main_cache.backend.name, device=opts.device)
    model = ToyModel(main_cfg, opts.seed)
    checked = _choose_checked(workload, opts.check_requests, opts.seed) if opts.check else set()
    extra = 4 if opts.check else 0
    engines = []
    for name, cache, reqs in (("main", main_cache, [r for r in workload.requests if not r.sliding]),
                              ("sliding window", window_cache, [r for r in workload.requests if r.sliding])):
        engines.append(Engine(name, cache, model.bind(cache), workload, reqs, check_rids=checked,
                              max_extra_checks=extra, tamper=tamper))
    backend, device = main_cache.backend.name, str(main_cache.backend.device or "default")
    progress = _Progress(len(workload.requests), opts.quiet,
                         f"kvcache demo on {backend} ({device})")
    now, steps, idle, t0 = 0, 0, 0, time.perf_counter()
    try:
        while not all(e.done for e in engines):
            ran = False
            for e in engines:
                if not e.done:
                    ran = e.step(now) or ran
            if ran:
                steps += 1
                idle = 0
                now += 1
            else:
                arrivals = [a for a in (e.next_arrival() for e in engines) if a is not None]
                if arrivals and min(arrivals) > now:
                    now = min(arrivals)
                else:
                    idle += 1
                    now += 1
                    if idle > 3:
                        raise SchedulerError("the scheduler cannot make progress: " + "; ".join(
                            e.describe_stuck() for e in engines if not e.done))
            progress.update(sum(len(e.finished) for e in engines),
                            f"step {steps}  batch {sum(e.history[-1].batch for e in engines if e.history)}"
                            f"  preemptions {sum(e.preemptions for e in engines)}")
    finally:
        progress.stop()
    wall = time.perf_counter() - t0
    checks = []
    if opts.check:
        for e in engines:
            if e.logs:
                checks.append(replay_check(e.name, e.cfg, model, workload, e.logs))
    return DemoResult(backend, device, engines, checks, wall, steps, workload, opts)


# ---------------------------------------------------------------------- report
def _fmt_us(values) -> str:
    if not values:
        return "-"
    us = np.asarray(values) * 1e6
    return f"{us.mean():.0f} µs mean, {np.percentile(us, 50):.0f} p50, {np.percentile(us, 99):.0f} p99"


def _check_text(check: Optional[CheckResult]) -> str:
    if check is None:
        return "skipped"
    atol, _ = check.tolerance
    status = "PASSED" if check.ok else "FAILED"
    return (f"{status}: {check.requests} requests replayed on reference, {check.tokens:,} tokens, "
            f"{check.values:,} values, max |err| {check.max_err:.2g} (tol {atol:g})")


def _report_rows(result: DemoResult) -> tuple[str, list]:
    """The report's title and one {row name: text} dict per cache."""
    rows = []
    totals = {"prefilled": 0, "decoded": 0, "busy": 0.0, "pre": 0}
    for e in result.engines:
        cfg = e.cfg
        reqs = [r for r in result.workload.requests if (r.sliding == (e.name != "main"))]
        feats: dict = {}
        for r in reqs:
            for f in r.features:
                key = f.split(" (")[0]
                feats[key] = feats.get(key, 0) + 1
        seqs = sum(r.n_samples for r in reqs)
        tok = e.tokens_prefilled + e.tokens_decoded
        check = next((c for c in result.checks if c.cache == e.name), None)
        if result.options.check and check is None:
            check_text = "no request sampled"
        else:
            check_text = _check_text(check)
        rows.append({
            "requests": f"{len(e.finished)} / {e.total} finished ({seqs} sequences)",
            "features": ", ".join(f"{v} {k}" for k, v in sorted(feats.items())) or "-",
            "cache": (f"{cfg.num_layers} layers, {cfg.num_qo_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, "
                      f"{cfg.dtype}, page {cfg.page_size}, chunk {cfg.prefill_chunk_size}"
                      + (", sliding window" if cfg.support_sliding_window else "")),
            "tokens prefilled": f"{e.tokens_prefilled:,}",
            "tokens decoded": f"{e.tokens_decoded:,} (spec trees incl.)" if e.name == "main" else f"{e.tokens_decoded:,}",
            "tokens/s": f"{tok / e.busy_s:,.0f}" if e.busy_s else "-",
            "forwards": f"{len(e.history):,} (max batch {max((h.batch for h in e.history), default=0)})",
            "peak pages used": (f"{e.peak_pages:,} / {e.cache.num_total_pages:,} "
                                f"({100 * e.peak_pages / e.cache.num_total_pages:.0f}%)"),
            "preemptions": f"{e.preemptions} ({len(e.preempted_rids)} requests)",
            "begin_forward host time": _fmt_us(e.begin_times),
            "check": check_text,
        })
        totals["prefilled"] += e.tokens_prefilled
        totals["decoded"] += e.tokens_decoded
        totals["pre"] += e.preemptions
    title = (f"kvcache demo: backend {result.backend} on {result.device}, seed {result.options.seed}, "
             f"{len(result.workload.requests)} requests, {result.steps} steps in {result.wall_s:.1f} s "
             f"({(totals['prefilled'] + totals['decoded']) / result.wall_s:,.0f} tokens/s overall)")
    return title, rows


def summary(result: DemoResult) -> dict:
    """The run as plain data (what ``--json`` prints): backend, device, seed, steps, wall time,
    check status and, per cache, the counters behind the table."""
    caches = []
    for e in result.engines:
        check = next((c for c in result.checks if c.cache == e.name), None)
        caches.append({
            "cache": e.name, "requests": e.total, "finished": len(e.finished),
            "tokens_prefilled": e.tokens_prefilled, "tokens_decoded": e.tokens_decoded,
            "busy_s": e.busy_s, "forwards": len(e.history),
            "max_batch": max((h.batch for h in e.history), default=0),
            "peak_pages": e.peak_pages, "total_pages": e.cache.num_total_pages,
            "preemptions": e.preemptions, "preempted_requests": len(e.preempted_rids),
            "begin_forward_us": [t * 1e6 for t in e.begin_times],
            "check": None if check is None else {
                "ok": check.ok, "requests": check.requests, "tokens": check.tokens,
                "values": check.values, "max_err": check.max_err,
                "failures": [str(f) for f in check.failures]},
        })
    for c in caches:   # the per-call list is long: keep its summary only
        us = np.asarray(c.pop("begin_forward_us"), dtype=float)
        c["begin_forward_us"] = ({} if us.size == 0 else
                                 {"mean": float(us.mean()), "p50": float(np.percentile(us, 50)),
                                  "p99": float(np.percentile(us, 99))})
    return {"backend": result.backend, "device": result.device, "seed": result.options.seed,
            "requests": len(result.workload.requests), "steps": result.steps,
            "wall_s": result.wall_s, "check_ok": result.check_ok, "caches": caches}


def report(result: DemoResult, console=None, plain: Optional[bool] = None) -> None:
    """Print the result table: rich box drawing on a terminal (or into ``console``), plain
    ``name: value`` lines otherwise (``plain`` forces either)."""
    title, rows = _report_rows(result)
    if plain is None:
        plain = console is None and not sys.stdout.isatty()
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the 'demo' extra
        plain = True
    if plain:
        print(title)
        for e, r in zip(result.engines, rows):
            print(f"{e.name} cache:")
            for key, text in r.items():
                print(f"  {key + ':':<25}{text}")
        for check in result.checks:
            for failure in check.failures:
                print(f"check failed: {failure}")
        return
    console = console or Console()
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("", style="bold")
    for e in result.engines:
        table.add_column(f"{e.name} cache")
    for key in rows[0]:
        cells = [r[key] for r in rows]
        if key == "check":
            cells = [f"[green]{c}[/green]" if c.startswith("PASSED") else
                     f"[bold red]{c}[/bold red]" if c.startswith("FAILED") else c for c in cells]
        table.add_row(key, *cells)
    console.print(table)
    for check in result.checks:
        for failure in check.failures:
            console.print(f"[bold red]check failed:[/bold red] {failure}")


def plot(result: DemoResult, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib (pip install 'kvcache[plot]'): {exc}")
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(10, 7.5))
    for e in result.engines:
        steps = [h.step for h in e.history]
        axes[0].plot(steps, [h.batch for h in e.history], label=f"{e.name} cache", lw=1)
        line, = axes[1].plot(steps, [h.pages_used for h in e.history], label=f"{e.name} cache", lw=1)
        axes[1].axhline(e.cache.num_total_pages, color=line.get_color(), ls="--", lw=0.8)
        axes[2].step(steps, [h.preemptions for h in e.history], where="post", label=f"{e.name} cache")
    axes[0].set_ylabel("sequences in batch")
    axes[1].set_ylabel("pages in use\n(dashed: total)")
    axes[2].set_ylabel("preemptions\n(cumulative)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvcache demo: {result.backend} on {result.device}, seed {result.options.seed}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_arg(argv):
    for i, a in enumerate(argv):
        if a == "--model" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--model="):
            return a.split("=", 1)[1]
    return None


def main(argv=None, tamper=None) -> int:
    """``kvcache demo ARGS``: 0 when the run finished and the check passed, 1 when the check
    failed, 2 when the workload could not run."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--disaggregate" in argv:
        from .disaggregate import main as disaggregate_main     # prefill and decode ranks
        return disaggregate_main(argv)
    model = _model_arg(argv)
    if model is not None and model != "synthetic":
        from .real import main as real_main      # a real architecture (transformers)
        return real_main(argv)
    opts = build_parser().parse_args(argv)
    from kvcache.cli import backend_for
    check_plot_prerequisite(opts.plot)
    backend_for(pick_backend(opts.backend, opts.device), opts.device)   # before any work
    if opts.json:
        opts.quiet = True
    try:
        result = run_demo(opts, tamper=tamper)
    except (SchedulerError, kvcache.KVCacheError) as exc:
        print(f"kvcache demo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if opts.json:
        print(json.dumps(summary(result), indent=2))
    else:
        report(result)
    if opts.plot:
        plot(result, opts.plot)
        print(f"plot written to {opts.plot}", file=sys.stderr if opts.json else sys.stdout)
    if result.check_ok is False:
        print("kvcache demo: the check FAILED: attention outputs differ from the reference backend "
              "(see above)", file=sys.stderr)
        return 1
    return 0
