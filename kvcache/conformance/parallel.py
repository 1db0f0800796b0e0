"""``kvcache conformance --jobs N``: the suite in N pytest processes at once, one summary.

On a GPU most of a run is the backend's kernels compiling on the CPU (each new shape or feature
of a test is a new kernel variant), one core at a time: N workers compile N variants at once.
Each worker is this process forked (so a backend registered in this process, not only through an
entry point, is there too), runs ``pytest.main`` on every N-th selected test
(``--kvcache-shard I/N``) with its output in a log file, and writes its record
(``plugin.run_record``, ``--kvcache-dump``); this process merges the records into the one
summary, time table and reports a single run prints (``report.finish``). Fork only: where the
platform has no fork (or on macOS, where a forked Metal process is not safe) ``--jobs auto`` is 1.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time

__all__ = ["auto_jobs", "backend_in_child", "run_parallel"]


def auto_jobs() -> int:
    """``--jobs auto``: half the CPUs, at most 8, where fork is safe; 1 otherwise (and on a
    machine of fewer than 8 CPUs, where compiling beside the tests gains little)."""
    cpus = os.cpu_count() or 1
    if not _can_fork() or cpus < 8:
        return 1
    return min(8, cpus // 2)


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and sys.platform != "darwin"


def backend_in_child(name: str, device) -> str:
    """``kvcache.cli_kit.backend_for(name, device)`` asked in a forked child: its description
    (``name (module.class)``), or its ``UsageError`` raised here. A backend's availability
    check may start its device (CUDA, say), and a device started before the workers fork is
    one they cannot use: this process stays clear of it."""
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def ask() -> None:
        from kvcache.cli_kit import UsageError, backend_for
        try:
            cls = backend_for(name, device)
            send.send(("ok", f"{cls.name!r} ({cls.__module__}.{cls.__qualname__})"))
        except UsageError as exc:
            send.send(("usage", str(exc)))
        except BaseException as exc:        # noqa: BLE001 - reported, then raised here
            send.send(("error", f"{type(exc).__name__}: {exc}"))
        os._exit(0)
    p = ctx.Process(target=ask)
    p.start()
    kind, text = recv.recv() if recv.poll(600) else ("error", "no answer in 600 s")
    p.join()
    if kind == "ok":
        return text
    from kvcache.cli_kit import UsageError
    if kind == "usage":
        raise UsageError(text)
    raise RuntimeError(f"checking backend {name!r}: {text}")


def _worker(args: list, log: str) -> None:
    """A forked child: pytest's output into ``log``, its exit status as the process's."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import pytest
    code = int(pytest.main(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_parallel(args: list, jobs: int, full: bool, reports: list) -> int:
    """Run pytest with ``args`` (the single run's command line, without reports) in ``jobs``
    forked workers and print the merged summary. Returns the merged exit status."""
    from .report import finish, merged_exitstatus
    if not _can_fork():
        from kvcache.cli_kit import UsageError
        raise UsageError(f"--jobs {jobs}: this platform cannot fork a worker process "
                         f"({sys.platform}); use --jobs 1")
    folder = tempfile.mkdtemp(prefix="kvcache-conformance-")
    ctx = multiprocessing.get_context("fork")
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.perf_counter()
    workers = []
    for i in range(jobs):
        log, dump = (os.path.join(folder, f"worker{i}.{ext}") for ext in ("log", "json"))
        p = ctx.Process(target=_worker, args=(
            args + ["--kvcache-shard", f"{i}/{jobs}", "--kvcache-dump", dump], log))
        p.start()
        workers.append((i, p, log, dump))
    print(f"kvcache conformance: {jobs} workers at once (--jobs), their pytest output in {folder}",
          flush=True)
    records: list = []
    for i, p, log, dump in _as_finished(workers):
        line = _last_line(log)
        print(f"  worker {i + 1}/{jobs} done after {time.perf_counter() - started:.0f} s "
              f"(exit status {p.exitcode}): {line}", flush=True)
        status = p.exitcode if p.exitcode >= 0 else 3      # killed by a signal: pytest's 3
        if os.path.exists(dump):
            with open(dump) as f:
                records.append(json.load(f))
        else:       # no results: the merged run fails with the worker's status
            records.append({"outcomes": [], "exitstatus": status or 3, "stale": [],
                            "seconds": [], "matrix": [0, 0],
                            "wall": time.perf_counter() - started})
    for i, p, log, dump in workers:         # pytest's own lines about what failed, per worker
        shown = [ln for ln in _lines(log) if ln.startswith(("FAILED ", "ERROR "))]
        for ln in shown[:20]:
            print(f"  worker {i + 1}: {ln}")
    missing = [i + 1 for i, _, _, dump in workers if not os.path.exists(dump)]
    if missing:
        print(f"kvcache conformance: worker(s) {missing} wrote no results (see their logs in "
              f"{folder})", flush=True)

    def section(title: str) -> None:
        print(f"{'=' * 20} {title} {'=' * 20}")
    status = finish(records, full, reports, section, print)["exitstatus"]
    if status == 0:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"kvcache conformance: the workers' logs are kept in {folder}")
    return status


def _as_finished(workers: list):
    """The workers in the order they finish."""
    left = list(workers)
    while left:
        for w in list(left):
            if not w[1].is_alive():
                w[1].join()
                left.remove(w)
                yield w
        if left:
            time.sleep(0.2)


def _lines(path: str) -> list:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return []


def _last_line(path: str) -> str:
    lines = [ln.strip("= ") for ln in _lines(path) if ln.strip()]
    return lines[-1] if lines else "(no output)"
