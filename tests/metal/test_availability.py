"""Discovery: availability reasons, priority only above the reference backend on an Apple GPU,
import without MLX."""

import subprocess
import sys

import kvcache
from kvcache.plugins import resolve_backend
from kvcache_metal import backend as mb
from kvcache_metal.backend import MetalBackend


def test_registered_through_entry_point():
    rows = {r["name"]: r for r in kvcache.list_backends("cpu")}
    assert rows["metal"]["class"] is MetalBackend
    assert rows["metal"]["available"]


def test_auto_on_machine_without_metal(monkeypatch):
    monkeypatch.setattr(mb, "_metal_available", lambda: False)
    ok, reason = MetalBackend.availability()
    assert not ok and reason == "no Metal device; MLX CPU device available with device='cpu'"
    assert MetalBackend.priority < 0
    assert resolve_backend("auto").name == "reference"
    assert resolve_backend("auto", "cpu").name == "reference"     # MLX CPU never beats numpy
    assert resolve_backend("metal", "cpu") is MetalBackend
    ok, reason = MetalBackend.availability("gpu")
    assert not ok and "Apple GPU" in reason
    assert MetalBackend.devices() == ["cpu"]


def test_mlx_cuda_build_offers_its_gpu_but_never_wins_auto(monkeypatch):
    """MLX's CUDA build (mlx-cuda-*, an NVIDIA GPU): device "gpu" runs there with the MLX-ops
    kernels (issue 51: MLX's lazy GPU execution proven on a lent GPU); "auto" still prefers
    the reference backend (and the cuda backend where it is installed)."""
    monkeypatch.setattr(mb, "_metal_available", lambda: False)
    monkeypatch.setattr(mb, "_mlx_cuda_available", lambda: True)
    ok, reason = MetalBackend.availability("gpu")
    assert ok and "CUDA build" in reason and "MLX-ops kernels" in reason
    assert MetalBackend.devices() == ["gpu", "cpu"]
    assert MetalBackend.priority < 0
    assert resolve_backend("auto", "cpu").name == "reference"
    ok, _ = MetalBackend.availability("metal")      # Metal by name still needs Apple's GPU
    assert not ok


def test_auto_on_apple_gpu(monkeypatch):
    monkeypatch.setattr(mb, "_metal_available", lambda: True)
    ok, reason = MetalBackend.availability()
    assert ok and "Metal" in reason
    assert MetalBackend.priority > 0
    assert resolve_backend("auto").name == "metal"
    assert MetalBackend.devices() == ["gpu", "cpu"]


def test_reasons(monkeypatch):
    ok, reason = MetalBackend.availability("cuda")
    assert not ok and "'cuda'" in reason
    monkeypatch.setattr(mb, "_MLX_ERROR", "ModuleNotFoundError: No module named 'mlx'")
    for dev in (None, "cpu", "gpu"):
        ok, reason = MetalBackend.availability(dev)
        assert not ok and reason.startswith("MLX not installed")
    assert MetalBackend.devices() == []
    assert MetalBackend.platform()["vendor"] == "apple"


def test_platform():
    p = MetalBackend.platform()
    assert p["vendor"] == "apple" and p["runtime"] == "metal/mlx" and p["metal"] is False


def test_import_without_mlx():
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"
        "from kvcache_metal import plugin\n"
        "[cls] = plugin.kvcache_register_backends()\n"
        "ok, reason = cls.availability('cpu')\n"
        "assert not ok and reason.startswith('MLX not installed'), reason\n"
        "print('OK', cls.priority)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("OK -10")
