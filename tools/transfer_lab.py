"""Where a sequence transfer's time goes, on two GPUs (NCCL): the gather (``export_sequences``,
all layers and one), plain sends of the same bytes in one message and in several, sizes from 1 MiB
to 1 GiB, and the whole ``send_sequence`` / ``recv_sequence``, with a profile of each side.

    python tools/transfer_lab.py [--tokens 4096] [--layers 32]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _med(fn, sync, n=7):
    ts = []
    for _ in range(n + 1):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def _rank(rank, world, opts):
    import numpy as np
    import torch
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv_sequence, send_sequence
    device = f"cuda:{rank}"
    T, L = opts["tokens"], opts["layers"]
    cfg = kvcache.CacheConfig(num_layers=L, num_qo_heads=8, num_kv_heads=8, head_dim=128,
                              page_size=16, dtype="bfloat16", rope_mode="none", max_batch_size=1,
                              max_total_tokens=2 * T + 32, prefill_chunk_size=T)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=device)

    def sync():
        torch.cuda.synchronize(device)
    out = {}
    if rank == 0:
        rng = np.random.default_rng(0)
        cache.add_sequence(0)
        with cache.forward([0], [T]):
            for layer in range(L):
                x = cache.from_numpy(rng.standard_normal((T, 8, 128)).astype(np.float32))
                cache.attention(layer, x, x, x)
        sync()
        out["export_ms"] = 1e3 * _med(lambda: cache.export_sequences([0]), sync)
        out["export_1layer_ms"] = 1e3 * _med(lambda: cache.export_sequences([0], layers=range(0, 1)), sync)
    # plain sends: one message, per-layer messages (2L), sizes table
    nbytes = T * cfg.token_kv_bytes
    buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    def plain():
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
    def chunks(n):
        parts = buf.view(n, -1)
        def go():
            ws = [(dist.isend if rank == 0 else dist.irecv)(parts[i], 1 - rank) for i in range(n)]
            for w in ws:
                w.wait()
        return go
    def timed(fn, n=7):
        ts = []
        for _ in range(n + 1):
            dist.barrier(); sync()
            t0 = time.perf_counter(); fn(); sync()
            ts.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(ts[1:])
    out["plain_ms"] = timed(plain)
    for n in (2, 8, 2 * L, 8 * L):
        out[f"chunks{n}_ms"] = timed(chunks(n))
    for mib in (1, 4, 16, 64, 256, 1024):
        b = torch.empty(mib << 20, dtype=torch.uint8, device=device)
        def one():
            if rank == 0:
                dist.send(b, 1)
            else:
                dist.recv(b, 0)
        out[f"plain_{mib}MiB_ms"] = timed(one)
    # the full transfer, and its receiver's parts
    def full():
        if rank == 0:
            send_sequence(cache, [0], dst=1).wait()
        else:
            recv_sequence(cache, [0], src=0).wait()
            cache.remove_sequence(0)
    out["send_recv_ms"] = timed(full)
    # the receiver's and sender's host phases: the call (head read, checks, reservation,
    # receives posted), then wait() (writes queued, commit), then the device
    phases = {"call": [], "wait": [], "device": []}
    for _ in range(8):
        dist.barrier(); sync()
        t0 = time.perf_counter()
        h = (send_sequence(cache, [0], dst=1) if rank == 0 else recv_sequence(cache, [0], src=0))
        t1 = time.perf_counter()
        h.wait()
        t2 = time.perf_counter()
        sync()
        t3 = time.perf_counter()
        if rank == 1:
            cache.remove_sequence(0)
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[k].append(1e3 * v)
    for k, v in phases.items():
        out[f"phase_{k}_ms"] = statistics.median(v[1:])
    # the host's time by function over 20 transfers (cProfile, tottime)
    import cProfile, io, pstats
    prof = cProfile.Profile()
    dist.barrier(); sync()
    prof.enable()
    for _ in range(20):
        full()
    sync()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(22)
    out["host_prof"] = "\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip())
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        full()
        sync()
    out["full_prof"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=6)
    # a prefill of PT tokens whose KV is sent from inside the forward: the host's time by
    # function on the prefill rank (the per-layer cost a layer-pipelined send adds)
    PT = opts["prefill_tokens"]
    pc = kvcache.CacheConfig(num_layers=L, num_qo_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, dtype="bfloat16", rope_mode="none", max_batch_size=1,
                             max_total_tokens=PT + 32, prefill_chunk_size=PT)
    pcache = kvcache.PagedKVCache(pc, backend="cuda", device=device)
    rng = np.random.default_rng(0)
    qkv = [pcache.from_numpy(rng.standard_normal((PT, h, 128)).astype(np.float32)) for h in (32, 8, 8)]

    def streamed(inside):
        if rank == 0:
            pcache.add_sequence(0)
            pcache.begin_forward([0], [PT])
            h = send_sequence(pcache, [0], dst=1) if inside else None
            for layer in range(L):
                pcache.attention(layer, *qkv)
            pcache.end_forward()
            if h is None:
                h = send_sequence(pcache, [0], dst=1)
            h.wait()
        else:
            recv_sequence(pcache, [0], src=0).wait()
        sync()
        pcache.remove_sequence(0)
    for inside in (False, True):
        out[f"prefill_send_{'inside' if inside else 'after'}_ms"] = timed(lambda: streamed(inside), n=5)
    prof = cProfile.Profile()
    dist.barrier(); sync()
    prof.enable()
    for _ in range(3):
        streamed(True)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(18)
    out["streamed_prof"] = "\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip())
    dist.barrier()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=4096)
    a = p.parse_args()
    from kvcache.distributed.tp import spawn
    r = spawn(_rank, 2, args=(dict(tokens=a.tokens, layers=a.layers, prefill_tokens=a.prefill_tokens),), backend="nccl", timeout_s=500)
    for rank, d in enumerate(r):
        profs = {k: d.pop(k) for k in list(d) if k.endswith("_prof")}
        print(f"rank {rank}:", {k: round(v, 3) if isinstance(v, float) else v for k, v in d.items()})
        for name, table in profs.items():
            print(f"rank {rank} {name}:")
            print(table)


if __name__ == "__main__":
    main()
