"""The demo's serving loop: a workload driven through an ``Engine``'s online API.

One loop for every model (the toy adapter, a transformers model): at each engine step the
requests whose arrival step has come are added (``add_request``), then the engine runs one step
(``step``) and its ``RequestOutput`` stream is recorded per request and sample; when nothing is
running the clock jumps to the next arrival. A progress line shows requests done, tokens/s,
running and waiting requests, pages in use and preemptions while it runs.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Optional

from .workload import Workload

__all__ = ["Served", "StepRecord", "Trace", "serve"]


@dataclasses.dataclass
class Trace:
    """What one request got: per sample its tokens, log-probabilities (when asked) and finish
    reason; when it was added and got its first token (engine step, seconds since the start)."""

    rid: int
    engine_id: int
    added_step: int
    added_s: float
    tokens: list
    logprobs: list
    reasons: list
    first_step: Optional[int] = None
    first_s: Optional[float] = None
    finished_step: Optional[int] = None
    decoding_when_added: int = 0     # other requests that had tokens and were unfinished


@dataclasses.dataclass
class StepRecord:
    step: int
    running: int
    waiting: int
    pages_used: int
    preemptions: int
    new_tokens: int


@dataclasses.dataclass
class Served:
    traces: dict                     # workload rid -> Trace
    history: list                    # StepRecord per engine step
    wall_s: float
    steps: int
    peak_pages: int
    total_pages: int

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for tr in self.traces.values() for t in tr.tokens)

    @property
    def interleaved(self) -> int:
        """Requests added while others were decoding."""
        return sum(1 for tr in self.traces.values() if tr.decoding_when_added)


class _Progress:
    """A rich progress line on stderr (plain start/end lines without rich; nothing if quiet)."""

    def __init__(self, total: int, quiet: bool, title: str):
        self.bar = None
        self.title = title
        self.quiet = quiet
        self._last = 0.0
        if quiet:
            return
        try:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                       TextColumn, TimeElapsedColumn)
        except ImportError:  # pragma: no cover - rich is in the 'demo' extra
            print(f"{title}: serving {total} requests ...", file=sys.stderr)
            return
        self.bar = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self.task = self.bar.add_task(title, total=total, info="")
        self.bar.start()

    def update(self, done: int, info: str, force: bool = False) -> None:
        if self.bar is None:
            return
        now = time.perf_counter()
        if force or now - self._last >= 0.1:          # ten refreshes a second at most
            self._last = now
            self.bar.update(self.task, completed=done, info=info, refresh=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def serve(engine, workload: Workload, params: Callable, *, quiet: bool = True,
          title: str = "kvcache demo") -> Served:
    """Drive ``engine`` (an ``Engine``) through ``workload``: each request is added with
    ``params(request)`` (a ``SamplingParams``) at its arrival step. Returns the traces."""
    cache, sched, stats = engine.cache, engine.scheduler, engine.stats
    pending = sorted(workload.requests, key=lambda r: (r.arrival, r.rid))
    traces: dict = {}
    by_engine: dict = {}
    history: list = []
    done = 0
    progress = _Progress(len(pending), quiet, title)
    step, peak, t0 = 0, 0, time.perf_counter()
    try:
        while pending or engine.has_unfinished():
            while pending and pending[0].arrival <= step:
                req = pending.pop(0)
                decoding = sum(1 for tr in by_engine.values()
                               if tr.first_step is not None and tr.finished_step is None)
                eid = engine.add_request(req.prompt, params(req))
                tr = Trace(req.rid, eid, step, time.perf_counter() - t0,
                           [[] for _ in range(req.n)], [[] for _ in range(req.n)],
                           [None] * req.n, decoding_when_added=decoding)
                traces[req.rid] = by_engine[eid] = tr
            if not engine.has_unfinished():
                step = pending[0].arrival            # idle: the clock jumps to the next arrival
                continue
            outs = engine.step()
            now = time.perf_counter() - t0
            new = 0
            for out in outs:
                tr = by_engine[out.request_id]
                tr.tokens[out.index].extend(out.new_token_ids)
                if out.logprobs is not None:
                    tr.logprobs[out.index].extend(out.logprobs)
                new += len(out.new_token_ids)
                if out.new_token_ids and tr.first_step is None:
                    tr.first_step, tr.first_s = step, now
                if out.finished:
                    tr.reasons[out.index] = out.finish_reason
                    if all(r is not None for r in tr.reasons):
                        tr.finished_step = step
                        done += 1
            used = cache.num_total_pages - cache.num_available_pages
            peak = max(peak, used)
            history.append(StepRecord(step, sched.num_running, sched.num_waiting, used,
                                      stats.preemptions, new))
            step += 1
            progress.update(done, f"step {step}  {stats.forward_tokens / max(now, 1e-9):,.0f} "
                                  f"tok/s  running {sched.num_running}  waiting "
                                  f"{sched.num_waiting}  pages {used}/{cache.num_total_pages}  "
                                  f"preemptions {stats.preemptions}")
        progress.update(done, f"{step} steps  {stats.preemptions} preemptions", force=True)
    finally:
        progress.stop()
    return Served(traces, history, time.perf_counter() - t0, step, peak, cache.num_total_pages)
