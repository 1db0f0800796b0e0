import pytest


@pytest.fixture(autouse=True)
def _cuda_cpu_test_mode(monkeypatch):
    # the cuda backend's CPU test mode for these tests only (process-wide it would let
    # backend="auto" pick it in other test directories)
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
