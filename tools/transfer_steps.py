"""Where one small transfer's host time goes, step by step, on two GPUs (NCCL): each function
``send_sequence`` / ``recv_sequence`` calls is wrapped with a wall-clock timer; plus plain
``isend``/``irecv`` of a reused buffer, of a fresh buffer each time, and of a staged head.

    python tools/transfer_steps.py [--tokens 8]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time


def _rank(rank, world, opts):
    import numpy as np
    import torch
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv, recv_sequence, send, send_sequence
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    T, L = opts["tokens"], 32
    cfg = kvcache.CacheConfig(num_layers=L, num_qo_heads=8, num_kv_heads=8, head_dim=128,
                              page_size=16, dtype="bfloat16", rope_mode="none", max_batch_size=1,
                              max_total_tokens=2 * T + 32, prefill_chunk_size=T)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=device)

    def sync():
        torch.cuda.synchronize(device)
    if rank == 0:
        cache.add_sequence(0)
        with cache.forward([0], [T]):
            for layer in range(L):
                x = cache.from_numpy(np.random.standard_normal((T, 8, 128)).astype(np.float32))
                cache.attention(layer, x, x, x)
        sync()
    out = {}

    def timed(fn, n=20):
        ts = []
        for _ in range(n + 1):
            dist.barrier(); sync()
            t0 = time.perf_counter(); fn(); sync()
            ts.append(time.perf_counter() - t0)
        return round(1e6 * statistics.median(ts[1:]), 1)
    nbytes = T * cfg.token_kv_bytes
    reused = torch.empty(nbytes, dtype=torch.uint8, device=device)
    peer = 1 - rank

    def p2p(make):
        def go():
            t = make()
            (dist.isend if rank == 0 else dist.irecv)(t, peer).wait()
        return go
    out["p2p_reused_us"] = timed(p2p(lambda: reused))
    out["p2p_fresh_us"] = timed(p2p(lambda: torch.empty(nbytes, dtype=torch.uint8, device=device)))
    head = torch.zeros(16384, dtype=torch.uint8)
    out["p2p_head_staged_us"] = timed(p2p(
        lambda: send._staged(torch, head, torch.device(device)) if rank == 0
        else torch.empty(16384, dtype=torch.uint8, device=device)))

    def two():
        if rank == 0:
            a = dist.isend(reused[:16384], 1); b = dist.isend(reused, 1); a.wait(); b.wait()
        else:
            a = dist.irecv(reused[:16384], 0); a.wait(); b = dist.irecv(reused, 0); b.wait()
    out["p2p_two_messages_us"] = timed(two)
    # the steps of a transfer, each wrapped
    spent = collections.defaultdict(float)
    calls = collections.Counter()

    def wrap(owner, name, label=None):
        real = getattr(owner, name)
        label = label or name

        def timed_call(*a, **k):
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0
                calls[label] += 1
        setattr(owner, name, timed_call)
    # each step wrapped in the module that calls it (a step both sides call, in both)
    for owner, names in ((send, ("_staged", "head_message", "_group_message", "_arrays",
                                 "_transport", "_torch", "_tokens_hint")),
                         (recv, ("_read_header", "_read_small", "_post_small", "_spans",
                                 "_arrays", "_transport", "_torch", "_from_wire"))):
        for name in names:
            wrap(owner, name)
    for name in ("isend", "irecv"):
        wrap(dist, name)
    for name in ("export_sequences", "reserve_import", "write_import", "commit_import"):
        wrap(cache, name)
    wrap(json, "dumps", "json.dumps")

    def full():
        if rank == 0:
            h = send_sequence(cache, [0], dst=1)
            spent["send_call"] += 0
            h.wait()
        else:
            recv_sequence(cache, [0], src=0).wait()
            cache.remove_sequence(0)
    out["send_recv_us"] = timed(full)
    spent.clear(); calls.clear()
    walls = {"call": [], "wait": []}
    for _ in range(20):
        dist.barrier(); sync()
        t0 = time.perf_counter()
        h = send_sequence(cache, [0], dst=1) if rank == 0 else recv_sequence(cache, [0], src=0)
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        sync()
        if rank == 1:
            cache.remove_sequence(0)
        walls["call"].append(t1 - t0); walls["wait"].append(t2 - t1)
    out["call_us"] = round(1e6 * statistics.median(walls["call"]), 1)
    out["wait_us"] = round(1e6 * statistics.median(walls["wait"]), 1)
    out["steps_us_per_transfer"] = {k: round(1e6 * v / 20, 1) for k, v in
                                    sorted(spent.items(), key=lambda kv: -kv[1])}
    out["calls_per_transfer"] = {k: v / 20 for k, v in calls.items()}
    dist.barrier()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8)
    a = p.parse_args()
    from kvcache.distributed.tp import spawn
    r = spawn(_rank, 2, args=(dict(tokens=a.tokens),), backend="nccl", timeout_s=300)
    for rank, d in enumerate(r):
        print(f"rank {rank}:")
        for k, v in d.items():
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
