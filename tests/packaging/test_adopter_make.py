"""Issue 30, findings 4 and 6 on the Makefile, as a new user runs `make` on a fresh clone:

* the torch it installs is the CPU build the README promises, said in the pin (`+cpu`), and the
  setup refuses a GPU build it finds (a bare `torch==2.13.0` fetched the CUDA build on Linux);
* `make` is quiet on success: every pip line is quiet, and installing the project's own
  packages editable prints nothing, not even the build backend's warning blocks (setuptools
  printed an "InformationOnly: Editable installation" banner for each of the five projects
  before their pyproject named the flat layout).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = (ROOT / "Makefile").read_text()
# the five projects the Makefile installs editable (-e): the core, the backends, the example
PROJECTS = [".", "backends/cuda", "backends/rocm", "backends/metal",
            "docs/examples/kvcache-example"]


def _variable(name: str) -> str:
    m = re.search(rf"^{name}\s*\??=\s*(.*)$", MAKEFILE, re.M)
    assert m, f"the Makefile sets no {name}"
    return m.group(1).strip()


def _recipe_lines() -> list[str]:
    """The recipes' command lines, continuation lines joined."""
    joined = MAKEFILE.replace("\\\n", " ")
    return [line.strip() for line in joined.splitlines() if line.startswith("\t")]


def test_the_makefile_installs_the_cpu_torch_the_readme_promises():
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"make test .*CPU torch", readme), "the README says make installs CPU torch"
    torch = _variable("TORCH")
    assert re.fullmatch(r"torch==\d+\.\d+\.\d+\+cpu", torch), torch     # the build, by its label
    installs = [line for line in _recipe_lines() if "pip install" in line and "$(TORCH)" in line]
    assert len(installs) == 1, installs
    assert "$(TORCH_INDEX)" in installs[0]                     # another index, where asked
    # after the install, a GPU build (cuda or hip set) fails the setup
    checks = [line for line in _recipe_lines() if "torch.version" in line]
    assert checks and "v.cuda is None and v.hip is None" in checks[0], checks


def test_every_pip_line_of_the_makefile_is_quiet():
    pips = [line for line in _recipe_lines() if re.search(r"-m pip install\b", line)]
    assert len(pips) >= 4, pips
    for line in pips:
        assert re.search(r"\s-q{1,2}\s", line), f"not quiet: {line}"
        if "$(TORCH)" in line or "--upgrade pip" in line:       # third-party: -qq (extra-index
            assert " -qq " in line, line                          # warnings otherwise)
    projects = [line for line in pips if " -e " in line]
    named = {p for line in projects for p in re.findall(r"-e ([^\s)]+)", line)}   # ) of $(if ...)
    assert named == set(PROJECTS), named


def _clean_copy(project: str, dest: Path) -> Path:
    """The project's files as a fresh clone has them (no egg-info, build/ or caches); the core
    without the folders that are projects of their own or not part of it."""
    src = ROOT / project
    if project == ".":
        dest.mkdir(parents=True)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(src / name, dest / name)
        src, dest = src / "kvcache", dest / "kvcache"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__"))
    return dest.parent if project == "." else dest


@pytest.mark.parametrize("project", PROJECTS)
def test_the_editable_build_prints_no_warning(project, tmp_path):
    """What `pip install -e` asks the build backend for (PEP 660 build_editable), with every
    warning shown: setuptools prints nothing that reads as a warning."""
    pytest.importorskip("setuptools")
    copy = _clean_copy(project, tmp_path / "src")
    code = ("import sys; from setuptools import build_meta as b; "
            "print('WHEEL', b.build_editable(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-W", "default", "-c", code, str(tmp_path / "out")],
                          cwd=copy, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "WHEEL " in proc.stdout, out[-3000:]
    for sign in ("Warning", "InformationOnly", "!!\n", "*****", "deprecated"):
        assert sign not in out, f"{project}: {sign!r} in the build's output:\n{out[-3000:]}"
    # a plain .pth editable install (the folder on sys.path), not an import-hook finder
    assert ".pth file" in out or "__editable__" in out, out[-3000:]
    assert "meta path finder" not in out, out[-3000:]


def test_the_makefiles_project_install_is_silent(tmp_path):
    """The Makefile's own lines that install the five projects, run as written (pip -q,
    --no-build-isolation --no-deps) into a fresh environment from a clean copy: no output."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "clone"
    for project in PROJECTS:
        _clean_copy(project, src if project == "." else src / project)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    # the build backend (--no-build-isolation) from this environment, on the new one's path
    backend = tmp_path / "backend"
    backend.mkdir()
    import setuptools
    import wheel
    site = Path(setuptools.__file__).parents[1]
    for name in os.listdir(site):
        if name.split("-")[0] in ("setuptools", "wheel", "_distutils_hack", "pkg_resources"):
            os.symlink(site / name, backend / name)
    assert Path(wheel.__file__).parents[1] == site
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PYTHONPATH=str(backend), PIP_DISABLE_PIP_VERSION_CHECK="1")
    # .venv's lines (make demo's .venv-demo installs a subset of them: the core, the cuda plugin)
    lines = [line for line in _recipe_lines() if re.search(r"^\$\(PY\) -m pip install .* -e ", line)]
    assert lines
    for line in lines:
        args = line.split("-m pip install", 1)[1].split()
        proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                               *args], cwd=src, capture_output=True, text=True, env=env,
                              timeout=600)
        assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-3000:])
        assert proc.stdout + proc.stderr == "", (line, proc.stdout + proc.stderr)
    # installed: each found in the copy (not imported: the dependencies are not installed)
    code = ("from importlib.util import find_spec; print(*(find_spec(n).origin for n in "
            "('kvcache', 'kvcache_cuda', 'kvcache_rocm', 'kvcache_metal', 'kvcache_example')))")
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    origins = proc.stdout.split()
    assert len(origins) == 5 and all(o.startswith(str(src)) for o in origins), origins
