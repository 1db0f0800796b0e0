"""``kvcache conformance --jobs N``: the suite split over N forked pytest workers gives the single
run's summary, verdict, exit status and reports: every selected test runs exactly once, a
backend registered in the calling process (not through an entry point) is there in the workers,
failures come back, and a worker that dies makes the run fail, never read CONFORMS."""

from __future__ import annotations

import json

import pytest

from _conformance_runs import nonzero, summary_tables, verdicts
from test_verdict import SELECTION, conformance

from kvcache.conformance.report import merged_exitstatus

pytestmark = pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork here")


def _report(tmp_path, name, *args):
    rc, out = conformance(tmp_path, *args, "-k", SELECTION, "--report", tmp_path / name)
    return rc, out, json.loads((tmp_path / name).read_text())


# two runs each (one worker, three): CI keeps the failing backend (the workers' failures, exit
# status and verdict merged); a conforming run's summary is test_verdict's, and `make test-all`
# runs the reference here too
@pytest.mark.parametrize("backend, rc", [pytest.param("reference", 0, marks=pytest.mark.slow),
                                         ("toy-wrong-attention", 1)])
def test_workers_give_the_single_runs_summary(tmp_path, backend, rc):
    rc1, out1, one = _report(tmp_path, "one.json", "--backend", backend, "--jobs", "1")
    rc3, out3, three = _report(tmp_path, "three.json", "--backend", backend, "--jobs", "3")
    assert rc1 == rc3 == rc, out3[-4000:]
    assert "3 workers at once" in out3 and out3.count("done after") == 3, out3[-4000:]
    b1, b3 = one["backends"][backend], three["backends"][backend]
    assert nonzero(b3["total"]) == nonzero(b1["total"]) and sum(b3["total"].values()) == 6
    assert b3["areas"] == b1["areas"] and b3["verdict"] == b1["verdict"]
    assert sorted(b3["failures"]) == sorted(b1["failures"])
    assert verdicts(out3) == [b1["verdict"]]
    assert nonzero(summary_tables(out3)[backend]["total"]) == nonzero(b1["total"])
    assert "(3 workers at once)" in out3          # the time table says so
    if rc:
        assert "worker" in out3 and "FAILED " in out3     # pytest's own lines, per worker


def test_a_worker_that_dies_fails_the_run(tmp_path):
    rc, out, data = _report(tmp_path, "r.json", "--backend", "toy-dies", "--jobs", "2")
    assert rc == 3, out[-4000:]
    assert "wrote no results" in out and "CONFORMS" not in out.replace("DOES NOT CONFORM", "")
    assert data["exitstatus"] == 3


def test_bad_jobs_and_merged_exit_status(tmp_path):
    rc, out = conformance(tmp_path, "--backend", "reference", "--jobs", "0")
    assert rc == 2 and "not a positive integer or 'auto'" in out, out[-2000:]
    assert merged_exitstatus([0, 5, 0]) == 0 and merged_exitstatus([5, 5]) == 5
    assert merged_exitstatus([0, 1, 5]) == 1 and merged_exitstatus([1, 4, 0]) == 4
