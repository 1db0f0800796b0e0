"""``pytest -p kvcache.conformance.plugin --pyargs kvcache.conformance --kvcache-backend NAME``
works as the plugin guide shows, and kvcache registers nothing with pytest: unrelated pytest runs
see no kvcache option or module.

Every run is a fresh pytest in a subprocess, in an empty directory (as a backend author would run
it), on a small ``-k`` selection.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvcache
from _conformance_runs import nonzero, pytest_counts, summary_tables

SELECTION = "TestPrefill"
SUITE = "kvcache.conformance.plugin"


def _env(**extra):
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("PYTEST_", "KVCACHE_CONFORMANCE_")) or key == "KVCACHE_EXAMPLE_BROKEN":
            del env[key]
    env.update(extra)
    return env


def _stale_entry_point():
    """An environment installed from an older kvcache still declares a ``pytest11`` entry point
    named ``kvcache`` (reinstalling removes it); these runs block it to see what a fresh install
    sees. The repository's own pyproject is checked in ``test_no_pytest11_entry_point``."""
    from importlib.metadata import distributions
    # every distribution on the path, as pytest scans them (entry_points() keeps one per name)
    return any(ep.group == "pytest11" and ep.name == "kvcache"
               for dist in distributions() for ep in dist.entry_points)


def pytest_command(args, **env):
    """A fresh pytest's command line with ``args``, and its environment with ``env``."""
    block = ["-p", "no:kvcache"] if _stale_entry_point() else []
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *block, *args], _env(**env)


def run_pytest(args, cwd, **env):
    cmd, env = pytest_command(args, **env)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(cwd), env=env, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def counts(out):
    """pytest's final line -> {"passed": n, "skipped": n, ...}."""
    last = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed|error|skipped)", line)]
    assert last, out[-3000:]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last[-1])}


def table(out, backend):
    """The summary table's header line and rows for ``backend`` -> {area: {column: n}}."""
    head = next(line for line in out.splitlines() if line.startswith(f"backend {backend!r} on "))
    return head, summary_tables(out)[backend]


@pytest.fixture(scope="module")
def selected(tmp_path_factory):
    """Node ids the selection collects (the same for every backend)."""
    rc, out = run_pytest(["-p", SUITE, "--pyargs", "kvcache.conformance",
                          "--kvcache-backend", "reference", "-k", SELECTION, "--collect-only", "-q"], tmp_path_factory.mktemp("collect"))
    assert rc == 0, out[-3000:]
    ids = [line for line in out.splitlines() if "::" in line]
    assert ids and all(SELECTION in i for i in ids), out[-3000:]
    return ids


def _backend_row(name):
    return next((r for r in kvcache.list_backends() if r["name"] == name and r["class"]), None)


def _target(name):
    if name == "example":
        pytest.importorskip("kvcache_example", reason="pip install -e docs/examples/kvcache-example")
    row = _backend_row(name)
    if row is None:
        pytest.skip(f"backend {name!r} is not installed")
    device = "cpu" if name == "metal" else None     # metal runs on the MLX CPU device here
    ok, why = row["class"].availability(device)
    if not ok:
        pytest.skip(f"backend {name!r} cannot run here: {why}")
    return device


# The runs of test_exact_form and test_environment_form (5-9 s each) start when collection ends
# and run on CI's second core beside the session (tests/cuda/background_runs.py; at once, in the
# test's wait, where that queue does not run), each in an empty folder of its own.
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

# reference: the built-in backend; metal: a backend from another distribution, with
# --kvcache-device. The example plugin (another distribution, no device) repeats what those two
# show and runs with `make test-all`.
EXACT = {"reference": (None, ()), "metal": ("cpu", ("kvcache_metal", "mlx")),
         "example": (None, ("kvcache_example",))}
"""backend: (the device the run names, the modules it needs); metal runs on the MLX CPU device
here (``_target`` skips a backend that is not installed or cannot run)."""
for _backend, (_device, _needs) in EXACT.items():
    background_runs.register(
        f"test_exact_form[{_backend}]",
        *pytest_command(["-p", SUITE, "--pyargs", "kvcache.conformance", "--kvcache-backend",
                         _backend, *(["--kvcache-device", _device] if _device else []),
                         "-k", SELECTION, "-q"], KVCACHE_PLUGINS=f"reference,{_backend}"),
        cwd=background_runs.folder(f"entry-point-{_backend}-"), timeout=600, needs=_needs)
background_runs.register(
    "test_environment_form",
    *pytest_command(["--pyargs", "kvcache.conformance", "-k", "TestPrefill and test_batch", "-q"],
                    KVCACHE_CONFORMANCE_BACKEND="reference"),
    cwd=background_runs.folder("entry-point-environment-"), timeout=600)


def background_pytest(test):
    """``run_pytest``'s (exit status, output) of the registered run of ``test``."""
    proc = background_runs.result(test)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["reference", "metal",
                                     pytest.param("example", marks=pytest.mark.slow)])
def test_exact_form(backend, selected, request):
    device = _target(backend)
    assert device == EXACT[backend][0]
    rc, out = background_pytest(request.node.name)
    assert rc == 0, out[-4000:]
    assert "unrecognized arguments" not in out
    got = counts(out)
    assert got.get("failed", 0) == 0 and got.get("error", 0) == 0, out[-4000:]
    assert got["passed"] + got.get("skipped", 0) == len(selected), (got, len(selected))
    if backend in ("reference", "example"):      # both declare every capability TestPrefill needs
        assert got["passed"] == len(selected)
    assert "kvcache conformance summary" in out
    head, rows = table(out, backend)
    assert head == f"backend {backend!r} on {device or 'default device'} (quick matrix)"
    assert nonzero(rows["TestPrefill"]) == nonzero(rows["total"]) == pytest_counts(out)
    assert "verdict: CONFORMS" in out


def test_named_plugin_with_and_without_autoload(tmp_path):
    """-p kvcache.conformance.plugin defines the options, with pytest's plugin autoload on or off."""
    args = ["-p", SUITE, "--pyargs", "kvcache.conformance", "--kvcache-backend", "reference",
            "-k", "TestPrefill and test_batch", "-q"]
    for env in ({}, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}):
        rc, out = run_pytest(args, tmp_path, **env)
        assert rc == 0, (env, out[-4000:])
        assert counts(out)["passed"] == 2 and "verdict: CONFORMS" in out, out[-4000:]


def test_environment_form():
    rc, out = background_pytest("test_environment_form")
    assert rc == 0, out[-4000:]
    assert counts(out)["passed"] == 2 and "backend 'reference' on default device" in out


UNRELATED = textwrap.dedent('''
    import sys

    import pytest


    def test_unrelated(request):
        pm = request.config.pluginmanager
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("kvcache", "numpy"))
        assert heavy == [], heavy
        assert not pm.has_plugin("kvcache.conformance.plugin")
        with pytest.raises(ValueError):
            request.config.getoption("kvcache_backend")
''')


def test_unrelated_run_loads_nothing(tmp_path):
    (tmp_path / "test_unrelated.py").write_text(UNRELATED)
    rc, out = run_pytest(["-q", "test_unrelated.py"], tmp_path)
    assert rc == 0, out[-4000:]
    assert counts(out) == {"passed": 1}
    assert "kvcache conformance summary" not in out
    # the options are the suite's: without it, pytest does not know them
    rc, out = run_pytest(["-q", "test_unrelated.py", "--kvcache-backend", "reference"], tmp_path)
    assert rc == 4 and "unrecognized arguments: --kvcache-backend" in out, out[-4000:]


def test_help_lists_the_options_only_with_the_suite(tmp_path):
    rc, out = run_pytest(["--help"], tmp_path)
    assert rc == 0, out[-4000:]
    assert "kvcache" not in out
    rc, out = run_pytest(["-p", SUITE, "--help"], tmp_path)
    assert rc == 0, out[-4000:]
    assert "kvcache conformance suite" in out and "--kvcache-backend" in out


def test_no_pytest11_entry_point():
    """The core's metadata registers nothing with pytest and ships no top-level module."""
    import tomllib
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert "pytest11" not in project["project"].get("entry-points", {})
    assert "py-modules" not in project.get("tool", {}).get("setuptools", {})


def test_options_are_defined_once():
    """The options module and the suite's plugin share one definition; adding twice is a no-op."""
    from kvcache.conformance import options, plugin

    class Option:
        def __init__(self, flag):
            self.flag = flag

        def names(self):
            return [self.flag]

    class Group:
        def __init__(self):
            self.options = []

        def addoption(self, flag, **kwargs):
            assert flag not in [o.flag for o in self.options], f"{flag} added twice"
            self.options.append(Option(flag))

    class Parser:
        def __init__(self):
            self.groups = {}

        def getgroup(self, name, description=""):
            return self.groups.setdefault(name, Group())

    parser = Parser()
    plugin.pytest_addoption(parser)
    plugin.pytest_addoption(parser)
    options.add_options(parser)
    assert list(parser.groups) == ["kvcache"]
    assert [o.flag for o in parser.groups["kvcache"].options] == [f for f, _ in options.OPTIONS]
    import inspect
    assert ".addoption(" not in inspect.getsource(plugin)
