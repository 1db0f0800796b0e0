"""Every distribution of the repository (the core, the three backends, the example plugin), built
once per session the way `make dist` builds them: an sdist, then a wheel from that sdist."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECTS = {"kvcache": ROOT, "kvcache_cuda": ROOT / "backends" / "cuda",
            "kvcache_rocm": ROOT / "backends" / "rocm", "kvcache_metal": ROOT / "backends" / "metal",
            "kvcache_example": ROOT / "docs" / "examples" / "kvcache-example"}


def run(cmd, **kw) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env,
                          timeout=300, **kw)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc.stdout


def _copy(project: Path, dest: Path) -> Path:
    """The project's files without what builds and checkouts leave (a stale egg-info, build/),
    so that the sdist holds what a clean clone gives, and the source tree stays as it is."""
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")
    nested = {"backends"} if project == ROOT else set()     # distributions of their own
    shutil.copytree(project, dest, ignore=lambda d, names: set(skip(d, names)) |
                    (nested & set(names) if Path(d) == project else set()))
    return dest


@pytest.fixture(scope="session")
def run_checked():
    """``run(cmd, **subprocess_kw) -> stdout``, asserting exit status 0."""
    return run


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{import name: {"sdist": path, "wheel": path}} for every distribution."""
    pytest.importorskip("build", reason="`make` installs build and twine")
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("dist")
    src = tmp_path_factory.mktemp("src")
    for name, project in PROJECTS.items():
        copy = _copy(project, src / name)
        run([sys.executable, "-m", "build", "--no-isolation", "--outdir", out, copy], cwd=src)
    found: dict[str, dict[str, Path]] = {}
    for path in out.iterdir():
        kind = "wheel" if path.suffix == ".whl" else "sdist"
        found.setdefault(path.name.split("-")[0], {})[kind] = path
    return found
