"""Every distribution of the repository (the core, the three backends, the example plugin) built
as `make dist` builds them, an sdist and a wheel from that sdist: `twine check --strict` passes on
each; their metadata declares what they need; the example plugin ships as the plugin guide says;
the core, one backend and the example, installed (not editable) into a fresh venv, run the
README's snippet.

(One module: a conftest.py here would be the `conftest` other test folders import from.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.tools      # `make build-check` runs it once; `make test` leaves it out
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


@pytest.fixture(scope="module")
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


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_every_distribution_builds_and_passes_twine_check(dists):
    pytest.importorskip("twine", reason="`make` installs build and twine")
    assert set(dists) == {"kvcache", "kvcache_cuda", "kvcache_rocm", "kvcache_metal",
                          "kvcache_example"}
    files = [path for built in dists.values() for path in (built["sdist"], built["wheel"])]
    out = run([sys.executable, "-m", "twine", "check", "--strict", *files])
    assert out.count("PASSED") == len(files) == 10 and "WARNING" not in out, out
    for name, built in dists.items():      # a README for the index page, and the license
        meta = _metadata(built["wheel"])
        assert "Description-Content-Type: text/markdown" in meta, name
        assert "License-Expression: Apache-2.0" in meta, name
        body = meta.split("\n\n", 1)[1]
        assert body.lstrip().startswith("# kvcache"), (name, body[:200])


def test_the_example_plugin_ships_where_the_guide_says(dists):
    """The guide's worked example is the distribution kvcache-example in
    docs/examples/kvcache-example: `make dist` builds it beside the others."""
    guide = (ROOT / "docs" / "plugin-guide.md").read_text()
    assert "docs/examples/kvcache-example" in guide and "`kvcache-example`" in guide
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndist:"):].split("\n\n", 1)[0]
    assert "docs/examples/kvcache-example" in recipe and "twine check --strict" in recipe, recipe
    built = dists["kvcache_example"]
    assert built["wheel"].name.startswith("kvcache_example-")
    with zipfile.ZipFile(built["wheel"]) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {"kvcache_example/plugin.py", "kvcache_example/backend.py"} <= set(names)
    assert re.search(r"^\[kvcache\]\nexample = kvcache_example\.plugin$", entry_points, re.M)
    readme = (ROOT / "docs" / "examples" / "kvcache-example" / "README.md").read_text()
    assert readme.strip() in _metadata(built["wheel"])      # its README is its index page
    with tarfile.open(built["sdist"]) as tar:      # the wheel above was built from this sdist
        assert any(n.endswith("kvcache_example-0.1.0/README.md") for n in tar.getnames())


@pytest.fixture(scope="module")
def wheels(dists):
    """The core's and the cuda backend's wheels."""
    return {name: dists[name]["wheel"] for name in ("kvcache", "kvcache_cuda")}


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


def test_fresh_venv_runs_the_readme_snippet(wheels, dists, tmp_path):
    venv = tmp_path / "venv"
    # numpy, pluggy and torch come from the shared environment (no network here); kvcache and
    # kvcache-cuda from the wheels, not editable
    run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv])
    py = venv / "bin" / "python"
    run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--ignore-installed",
                 wheels["kvcache"], wheels["kvcache_cuda"], dists["kvcache_example"]["wheel"]])
    readme = (ROOT / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    check = ("import kvcache, kvcache_cuda, sys\n"
             "print('FILES', kvcache.__file__, kvcache_cuda.__file__)\n"
             "print('BACKENDS', sorted(r['name'] for r in kvcache.list_backends()))\n")
    out = run([py, "-W", "error::FutureWarning", "-c", snippet + "\n" + check], cwd=tmp_path)
    assert "(5, 8, 64) 5" in out, out
    files = next(line for line in out.splitlines() if line.startswith("FILES")).split()[1:]
    assert all(str(venv) in f for f in files), files      # the installed wheels, not the clone
    assert "'cuda'" in out and "'reference'" in out and "'example'" in out   # the example ships
    info = run([venv / "bin" / "kvcache", "info"], cwd=tmp_path)
    assert re.search(r"^cuda\s", info, re.M) and re.search(r"^reference\s.*available", info, re.M)
    assert re.search(r"^example\s.*available", info, re.M)
