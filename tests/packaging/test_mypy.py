"""mypy is clean on kvcache/ and the backend packages (configured in pyproject's [tool.mypy],
which checks the bodies of unannotated functions too; `make` installs mypy). One mypy run over
the four packages (they share most of what mypy reads); marked ``tools``: `make check` and
`make build-check` run it, `make test` leaves it out."""

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.tools
TARGETS = ["kvcache", "backends/cuda/kvcache_cuda", "backends/rocm/kvcache_rocm",
           "backends/metal/kvcache_metal"]


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    pytest.importorskip("mypy", reason="mypy is a development tool: make installs it")
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)


def test_mypy_is_clean():
    proc = _mypy(*TARGETS)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
    # the one run read the backends too, not the core alone
    checked = int(re.search(r"in (\d+) source files", proc.stdout).group(1))
    assert checked > len(list((ROOT / "kvcache").rglob("*.py"))), proc.stdout[-500:]


def test_the_config_checks_unannotated_functions(tmp_path):
    """The project's config (not mypy's default) fails on an error inside a function without
    annotations, where most of the suite's helpers are: with ``check_untyped_defs`` off, mypy
    would skip its body and pass."""
    (tmp_path / "probe.py").write_text(textwrap.dedent('''
        class Holder:
            def __init__(self):
                self.items = None

            def first(self):
                return self.items[0]
    '''))
    proc = _mypy("--config-file", str(ROOT / "pyproject.toml"), "--no-incremental",
                 str(tmp_path / "probe.py"), cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "probe.py:7: error:" in proc.stdout and "[index]" in proc.stdout, proc.stdout
