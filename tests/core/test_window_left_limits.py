"""``window_left`` beyond any sequence (issue 28, item 7): 2**31, 2**63-1, 2**64-1 (also as numpy
ints) raised untyped OverflowError / ValueError / ``std::bad_cast`` on some backends and gave a
wrong window on another. The core now decides once, before any backend sees it: a window of
``num_pages * page_size`` positions or more covers every key (no sequence is longer), so it is
-1 (no window), bit for bit, on every backend; below that bound it is a real window; below -1
or not an int it is InvalidArgumentError. Run on the reference backend, metal on MLX's CPU
device and cuda's CPU mode (torch kernels here, Triton kernels through the interpreter in a
subprocess)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HUGE = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**80, np.int64(2**63 - 1),
        np.uint64(2**64 - 1), np.uint32(2**32 - 1), np.int32(2**31 - 1)]
if INTERPRET:                           # the interpreter is slow: the values only
    HUGE = [2**31, 2**63 - 1, 2**64 - 1, np.uint64(2**64 - 1)]
BACKENDS = ["cuda"] if INTERPRET else ["reference", "metal", "cuda"]


def make_cache(backend, monkeypatch, layers):
    device = None
    if backend == "metal":
        pytest.importorskip("mlx.core")
        device = "cpu"
    elif backend == "cuda":
        pytest.importorskip("torch")
        monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
        device = "cpu"
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=4, num_kv_heads=2, head_dim=16,
                              page_size=4, max_batch_size=4, max_total_tokens=64,
                              prefill_chunk_size=32, dtype="float32", rope_mode="normal")
    cache = kvcache.PagedKVCache(cfg, backend=backend, device=device)
    if backend == "cuda" and INTERPRET:
        cache.backend.impl = "triton"
    return cache


def run(cache, seq_ids, lens, windows, rng):
    """One forward; layer ``i`` runs with ``windows[i]`` and the same q/k/v as every other layer
    (so every layer's history is the same): returns each layer's (o, lse) as numpy."""
    c, t = cache.config, sum(lens)
    q, k, v = (rng.standard_normal((t, h, c.head_dim)).astype(np.float32)
               for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
    out = []
    with cache.forward(seq_ids, lens):
        for layer, w in enumerate(windows):
            o, lse = cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k),
                                     cache.from_numpy(v), return_lse=True, window_left=w)
            out.append((kvcache.to_numpy(o), kvcache.to_numpy(lse)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_beyond_every_sequence_is_no_window(backend, monkeypatch):
    bound = None
    windows = [-1, *HUGE]
    cache = make_cache(backend, monkeypatch, len(windows) + 2)
    bound = cache.config.num_pages * cache.config.page_size
    windows += [bound, bound - 1]           # the bound itself: none; just below: a real window
    rng = np.random.default_rng(0)
    cache.add_sequence(0)
    cache.add_sequence(1)
    # a prefill (ragged + paged), a mixed step, then decode steps (paged only)
    steps = [([0, 1], [9, 5]), ([0, 1], [3, 1]), ([1, 0], [1, 1]), ([0, 1], [1, 1])]
    for seq_ids, lens in steps[:2] + steps[3:] if INTERPRET else steps:
        out = run(cache, seq_ids, lens, windows, rng)
        want_o, want_lse = out[0]
        for w, (o, lse) in zip(windows[1:-1], out[1:-1]):
            np.testing.assert_array_equal(o, want_o, err_msg=f"window_left={w!r}")
            np.testing.assert_array_equal(lse, want_lse, err_msg=f"window_left={w!r}")
        o, lse = out[-1]                    # bound - 1 still covers every key here
        np.testing.assert_allclose(o, want_o, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)
    assert cache.sequence_length(0) == 14 - INTERPRET and cache.sequence_length(1) == 8 - INTERPRET


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [-2, -2**63, -2**64, np.int64(-5), 1.0, "3", None, True,
                                 np.float64(2.0**70)][:3 if INTERPRET else None], ids=repr)
def test_a_bad_window_is_a_typed_error_naming_it(backend, bad, monkeypatch):
    cache = make_cache(backend, monkeypatch, 1)
    cache.add_sequence(0)
    c = cache.config
    cache.begin_forward([0], [2])
    q, k = (cache.from_numpy(np.ones((2, h, c.head_dim), np.float32))
            for h in (c.num_qo_heads, c.num_kv_heads))
    with pytest.raises(InvalidArgumentError, match=r"window_left.*forward over sequences \[0\]"):
        cache.attention(0, q, k, k, window_left=bad)
    assert cache.layers_run == frozenset()
    cache.attention(0, q, k, k, window_left=1)
    cache.end_forward()
    assert cache.sequence_length(0) == 2


# background_runs.py: the interpreter child starts when collection ends, on CI's second core
sys.path.append(str(Path(__file__).resolve().parents[1] / "cuda"))   # tests/ has no packages
import background_runs  # noqa: E402

if not INTERPRET:
    background_runs.register(
        "test_cuda_triton_kernels_under_the_interpreter",
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "beyond_every_sequence or bad_window"],
        background_runs.clean_env(TRITON_INTERPRET="1", KVCACHE_CUDA_CPU="1"),
        cwd=Path(__file__).resolve().parents[2], timeout=600, needs=("triton", "torch"))


@pytest.mark.skipif(INTERPRET, reason="this is the spawner")
def test_cuda_triton_kernels_under_the_interpreter():
    """The cuda rows again with the Triton kernels, through Triton's interpreter (it must be
    set before triton is imported, hence a subprocess)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    # the child (registered above) started when collection ended, on the second core
    r = background_runs.result("test_cuda_triton_kernels_under_the_interpreter")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert "passed" in r.stdout.splitlines()[-1] and "skipped" not in r.stdout.splitlines()[-1], \
        r.stdout[-3000:]
