"""Issue 30, findings 3 and 6, on a whole ``kvcache conformance`` run as a plugin author starts it:

* the plugin guide says why the suite skips a test (section 4: three kinds, each with the reason
  it prints); every skip of a run is one of the kinds the guide names, counted where the guide
  says (the guide said a capability skip was the only skip, while two tests skipped for another
  reason);
* the run prints no warning of ours (a RuntimeWarning from the dense model) and no
  ``configfile: ../../dev/null`` in pytest's header.

The run is the reference backend's whole quick matrix (every test of the suite), so a new test
that skips for an undocumented reason, or warns, fails here.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("pytest")

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugin-guide.md"


def guide_skip_kinds() -> list[re.Pattern]:
    """The reasons the guide's list of skips names, as patterns: ``X`` a capability's name,
    ``...`` any text."""
    text = GUIDE.read_text()
    start = text.index("The suite skips a test for one of three reasons")
    section = text[start:text.index("\n## ", start)]
    templates = re.findall(r"`(capability 'X'[^`]*)`", section)
    assert len(templates) == 2, templates      # not declared; declared (not applicable)
    patterns = []
    for template in templates:
        pattern = re.escape(template).replace("'X'", "'[a-z_]+'").replace(r"\.\.\.", ".*")
        patterns.append(re.compile(pattern + "$"))
    assert "**anything else**" in section and "DOES NOT CONFORM" in section
    return patterns


# The run (a child of 20-30 s) starts when collection ends and runs on CI's second core beside
# the session (tests/cuda/background_runs.py; at once, in the first test's wait, where that
# queue does not run), in an empty folder of its own; both tests read it.
sys.path.append(str(ROOT / "tests" / "cuda"))          # tests/ has no packages
import background_runs  # noqa: E402

RUN = "test_every_skip_is_of_a_kind_the_guide_names"
_WHERE = Path(background_runs.folder("adopter-conformance-"))
_ENV = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCACHE_CONFORMANCE_"))}
_ENV.update(KVCACHE_PLUGINS="reference", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
background_runs.register(
    RUN, [sys.executable, "-m", "kvcache.conformance", "--backend", "reference",
          "--report", "r.json", "--", "-rs"], _ENV, cwd=_WHERE, timeout=900,
    readers=("test_the_run_prints_no_warning_and_no_dev_null_configfile",))


@pytest.fixture(scope="module")
def reference_run():
    proc = background_runs.result(RUN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out, json.loads((_WHERE / "r.json").read_text())


def test_every_skip_is_of_a_kind_the_guide_names(reference_run):
    out, report = reference_run
    kinds = guide_skip_kinds()
    skips = re.findall(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", out, re.M)
    assert skips, out[-4000:]
    counted = [0] * len(kinds)
    for n, reason in skips:
        matched = [i for i, kind in enumerate(kinds) if kind.match(reason)]
        assert matched, f"a skip of a kind the plugin guide does not name: {reason!r}"
        counted[matched[0]] += int(n)
    # where the guide says each kind is counted: "skipped by capability", "not applicable"
    b = report["backends"]["reference"]
    assert counted[0] == sum(b["capabilities"].values()), (counted, b["capabilities"])
    assert counted[1] == len(b["not_applicable"]), (counted, b["not_applicable"])
    assert b["other_skips"] == [] and b["verdict"].startswith("CONFORMS"), b
    # the reference declares what both module-level refusal tests check: not applicable there
    assert {name for name, _ in b["not_applicable"]} == {
        "test_window_left_unsupported_raises", "test_rope_frequencies_unsupported_raises"}
    assert sum(b["total"].values()) == sum(v for k, v in report["pytest"].items())


def test_the_run_prints_no_warning_and_no_dev_null_configfile(reference_run):
    out, _ = reference_run
    final = [ln for ln in out.splitlines() if re.search(r"\d+ passed.* in [\d.]+s", ln)]
    assert final, out[-3000:]
    assert "warning" not in final[-1], final[-1]
    assert "warnings summary" not in out and "Warning:" not in out, \
        out[out.find("warnings summary"):][:3000]
    header = out[:out.index("collected")]
    assert "rootdir:" in header and "configfile" not in header and "/dev/null" not in header, header
