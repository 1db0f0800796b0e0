"""A progress display for a serving run: new tokens against the run's most, tokens per second,
running and waiting requests, pages in use. On stderr, on a terminal only (or when forced), with
rich when it is installed, else nothing."""

from __future__ import annotations

import sys
import time
from typing import Optional

__all__ = ["Progress"]


class Progress:
    """``total``: the most new tokens the run can make (it ends sooner when samples stop);
    ``force``: None shows it on a TTY only; ``engine``: what the status line reads (its
    ``scheduler`` and ``cache``)."""

    def __init__(self, total: int, force: Optional[bool], engine):
        self.bar = None
        self.engine = engine
        self.done = 0
        self.t0 = time.perf_counter()
        show = sys.stderr.isatty() if force is None else force
        if not show:
            return
        try:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn
        except ImportError:
            return
        self.bar = Bar(TextColumn("kvcache"), BarColumn(), MofNCompleteColumn(),
                       TextColumn("{task.fields[info]}"), console=Console(stderr=True),
                       transient=True, auto_refresh=False)
        self.task = self.bar.add_task("generate", total=total, info="")
        self.bar.start()
        self._last = 0.0

    def update(self, outputs: list) -> None:
        self.done += sum(len(o.new_token_ids) for o in outputs)
        if self.bar is None:
            return
        now = time.perf_counter()
        if now - self._last < 0.1:             # a refresh costs host time: ten a second at most
            return
        self._last = now
        sched, cache = self.engine.scheduler, self.engine.cache
        used = cache.num_total_pages - cache.num_available_pages
        rate = self.done / max(now - self.t0, 1e-9)
        self.bar.update(self.task, completed=self.done, refresh=True,
                        info=f"{rate:,.0f} tok/s  running {sched.num_running}  waiting "
                             f"{sched.num_waiting}  pages {used}/{cache.num_total_pages}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
