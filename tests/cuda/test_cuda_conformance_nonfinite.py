"""The conformance suite's TestMaskedNonFinite (NaN / inf in the K or V of keys a query must not
see) against this backend's CPU test mode, with the torch kernels and with the Triton kernels
through the interpreter (CI has no GPU; on one, ``kvcache conformance --backend cuda`` runs it);
TestQuantizedKV (fp8 pages) with the torch kernels.

The interpreter run writes no poison: writing it through the interpreted append kernel takes
minutes, and the kernel tests (test_cuda_kernels.py) already run on NaN-poisoned pools."""

import os
import re
import sys

import pytest

import background_runs
import cuda_cases as cc


def _command(env_changes, *args, cls="TestMaskedNonFinite"):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "KVCACHE_CUDA_IMPL", "KVCACHE_CUDA_TEST_DEVICE")}
    env.update(KVCACHE_CUDA_CPU="1", **env_changes)
    return [sys.executable, "-m", "kvcache.cli", "conformance", "--backend", "cuda",
            "--device", "cpu", "-k", cls, *args], env


def _suite(name, cls="TestMaskedNonFinite", row=r"6\s+0\s+0\s+0"):
    # the child (_command) started when collection ended, on the second core (background_runs.py)
    r = background_runs.result(name)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert re.search(cls + r"\s+" + row, out), out[-3000:]
    assert "verdict: CONFORMS" in out


if not (cc.ON_GPU or cc.INTERPRET):
    background_runs.register("test_masked_nonfinite_class_torch_kernels", *_command({}),
                             timeout=900)
    # under the interpreter the page-size-16 variant of each of the three masks (the float32
    # page-size-1 variants took as long again: the kernel tests cover page size 1 there)
    background_runs.register("test_masked_nonfinite_class_triton_interpreter",
                             *_command({"TRITON_INTERPRET": "1"}, "--poison", "none",
                                       cls="TestMaskedNonFinite and ps16"), timeout=900)
    background_runs.register("test_quantized_class_torch_kernels",
                             *_command({}, cls="TestQuantizedKV"), timeout=900)


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="CPU run of the suite's class")
def test_masked_nonfinite_class_torch_kernels():
    _suite("test_masked_nonfinite_class_torch_kernels")


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="CPU run of the suite's class")
def test_masked_nonfinite_class_triton_interpreter():
    pytest.importorskip("triton")
    _suite("test_masked_nonfinite_class_triton_interpreter", row=r"3\s+0\s+0\s+0")


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="CPU run of the suite's class")
def test_quantized_class_torch_kernels():
    # fp8 pages (the format this backend declares): the quick matrix's 11 fp8 cases pass, its
    # int8 / int4 cases skip by capability (the Triton kernels run this class on a GPU, and
    # test_cuda_fp8.py under the interpreter)
    _suite("test_quantized_class_torch_kernels", cls="TestQuantizedKV", row=r"11\s+0\s+0\s+16")
