"""mypy is clean on kvcache/ and the backend packages (configured in pyproject's [tool.mypy]; `make test` installs mypy)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("target", ["kvcache", "backends/cuda/kvcache_cuda",
                                    "backends/rocm/kvcache_rocm", "backends/metal/kvcache_metal"])
def test_mypy_is_clean(target):
    pytest.importorskip("mypy", reason="mypy is a development tool: make installs it")
    proc = subprocess.run([sys.executable, "-m", "mypy", target], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout
