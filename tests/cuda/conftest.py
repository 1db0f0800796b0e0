"""Shared setup of the CUDA backend tests.

The same test files run in three modes (chosen by environment, see docs/backends/cuda.md):
* default (CI, no GPU): CPU tensors, torch kernels;
* ``TRITON_INTERPRET=1``: CPU tensors, Triton kernels through the interpreter (float32/float16:
  the interpreter has no bfloat16); spawned by ``test_cuda_triton_interpreter.py``;
* ``KVCACHE_CUDA_TEST_DEVICE=cuda``: GPU tensors, torch *and* Triton kernels, every dtype.
"""

import pytest

import cuda_cases as cc


@pytest.fixture(autouse=True)
def _cpu_test_mode(monkeypatch):
    # enable the backend's CPU test mode for these tests only: set process-wide it would let
    # backend="auto", device="cpu" pick the cuda backend in other test directories
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")


def pytest_report_header(config):
    return f"kvcache-cuda tests: device={cc.DEVICE} impls={cc.IMPLS} dtypes={cc.DTYPES}"


@pytest.fixture(params=cc.IMPLS)
def impl(request):
    return request.param


@pytest.fixture(params=cc.DTYPES)
def dtype(request):
    return request.param
