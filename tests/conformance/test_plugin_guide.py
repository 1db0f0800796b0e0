"""docs/plugin-guide.md walked end to end: the code blocks that name a file (``# pyproject.toml``,
``# kvcache_mydevice/backend.py``, ``# tests/test_kvcache_conformance.py``, ...) are written out
as the plugin ``kvcache-mydevice``, pip installs it offline into a folder of its own (on
PYTHONPATH that folder is the installed plugin: kvcache finds its entry point there; this venv is
left as it is), and the guide's CI file runs under pytest with the verdict the guide promises.

The fast test runs the CI file on a selection that holds every kind of outcome the guide
describes (passes, capability skips, the module-level refusal tests); the slow one runs all of it.
"""

from __future__ import annotations

import sys

import pytest

from _conformance_runs import (guide_commands, guide_files, install_target, nonzero,
                               pytest_counts, run, summary_tables, verdicts, write_files)

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10
    tomllib = pytest.importorskip("tomli")

CI_FILE = "tests/test_kvcache_conformance.py"
# prefill and decode on the guide's dtypes (float32 skipped by capability), the capability
# refusals (TestCapabilities) and the module-level refusal tests the guide's capabilities make run
SELECTION = "TestPrefill and test_single or TestDecode and steps or TestCapabilities or unsupported_raises"


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    """The guide's plugin, written out and installed: (project folder, install folder)."""
    files = guide_files()
    project = write_files(files, tmp_path_factory.mktemp("kvcache-mydevice"))
    target = tmp_path_factory.mktemp("site")
    install_target(project, target)
    return project, target


def test_the_guide_names_every_file_of_its_plugin():
    files = guide_files()
    assert set(files) == {"pyproject.toml", "kvcache_mydevice/__init__.py",
                          "kvcache_mydevice/plugin.py", "kvcache_mydevice/backend.py", CI_FILE}
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["version"] and project["entry-points"]["kvcache"] == {
        "mydevice": "kvcache_mydevice.plugin"}
    # the install lines: kvcache from its clone with the test extra (pytest for the suite), and
    # the plugin itself; and that extra exists
    commands = guide_commands()
    assert "pip install -e ." in [c.split("#")[0].strip() for c in commands], commands
    assert any(c.startswith("pip install") and "[test]'" in c for c in commands), commands
    from _conformance_runs import ROOT
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("pytest") for req in extras["test"])


def run_ci_file(plugin, *args):
    project, target = plugin
    return run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", CI_FILE, *args], project,
               PYTHONPATH=target, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def check_run(rc, out):
    assert rc == 0, out[-4000:]
    counts = pytest_counts(out)
    tables = summary_tables(out)
    assert list(tables) == ["mydevice"], out[-4000:]
    assert nonzero(tables["mydevice"]["total"]) == counts, out[-4000:]
    assert verdicts(out) == ["CONFORMS (partially: see expected failures and capability skips)"], \
        out[-4000:]
    assert "capability 'dtypes' not declared" in out     # float32: the guide's capabilities
    assert "Warning" not in out, out[-4000:]
    return counts, tables["mydevice"]


def test_the_guides_plugin_installs_and_conforms(plugin):
    project, target = plugin
    rc, out = run([sys.executable, "-m", "kvcache.cli", "info"], project, PYTHONPATH=target)
    assert rc == 0 and "mydevice" in out, out[-4000:]
    rc, out = run_ci_file(plugin, "-q", "-k", SELECTION)
    counts, table = check_run(rc, out)
    # both module-level refusal tests ran on the guide's float16/bfloat16 capabilities
    assert nonzero(table["test_forward"]) == {"passed": 2}, out[-4000:]
    # float16 prefill and decode, two refusals, two module-level tests; the decode test's float32
    # row (page size 1, a row of the quick matrix's edge cases) skipped
    assert counts == {"passed": 6, "skipped": 1}, counts


@pytest.mark.slow
def test_the_guides_ci_file_whole(plugin):
    """All of the suite through the guide's CI file (20-60 s on two cores)."""
    rc, out = run_ci_file(plugin, "-q")
    counts, table = check_run(rc, out)
    assert counts["passed"] > 70 and set(counts) == {"passed", "skipped"}, counts
    assert table["test_forward"]["passed"] == 2
