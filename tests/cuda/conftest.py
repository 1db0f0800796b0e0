"""Shared setup of the CUDA backend tests.

The same test files run in three modes (chosen by environment, see docs/backends/cuda.md):
* default (CI, no GPU): CPU tensors, torch kernels;
* ``TRITON_INTERPRET=1``: CPU tensors, Triton kernels through the interpreter (float32/float16:
  the interpreter has no bfloat16); spawned by ``test_cuda_triton_interpreter.py``;
* ``KVCACHE_CUDA_TEST_DEVICE=cuda``: GPU tensors, torch *and* Triton kernels, every dtype.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import cuda_cases as cc


@pytest.fixture(autouse=True)
def _cpu_test_mode(monkeypatch):
    # enable the backend's CPU test mode for these tests only: set process-wide it would let
    # backend="auto", device="cpu" pick the cuda backend in other test directories
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")


def pytest_report_header(config):
    return f"kvcache-cuda tests: device={cc.DEVICE} impls={cc.IMPLS} dtypes={cc.DTYPES}"


@pytest.fixture(params=cc.IMPLS)
def impl(request):
    return request.param


@pytest.fixture(params=cc.DTYPES)
def dtype(request):
    return request.param


# ------------------------------------------------------------------ the Triton-interpreter run
# test_cuda_triton_interpreter.py runs the kernel tests under TRITON_INTERPRET=1 in a child pytest:
# about 1.5 minutes of one core, while the rest of the session mostly keeps one of CI's two cores
# busy. So when that test is selected, its child starts as soon as collection ends and runs beside
# the other tests; the test waits for it and asserts on its output as before (same command, same
# environment, same 900 s limit counted from the start). Nothing else changes: with the test
# deselected or skipped nothing starts, and a child still running when the session ends is killed.
INTERPRETER_TEST = "test_triton_kernels_under_interpreter"
INTERPRETER_TIMEOUT_S = 900


class InterpreterRun:
    """The child pytest of ``test_triton_kernels_under_interpreter``, started now."""

    def __init__(self, markexpr: str):
        here = Path(__file__).resolve().parent
        env = {k: v for k, v in os.environ.items()
               if k not in ("KVCACHE_CUDA_IMPL", "KVCACHE_CUDA_TEST_DEVICE")}
        env.update(TRITON_INTERPRET="1", KVCACHE_CUDA_CPU="1")
        # the child gets this run's -m: `make test` leaves out the scenarios marked slow for the
        # interpreter (test_cuda_end_to_end.py, test_cuda_graph_mode.py say why), `make
        # test-all` runs them
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
               str(here / "test_cuda_kernels.py"), str(here / "test_cuda_attention_features.py"),
               str(here / "test_cuda_end_to_end.py"), str(here / "test_cuda_graph_mode.py"),
               str(here / "test_cuda_fp8.py"), str(here / "test_cuda_static_mixed.py"),
               str(here / "test_invariant_triton_ops.py"), str(here / "test_cuda_flash.py"),
               "-k", "(not end_to_end and not graph) or token_tree or fused_qkv "
                     "or graph_mode_decode_equals",
               "-m", markexpr]
        # files, not pipes: nobody reads the child's output until the test runs
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self._started = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=here.parent.parent, env=env, stdout=self._out,
                                     stderr=self._err)

    def result(self):
        """The finished child as ``subprocess.run`` returns it (text output); a child past the
        limit is killed and ``subprocess.TimeoutExpired`` raised, as ``subprocess.run`` does."""
        left = INTERPRETER_TIMEOUT_S - (time.monotonic() - self._started)
        try:
            self.proc.wait(timeout=max(left, 0.001))
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        out = [f.seek(0) or f.read().decode(errors="replace") for f in (self._out, self._err)]
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *out)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_INTERPRETER_RUN = pytest.StashKey["InterpreterRun"]()


def _interpreter_test_runs(item) -> bool:
    if item.name != INTERPRETER_TEST or cc.INTERPRET or cc.ON_GPU:
        return False               # not the spawner, or it skips itself (see its skipif)
    return importlib.util.find_spec("triton") is not None       # its importorskip


def pytest_collection_finish(session):
    config = session.config
    if config.option.collectonly or _INTERPRETER_RUN in config.stash:
        return
    if any(_interpreter_test_runs(item) for item in session.items):
        config.stash[_INTERPRETER_RUN] = InterpreterRun(config.getoption("markexpr"))


def pytest_sessionfinish(session):
    run = session.config.stash.get(_INTERPRETER_RUN, None)
    if run is not None:
        run.kill()


@pytest.fixture
def triton_interpreter_run(pytestconfig):
    """A call that waits for the interpreter child and returns it finished: the child started
    when collection ended, or (none started) one started by the call."""
    def finished():
        stash = pytestconfig.stash
        if _INTERPRETER_RUN not in stash:
            stash[_INTERPRETER_RUN] = InterpreterRun(pytestconfig.getoption("markexpr"))
        return stash[_INTERPRETER_RUN].result()
    return finished
