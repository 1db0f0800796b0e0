"""Shared setup of the CUDA backend tests.

The same test files run in three modes (chosen by environment, see docs/backends/cuda.md):
* default (CI, no GPU): CPU tensors, torch kernels;
* ``TRITON_INTERPRET=1``: CPU tensors, Triton kernels through the interpreter (float32/float16:
  the interpreter has no bfloat16); spawned by ``test_cuda_triton_interpreter.py``;
* ``KVCACHE_CUDA_TEST_DEVICE=cuda``: GPU tensors, torch *and* Triton kernels, every dtype.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

import background_runs
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


# ------------------------------------------------------------------ the children on the second core
# test_cuda_triton_interpreter.py runs the kernel tests under TRITON_INTERPRET=1 in a child pytest
# (about 1.5 minutes of one core), and a few other tests only spawn a child and read what it
# printed (background_runs.py names them): while the rest of the session mostly keeps one of CI's
# two cores busy. So when collection ends, the children of the selected ones start, one after
# another on the other core, and each test waits for its own and asserts on its output as before
# (same command, same environment, same limit counted from the child's start). Nothing else
# changes: with a test deselected or skipped its child does not start, and a child still running
# when the session ends is killed.
INTERPRETER_TEST = "test_triton_kernels_under_interpreter"
INTERPRETER_TIMEOUT_S = 900


def _register_interpreter_run(markexpr: str) -> None:
    """The child pytest of ``test_triton_kernels_under_interpreter``."""
    here = Path(__file__).resolve().parent
    # the child gets this run's -m: `make test` leaves out the scenarios marked slow for the
    # interpreter (test_cuda_end_to_end.py, test_cuda_graph_mode.py say why), `make
    # test-all` runs them
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           str(here / "test_cuda_kernels.py"), str(here / "test_cuda_attention_features.py"),
           str(here / "test_cuda_end_to_end.py"), str(here / "test_cuda_graph_mode.py"),
           str(here / "test_cuda_fp8.py"), str(here / "test_cuda_static_mixed.py"),
           str(here / "test_invariant_triton_ops.py"), str(here / "test_cuda_flash.py"),
           str(here / "test_cuda_batch_invariant.py"),
           "-k", "(not end_to_end and not graph) or token_tree or fused_qkv "
                 "or graph_mode_decode_equals",
           "-m", markexpr]
    background_runs.register(INTERPRETER_TEST, cmd,
                             background_runs.clean_env(TRITON_INTERPRET="1", KVCACHE_CUDA_CPU="1"),
                             cwd=here.parent.parent, timeout=INTERPRETER_TIMEOUT_S,
                             needs=("triton",))


def _register_child_files(config, items) -> None:
    """Deselect the tests of each of background_runs.CHILD_FILES from ``items`` and register
    its child, where the session selects every test of the file and its reader
    (tests/test_child_files.py), without -k."""
    if config.getoption("keyword"):
        return
    names = {item.name for item in items}
    tests = Path(__file__).resolve().parents[1]
    for rel in background_runs.CHILD_FILES:
        reader, path = background_runs.child_file_reader(rel), tests / rel
        mine = [item for item in items if Path(str(item.fspath)) == path]
        if reader not in names or not mine or reader in background_runs.RUNS:
            continue
        items[:] = [item for item in items if Path(str(item.fspath)) != path]
        config.hook.pytest_deselected(items=mine)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path),
               "-m", config.getoption("markexpr")]
        background_runs.register(reader, cmd, background_runs.clean_env(drop=()),
                                 cwd=tests.parent, timeout=900)
        background_runs.CHILD_FILE_COUNTS[reader] = len(mine)


_QUEUE = pytest.StashKey["background_runs.Queue"]()


def _runs_child(item) -> bool:
    if cc.INTERPRET or cc.ON_GPU or item.name not in background_runs.RUNS:
        return False               # not a spawner, or it skips itself (see their skipifs)
    run = background_runs.RUNS[item.name]
    needs = set(run.needs) | ({"triton"} if run.env.get("TRITON_INTERPRET") == "1" else set())
    return all(importlib.util.find_spec(m) is not None for m in needs)     # their importorskips


@pytest.hookimpl(trylast=True)        # after -m / -k deselected: the children take what is left
def pytest_collection_modifyitems(session, config, items):
    # the tests that only wait for a child run last: the children run on the second core in
    # the session's order from collection's end, while the first core runs every other test;
    # a spawner met early would keep the first core waiting for its child instead
    if cc.INTERPRET or cc.ON_GPU:
        return
    _register_child_files(config, items)
    names = set(background_runs.RUNS) | {INTERPRETER_TEST}
    waits = [item for item in items if item.name in names]
    if waits:
        items[:] = [item for item in items if item.name not in names] + waits


_EARLY = pytest.StashKey["background_runs.Run"]()


def pytest_configure(config):
    # This conftest loads about 12 s into the whole suite's collection (26 s on CI's two cores),
    # during which the second core has nothing to do: the interpreter child, the longest, starts
    # here where the session is bound to select its test (this folder collected whole, no -k,
    # an -m that keeps unmarked tests); collection's end kills it if the test was deselected.
    if cc.INTERPRET or cc.ON_GPU or config.option.collectonly or config.getoption("keyword"):
        return
    if importlib.util.find_spec("triton") is None or not _keeps_unmarked(config):
        return
    here = Path(__file__).resolve().parent
    args = [Path(a).resolve() for a in config.args if "::" not in a]
    if not any(here == a or a in here.parents for a in args):
        return
    _register_interpreter_run(config.getoption("markexpr"))
    run = background_runs.RUNS[INTERPRETER_TEST]
    run.start()
    config.stash[_EARLY] = run


def _keeps_unmarked(config) -> bool:
    """Whether the session's -m selects a test with no marks (False where it cannot be told)."""
    expr = config.getoption("markexpr")
    if not expr:
        return True
    try:
        from _pytest.mark.expression import Expression
        return bool(Expression.compile(expr).evaluate(lambda *a, **k: False))
    except Exception:                   # noqa: BLE001 - pytest's private API moved: no early start
        return False


def pytest_collection_finish(session):
    config = session.config
    if config.option.collectonly or _QUEUE in config.stash:
        return
    early = config.stash.get(_EARLY, None)
    if not (cc.INTERPRET or cc.ON_GPU) and early is None:
        _register_interpreter_run(config.getoption("markexpr"))
    runs = []
    for item in session.items:
        run = background_runs.RUNS.get(item.name)
        if _runs_child(item) and all(run is not r for r in runs):   # a child read by several
            runs.append(run)
    if early is not None:
        if any(early is r for r in runs):   # first: the queue waits for it before the others
            runs = [early] + [r for r in runs if r is not early]
        else:
            early.kill()                    # its test was deselected after all
    if runs:
        config.stash[_QUEUE] = background_runs.Queue(runs, started=(early,) if early else ())


def pytest_sessionfinish(session):
    queue = session.config.stash.get(_QUEUE, None)
    if queue is not None:
        queue.stop()


def pytest_terminal_summary(terminalreporter, config):
    # each child's own wall time: they share CI's second core, so their sum bounds the suite's
    queue = config.stash.get(_QUEUE, None)
    if queue is None or config.option.verbose < 0 and config.getoption("durations") is None:
        return
    walls = [(run.wall, run.name) for run in queue.runs if run.wall is not None]
    terminalreporter.write_line(f"background children: {sum(w for w, _ in walls):.0f} s in all")
    for wall, name in sorted(walls, reverse=True):
        terminalreporter.write_line(f"  {wall:7.1f} s  {name}")


@pytest.fixture
def triton_interpreter_run(pytestconfig):
    """A call that waits for the interpreter child and returns it finished: the child started
    by the queue, or (none started) one started by the call."""
    def finished():
        if INTERPRETER_TEST not in background_runs.RUNS:
            _register_interpreter_run(pytestconfig.getoption("markexpr"))
        return background_runs.result(INTERPRETER_TEST)
    return finished
