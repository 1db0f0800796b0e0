"""The demo's output: the table (rich on a terminal, plain lines otherwise), ``--json`` and
``--plot``. Every number about the serving comes from the engine (``EngineStats``, its cache)
or from the streamed outputs."""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional

import numpy as np

from .check import check_summary

__all__ = ["plot", "report", "rows", "summary"]


def _ms(values) -> str:
    if not values:
        return "-"
    ms = np.asarray(values) * 1e3
    return f"{np.percentile(ms, 50):,.0f} ms median, {np.percentile(ms, 99):,.0f} ms p99"


def _ttft(result) -> list:
    return [tr.first_s - tr.added_s for tr in result.served.traces.values() if tr.first_s is not None]


def rows(result) -> tuple:
    """The report's title and its (name, text) rows."""
    s, served, work = result.stats, result.served, result.workload
    wall = max(served.wall_s, 1e-9)
    feats = ", ".join(f"{v} {k}" for k, v in work.features().items() if v)
    samples = sum(r.n for r in work.requests)
    sampled = [r for r in work.requests if r.sampled]
    out = [
        ("model", result.model),
        ("requests", f"{len(work.requests)} ({samples} samples) arriving over "
                     f"{work.last_arrival + 1} steps, {served.interleaved} of them added while "
                     f"others decoded: {feats}"),
        ("new tokens", f"{served.new_tokens:,} in {served.wall_s:.1f} s "
                       f"({served.new_tokens / wall:,.0f} tokens/s); "
                       f"{s.forward_tokens / wall:,.0f} forward tokens/s"),
        ("time to first token", _ms(_ttft(result))),
        ("forwards", f"{s.forwards:,} in {served.steps:,} steps: {s.prefill_tokens:,} prompt "
                     f"tokens, {s.decode_tokens:,} decode tokens; {s.overlapped_forwards:,} "
                     f"with the host a step ahead"),
    ]
    if result.engine.graphs:
        out.append(("whole-step graphs", f"{s.graph_forwards:,} forwards replayed a graph "
                                         f"({s.graph_captures} captured while serving)"))
    shared = f"{s.forks} forks, {s.shared_prefix_tokens:,} prompt tokens not recomputed"
    shared += (f"; prefix cache: {s.prefix_hit_tokens:,} tokens found cached "
               f"({100 * s.prefix_hit_rate:.0f}% of prompt tokens)")
    out.append(("shared pages", shared))
    if sampled:
        distinct = result.distinct()
        full = sum(1 for d in distinct if d == result.options.samples)
        out.append(("parallel samples", f"{result.options.samples} per parallel request (4 per "
                                        f"burst request), drawn at temperature 0.8: all distinct "
                                        f"in {full} of {len(distinct)} parallel requests"))
    cache = result.engine.cache
    out += [
        ("preemptions", f"{s.preemptions:,} ({s.recomputed_tokens:,} tokens recomputed, "
                        f"{s.offloaded_tokens:,} offloaded to the host tier, "
                        f"{s.recompute_tokens_saved:,} restored from it)"),
        ("pages", f"peak {served.peak_pages:,} of {cache.num_total_pages:,} "
                  f"({100 * served.peak_pages / max(cache.num_total_pages, 1):.0f}%), page "
                  f"{cache.config.page_size}, chunk {cache.config.prefill_chunk_size}, batch "
                  f"{cache.config.max_batch_size}"),
        ("check", "skipped (--no-check)" if result.check is None else result.check.text()),
        ("time", time_split(result)),
    ]
    title = (f"kvcache demo on backend {result.backend} ({result.device}, {result.dtype}), "
             f"seed {result.options.seed}")
    return title, out


def time_split(result) -> str:
    """Where the run's wall time went: set-up (model and engine), the engine's warm-up (kernels
    compiled, graphs captured), serving (what the tokens/s are of) and the check."""
    warm = result.warm_up
    parts = [f"set-up {result.setup_s:.1f} s"]
    if warm is not None:
        parts.append(f"warm-up {warm.seconds:.1f} s ({warm.forwards} forwards, {warm.captures} "
                     f"graphs captured)")
    parts.append(f"serving {result.served.wall_s:.1f} s")
    if result.check is not None:
        parts.append(f"check {result.check.seconds:.1f} s")
    return ", ".join(parts)


def summary(result) -> dict:
    """The run as plain data (what ``--json`` prints)."""
    served = result.served
    stats = dataclasses.asdict(result.stats)
    ttft = _ttft(result)
    return {
        "mode": result.mode, "model": result.model, "backend": result.backend,
        "device": result.device, "dtype": result.dtype, "seed": result.options.seed,
        "requests": len(result.workload.requests),
        "finished": sum(1 for tr in served.traces.values() if tr.finished_step is not None),
        "features": result.workload.features(), "interleaved": served.interleaved,
        "steps": served.steps, "wall_s": served.wall_s, "new_tokens": served.new_tokens,
        "tokens_per_s": served.new_tokens / max(served.wall_s, 1e-9),
        "ttft_ms": {} if not ttft else {"p50": float(np.percentile(ttft, 50) * 1e3),
                                        "p99": float(np.percentile(ttft, 99) * 1e3)},
        "graphs": bool(result.engine.graphs), "stats": stats,
        "setup_s": result.setup_s,
        "warm_up": None if result.warm_up is None else dataclasses.asdict(result.warm_up),
        "peak_pages": served.peak_pages, "total_pages": served.total_pages,
        "distinct_samples": result.distinct(), "check_ok": result.check_ok,
        "check": check_summary(result.check),
    }


def report(result, console=None, plain: Optional[bool] = None) -> None:
    """Print the table: rich box drawing on a terminal (or into ``console``), plain ``name:
    value`` lines otherwise (``plain`` forces either)."""
    title, table_rows = rows(result)
    if plain is None:
        plain = console is None and not sys.stdout.isatty()
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is in the 'demo' extra
        plain = True
    failures = [] if result.check is None else result.check.failures
    if plain:
        print(title)
        for key, text in table_rows:
            print(f"  {key + ':':<22}{text}")
        for failure in failures:
            print(f"check failed: {failure}")
        return
    console = console or Console()
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    for key, text in table_rows:
        if key == "check":
            text = f"[green]{text}[/green]" if text.startswith("PASSED") else (
                f"[bold red]{text}[/bold red]" if text.startswith("FAILED") else text)
        table.add_row(key, text)
    console.print(table)
    for failure in failures:
        console.print(f"[bold red]check failed:[/bold red] {failure}")


def plot(result, path: str) -> None:
    """A PNG of running and waiting requests, pages in use (with the capacity) and cumulative
    preemptions per engine step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    h = result.served.history
    steps = [r.step for r in h]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(10, 7.5))
    axes[0].plot(steps, [r.running for r in h], lw=1, label="running sequences")
    axes[0].plot(steps, [r.waiting for r in h], lw=1, label="waiting requests")
    axes[0].set_ylabel("requests")
    axes[1].plot(steps, [r.pages_used for r in h], lw=1, label="pages in use")
    axes[1].axhline(result.served.total_pages, color="k", ls="--", lw=0.8, label="capacity")
    axes[1].set_ylabel("pages")
    axes[2].step(steps, [r.preemptions for r in h], where="post", label="preemptions")
    axes[2].set_ylabel("preemptions\n(cumulative)")
    axes[2].set_xlabel("engine step")
    for ax in axes:
        # counts from 0 (a line at 0 just above the axis), over at least 0..1: a flat line (no
        # preemptions) gets integer ticks too (MaxNLocator(integer=True) gives fractions on a
        # range under 1)
        top = max(ax.get_ylim()[1], 1.05)
        ax.set_ylim(-0.03 * top, top)
        lo, hi = ax.get_xlim()
        ax.set_xlim(lo, max(hi, lo + 1))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"kvcache demo: {result.model}\n{result.backend} on {result.device}, "
                 f"seed {result.options.seed}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
