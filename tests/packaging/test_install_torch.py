"""Issue 53, item 1: the Makefile's torch install (tools/install_torch.sh) on a machine whose
only index is the public registry, which has no `+cpu` build of torch.

Simulated with the real pip against indexes and wheel folders made here, holding stand-in torch
wheels (a few lines of Python each, the registry's default one saying it is a CUDA build as the
real one does): `make demo`'s mode takes the CPU build where a local wheel or TORCH_INDEX has it
and otherwise the registry's default torch, and says which; `make test`'s mode refuses, naming
TORCH_INDEX. Each case installs into a fresh venv (seconds: the wheels are tiny, no network)."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "install_torch.sh"
MAKEFILE = (ROOT / "Makefile").read_text()
CPU_PIN = re.search(r"^TORCH\s*\?=\s*(\S+)", MAKEFILE, re.M).group(1)       # torch==2.13.0+cpu
CPU_VERSION = CPU_PIN.split("==", 1)[1]
DEFAULT_VERSION = "2.14.1"          # what plain `torch` gets from the registry: a CUDA build


def _wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """A minimal pure-Python wheel: NAME/__init__.py holding ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-{version}"
    files = {f"{name}/__init__.py": body,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_, text in files.items():
            z.writestr(name_, text)
    return path


def _torch(folder: Path, version: str) -> Path:
    cuda = None if version.endswith("+cpu") else "12.8"
    return _wheel(folder, "torch", version,
                  f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n    hip = None\n")


def _index(root: Path, wheels: list[Path]) -> str:
    """A simple (PEP 503) index in ``root`` serving ``wheels``; returns its URL."""
    for wheel in wheels:
        project = root / wheel.name.split("-")[0]
        project.mkdir(parents=True, exist_ok=True)
        page = project / "index.html"
        links = page.read_text() if page.exists() else ""
        page.write_text(links + f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    root.mkdir(parents=True, exist_ok=True)
    return root.as_uri()


@pytest.fixture
def machine(tmp_path):
    """A fresh venv and an environment in which pip sees only the indexes a case gives it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"

    def run(mode: str, *, registry: list[Path], local: list[Path] = (), torch_index: str = "",
            gpu: bool = False) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        local_dir = tmp_path / "local-wheels"
        local_dir.mkdir(exist_ok=True)
        for wheel in local:
            os.replace(wheel, local_dir / wheel.name)
        env.update(
            PIP_CONFIG_FILE=os.devnull,      # not this machine's pip.conf (its wheels, its cap)
            PIP_INDEX_URL=_index(tmp_path / "registry", registry),
            PIP_FIND_LINKS=str(local_dir),   # as this project's machines keep the +cpu wheel
            PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1",
            # this environment's pip, installing into the new venv
            PIP=f"{sys.executable} -m pip --python {python}",
            TORCH=CPU_PIN, TORCH_INDEX=torch_index,
            NVIDIA_SMI="true" if gpu else "false")
        return subprocess.run(["bash", str(SCRIPT), str(python), mode], env=env,
                              capture_output=True, text=True, timeout=300)

    def installed() -> dict:
        code = ("import importlib.metadata as m\nfor n in ('torch', 'triton'):\n"
                "    try: print(n, m.version(n))\n    except m.PackageNotFoundError: pass\n")
        out = subprocess.run([str(python), "-c", code], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return dict(line.split() for line in out.splitlines())

    run.installed = installed
    run.wheels = tmp_path / "wheels"
    return run


def test_public_registry_only_falls_back_to_the_default_torch_and_says_so(machine):
    """No local `+cpu` wheel, no TORCH_INDEX, a registry without the CPU build: `make demo`'s
    install takes the registry's torch (here a CUDA build, as on Linux) instead of failing."""
    proc = machine("prefer", registry=[_torch(machine.wheels, DEFAULT_VERSION)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert machine.installed() == {"torch": DEFAULT_VERSION}
    assert f"{CPU_PIN} is not to be had here" in out and "TORCH_INDEX=" in out, out
    assert "taking the registry's default torch" in out, out
    assert f"installed torch {DEFAULT_VERSION} (CUDA 12.8 build)" in out, out


def test_without_a_gpu_auto_is_prefer(machine):
    proc = machine("auto", registry=[_torch(machine.wheels, DEFAULT_VERSION)], gpu=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert machine.installed() == {"torch": DEFAULT_VERSION}
    assert "registry's default torch" in proc.stdout and "nvidia-smi" not in proc.stdout


def test_a_local_cpu_wheel_is_taken_first(machine):
    """This project's machines keep the +cpu wheel on disk (pip's find-links): it wins over the
    registry's newer default build."""
    proc = machine("prefer", registry=[_torch(machine.wheels, DEFAULT_VERSION)],
                   local=[_torch(machine.wheels / "cpu", CPU_VERSION)])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert machine.installed() == {"torch": CPU_VERSION}
    assert f"the CPU build {CPU_PIN}, from a local wheel" in out, out
    assert f"installed torch {CPU_VERSION} (CPU build)" in out and "default" not in out, out


def test_torch_index_gives_the_cpu_build(machine, tmp_path):
    index = _index(tmp_path / "cpu-index", [_torch(machine.wheels / "cpu", CPU_VERSION)])
    proc = machine("cpu", registry=[_torch(machine.wheels, DEFAULT_VERSION)], torch_index=index)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert machine.installed() == {"torch": CPU_VERSION}
    assert f"from TORCH_INDEX={index}" in out and "(CPU build)" in out, out


def test_make_tests_mode_refuses_the_default_build_naming_torch_index(machine):
    """`make test` keeps the CPU build: without one it stops at once (no CUDA download)."""
    proc = machine("cpu", registry=[_torch(machine.wheels, DEFAULT_VERSION)])
    assert proc.returncode == 1
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in proc.stderr, proc.stderr
    assert machine.installed() == {}


def test_with_a_gpu_the_demo_takes_the_cuda_build_and_triton(machine):
    registry = [_torch(machine.wheels, DEFAULT_VERSION),
                _wheel(machine.wheels, "triton", "3.6.0", "")]
    proc = machine("auto", registry=registry, local=[_torch(machine.wheels / "cpu", CPU_VERSION)],
                   gpu=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert machine.installed() == {"torch": DEFAULT_VERSION, "triton": "3.6.0"}
    assert "nvidia-smi" in out and "(CUDA 12.8 build)" in out, out


def _recipe(target: str) -> str:
    """The recipe of a target (continuation lines joined)."""
    joined = MAKEFILE.replace("\\\n", " ")
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", joined, re.M)
    assert m, f"no recipe for {target}"
    return m.group(1)


def test_the_makefile_installs_torch_through_the_script():
    """`make test` in the CPU-only mode (its CPU-build check after), `make demo` in auto, in its
    own light venv; the demo's venv has no developer tools."""
    test = _recipe("$(STAMP)")
    assert re.search(r"tools/install_torch\.sh \$\(PY\) cpu$", test, re.M), test
    assert "v.cuda is None and v.hip is None" in test
    demo = _recipe("$(DEMO_STAMP)")
    assert re.search(r"tools/install_torch\.sh \$\(DEMO_PY\) \$\(if \$\(GPU\),gpu,prefer\)$", demo,
                     re.M), demo
    assert re.search(r"^GPU := \$\(shell nvidia-smi -L >/dev/null 2>&1 && echo yes\)$", MAKEFILE, re.M)
    for tool in ("mypy", "mkdocs", "twine", "hypothesis", "mlx", "pytest", "build"):
        assert not re.search(rf"\b{tool}\b", demo.replace("--no-build-isolation", "")), tool
    assert "$(if $(GPU),-e backends/cuda)" in demo                  # the cuda plugin with a GPU
    assert re.search(r"^demo: \$\(DEMO_STAMP\)$", MAKEFILE, re.M)
    for line in (test + demo).splitlines():           # both pass the pin and the index on
        if "install_torch.sh" in line:
            assert 'TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)"' in line, line


@pytest.mark.parametrize("gpu", [False, True])
def test_make_demo_picks_its_torch_by_nvidia_smi(gpu, tmp_path):
    """What `make demo` would run (make -n), with an nvidia-smi on PATH that answers or fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nexit {0 if gpu else 1}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["make", "-n", "-B", "demo", f"DEMO_VENV={tmp_path / 'venv-demo'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    mode = "gpu" if gpu else "prefer"
    assert re.search(rf"tools/install_torch\.sh \S+/venv-demo/bin/python {mode}$", out, re.M), out
    plugin = re.search(r"-m pip install -q --no-build-isolation --no-deps -e \.(.*)$", out, re.M)
    assert plugin and (plugin.group(1).strip() == ("-e backends/cuda" if gpu else "")), out
    assert "kvcache demo --model llama" in out
