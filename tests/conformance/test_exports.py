"""``from kvcache.conformance import *`` brings in everything the suite runs: a plugin author's CI
file (the plugin guide's) collects exactly the tests ``kvcache conformance`` runs, module-level
tests included."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys

import kvcache.conformance as suite
from kvcache.conformance.base import Conformance

from _conformance_runs import guide_files, run

CI_FILE = "tests/test_kvcache_conformance.py"


def suite_tests() -> set:
    """Every test class and module-level test function defined in the suite's test modules."""
    found = set()
    for info in pkgutil.iter_modules(suite.__path__):
        if not info.name.startswith("test_"):
            continue
        module = importlib.import_module(f"{suite.__name__}.{info.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj) and issubclass(obj, Conformance) and name.startswith("Test"):
                found.add(name)
            elif inspect.isfunction(obj) and name.startswith("test"):
                found.add(name)
    return found


def test_all_names_every_test_of_the_suite():
    found = suite_tests()
    assert {"TestWindowLeft", "test_window_left_unsupported_raises",
            "test_rope_frequencies_unsupported_raises"} <= found
    assert sorted(found - set(suite.__all__)) == []
    assert sorted(set(suite.__all__) - found) == []
    for name in suite.__all__:
        assert getattr(suite, name).__name__ == name


def collected(out: str) -> list:
    """``--collect-only -q`` node ids without their file: ``Class::test[params]``, ``test``."""
    return sorted(line.split("::", 1)[1] for line in out.splitlines()
                  if "::" in line and not line.startswith(("ERROR", "FAILED")))


def test_ci_file_collects_what_kvcache_conformance_runs(tmp_path):
    """The guide's CI file and ``kvcache conformance`` collect the same tests, by name."""
    ci = tmp_path / CI_FILE
    ci.parent.mkdir(parents=True)
    ci.write_text(guide_files()[CI_FILE].replace('"mydevice"', '"reference"'))
    env = dict(KVCACHE_PLUGINS="reference", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    rc, out = run([sys.executable, "-m", "kvcache.conformance", "--backend", "reference", "-q",
                   "--", "--collect-only"], tmp_path, **env)
    assert rc == 0, out[-4000:]
    cli = collected(out)
    rc, out = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                   CI_FILE], tmp_path, **env)
    assert rc == 0, out[-4000:]
    ci_file = collected(out)
    assert len(cli) > 150 and "test_window_left_unsupported_raises" in cli   # the quick matrix
    missing, extra = sorted(set(cli) - set(ci_file)), sorted(set(ci_file) - set(cli))
    assert (missing, extra) == ([], []), f"the CI file misses {missing}, adds {extra}"
    assert ci_file == cli
