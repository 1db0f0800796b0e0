"""kvcache.distributed: two processes on gloo move 100 random sequences (forks imported as
shared prefixes, sliding windows, partial pages) between the reference backend and cuda's
CPU test mode in a few batched, asynchronous calls, bit-exactly, and 40 over fp8 pages (the
sender's scales adopted, its codes bit for bit); the errors a caller meets before any message
moves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcache
from transfer_cases import config, make_cache, run_forward

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                    reason="torch.distributed with gloo is not available")
def test_two_processes_move_100_sequences_bit_exactly(tmp_path):
    env = dict(os.environ, KVCACHE_CUDA_CPU="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    init = tmp_path / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(HERE / "dist_worker.py"), str(rank), str(init)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    log = "\n".join(f"--- rank {r} (exit {p.returncode})\n{o}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert all(p.returncode == 0 for p in procs), log
    assert "round 0: 100 sequences" in outs[1] and "round 1: 100 sequences" in outs[1], log
    assert "round 2: 40 sequences" in outs[1] and "round 3: 40 sequences" in outs[1], log
    assert "kv_dtype=float8_e4m3 ok" in outs[1], log
    assert "round 4: 40 sequences" in outs[1] and "round 5: 40 sequences" in outs[1], log
    assert "kv_dtype=int4 ok" in outs[1] and "kv_dtype=int8 ok" in outs[1], log
    assert "fp8 into a plain cache only converted; packed int8 rows only into int8" in outs[1], log
    assert "refused header drained" in outs[1], log
    assert "a header longer than the head message arrives in two" in outs[1], log
    assert "a flipped bit of K, of V, of the JSON: refused; in step after" in outs[1], log
    assert "sends inside their forwards (reference)" in outs[1], log
    assert "sends inside their forwards (cuda)" in outs[1], log
    assert "malformed headers refused and drained; the next transfer arrived" in outs[1], log


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _cache(backend="reference"):
    cache = make_cache(backend, config(4, "float32", "none"))
    cache.add_sequence(1)
    run_forward(cache, [1], [5], np.random.default_rng(0))
    return cache


def test_without_a_process_group_the_error_says_how_to_start_one():
    from kvcache.distributed import send_sequence
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    with pytest.raises(kvcache.ForwardStateError, match="init_process_group"):
        send_sequence(_cache(), 1, dst=1)


def test_without_torch_the_error_names_the_extra(monkeypatch):
    from kvcache.distributed import recv_sequence
    from kvcache.integrations import MissingExtraError
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(MissingExtraError, match=r"kvcache\[distributed\]"):
        recv_sequence(_cache(), 2, src=0)


def test_mlx_arrays_are_refused_before_any_message(one_process_group):
    from kvcache.distributed import send_sequence
    cache = _cache("metal")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="backend 'metal' keeps mlx"):
        send_sequence(cache, 1, dst=0)


def test_bad_arguments_are_refused_before_any_message(one_process_group):
    from kvcache.distributed import recv_sequence, send_sequence
    cache = _cache()
    with pytest.raises(kvcache.SequenceNotFoundError, match="sequence 7"):
        send_sequence(cache, [1, 7], dst=0)
    with pytest.raises(kvcache.InvalidArgumentError, match="repeat a sequence"):
        send_sequence(cache, [1, 1], dst=0)
    with pytest.raises(kvcache.InvalidArgumentError, match="parent_ids has 1 entries for 2"):
        recv_sequence(cache, [3, 4], src=0, parent_ids=[None])
    cache.begin_forward([1], [1])
    with pytest.raises(kvcache.ForwardStateError, match="a forward is open"):
        recv_sequence(cache, [3], src=0)
    cache.abort_forward()


def test_fp8_headers_say_the_arrays_dtype_and_are_checked_against_it():
    """An fp8 transfer's K/V are the values in the compute dtype (``dtype``), the scales in the
    payload headers: the receiver sizes and reads the data by ``dtype``; a header without it,
    with another one than its payloads', or packed int8 rows said to be values, is refused,
    typed."""
    import copy
    import json

    from kvcache.distributed.wire import _read_header
    cache = make_cache("reference", config(4, "bfloat16", "none", kv_dtype="float8_e4m3"))
    cache.add_sequence(1)
    run_forward(cache, [1], [5], np.random.default_rng(0))
    headers, k, _ = cache.export_sequences([1])
    assert k.dtype.name == "bfloat16" and headers[0].kv_scales[0] is not None
    good = {"version": 1, "kv_dtype": "float8_e4m3", "dtype": "bfloat16",
            "shape": list(k.shape), "nbytes": k.nbytes, "payloads": [h.header() for h in headers]}

    def read(msg, nbytes=k.nbytes):
        return _read_header(json.dumps(msg).encode(), nbytes, [7], 0)

    msg, shape, got = read(good)
    assert msg["dtype"] == "bfloat16" and got[0].kv_scales == headers[0].kv_scales
    bad = dict(good, dtype=None)
    with pytest.raises(kvcache.InvalidArgumentError, match="dtype=None"):
        read(bad)
    bad = dict(good, dtype="float32", nbytes=2 * k.nbytes)
    with pytest.raises(kvcache.InvalidArgumentError, match=r"arrays in bfloat16\).*arrays in float32"):
        read(bad, 2 * k.nbytes)
    with pytest.raises(kvcache.InvalidArgumentError, match="bytes"):
        read(good, k.nbytes // 2)
    bad = copy.deepcopy(good)
    bad["kv_dtype"] = "int8"
    with pytest.raises(kvcache.InvalidArgumentError, match="uint8 \\(packed rows\\)"):
        read(bad)


def test_packed_affine_headers_are_read_by_their_bytes():
    """An int8 / int4 transfer's K/V are packed rows (uint8, the last axis the row's bytes):
    the header's shape and nbytes count them, and a byte count for another group size is
    refused."""
    import json

    from kvcache.distributed.wire import _read_header
    cache = make_cache("reference", config(4, "bfloat16", "none", kv_dtype="int4"))
    cache.add_sequence(1)
    run_forward(cache, [1], [5], np.random.default_rng(0))
    headers, k, _ = cache.export_sequences([1])
    assert k.dtype == np.uint8 and k.shape[-1] == headers[0].shape[3] < cache.config.head_dim
    good = {"version": 1, "kv_dtype": "int4", "dtype": "uint8", "shape": list(k.shape),
            "nbytes": k.nbytes, "payloads": [h.header() for h in headers]}
    msg, shape, got = _read_header(json.dumps(good).encode(), k.nbytes, [7], 0)
    assert shape == k.shape and got[0].kv_quant_group == cache.config.kv_quant_group
    other = 32 if cache.config.kv_quant_group == 64 else 64
    bad = dict(good, payloads=[dict(good["payloads"][0], kv_quant_group=other)])
    with pytest.raises(kvcache.InvalidArgumentError, match="row"):
        _read_header(json.dumps(bad).encode(), k.nbytes, [7], 0)

