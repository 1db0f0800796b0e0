"""Run the Triton kernels on CPU tensors through Triton's interpreter, in a subprocess:
TRITON_INTERPRET must be set before triton is first imported, and this process may already have
imported it. The subprocess runs the kernel tests (every kernel vs the reference; softcap, sinks,
head_dim_v and small head dims vs numpy), two end-to-end scenarios (token tree, fused qkv) and
the graph-mode decode scenario (padded buckets, forks) and the static-shape mixed steps
(test_cuda_static_mixed.py) with the backend selecting Triton for CPU tensors.

The child pytest gets this run's ``-m`` expression: under ``make test`` (``-m 'not slow'``) it
leaves out the scenarios marked slow for the interpreter only (each 10-60 s there; see
test_cuda_end_to_end.py and test_cuda_graph_mode.py for why the one kept covers them), and
``make test-all`` (``-m ""``) runs every one of them, as before. It starts when collection ends
(conftest.py), so that its minute and a half of one core overlaps the session's other tests."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import background_runs
import cuda_cases as cc

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(cc.INTERPRET or cc.ON_GPU, reason="this is the spawner; it runs in CPU mode only")
def test_triton_kernels_under_interpreter(triton_interpreter_run):
    pytest.importorskip("triton")
    # the child pytest (command and environment: conftest.InterpreterRun), started when
    # collection ended so that it runs beside the session's other tests; finished here
    r = triton_interpreter_run()
    tail = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, tail
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 50, tail
    assert "failed" not in r.stdout.splitlines()[-1], tail


@pytest.mark.skipif(os.environ.get("KVCACHE_CUDA_COMPILE_CHECK") != "1" or cc.ON_GPU,
                    reason="opt-in, 1-2 min cold: KVCACHE_CUDA_COMPILE_CHECK=1 compiles every "
                           "Triton kernel for sm_90 without a GPU (triton_compile_check.py)")
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(HERE / "triton_compile_check.py"), "90"],
                       cwd=HERE.parent.parent, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    compiled = re.search(r"COMPILED (\d+)", r.stdout)
    assert compiled and int(compiled.group(1)) >= 30, r.stdout[-4000:]


def test_the_warp_uniform_prefill_kernel_compiles_for_sm90():
    """``warp_uniform_scalars``' inline PTX (``shfl.sync``) is compiled, never interpreted: the
    paged prefill kernel with it goes through the whole NVIDIA pipeline (PTX, then ptxas) for
    sm_90 here, without a GPU (a few seconds; the opt-in check above compiles it in every
    flag combination)."""
    pytest.importorskip("triton")
    # the child (registered below) started when collection ended, on the second core
    r = background_runs.result("test_the_warp_uniform_prefill_kernel_compiles_for_sm90")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "compiled _paged_prefill_kernel" in r.stdout and "COMPILED 1" in r.stdout, r.stdout


# background_runs.py: the compile check's child starts when collection ends (it compiles: no
# TRITON_INTERPRET; in CPU mode only, where the queue runs)
background_runs.register(
    "test_the_warp_uniform_prefill_kernel_compiles_for_sm90",
    [sys.executable, str(HERE / "triton_compile_check.py"), "--uniform", "90"],
    {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, cwd=HERE.parent.parent,
    timeout=600, needs=("triton",))
