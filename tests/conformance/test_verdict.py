"""The conformance summary, ``--report`` (Markdown and JSON), the verdict and the exit status come
from one source, pytest's own outcomes: every test counted (module-level tests too), and a failed
run never reads CONFORMS. Expected-failure patterns that match no test fail the run.

Each run is ``kvcache conformance`` (its ``main``) in a subprocess, against toy backends that this
file registers in that process (the reference kernels under other capabilities, or with a planted
fault), on a small ``-k`` selection that holds class tests and both module-level tests.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from _conformance_runs import clean_env, nonzero, pytest_counts, run, summary_tables, verdicts

TOYS = textwrap.dedent('''
    import sys

    import kvcache
    from kvcache.conformance.cli import main
    from kvcache.plugins import register_plugin
    from kvcache.reference import ReferenceBackend


    class GuideCapabilities(ReferenceBackend):
        """The plugin guide's capabilities: float16 and bfloat16 only."""
        name = "toy-guide-caps"
        capabilities = kvcache.Capabilities(dtypes=("float16", "bfloat16"), tree_attention=True,
                                            head_dims=(64, 128))


    class ModuleLevelFault(ReferenceBackend):
        """Declares no rope_frequencies, and cannot build a cache with partial rotary even with
        RoPE off: only the module-level test_rope_frequencies_unsupported_raises sees it."""
        name = "toy-module-fault"
        capabilities = kvcache.Capabilities(dtypes=("float32", "float16"), head_dims=(64, 128))

        def __init__(self, config, device=None):
            if config.rope_rotary_dim:
                raise RuntimeError("planted: no partial rotary")
            super().__init__(config, device)


    class WrongAttention(ReferenceBackend):
        """Paged attention 1.5 times too large: class tests fail."""
        name = "toy-wrong-attention"

        def paged_attention(self, *args, **kwargs):
            o, lse = super().paged_attention(*args, **kwargs)
            return o * 1.5, lse


    class Dies(ReferenceBackend):
        """Its process is killed in paged attention (a crashing kernel): no results come back."""
        name = "toy-dies"

        def paged_attention(self, *args, **kwargs):
            import os
            import signal
            os.kill(os.getpid(), signal.SIGKILL)


    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [GuideCapabilities, ModuleLevelFault, WrongAttention, Dies]


    register_plugin(Plugin(), name="toys")
    sys.exit(main(sys.argv[1:]))
''')

# class tests that decode (paged attention), both module-level tests, and a test whose dense model
# meets NaN keys (it printed a RuntimeWarning)
SELECTION = ("TestDecode and test_steps_cross_pages or unsupported_raises "
             "or TestMaskedNonFinite and later_tokens")


def conformance(tmp_path, *args):
    (tmp_path / "toys.py").write_text(TOYS)
    # the suite's plugin is named on the command line; the environment's plugins are not needed
    return run([sys.executable, "toys.py", *args], tmp_path, KVCACHE_PLUGINS="reference",
               PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


def markdown_total(text: str) -> dict:
    head = next(line for line in text.splitlines() if line.startswith("| area |"))
    total = next(line for line in text.splitlines() if line.startswith("| **total** |"))
    names = [c.strip() for c in head.strip("|").split("|")][1:]
    values = [int(c.strip()) for c in total.strip("|").split("|")[1:]]
    return nonzero({("xfailed" if n == "expected failures" else n): v for n, v in zip(names, values)})


VERDICT_CASES = [
    # old code: pytest 2 failed (float32 configs), the summary "failed 0, CONFORMS"
    ("toy-guide-caps", 0, "CONFORMS (partially"),
    # old code: the module-level failure left out, "CONFORMS" with exit status 1
    ("toy-module-fault", 1, "DOES NOT CONFORM (1 failed"),
    # old code: DOES NOT CONFORM, with counts that leave out the module-level tests
    ("toy-wrong-attention", 1, "DOES NOT CONFORM ("),
]

# These runs (4-5 s each) start when collection ends and run on CI's second core beside the
# session (tests/cuda/background_runs.py; at once, in the test's wait, where that queue does not
# run), each in an empty folder of its own with toys.py, as conformance() runs them.
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

_VERDICT_FOLDERS = {}
for _backend, _rc, _verdict in VERDICT_CASES:
    _folder = _VERDICT_FOLDERS[_backend] = Path(background_runs.folder(f"verdict-{_backend}-"))
    (_folder / "toys.py").write_text(TOYS)
    background_runs.register(
        f"test_summary_reports_and_exit_status_agree_with_pytest[{_backend}-{_rc}-{_verdict}]",
        [sys.executable, "toys.py", "--backend", _backend, "-k", SELECTION,
         "--report", _folder / "r.json", "--report", _folder / "r.md"],
        clean_env(KVCACHE_PLUGINS="reference", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1"),
        cwd=_folder, timeout=600)


@pytest.mark.parametrize("backend, rc, verdict", VERDICT_CASES)
def test_summary_reports_and_exit_status_agree_with_pytest(request, backend, rc, verdict):
    tmp_path = _VERDICT_FOLDERS[backend]
    proc = background_runs.result(request.node.name)
    got_rc, out = proc.returncode, proc.stdout + proc.stderr
    assert got_rc == rc, out[-4000:]
    counts = pytest_counts(out)
    assert bool(counts.get("failed")) == bool(rc), out[-4000:]
    assert sum(counts.values()) == 2 + 2 + 2     # two variants of each class test, two functions
    tables = summary_tables(out)
    assert list(tables) == [backend], out[-4000:]
    assert nonzero(tables[backend]["total"]) == counts, out[-4000:]
    found = verdicts(out)
    assert len(found) == 1 and found[0].startswith(verdict), out[-4000:]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["exitstatus"] == rc and nonzero(data["pytest"]) == counts
    b = data["backends"][backend]
    assert nonzero(b["total"]) == counts and b["verdict"] == found[0]
    md = (tmp_path / "r.md").read_text()
    assert markdown_total(md) == counts and f"**Verdict: {found[0]}**" in md
    assert f"(exit status {rc})" in md
    # our code prints no warnings (the dense model's NaN arithmetic is deliberate), and the
    # header names no configfile ../../dev/null (the CLI's -c os.devnull)
    assert "test session starts" in out and "rootdir:" in out, out[:2000]
    assert "configfile" not in out and "/dev/null" not in out, out[:2000]
    assert "Warning" not in out and "warnings summary" not in out, out[-4000:]


def test_a_failed_run_never_reads_conforms():
    """The verdict takes pytest's exit status: with every test of the backend passed, a run that
    failed elsewhere (or was interrupted, or had no test) is not CONFORMS."""
    from kvcache.conformance.report import Outcome, format_summary, summarize
    outcomes = [Outcome("b", None, "TestPrefill", "TestPrefill::test_single", "passed"),
                Outcome(None, None, "(not the suite)", "test_mine.py::test_x", "failed", "boom")]
    for status, outs in ((1, outcomes), (2, outcomes[:1]), (5, outcomes[:1])):
        s = summarize(outs, status)
        assert s["backends"]["b"]["verdict"].startswith("DOES NOT CONFORM"), s
        assert f"pytest exit status {status}" in s["backends"]["b"]["verdict"]
    assert summarize(outcomes[:1], 0)["backends"]["b"]["verdict"] == "CONFORMS"
    # an error in a fixture is counted as pytest counts it, in a column of its own
    error = Outcome("b", None, "TestPrefill", "TestPrefill::test_single", "error", "error in teardown: x")
    s = summarize(outcomes[:1] + [error], 1)
    assert s["backends"]["b"]["total"]["error"] == 1 and s["pytest"] == {"passed": 1, "error": 1}
    lines = format_summary(s, full=False)
    assert lines[1].split() == ["area", "passed", "failed", "xfail", "skipped", "error"], lines
    assert lines[-1] == "pytest: 1 passed, 1 error (exit status 1)", lines


XFAIL_RUNS = "TestPrefill and test_batch"


def test_stale_expected_failure_pattern_fails_the_run(tmp_path):
    """A pattern that matches no test stops the run with a usage error naming it; a pattern that
    names a row of the full matrix only is not stale in a quick run."""
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("TestPrefill::test_renamed_long_ago   # stale\n"
                     "TestMatrix::test_workload[bfloat16-gqa8-d256-ps1]   # full matrix only\n"
                     "TestFork::*   # not collected by -k, still a test of the suite\n")
    rc, out = conformance(tmp_path, "--backend", "toy-wrong-attention", "--xfail", xfail,
                          "-k", XFAIL_RUNS, "--report", tmp_path / "r.json")
    assert rc == 4, out[-4000:]
    assert "'TestPrefill::test_renamed_long_ago'" in out and "match no test" in out
    assert "test_workload[bfloat16-gqa8-d256-ps1]'  #" not in out
    assert "verdict: CONFORMS" not in out and "DOES NOT CONFORM" in out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["exitstatus"] == 4 and "TestPrefill::test_renamed_long_ago" in data["problems"][0]


def test_brackets_in_patterns_are_literal(tmp_path):
    """``Class::test[float16-*]`` names the float16 rows (fnmatch read ``[...]`` as a character
    set, so such a pattern matched nothing and the list passed silently). Strict: the listed
    row passes on the reference, so the run fails with an unexpected pass."""
    xfail = tmp_path / "xfail.txt"
    xfail.write_text("TestPrefill::test_batch[float16-*]   # half precision\n")
    rc, out = conformance(tmp_path, "--backend", "reference", "--xfail", xfail, "-k", XFAIL_RUNS)
    assert rc == 1, out[-4000:]
    assert pytest_counts(out) == {"passed": 1, "failed": 1}
    assert "TestPrefill::test_batch[float16-ps16]: unexpected pass" in out
