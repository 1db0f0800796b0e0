"""``kvcache bench --transfer``: moving one sequence's KV between two processes, against a plain
``torch.distributed`` send of the same bytes measured in the same run.

Two local processes (``kvcache.distributed.tp.spawn``): NCCL with rank r on ``cuda:r`` when the
device is a GPU (two needed), gloo on CPUs. Rank 0 holds a cache with one sequence of
``--transfer-tokens`` tokens (default: Llama-3-8B KV shapes, 32 layers, 8 KV heads, head_dim 128,
bfloat16 on a GPU); each repeat it ``send_sequence``s it and rank 1 ``recv_sequence``s it into its
own cache (then removes it). The peer: rank 0 ``dist.send``s one contiguous tensor of the same
byte count to rank 1. Both are timed on the receiver, from a barrier to the data being usable
(``wait()`` returned, the device synchronized). Reported: the medians, both bandwidths and their
ratio (target: the sequence's transfer at >= 0.8 of the plain send).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

__all__ = ["add_arguments", "main", "measure"]

TARGET = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The transfer bench's options (on ``kvcache bench``'s parser)."""
    g = p.add_argument_group("transfer bench (--transfer)")
    g.add_argument("--transfer", action="store_true",
                   help="one sequence's KV sent between two processes (send_sequence / "
                        "recv_sequence) vs a plain torch.distributed send of the same bytes")
    g.add_argument("--transfer-tokens", type=int, default=4096, metavar="N",
                   help="tokens of the sequence (default 4096)")
    g.add_argument("--transfer-layers", type=int, default=32, metavar="N",
                   help="layers of the cache (default 32; 8 KV heads, head_dim 128)")
    g.add_argument("--transfer-repeat", type=int, default=10, metavar="N",
                   help="timed repeats of each (default 10, after one warm-up)")


def _rank(rank: int, world: int, opts: dict) -> dict:
    import numpy as np
    import torch
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv_sequence, send_sequence
    gpu = opts["device"] == "cuda"
    device = f"cuda:{rank}" if gpu else "cpu"
    cfg = kvcache.CacheConfig(
        num_layers=opts["layers"], num_qo_heads=opts["kv_heads"], num_kv_heads=opts["kv_heads"],
        head_dim=opts["head_dim"], page_size=16, dtype=opts["dtype"], rope_mode="none",
        max_batch_size=1, max_total_tokens=opts["tokens"] + 16,
        prefill_chunk_size=opts["tokens"])
    cache = kvcache.PagedKVCache(cfg, backend=opts["backend"], device=device)

    def sync():
        if gpu:
            torch.cuda.synchronize(device)

    if rank == 0:                          # the sequence: one prefill of random K/V
        rng = np.random.default_rng(0)
        cache.add_sequence(0)
        with cache.forward([0], [opts["tokens"]]):
            for layer in range(cfg.num_layers):
                x = cache.from_numpy(rng.standard_normal(
                    (opts["tokens"], cfg.num_kv_heads, cfg.head_dim)).astype(np.float32))
                cache.attention(layer, x, x, x)
        sync()
    nbytes = opts["tokens"] * cfg.token_kv_bytes
    plain = torch.empty(nbytes, dtype=torch.uint8, device=device)
    kv_times, plain_times = [], []
    for r in range(opts["repeat"] + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            send_sequence(cache, [0], dst=1).wait()
        else:
            recv_sequence(cache, [0], src=0).wait()
            sync()
            if r == opts["repeat"]:
                k, _ = cache.get_kv(0)
                got = kvcache.to_numpy(k).shape
            cache.remove_sequence(0)
        kv_times.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(plain, 1)
        else:
            dist.recv(plain, 0)
            sync()
        plain_times.append(time.perf_counter() - t0)
    out = dict(bytes=nbytes, kv_s=statistics.median(kv_times[1:]),
               plain_s=statistics.median(plain_times[1:]))
    if rank == 1:
        out["received_shape"] = list(got)
    return out


def measure(device: str, backend: str, tokens: int, layers: int, repeat: int,
            kv_heads: int = 8, head_dim: int = 128, dtype: Optional[str] = None) -> dict:
    """Run both ranks and return the receiver's medians, bandwidths and their ratio."""
    from .distributed.tp import spawn
    opts = dict(device=device, backend=backend, tokens=tokens, layers=layers, repeat=repeat,
                kv_heads=kv_heads, head_dim=head_dim,
                dtype=dtype or ("bfloat16" if device == "cuda" else "float32"))
    ranks = spawn(_rank, 2, args=(opts,), backend="nccl" if device == "cuda" else "gloo",
                  timeout_s=600)
    r = ranks[1]
    r.update(kv_gbps=r["bytes"] / r["kv_s"] / 1e9, plain_gbps=r["bytes"] / r["plain_s"] / 1e9)
    r["ratio"] = r["plain_s"] / r["kv_s"]
    r.update(opts)
    return r


def main(args) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2
                             else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        from .cli import UsageError
        raise UsageError(f"--transfer on cuda needs two GPUs; this host has {torch.cuda.device_count()}")
    backend = args.backend or ("cuda" if device == "cuda" else "reference")
    r = measure(device, backend, args.transfer_tokens, args.transfer_layers, args.transfer_repeat)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"kvcache bench --transfer: {where} x2 ({'nccl' if device == 'cuda' else 'gloo'}), "
          f"backend {backend}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"  sequence: {r['tokens']} tokens, {r['layers']} layers, {r['kv_heads']} KV heads, "
          f"head_dim {r['head_dim']}, {r['dtype']}: {r['bytes'] / 2**20:.1f} MiB; medians of "
          f"{r['repeat']} (receiver, barrier to usable)")
    print(f"  send_sequence/recv_sequence  {r['kv_s'] * 1e3:9.3f} ms  {r['kv_gbps']:8.2f} GB/s")
    print(f"  plain dist.send of the bytes {r['plain_s'] * 1e3:9.3f} ms  {r['plain_gbps']:8.2f} GB/s")
    ok = r["ratio"] >= TARGET
    print(f"target: sequence transfer / plain send bandwidth {r['ratio']:.2f} (target >= {TARGET}) "
          f"{'met' if ok else 'MISSED'}")
    return 0
