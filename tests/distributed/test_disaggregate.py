"""``kvcache demo --disaggregate`` on the CPU: two gloo processes each driving an Engine, rank 0
prefills (``hold_kv``) and sends each group's KV, rank 1 receives, adopts (``kv_seq_id``) and
decodes; its tokens must equal the single-process Engine's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kvcache.demo import disaggregate  # noqa: E402


# 12-15 s a backend on 2 cores (most of it the two ranks importing torch and transformers). The
# disaggregation code (hold_kv, send/receive, adopt) is the same for every backend: `make
# test-all` runs this on both; CI runs the same workload once, through the command on the cuda
# backend's CPU mode (test_the_cli_reports_and_exits_zero below, which asserts the same
# numbers from what it prints).
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_decode_rank_matches_the_single_process_engine(backend, monkeypatch):
    if backend == "cuda":
        monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")       # inherited by the spawned ranks
    opts = disaggregate.build_parser().parse_args(["--disaggregate", "--backend", backend, *WORKLOAD])
    r = disaggregate.run(opts)
    assert r["failures"] == [] and r["identical"] == r["requests"] == 7
    assert r["backend"] == backend
    # both ranks drive an Engine: rank 0 prefilled every prompt (batched, shared system prompts
    # computed once), rank 1 ran one token per request (the first, with the adopted KV) and
    # decoded 5 steps per group of at most 3 requests
    p, d = r["prefill"], r["decode"]
    assert 0 < p["prefill_tokens"] <= p["prompt_tokens"] and p["forwards"] >= 2
    assert d["prefill_tokens"] == 7 and d["decode_tokens"] == 7 * 4
    assert d["forwards"] == 5 * 3
    assert r["prefill"]["kv_bytes"] == kv_bytes(r["prefill"]["prompt_tokens"])


WORKLOAD = ["--device", "cpu", "--requests", "7", "--group", "3", "--max-output", "6",
            "--long-prompt", "150", "--prefill-chunk-size", "64"]


def kv_bytes(tokens: int) -> int:
    """K and V of 4 layers x 2 KV heads x head_dim 64 in float32 per prompt token."""
    return tokens * 2 * 4 * 2 * 64 * 4


# The command (30-40 s: two ranks and the single-process Engine) starts when collection ends and
# runs on CI's second core beside the session (tests/cuda/background_runs.py; at once, in the
# test's wait, where that queue does not run).
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

# --deterministic (the default on a GPU): every Engine batch-invariant, identity asked
background_runs.register(
    "test_the_cli_reports_and_exits_zero",
    [sys.executable, "-m", "kvcache.cli", "demo", "--disaggregate", "--backend", "cuda",
     *WORKLOAD, "--deterministic"],
    dict(os.environ, KVCACHE_CUDA_CPU="1"), timeout=600, needs=("torch", "transformers", "triton"))


def test_the_cli_reports_and_exits_zero():
    pytest.importorskip("triton")
    proc = background_runs.result("test_the_cli_reports_and_exits_zero")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "backend cuda on cpu" in out and "each driving an Engine (deterministic=True)" in out
    assert "7/7 requests token-identical to the single-process Engine" in out
    # what test_decode_rank_matches_the_single_process_engine asserts, as printed: rank 0
    # prefilled every prompt in batched forwards and sent their K and V; rank 1 ran the first
    # token of each request with the adopted KV, then 5 steps per group of at most 3
    m = re.search(r"rank 0 \(prefill\): 7 prompts, (\d+) tokens \((\d+) computed, \d+ shared by "
                  r"\d+ forks\) in (\d+) forwards, .*; KV sent: ([\d.]+) MiB in groups of 3", out)
    assert m, out[-3000:]
    prompt, computed, forwards = (int(g) for g in m.groups()[:3])
    assert 0 < computed <= prompt and forwards >= 2
    assert m.group(4) == f"{kv_bytes(prompt) / 2**20:.1f}"
    assert re.search(r"rank 1 \(decode\):  6 tokens per request in 15 forwards \(7 prompt "
                     r"tokens run", out), out[-3000:]
