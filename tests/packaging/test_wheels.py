"""The core, one backend and the example plugin, built as wheels and installed (not editable) into
a fresh venv, run the README's snippet; their metadata declares what they need."""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheels(dists):
    """The core's and the cuda backend's wheels (built from their sdists, see conftest)."""
    return {name: dists[name]["wheel"] for name in ("kvcache", "kvcache_cuda")}


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def test_wheels_declare_what_they_need(wheels):
    assert set(wheels) == {"kvcache", "kvcache_cuda"}
    core, cuda = _metadata(wheels["kvcache"]), _metadata(wheels["kvcache_cuda"])
    assert "License-Expression: Apache-2.0" in core and "License-Expression: Apache-2.0" in cuda
    for extra in ("cuda", "metal", "rocm", "transformers", "mlx-lm", "test"):
        assert f"Provides-Extra: {extra}" in core, extra
    assert re.search(r"Requires-Dist: kvcache-cuda>=0\.1\.0; extra == \"cuda\"", core)
    assert "Requires-Dist: kvcache>=0.1.0" in cuda and "Requires-Dist: torch>=2.4" in cuda
    with zipfile.ZipFile(wheels["kvcache"]) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvcache/py.typed" in names and any(n.endswith("licenses/LICENSE") for n in names)
    assert not [n for n in names if "/" not in n], "a top-level module"   # e.g. a pytest plugin
    assert "[pytest11]" not in entry_points and "[kvcache]" in entry_points
    with zipfile.ZipFile(wheels["kvcache_cuda"]) as z:
        assert "kvcache_cuda/py.typed" in z.namelist()


def test_fresh_venv_runs_the_readme_snippet(wheels, dists, run_checked, tmp_path):
    venv = tmp_path / "venv"
    # numpy, pluggy and torch come from the shared environment (no network here); kvcache and
    # kvcache-cuda from the wheels, not editable
    run_checked([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv])
    py = venv / "bin" / "python"
    run_checked([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed",
                 wheels["kvcache"], wheels["kvcache_cuda"], dists["kvcache_example"]["wheel"]])
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    check = ("import kvcache, kvcache_cuda, sys\n"
             "print('FILES', kvcache.__file__, kvcache_cuda.__file__)\n"
             "print('BACKENDS', sorted(r['name'] for r in kvcache.list_backends()))\n")
    out = run_checked([py, "-W", "error::FutureWarning", "-c", snippet + "\n" + check], cwd=tmp_path)
    assert "(5, 8, 64) 5" in out, out
    files = next(line for line in out.splitlines() if line.startswith("FILES")).split()[1:]
    assert all(str(venv) in f for f in files), files      # the installed wheels, not the clone
    assert "'cuda'" in out and "'reference'" in out and "'example'" in out   # the example ships
    info = run_checked([venv / "bin" / "kvcache", "info"], cwd=tmp_path)
    assert re.search(r"^cuda\s", info, re.M) and re.search(r"^reference\s.*available", info, re.M)
    assert re.search(r"^example\s.*available", info, re.M)
