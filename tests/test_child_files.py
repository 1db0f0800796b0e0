"""The readers of the whole-file children (tests/cuda/background_runs.py, ``CHILD_FILES``):
when a whole session selects such a file (``make test``), its tests run in a child pytest on
CI's second core beside the session; its reader passes when every one of them passed there, and
shows the child's failures when not. Run alone, or with -k, the file's tests run in the
session's own process and the reader has nothing to read."""

import re
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402


@pytest.mark.parametrize("rel", background_runs.CHILD_FILES, ids=str)
def test_child_file_passes(rel):
    name = background_runs.child_file_reader(rel)
    if name not in background_runs.RUNS:
        pytest.skip(f"{rel} ran in this session's own process")
    proc = background_runs.result(name)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # the child ran every test the session deselected: none lost, none added
    last = out.strip().splitlines()[-1]
    ran = sum(int(n) for n, _ in re.findall(r"(\d+) (passed|skipped|xfailed)", last))
    assert ran == background_runs.CHILD_FILE_COUNTS[name], out[-3000:]
