"""Availability reasons, plugin registration, and import without torch."""

import subprocess
import sys

import pytest
import torch

import kvcache
from kvcache.plugins import resolve_backend
from kvcache_cuda import backend as cb
from kvcache_cuda.backend import CudaBackend


def test_registered_through_the_entry_point():
    rows = {r["name"]: r for r in kvcache.list_backends()}
    assert rows["cuda"]["class"] is CudaBackend
    assert rows["cuda"]["priority"] == 100
    caps = CudaBackend.capabilities
    assert caps.copy_stream and caps.merged_aux and caps.fused_rope_append and caps.inline_rope
    assert caps.tree_attention and caps.sliding_window and caps.static_decode
    assert set(caps.dtypes) == {"float16", "bfloat16", "float32"}
    assert {64, 128, 256} <= set(caps.head_dims)


def test_rocm_torch_is_refused(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    ok, why = CudaBackend.availability()
    assert not ok and "ROCm" in why and "rocm backend" in why


def test_no_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = CudaBackend.availability()
    assert not ok and "no CUDA device" in why
    assert CudaBackend.devices() == []


def test_torch_missing(monkeypatch):
    monkeypatch.setattr(cb, "torch", None)
    ok, why = CudaBackend.availability()
    assert not ok and why.startswith("torch is not installed") and "pip install 'torch>=2.4'" in why
    assert "a CUDA build" in why and "'kvcache[" not in why, why      # kvcache is not on PyPI


def test_visible_gpu_is_available(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake H100")
    ok, why = CudaBackend.availability()
    assert ok and "Fake H100" in why
    ok, why = CudaBackend.availability("cuda:3")
    assert not ok and "does not exist" in why
    assert CudaBackend.devices() == ["cuda:0"]


def test_cpu_test_mode_needs_opt_in(monkeypatch):
    monkeypatch.delenv("KVCACHE_CUDA_CPU", raising=False)
    ok, why = CudaBackend.availability("cpu")
    assert not ok and "KVCACHE_CUDA_CPU=1" in why
    assert resolve_backend("auto", "cpu").name != "cuda"     # auto never lands on test mode
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    ok, why = CudaBackend.availability("cpu")
    assert ok and "test mode" in why


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU auto choice")
def test_auto_does_not_pick_cuda_without_a_gpu():
    assert resolve_backend("auto").name != "cuda"
    with pytest.raises(kvcache.BackendNotAvailableError, match="no CUDA device"):
        kvcache.PagedKVCache(kvcache.CacheConfig(1, 4, 2, 64, rope_mode="normal"), backend="cuda")


def test_import_and_register_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvcache_cuda, kvcache_cuda.plugin as p\n"
            "(cls,) = p.kvcache_register_backends()\n"
            "print(cls.name, cls.availability())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cuda (False, \"torch is not installed (pip install 'torch>=2.4'" in r.stdout, r.stdout
