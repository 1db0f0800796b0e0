"""The cuda backend declares ``batch_invariant``: the conformance suite's ``TestBatchInvariance``
(one sequence's tokens bit-identical alone, batched in uneven chunks, from a prefix-cache hit,
forked inside a page, decoding beside its forks) passes on each of its implementations: the
torch fallback of the CPU test mode (each row computed alone), the Triton kernels under
Triton's interpreter (the paged prefill kernel's invariant loop, decode entries included), and
the GPU where there is one. Before the invariant loop the Triton kernels failed the class at
the second token of the chunked run, on the H100 and under the interpreter alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import background_runs
import cuda_cases as cc


def _command(env_extra: dict, device: str, full: bool = False) -> tuple:
    env = background_runs.interpreter_blas(dict(os.environ, **env_extra))
    cmd = [sys.executable, "-m", "kvcache.cli", "conformance", "--backend", "cuda", "--device",
           device, "--jobs", "1", "-k", "TestBatchInvariance"]
    if full:
        cmd.append("--full")
    return cmd, env


def _check(r) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    return out


def _run(env_extra: dict, device: str, full: bool = False) -> str:
    cmd, env = _command(env_extra, device, full)
    return _check(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900))


# the CPU runs' children start when collection ends, on the second core (background_runs.py);
# a slow test's child only under `make test-all` (the queue starts the selected tests' children)
if not (cc.ON_GPU or cc.INTERPRET):
    _TORCH = {"KVCACHE_CUDA_CPU": "1", "TRITON_INTERPRET": "0"}
    background_runs.register("test_the_torch_fallback_is_batch_invariant",
                             *_command(_TORCH, "cpu"))
    background_runs.register("test_the_torch_fallback_is_batch_invariant_in_every_variant",
                             *_command(_TORCH, "cpu", full=True))
    background_runs.register("test_the_triton_kernels_are_batch_invariant_under_the_interpreter",
                             *_command({"KVCACHE_CUDA_CPU": "1", "TRITON_INTERPRET": "1"}, "cpu"))


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="the CPU test mode's torch fallback")
def test_the_torch_fallback_is_batch_invariant():
    out = _check(background_runs.result("test_the_torch_fallback_is_batch_invariant"))
    # the quick matrix: two tests (the variants' run is the slow test below)
    assert "TestBatchInvariance          2       0       0        0" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="the CPU test mode's torch fallback")
def test_the_torch_fallback_is_batch_invariant_in_every_variant():
    out = _check(background_runs.result(
        "test_the_torch_fallback_is_batch_invariant_in_every_variant"))
    # every dtype and page size: two tests each
    assert "TestBatchInvariance         18       0       0        0" in out, out[-3000:]


# The class under the interpreter takes the shipped tiles (128-row prefill tiles: about 100 s of
# a core); in CI test_a_tokens_bits_hold_across_key_segments runs its scenario
# (check_invariance) through the same invariant kernels under the interpreter on small tiles,
# segments split and folded
@pytest.mark.slow
@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="a child run under the interpreter")
def test_the_triton_kernels_are_batch_invariant_under_the_interpreter():
    out = _check(background_runs.result(
        "test_the_triton_kernels_are_batch_invariant_under_the_interpreter"))
    assert "TestBatchInvariance          2       0       0        0" in out, out[-3000:]


@pytest.mark.skipif(not cc.ON_GPU, reason="needs a GPU")
def test_the_triton_kernels_are_batch_invariant_on_the_gpu():
    out = _run({}, "cuda", full=True)
    assert "verdict: CONFORMS" in out, out[-3000:]


def test_invariant_decode_steps_take_fewer_rows_with_the_prefill_key_step():
    """A batch-invariant decode step (one query an entry) runs the paged prefill kernel with
    the shipped sm_90 tiles cut to 64 rows and 4 warps (one warpgroup's MMA rows), the key
    step and stages kept: the same arithmetic per row, about half the wasted rows' work;
    ``invariant_decode_rows=0`` keeps the prefill tiles. (The bits are the GPU run's check:
    conformance's TestBatchInvariance.)"""
    import dataclasses

    import torch

    from kvcache_cuda.backend import KernelCtx
    from kvcache_cuda.launch import LaunchCache
    from kvcache_cuda.triton_kernels import _Cfg
    from kvcache_cuda.tuning import Tuning, for_arch, read_table

    sm90 = for_arch(Tuning(), "sm_90", read_table())

    def cfg(tuning):
        return _Cfg(KernelCtx(page_size=16, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              group=4, dtype=torch.bfloat16, tuning=tuning, num_sms=132,
                              launch=LaunchCache(), batch_invariant=True))

    c = cfg(sm90)
    pre, inv = c.pre_tiles, c.inv_tiles
    assert (pre.block_rows, pre.num_warps) == (128, 8)
    assert (inv.block_rows, inv.num_warps) == (64, 4)
    assert (inv.block_n, inv.num_stages) == (pre.block_n, pre.num_stages)
    assert (c.inv_block_r, c.inv_m_tok) == (64, 16)
    off = cfg(dataclasses.replace(sm90, invariant_decode_rows=0))
    assert off.inv_tiles == off.pre_tiles and off.inv_m_tok == off.pre_m_tok == 32


@pytest.mark.parametrize("dtype,ps,split", cc.cpu_sample(
    [(d, ps, split) for d in cc.DTYPES for ps in (16, 1) for split in (True, False)],
    keep_torch=[("bfloat16", 16, True), ("float32", 1, False)],
    keep_interpreter=[("float32", 16, True)]))
def test_a_tokens_bits_hold_across_key_segments(impl, dtype, ps, split):
    """Batch-invariant attention cuts a row's keys into segments of a fixed size from key 0,
    each its own softmax, folded in key order. A prompt chunk folds its rows' segments in its
    program; a decode step does the same, or (``split``, the default) runs one program per
    (sequence, segment) and folds their partials in a second kernel. The conformance class's runs of one sequence (alone; chunked beside others, so
    its decode steps share a step with prompt chunks; from the prefix cache; forked; beside
    its forks) on a prompt of several segments, whose decode steps cross into a new one, give
    the same bits: small tiles and 32-key segments, so the interpreter covers several. (The
    decode steps take the prefill tile's rows here: tiles of other rows must share its MMA
    layout, which the shipped pair does: the conformance run on the GPU checks those.) With
    the fold kernel taking the segments in reverse order the forked run's first decode token
    differs."""
    import kvcache
    from kvcache.conformance.test_invariance import _Run, check_invariance
    from kvcache_cuda.tuning import AttnTiles

    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                              page_size=ps, dtype=dtype, max_total_tokens=1024, max_batch_size=8,
                              batch_invariant=True, prefix_cache=True, rope_mode="none")
    tiles = {64: {"prefill": AttnTiles(32, 16, 4, 1)}}

    def fresh():
        cache = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
        cache.backend.impl = impl
        t = cache.backend.tuning
        cache.backend.tuning = t.with_(
            invariant_segment_keys=32, by_head_dim={**t.by_head_dim, **tiles},
            float32_by_head_dim={**t.float32_by_head_dim, **tiles}, invariant_decode_rows=32,
            invariant_split_programs=0 if split else 1)
        return _Run(cache)

    # 62 prompt tokens: segments of 32 and 30 keys; the third decode step (key 64) opens a
    # third
    check_invariance(cfg, fresh, n=62)
