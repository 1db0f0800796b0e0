"""The batch-invariant attention's cost against the default's (issue 54, item 2), on a GPU.

Llama-3-8B's attention shapes (Hq 32, Hkv 8, D 128), bf16, page 16: ``--batch`` sequences of
``--len`` tokens prefilled, then decode steps of ``--layers`` attention calls each, profiled
(torch.profiler, CUDA kernel time per layer by kernel) for the default cache and for
``batch_invariant=True`` at several key-segment sizes (``Tuning.invariant_segment_keys``;
a size past every sequence's length is the one-pass loop of before). A prompt chunk's
attention (one sequence, ``--chunk`` tokens over ``--len`` cached) is timed the same way, the
in-program fold's cost. Each invariant decode output is checked against the default's within
bf16's tolerance (the bits are the tests' matter).

    python tools/invariant_attention_lab.py [--shapes 64x600,64x4096,8x4096,1x4096]
        [--segments 512,1024,2048] [--layers 8] [--steps 10] [--chunk 512]
"""

from __future__ import annotations

import argparse

import os

import numpy as np

DEV = os.environ.get("LAB_DEVICE", "cuda")      # cpu: a dry run in the CPU test mode
DTYPE = os.environ.get("LAB_DTYPE", "bfloat16")


def _DT():
    import torch
    return getattr(torch, DTYPE)


def _sync() -> None:
    import torch
    if DEV != "cpu":
        torch.cuda.synchronize()


def _ACTS() -> list:
    from torch.profiler import ProfilerActivity
    return [ProfilerActivity.CPU if DEV == "cpu" else ProfilerActivity.CUDA]


def _kernel_us(prof, calls: int) -> dict:
    """Microseconds per call of each CUDA kernel name (summed over its launches)."""
    out: dict = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        if t and ev.key and not ev.key.startswith(("cuda", "Memcpy", "Memset", "aten::",
                                                   "Command", "ProfilerStep")):
            out[ev.key] = out.get(ev.key, 0.0) + t / calls
    return out


def _cache(batch: int, length: int, layers: int, invariant: bool, seg: int, split: bool):
    import kvcache
    cfg = kvcache.CacheConfig(num_layers=layers, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                              page_size=16, dtype=DTYPE,
                              max_total_tokens=batch * (length + 64) + length + 1024,
                              max_batch_size=max(batch, 1), batch_invariant=invariant,
                              rope_mode="none", prefill_chunk_size=8192)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=DEV)
    if invariant:
        cache.backend.tuning = cache.backend.tuning.with_(
            invariant_segment_keys=seg, invariant_split_programs=0 if split else 1)
    return cache


def _fill(cache, batch: int, length: int, layers: int) -> None:
    import torch
    g = torch.Generator(device=DEV).manual_seed(0)
    for sid in range(batch):
        cache.add_sequence(sid)
    per = max(1, 8192 // max(length, 1))
    for lo in range(0, batch, per):
        ids = list(range(lo, min(batch, lo + per)))
        n = len(ids) * length
        with cache.forward(ids, [length] * len(ids)):
            for layer in range(layers):
                q = torch.randn(n, 32, 128, device=DEV, dtype=_DT(), generator=g)
                k = torch.randn(n, 8, 128, device=DEV, dtype=_DT(), generator=g)
                v = torch.randn(n, 8, 128, device=DEV, dtype=_DT(), generator=g)
                cache.attention(layer, q, k, v)


def _decode(cache, batch: int, layers: int, steps: int, seed: int = 1) -> tuple:
    """(kernel us per layer, the last step's outputs) of ``steps`` decode steps after 3 warm."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator(device=DEV).manual_seed(seed)
    ids = list(range(batch))
    qkv = [(torch.randn(batch, 32, 128, device=DEV, dtype=_DT(), generator=g),
            torch.randn(batch, 8, 128, device=DEV, dtype=_DT(), generator=g),
            torch.randn(batch, 8, 128, device=DEV, dtype=_DT(), generator=g))
           for _ in range(layers)]
    outs = []

    def step():
        outs.clear()
        with cache.forward(ids, [1] * batch):
            for layer in range(layers):
                outs.append(cache.attention(layer, *qkv[layer]))
    for _ in range(3):
        step()
    _sync()
    with profile(activities=_ACTS()) as prof:
        for _ in range(steps):
            step()
        _sync()
    return _kernel_us(prof, steps * layers), [o.float().cpu().numpy() for o in outs]


def _chunk(cache, length: int, chunk: int, layers: int) -> dict:
    """Kernel us per layer of one prompt chunk of ``chunk`` tokens after ``length`` cached."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator(device=DEV).manual_seed(2)
    sid = 10_000
    cache.add_sequence(sid)
    with cache.forward([sid], [length]):
        for layer in range(layers):
            cache.attention(layer, *(torch.randn(length, h, 128, device=DEV,
                                                 dtype=_DT(), generator=g)
                                     for h in (32, 8, 8)))
    qkv = [tuple(torch.randn(chunk, h, 128, device=DEV, dtype=_DT(), generator=g)
                 for h in (32, 8, 8)) for _ in range(layers)]
    res = {}
    for rep in range(2):          # the first compiles
        with profile(activities=_ACTS()) as prof:
            with cache.forward([sid], [chunk]):
                for layer in range(layers):
                    cache.attention(layer, *qkv[layer])
            _sync()
        res = _kernel_us(prof, layers)
        cache.popn(sid, chunk)
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="64x600,64x4096,8x4096,1x4096")
    p.add_argument("--segments", default="512,1024,2048")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--chunk", type=int, default=512)
    a = p.parse_args()
    segs = [int(s) for s in a.segments.split(",")]
    for shape in a.shapes.split(","):
        batch, length = (int(x) for x in shape.split("x"))
        rows = []
        base_out = None
        variants = [("default", False, 0, False), ("one pass", True, 1 << 30, False)]
        for s in segs:
            variants += [(f"S={s} in-prog", True, s, False), (f"S={s} split", True, s, True)]
        for name, inv, seg, split in variants:
            cache = _cache(batch, length, a.layers, inv, seg, split)
            _fill(cache, batch, length, a.layers)
            k_us, outs = _decode(cache, batch, a.layers, a.steps)
            total = sum(k_us.values())
            attn = {k: v for k, v in k_us.items() if "paged" in k or "fold" in k or "merge" in k}
            err = 0.0
            if base_out is None:
                base_out = outs
            else:
                err = max(float(np.abs(x - y).max()) for x, y in zip(outs, base_out))
            c_us = _chunk(cache, min(length, 4096), a.chunk, a.layers) if batch == 1 else {}
            rows.append((name, total, attn, err, sum(c_us.values())))
            del cache
            import torch
            if DEV != "cpu":
                torch.cuda.empty_cache()
        base = rows[0][1]
        print(f"# B={batch} L={length}: decode kernels per layer (us), ratio to default; "
              f"max |o - default o|")
        for name, total, attn, err, chunk_us in rows:
            detail = ", ".join(f"{k.split('_kernel')[0].lstrip('_')} {v:.1f}"
                               for k, v in sorted(attn.items(), key=lambda kv: -kv[1]))
            extra = f"; prompt chunk {a.chunk} over {min(length, 4096)}: {chunk_us:.1f} us" \
                if chunk_us else ""
            print(f"  {name:>16} {total:8.1f} us  {(total / base if base else float('nan')):5.2f}x  err {err:.4f}  "
                  f"[{detail}]{extra}")


if __name__ == "__main__":
    main()
