"""Shared helpers of the transfer tests (a top-level module: tests/ has no packages): caches on
any backend, random workloads that leave sequences with forks, sliding windows and partial
pages behind, and exact comparisons."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

import kvcache
from kvcache.arrays import to_host

HEAD_DIM = 64          # every backend's kernels take it
DEVICES = {"reference": None, "cuda": os.environ.get("KVCACHE_CUDA_TEST_DEVICE", "cpu"),
           "metal": "cpu", "example": None}
"""The device each backend runs on in these tests (cuda: its CPU test mode, or the GPU under
``KVCACHE_CUDA_TEST_DEVICE=cuda``, as tests/cuda; metal: MLX CPU)."""


def config(page_size=4, dtype="float32", rope_mode="normal", sliding=False, layers=2,
           max_total_tokens=1024, **kw) -> kvcache.CacheConfig:
    return kvcache.CacheConfig(num_layers=layers, num_qo_heads=4, num_kv_heads=2,
                               head_dim=HEAD_DIM, page_size=page_size, max_batch_size=8,
                               max_total_tokens=max_total_tokens, prefill_chunk_size=256,
                               dtype=dtype, rope_mode=rope_mode, support_sliding_window=sliding,
                               **kw)


def backend_class(name):
    for info in kvcache.list_backends():
        if info["name"] == name:
            return info
    return None


def make_cache(backend, cfg) -> kvcache.PagedKVCache:
    """A cache on ``backend`` (its test device); skips when the backend cannot run here or
    lacks a capability ``cfg`` needs (the error names the capability)."""
    try:
        return kvcache.PagedKVCache(cfg, backend=backend, device=DEVICES[backend])
    except kvcache.BackendNotAvailableError as exc:
        pytest.skip(f"backend {backend!r} is not available here: {exc}")
    except kvcache.UnsupportedFeatureError as exc:
        pytest.skip(str(exc))


def caches_here(backends, cfg_of) -> list:
    """``[(backend, cache)]`` of ``backends`` that run here (``cfg_of()`` a fresh config each):
    a destination that cannot run is left out, not the whole test (a GPU machine without MLX
    still loads a file on reference and on the GPU); at least two must run."""
    out = []
    for name in backends:
        try:
            out.append((name, make_cache(name, cfg_of())))
        except pytest.skip.Exception:
            continue
    if len(out) < 2:
        pytest.skip(f"fewer than two of {backends} run here")
    return out


def run_forward(cache, ids, lens, rng, return_output=False, qkv=None):
    """One forward appending ``lens[i]`` random tokens to ``ids[i]``; returns the outputs per
    layer as host arrays when asked. ``qkv``: per layer (q, k, v) host arrays to use."""
    c = cache.config
    total = int(sum(lens))
    outs = []
    with cache.forward(ids, lens):
        for layer in range(c.num_layers):
            if qkv is None:
                q = rng.standard_normal((total, c.num_qo_heads, c.head_dim)).astype(np.float32)
                k = rng.standard_normal((total, c.num_kv_heads, c.head_dim)).astype(np.float32)
                v = rng.standard_normal((total, c.num_kv_heads, c.head_dim)).astype(np.float32)
            else:
                q, k, v = qkv[layer]
            o = cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v))
            if return_output:
                outs.append(kvcache.to_numpy(o))
    return outs


def parent_and_child(cache, rng, parent_len, fork_pos, child_len) -> None:
    """Sequence 1 with ``parent_len`` random tokens, and sequence 2 forked from it at
    ``fork_pos`` and grown by ``child_len``."""
    cache.add_sequence(1)
    run_forward(cache, [1], [parent_len], rng)
    cache.fork_sequence(1, 2, fork_pos)
    run_forward(cache, [2], [child_len], rng)


@dataclasses.dataclass
class Workload:
    """Sequences built on a cache; ``forks[child] = (parent, fork_pos)`` for children whose
    first ``fork_pos`` tokens still are the parent's (checked when built)."""

    ids: list
    forks: dict


def build_workload(cache, rng, count=12, max_len=40, windows=True, forks=True) -> Workload:
    """``count`` sequences with random lengths (partial pages), some forked from others at
    random positions (then grown), some with sliding windows that have slid, some popped."""
    c = cache.config
    windows = windows and c.support_sliding_window
    ids, fork_of = [], {}
    next_id = 100
    for _ in range(count):
        sid, next_id = next_id, next_id + 1
        kind = rng.random()
        parents = [p for p in ids if cache.state.seq(p).window == -1]
        if forks and parents and kind < 0.4:
            parent = int(rng.choice(parents))
            pos = int(rng.integers(0, cache.sequence_length(parent) + 1))
            cache.fork_sequence(parent, sid, pos)
            fork_of[sid] = (parent, pos)
            grow = int(rng.integers(0, max_len // 2))
            if grow:
                run_forward(cache, [sid], [grow], rng)
        else:
            cache.add_sequence(sid)
            if windows and kind > 0.7:
                window = int(rng.integers(4, 24))
                cache.enable_sliding_window(sid, window, int(rng.integers(0, min(window, 6))))
            first = int(rng.integers(1, max_len))
            run_forward(cache, [sid], [first], rng)
            if windows and kind > 0.7:
                # a second forward batched with another sequence: the window slides further
                other = [p for p in ids if p in cache.sequence_ids]
                batch = [sid] + ([int(rng.choice(other))] if other else [])
                run_forward(cache, batch, [int(rng.integers(1, 12)) for _ in batch], rng)
        if rng.random() < 0.15 and cache.sequence_length(sid) > 2:
            cache.popn(sid, int(rng.integers(1, 3)))
        ids.append(sid)
    cache.state.pt.check_invariants()
    valid = {}
    for child, (parent, pos) in fork_of.items():
        if min(cache.sequence_length(child), cache.sequence_length(parent)) < pos:
            continue                                 # popped below the fork
        a, b = cache.get_kv(child, 0, pos), cache.get_kv(parent, 0, pos)
        if all(same(x, y, read_dtype(c)) for x, y in zip(a, b)):
            valid[child] = (parent, pos)
    return Workload(ids, valid)


def read_dtype(cfg) -> str:
    """The dtype ``get_kv`` gives (and a payload's arrays hold): the storage dtype, or the
    compute dtype for quantized pages (their values read back)."""
    return cfg.dtype if cfg.kv_quantized else cfg.kv_dtype


def host(array, dtype):
    """``array`` on the host with its stored bits (bfloat16 kept, not widened)."""
    return to_host(array, dtype)


def same(a, b, dtype) -> bool:
    """Bit-exact equality of two arrays of any backend in storage dtype ``dtype``."""
    x, y = host(a, dtype), host(b, dtype)
    return x.shape == y.shape and x.tobytes() == y.tobytes()


def assert_same_kv(src, sid, dst, did):
    """``dst``'s sequence ``did`` holds exactly ``src``'s ``sid``: length and K/V bits."""
    assert dst.sequence_length(did) == src.sequence_length(sid), (sid, did)
    for name, a, b in zip("kv", src.get_kv(sid), dst.get_kv(did)):
        assert same(a, b, read_dtype(src.config)), f"{name} of sequence {sid} -> {did} differs"


def snapshot(cache):
    """Everything a failed call must leave unchanged."""
    dt = read_dtype(cache.config)
    return (cache.num_available_pages, list(cache.sequence_ids),
            {s: cache.sequence_length(s) for s in cache.sequence_ids},
            {s: [host(a, dt).tobytes() for a in cache.get_kv(s)] for s in cache.sequence_ids})


def fp8_codes(cache, sid) -> np.ndarray:
    """The e4m3 codes (uint8) that ``cache`` stores for sequence ``sid``: (num_layers, length,
    2, num_kv_heads, head_dim), read out of the pages at the sequence's slots. Torch pages hold
    the codes; the reference's hold ``code * scale`` in float32 (exactly), quantized back with
    the layer's scales here (``kv_quant.fp8_quantize``: the value over the scale is the code
    within a float32 rounding, far inside the code's interval)."""
    from kvcache import kv_quant
    seq = cache.state.seq(sid)
    slots = cache.state.pt.position_slots(seq, 0, cache.state.pt.length(seq)).astype(np.int64)
    ps, d = cache.config.page_size, cache.config.head_dim
    out = []
    for layer, pages in enumerate(cache.pages):
        if isinstance(pages, np.ndarray):
            rows = pages[slots // ps, :, :, slots % ps, :d]          # (n, 2, Hkv, D) values
            scales = np.asarray(cache.kv_scales(layer), np.float32)
            codes = np.stack([kv_quant.fp8_quantize(rows[:, i], scales[i]).view(np.uint8)
                              for i in (0, 1)], axis=1)
        else:
            import torch
            idx = torch.from_numpy(slots)
            codes = (pages[idx // ps, :, :, idx % ps, :d].contiguous().view(torch.uint8)
                     .cpu().numpy())
        out.append(codes)
    return np.stack(out)
