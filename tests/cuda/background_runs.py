"""The child processes of the CPU-mode spawner tests, run on CI's otherwise idle second core.

Several tests here only spawn a child (a pytest under TRITON_INTERPRET=1, a `kvcache conformance`
run) and assert on what it printed: 3-40 s each on 2 cores, most of it a core's worth of the
child while the session's own process waits. Each of those test modules registers its child's
command at import time (``register``); when collection ends, conftest.py starts a queue that runs
the registered children of the selected tests one after another, in the session's order, beside
the session's other tests (one extra core, as the interpreter run alone took before). The
interpreter child, the longest, starts earlier, when tests/cuda/conftest.py loads during
collection, where the session is bound to select its test; the queue waits for it first. The test
then calls ``result(name)``: the finished child as ``subprocess.run`` returns it (text output),
waiting for it if it still runs, or starting it at once if the queue has not reached it (or was
never started: the test selected alone, ``--collect-only`` before). The command, its environment
and its time limit (counted from the child's start) are the test's own, the assertions unchanged.
A child still running when the session ends is killed."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Run:
    """One registered child: ``cmd`` run in ``cwd`` with ``env`` and ``timeout`` seconds."""
    name: str
    cmd: list
    env: dict
    cwd: Optional[str] = None
    timeout: float = 900.0
    needs: tuple = ()
    """Modules the child needs (its test importorskips them): not queued where one is missing."""
    proc: Optional[subprocess.Popen] = None
    _started: float = 0.0
    wall: Optional[float] = None
    """Seconds from the child's start to its end (its own wall time, however long its test
    waited), once it ended."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> bool:
        """Start the child unless it was; True if this call started it."""
        with self._lock:
            if self.proc is not None:
                return False
            # files, not pipes: nobody reads the child's output until its test runs
            self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            self._started = time.monotonic()
            self.proc = subprocess.Popen([str(c) for c in self.cmd], cwd=self.cwd, env=self.env,
                                         stdout=self._out, stderr=self._err)
            return True

    def wait(self) -> None:
        """Wait until the child ends or its limit passes (then it is killed)."""
        left = self.timeout - (time.monotonic() - self._started)
        try:
            self.proc.wait(timeout=max(left, 0.001))
            self._ended()
        except subprocess.TimeoutExpired:
            self.kill()

    def _ended(self) -> None:
        with self._lock:
            if self.wall is None:
                self.wall = time.monotonic() - self._started

    def result(self) -> subprocess.CompletedProcess:
        """The finished child as ``subprocess.run(..., capture_output=True, text=True)`` returns
        it; a child past its limit is killed and ``subprocess.TimeoutExpired`` raised."""
        self.start()
        left = self.timeout - (time.monotonic() - self._started)
        try:
            self.proc.wait(timeout=max(left, 0.001))
            self._ended()
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        if self.proc.returncode is not None and self.proc.returncode < 0 and \
                time.monotonic() - self._started >= self.timeout:
            raise subprocess.TimeoutExpired(self.proc.args, self.timeout)
        out = [f.seek(0) or f.read().decode(errors="replace") for f in (self._out, self._err)]
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *out)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


CHILD_FILES = ("conformance/test_conformance_suite.py", "core/test_bad_input_catalogue.py")
"""Whole test files (under tests/) that run in a child pytest on the second core when a session
selects all of a file and its reader, ``test_child_file_passes[<file>]`` (tests/
test_child_files.py), without -k: the file's tests pass or fail in the child, with the
session's -m, and the reader asserts the child passed every one of them and shows its failures.
The session's own process was the suite's longest path (about 1,080 s on CI's two cores against
the children's 1,000 before these files moved). A session with -k, or one that selects a file
without its reader, runs the file's tests in its own process as before."""

CHILD_FILE_COUNTS: dict[str, int] = {}
"""The number of tests each whole-file child runs, by its reader's name (the session
deselected them)."""


def child_file_reader(rel: str) -> str:
    """The name of the reader test of CHILD_FILES' ``rel``."""
    return f"test_child_file_passes[{rel}]"

RUNS: dict[str, Run] = {}
"""The registered children, by the name of each test that asserts on one (a child read by
several tests is under each of their names)."""


def register(name: str, cmd: list, env: dict, cwd=None, timeout: float = 900.0,
             needs: tuple = (), readers: tuple = ()) -> None:
    """Register the child of the test function ``name`` (call it where the test module is
    imported, under the same conditions as the test's skipif; ``needs``: the modules its test
    importorskips; ``readers``: the other test functions that read the same child's output,
    which wait for it last in the session as ``name`` does)."""
    run = Run(name, list(cmd), dict(env), None if cwd is None else str(cwd), timeout,
              tuple(needs))
    for test in (name, *readers):
        RUNS[test] = run


def folder(prefix: str) -> str:
    """A fresh empty folder for a registered child to run in (as a test's ``tmp_path``),
    removed when the session's process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def result(name: str) -> subprocess.CompletedProcess:
    """The finished child of the test ``name`` (see the module's docstring)."""
    return RUNS[name].result()


def clean_env(drop=("KVCACHE_CUDA_IMPL", "KVCACHE_CUDA_TEST_DEVICE"), **changes) -> dict:
    """This process's environment without ``drop``, with ``changes`` (and, for a child under
    the Triton interpreter, ``interpreter_blas``)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(changes)
    return interpreter_blas(env)


def interpreter_blas(env: dict) -> dict:
    """``env`` for a child that runs Triton kernels under the interpreter
    (``TRITON_INTERPRET=1``): OpenBLAS's Sandybridge kernels unless the caller chose others.
    The interpreter's ``tl.dot`` is numpy's matmul, and OpenBLAS's FMA kernels (its Haswell /
    Zen paths, e.g. on an AMD EPYC) round a tile's tail rows other than its first ones, so in
    the emulator a row's bits depend on the rows beside it and the batch-invariance tests fail
    there (not on a GPU); the Sandybridge kernels round every row alike."""
    if env.get("TRITON_INTERPRET") == "1":
        env.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
    return env


class Queue:
    """Runs ``runs`` one after another on a thread (a run its test started already is skipped;
    one of ``started``, begun before the queue was, is waited for)."""

    def __init__(self, runs: list[Run], started: tuple = ()):
        self.runs = runs
        self._started = tuple(started)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="background-runs", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        for run in self.runs:
            if self._stop.is_set():
                return
            if run.start() or any(run is r for r in self._started):
                run.wait()

    def stop(self) -> None:
        self._stop.set()
        for run in self.runs:
            run.kill()
