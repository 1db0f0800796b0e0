"""ROCm plugin: registration, availability reasons under real and simulated builds, tuning data,
and its Python paths through the shared torch kernels on CPU tensors."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcache  # noqa: E402
from kvcache import plugins  # noqa: E402
from kvcache.conformance import assert_close  # noqa: E402
from kvcache_cuda.backend import CudaBackend  # noqa: E402
from kvcache_rocm.backend import RocmBackend  # noqa: E402
from kvcache_rocm.tuning import ROCM_TUNING  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    plugins.reset_plugins()
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    yield
    plugins.reset_plugins()


def test_registered_through_entry_point():
    row = next(r for r in kvcache.list_backends() if r["name"] == "rocm")
    assert row["class"] is RocmBackend


def test_unavailable_on_this_build_with_reason():
    ok, reason = RocmBackend.availability()
    assert not ok
    if torch.version.cuda is None:
        assert "CPU-only build" in reason
    else:
        assert "not ROCm" in reason


def test_simulated_hip_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert RocmBackend.availability() == (False, "no ROCm GPU visible (torch.cuda.is_available() is False under HIP)")
    assert CudaBackend.availability()[1] == "torch built for ROCm (HIP), use the rocm backend"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=0: "AMD Instinct MI300X")
    ok, reason = RocmBackend.availability()
    assert ok and reason.startswith("AMD Instinct MI300X (HIP 6.2.41133")
    info = RocmBackend.platform()
    assert info["vendor"] == "amd" and info["runtime"] == "hip" and info["hip"] == "6.2.41133"
    assert RocmBackend.devices() == [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def test_tuning_table_is_rocm_data():
    assert RocmBackend.TUNING is ROCM_TUNING
    assert ROCM_TUNING != CudaBackend.TUNING
    cfg = kvcache.CacheConfig(2, 4, 2, 64, page_size=16, max_total_tokens=256, dtype="float32", rope_mode="normal")
    cache = kvcache.PagedKVCache(cfg, backend="rocm", device="cpu")
    assert cache.backend.tuning is ROCM_TUNING
    assert cache.capabilities.copy_stream and cache.capabilities.merged_aux


def test_python_paths_match_reference_on_cpu():
    cfg = kvcache.CacheConfig(2, 8, 2, 64, page_size=16, max_total_tokens=512, dtype="float32", rope_mode="normal")
    caches = [kvcache.PagedKVCache(cfg, backend="rocm", device="cpu"),
              kvcache.PagedKVCache(cfg, backend="reference")]
    rng = np.random.default_rng(0)
    for c in caches:
        c.add_sequence(0)
        c.add_sequence(1)
    steps = [([0, 1], [20, 7]), ([0, 1], [1, 1]), ([1], [3])]
    for i, (ids, lens) in enumerate(steps):
        if i == 2:
            for c in caches:
                c.fork_sequence(0, 2, 17)
            ids, lens = [1, 2], [3, 2]
        t = sum(lens)
        data = [(rng.standard_normal((t, 8, 64)), rng.standard_normal((t, 2, 64)),
                 rng.standard_normal((t, 2, 64))) for _ in range(2)]
        outs = []
        for c in caches:
            with c.forward(ids, lens):
                outs.append([kvcache.to_numpy(c.attention(l, *(c.from_numpy(x) for x in data[l])))
                             for l in range(2)])
        for a, b in zip(*outs):
            assert_close("rocm vs reference o", b, a, cfg.dtype)
    assert caches[0].aux_manager.kind == "merged" and caches[0].aux_manager.copies == 3


def test_soft_capped_kernels_take_no_inline_ptx_under_hip(monkeypatch):
    """The shared Triton kernels' fast soft cap is a ``tanh.approx`` PTX instruction, which
    HIP cannot compile: under a ROCm build the launcher picks the exact cap (mode 1) for
    16-bit caches too, as it does under the interpreter; on an NVIDIA build it keeps the PTX
    one (mode 2, mode 4 for a negative scale)."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from kvcache_cuda import triton_kernels as tk
    rec = SimpleNamespace(run=SimpleNamespace(kw={"IEEE": False}))     # a 16-bit cache's kernel
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert (tk._softcap_mode(rec, 30.0, 0.1), tk._softcap_mode(rec, 30.0, -0.1)) == (2, 4)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    assert (tk._softcap_mode(rec, 30.0, 0.1), tk._softcap_mode(rec, 30.0, -0.1)) == (1, 1)
    assert tk._softcap_mode(rec, 0.0, 0.1) == 0
