"""Issue 53 item 8: ``kvcache conformance`` runs the quick matrix by default (every test class and
test function of the suite, fewer dtypes / page sizes / shapes / parameter values), ``--full`` the
whole one, and the end of a run prints the time of each test class."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter

import pytest

from _conformance_runs import pytest_counts, run

from kvcache.conformance import plugin

ENV = dict(KVCACHE_PLUGINS="reference", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def _collect(tmp_path, *args) -> list:
    """``Class::test[params]`` of what ``kvcache conformance --backend reference ARGS`` runs."""
    rc, out = run([sys.executable, "-m", "kvcache.conformance", "--backend", "reference", "-q",
                   *args, "--", "--collect-only"], tmp_path, **ENV)
    assert rc == 0, out[-4000:]
    names = [line.split("::", 1)[1] for line in out.splitlines()
             if "::" in line and line.split("::")[0].endswith(".py")]
    assert names, out[-4000:]
    return names


def _base(node: str) -> str:
    return node.split("[", 1)[0]


@pytest.fixture(scope="module")
def matrices(tmp_path_factory):
    where = tmp_path_factory.mktemp("collect")
    return _collect(where), _collect(where, "--full")


def test_the_quick_matrix_keeps_every_test_function(matrices):
    quick, full = matrices
    assert set(quick) <= set(full)                          # the same names: a sample of the full
    assert {_base(n) for n in quick} == {_base(n) for n in full}
    assert {_base(n).split("::")[0] for n in quick} == {_base(n).split("::")[0] for n in full}
    # the sample is small (a GPU run in minutes), and every function still runs
    assert 8 * len(quick) < len(full), (len(quick), len(full))
    assert len(quick) >= len({_base(n) for n in full}) > 100


def test_the_quick_matrix_keeps_the_edge_cases(matrices):
    quick, full = matrices
    ids = set(quick)
    # each variant of the quick matrix runs; page size 1 on the page-boundary tests
    for dtype, page_size in plugin.QUICK_VARIANTS:
        assert any(f"[{dtype}-ps{page_size}" in n for n in quick), (dtype, page_size)
    for name in plugin.QUICK_EDGES:
        assert any(n.startswith(name + "[") and "-ps1" in n for n in quick), name
    # the shape matrix covers every value of every axis: dtypes, GQA 1/4/8, head dims, page sizes
    shapes = [n for n in quick if n.startswith("TestMatrix::")]
    for value in [*plugin.DTYPES, *(f"gqa{g}" for g in plugin.GQA),
                  *(f"d{d}" for d in plugin.HEAD_DIMS), *(f"ps{p}" for p in plugin.PAGE_SIZES)]:
        assert any(f"-{value}-" in n.replace("[", "[-").replace("]", "-]") for n in shapes), value
    # each value of a test's own parameters runs at least once (a tree, a window, each KV
    # format, each RoPE mode), except where QUICK_VALUES narrows it
    def values(names):
        out = {}
        for n in names:
            parts = n[n.index("[") + 1:-1].split("-") if "[" in n else []
            if parts[:1] and parts[0] in plugin.DTYPES and not n.startswith("TestMatrix::"):
                parts = parts[2:]                    # the variant
            for i, part in enumerate(parts):
                out.setdefault((_base(n), i), set()).add(part)
        return out
    have, want = values(quick), values(full)
    for (base, i), wanted in want.items():
        if base in plugin.QUICK_VALUES or base == "TestMatrix::test_workload":
            continue
        assert have.get((base, i)) == wanted, (base, i, wanted, have.get((base, i)))
    assert {"TestHeadDims::test_prefill_decode[float16-ps16-24]",
            "TestHeadDims::test_prefill_decode[float16-ps16-200]"} <= ids


def test_the_tables_name_tests_of_the_suite():
    """QUICK_EDGES and QUICK_VALUES name tests that exist (a rename must update them)."""
    names = plugin._suite_base_names()
    assert set(plugin.QUICK_EDGES) <= names, set(plugin.QUICK_EDGES) - names
    assert set(plugin.QUICK_VALUES) <= names, set(plugin.QUICK_VALUES) - names


def test_full_collects_more_and_every_variant(matrices):
    quick, full = matrices
    assert len(full) > 8 * len(quick)
    counts = Counter(_base(n) for n in full)
    assert counts["TestMatrix::test_workload"] == len(plugin.FULL_SHAPES)
    assert counts["TestPrefill::test_single"] == len(plugin.FULL_VARIANTS)
    # the environment switch does the same as --full
    rc, out = run([sys.executable, "-m", "pytest", "-p", "kvcache.conformance.plugin", "-p",
                   "no:cacheprovider", "--pyargs", "kvcache.conformance", "--collect-only", "-q"],
                  ".", KVCACHE_CONFORMANCE_FULL="1", **ENV)
    assert rc == 0 and f"{len(full)} tests collected" in out, out[-2000:]


def test_the_time_of_each_class_is_printed(tmp_path):
    rc, out = run([sys.executable, "-m", "kvcache.conformance", "--backend", "reference",
                   "-k", "TestFork and test_at_zero or TestLse", "--report", "r.json"],
                  tmp_path, **ENV)
    assert rc == 0, out[-4000:]
    section = out[out.index("kvcache conformance time"):]
    assert re.search(r"quick matrix, \d+ of the full matrix's \d+ tests \(--full runs all\); "
                     r"wall time [\d.]+ s", section), section
    rows = {m.group(1): (int(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^  (\w+)\s+(\d+)\s+([\d.]+)\s+[\d.]+%$", section, re.M)}
    assert set(rows) == {"TestFork", "TestLse", "total"}, section
    assert rows["TestFork"][0] == 1 and rows["TestLse"][0] == 2, rows
    assert rows["total"][0] == 3
    assert rows["total"][1] == pytest.approx(rows["TestFork"][1] + rows["TestLse"][1], abs=0.11)
    seconds = json.loads((tmp_path / "r.json").read_text())["backends"]["reference"]["seconds"]
    assert set(seconds) == {"TestFork", "TestLse"} and all(v >= 0 for v in seconds.values())


# The full matrix holds cases the quick one never draws: its first whole run on a GPU (H200,
# 2026-11-29) failed TestStateSlots' prefix-hit scenario at one-token pages on every backend,
# the reference included (a forward of ps - 2 = -1 tokens: the scenario, not a backend, was
# wrong). CI keeps that case; `make test-all` runs the whole matrix on the reference.
@pytest.mark.parametrize("select", [
    pytest.param(["-k", "test_prefix_hits_restore_checkpoints and ps1"], id="one-token-pages"),
    pytest.param([], id="everything", marks=pytest.mark.slow)])
def test_the_full_matrix_passes_on_the_reference(tmp_path, select):
    rc, out = run([sys.executable, "-m", "kvcache.conformance", "--backend", "reference",
                   "--full", "--jobs", "1", "-q", *select], tmp_path, timeout=1800, **ENV)
    assert rc == 0 and "verdict: CONFORMS" in out, out[-4000:]
    assert "failed" not in pytest_counts(out) and pytest_counts(out)["passed"] >= 3, out[-2000:]
