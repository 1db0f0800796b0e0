"""``kvcache bench --transfer``: moving one sequence's KV between two processes, against a plain
``torch.distributed`` send of the same bytes measured in the same run.

Two local processes (``kvcache.distributed.tp.spawn``): NCCL with rank r on ``cuda:r`` when the
device is a GPU (two needed), gloo on CPUs. Rank 0 holds a cache with one sequence per size
(Llama-3-8B KV shapes, 32 layers, 8 KV heads, head_dim 128, bfloat16 on a GPU; by default a table
of sequences of 1 MiB to 1 GiB on a GPU, ``--transfer-tokens`` for one size); each repeat it
``send_sequence``s one and rank 1 ``recv_sequence``s it into its own cache (then removes it). The peer: rank 0 ``dist.send``s one contiguous tensor of the same
byte count to rank 1; and the transfer again with the receiver not checking the data's sums
(``recv_sequence(..., verify=False)``: integrity left to the transport). All are timed on the
receiver, from a barrier to the data being usable
(``wait()`` returned, the device synchronized). Reported: the medians, both bandwidths and their
ratio (target: the sequence's transfer at >= 0.8 of the plain send).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Optional

from ..arrays import to_numpy

__all__ = ["add_arguments", "main", "measure"]

TARGET = 0.8


SIZES_MIB = (1, 4, 16, 64, 256, 1024)
"""The table's sequence sizes (K and V together) on a GPU."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The transfer bench's options (on ``kvcache bench``'s parser)."""
    g = p.add_argument_group("transfer bench (--transfer)")
    g.add_argument("--transfer", action="store_true",
                   help="one sequence's KV sent between two processes (send_sequence / "
                        "recv_sequence) vs a plain torch.distributed send of the same bytes")
    g.add_argument("--transfer-tokens", type=int, default=None, metavar="N",
                   help="tokens of the sequence (default: a table of sequences of 1 MiB to "
                        "1 GiB on a GPU, 4096 tokens on CPUs)")
    g.add_argument("--transfer-layers", type=int, default=32, metavar="N",
                   help="layers of the cache (default 32; 8 KV heads, head_dim 128)")
    g.add_argument("--transfer-repeat", type=int, default=10, metavar="N",
                   help="timed repeats of each (default 10, after one warm-up)")


def _rank(rank: int, world: int, opts: dict) -> list:
    import numpy as np
    import torch
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv_sequence, send_sequence
    gpu = opts["device"] == "cuda"
    device = f"cuda:{rank}" if gpu else "cpu"
    sizes = opts["tokens"]
    count, each = opts.get("batch") or (0, 0)
    cfg = kvcache.CacheConfig(
        num_layers=opts["layers"], num_qo_heads=opts["kv_heads"], num_kv_heads=opts["kv_heads"],
        head_dim=opts["head_dim"], page_size=16, dtype=opts["dtype"], rope_mode="none",
        max_batch_size=1, max_total_tokens=sum(sizes) + 16 * len(sizes) + count * (each + 16),
        prefill_chunk_size=max(sizes + [each]))
    cache = kvcache.PagedKVCache(cfg, backend=opts["backend"], device=device)

    def sync():
        if gpu:
            torch.cuda.synchronize(device)

    # one sequence per size, then ``count`` sequences of ``each`` tokens sent in one call
    cases = [([sid], n) for sid, n in enumerate(sizes)]
    if count:
        cases.append((list(range(BATCH_IDS, BATCH_IDS + count)), count * each))
    if rank == 0:                          # each sequence: one prefill of random K/V
        rng = np.random.default_rng(0)
        for sid, n in [(s, n) for s, n in enumerate(sizes)] + [
                (b, each) for b in range(BATCH_IDS, BATCH_IDS + count)]:
            cache.add_sequence(sid)
            with cache.forward([sid], [n]):
                for layer in range(cfg.num_layers):
                    x = cache.from_numpy(rng.standard_normal(
                        (n, cfg.num_kv_heads, cfg.head_dim)).astype(np.float32))
                    cache.attention(layer, x, x, x)
        sync()
    rows = []
    for ids, n in cases:
        nbytes = n * cfg.token_kv_bytes
        plain = torch.empty(nbytes, dtype=torch.uint8, device=device)
        kv_times, plain_times, loose_times = [], [], []
        got = None
        for r in range(opts["repeat"] + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                send_sequence(cache, ids, dst=1).wait()
            else:
                recv_sequence(cache, ids, src=0).wait()
                sync()
            kv_times.append(time.perf_counter() - t0)
            if r == opts["repeat"]:         # the last copy against the source, bit for bit
                same = all(_same_bits(cache, sid, device, dist, torch) for sid in ids)
                if rank == 1:
                    got = list(kvcache.to_numpy(cache.get_kv(ids[-1])[0]).shape)
            if rank == 1:
                for sid in ids:
                    cache.remove_sequence(sid)
            dist.barrier()                  # the same, the receiver not checking the sums
            t0 = time.perf_counter()
            if rank == 0:
                send_sequence(cache, ids, dst=1).wait()
            else:
                recv_sequence(cache, ids, src=0, verify=False).wait()
                sync()
                for sid in ids:
                    cache.remove_sequence(sid)
            loose_times.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(plain, 1)
            else:
                dist.recv(plain, 0)
                sync()
            plain_times.append(time.perf_counter() - t0)
        row = dict(tokens=n, bytes=nbytes, kv_s=statistics.median(kv_times[1:]),
                   plain_s=statistics.median(plain_times[1:]), sequences=len(ids),
                   unverified_s=statistics.median(loose_times[1:]))
        if rank == 1:
            row.update(received_shape=got, bit_exact=same)
        rows.append(row)
    if rank == 0:
        rows.append(_host_tier(cache, len(sizes) - 1, sync, device, opts["repeat"]))
    rows.append(_pipelined(rank, opts, sync, device))
    return rows


BATCH_IDS = 10_000                   # the batch row's sequence ids
BATCH = 64
"""The batch row: this many sequences of the table's smallest size, sent in one call."""
PIPELINE_TOKENS = 4096
"""The prompt of the pipelined-prefill row (on a GPU; 256 on CPUs)."""


def _pipelined(rank: int, opts: dict, sync, device: str) -> dict:
    """A prefill of one prompt on rank 0 whose KV goes to rank 1: alone (rank 0's forward,
    to its end), then sent after the forward, and sent from inside it (``send_sequence``
    during the forward: layer i on the wire while layer i+1 computes). Timed from a barrier
    to the KV usable on rank 1 (``wait()`` returned, device synchronized) and, alone, to the
    forward's end on rank 0."""
    import torch
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv_sequence, send_sequence
    n = PIPELINE_TOKENS if device != "cpu" else 256
    cfg = kvcache.CacheConfig(
        num_layers=opts["layers"], num_qo_heads=4 * opts["kv_heads"],
        num_kv_heads=opts["kv_heads"], head_dim=opts["head_dim"], page_size=16,
        dtype=opts["dtype"], rope_mode="none", max_batch_size=1, max_total_tokens=n + 16,
        prefill_chunk_size=n)
    cache = kvcache.PagedKVCache(cfg, backend=opts["backend"], device=device)
    import numpy as np
    rng = np.random.default_rng(0)
    qkv = [cache.from_numpy(rng.standard_normal((n, h, cfg.head_dim)).astype(np.float32))
           for h in (cfg.num_qo_heads, cfg.num_kv_heads, cfg.num_kv_heads)]   # every layer's
    times: dict = {"prefill": [], "after": [], "during": []}
    same = None

    def prefill(send_inside: bool):
        cache.add_sequence(0)
        cache.begin_forward([0], [n])
        h = send_sequence(cache, [0], dst=1) if send_inside else None
        for layer in range(cfg.num_layers):
            cache.attention(layer, *qkv)
        cache.end_forward()
        return h

    for r in range(opts["repeat"] + 1):
        for how in ("prefill", "after", "during"):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                h = prefill(how == "during")
                if how == "after":
                    h = send_sequence(cache, [0], dst=1)
                if how == "prefill":
                    sync()
                    times[how].append(time.perf_counter() - t0)
                else:
                    h.wait()
            elif how != "prefill":
                recv_sequence(cache, [0], src=0).wait()
                sync()
                times[how].append(time.perf_counter() - t0)
            if how == "during" and r == opts["repeat"]:     # the copy against the source
                same = _same_bits(cache, 0, device, dist, torch)
            if how != "prefill" or rank == 0:
                cache.remove_sequence(0)
    if rank == 0:
        return dict(pipelined=True, prefill_s=statistics.median(times["prefill"][1:]))
    return dict(pipelined=True, tokens=n, bytes=n * cfg.token_kv_bytes,
                after_s=statistics.median(times["after"][1:]),
                during_s=statistics.median(times["during"][1:]), bit_exact=same)


def _same_bits(cache, sid: int, device: str, dist, torch) -> bool:
    """Whether the sender's sequence ``sid`` and the receiver's copy hold the same bits (each
    side's ``Backend.checksum`` of K and V, exchanged)."""
    payload = cache.export_sequence(sid)
    b = cache.backend
    mine = torch.tensor([int(x) for a in (payload.k, payload.v)
                         for x in to_numpy(b.checksum(a))], dtype=torch.int64,
                        device=device)
    both = [torch.zeros_like(mine) for _ in range(2)]
    dist.all_gather(both, mine)
    return bool(torch.equal(both[0], both[1]))


def _host_tier(cache, sid: int, sync, device: str, repeat: int) -> dict:
    """Offload and restore of sequence ``sid`` (``HostTier`` as built by default: the device
    checksums kept, the hash chain where ``verify_by_default`` says) against a pinned ``copy_``
    of the same bytes each way (a numpy copy on a CPU); and, apart, with the hash chain on
    (``verify=True``: ``chained_*``, two repeats)."""
    import numpy as np
    import torch

    import kvcache
    nbytes = cache.sequence_length(sid) * cache.config.token_kv_bytes
    tier = kvcache.HostTier(cache)
    chained = kvcache.HostTier(cache, verify=True)
    gpu = device != "cpu"
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=gpu)
    times: dict = {"offload": [], "restore": [], "d2h": [], "h2d": [], "chained_offload": [],
                   "chained_restore": []}

    def timed(name, fn):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times[name].append(time.perf_counter() - t0)
    for _ in range(repeat + 1):
        timed("offload", lambda: tier.offload(sid))
        timed("restore", lambda: tier.restore(sid))
        if gpu:
            timed("d2h", lambda: host.copy_(dev, non_blocking=True))
            timed("h2d", lambda: dev.copy_(host, non_blocking=True))
        else:
            a, b = np.empty(nbytes, np.uint8), np.empty(nbytes, np.uint8)
            timed("d2h", lambda: np.copyto(a, b))
            timed("h2d", lambda: np.copyto(b, a))
    for _ in range(3):
        timed("chained_offload", lambda: chained.offload(sid))
        timed("chained_restore", lambda: chained.restore(sid))
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return dict(host_tier=True, tokens=cache.sequence_length(sid), bytes=nbytes,
                offload_s=med["offload"], restore_s=med["restore"], d2h_s=med["d2h"],
                h2d_s=med["h2d"], offload_ratio=med["d2h"] / med["offload"],
                restore_ratio=med["h2d"] / med["restore"], verify=tier.verify,
                chained_offload_s=med["chained_offload"], chained_restore_s=med["chained_restore"])


def measure(device: str, backend: str, tokens, layers: int, repeat: int,
            kv_heads: int = 8, head_dim: int = 128, dtype: Optional[str] = None,
            batch: int = 0) -> dict:
    """Run both ranks and return the receiver's medians, bandwidths and their ratio: for one
    size (``tokens`` an int: the row's fields at the top level) or several (a list: ``rows``,
    and ``ratio`` the smallest of theirs). ``batch``: also ``batch`` sequences of the smallest
    size in one call (``batch_row``, not in ``ratio``)."""
    from ..distributed.tp import spawn
    sizes = [int(tokens)] if isinstance(tokens, int) else [int(t) for t in tokens]
    opts = dict(device=device, backend=backend, tokens=sizes, layers=layers, repeat=repeat,
                kv_heads=kv_heads, head_dim=head_dim, batch=(batch, min(sizes)) if batch else None,
                dtype=dtype or ("bfloat16" if device == "cuda" else "float32"))
    ranks = spawn(_rank, 2, args=(opts,), backend="nccl" if device == "cuda" else "gloo",
                  timeout_s=600)
    rows = ranks[1][:-1]
    host = ranks[0][-2]
    pipe = dict(ranks[1][-1], prefill_s=ranks[0][-1]["prefill_s"])
    for r in rows:
        r.update(kv_gbps=r["bytes"] / r["kv_s"] / 1e9, plain_gbps=r["bytes"] / r["plain_s"] / 1e9)
        r["ratio"] = r["plain_s"] / r["kv_s"]
        r["unverified_ratio"] = r["plain_s"] / r["unverified_s"]
    batch_row = rows.pop() if batch else None
    out: dict = dict(opts, rows=rows, ratio=min(r["ratio"] for r in rows), host_tier=host,
                     pipelined=pipe, batch_row=batch_row)
    if isinstance(tokens, int):
        out.update(rows[0])
        out["tokens"] = sizes[0]
    return out


def main(args) -> int:
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2
                             else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        from ..cli_kit import UsageError
        raise UsageError(f"--transfer on cuda needs two GPUs; this host has {torch.cuda.device_count()}")
    backend = args.backend or ("cuda" if device == "cuda" else "reference")
    tokens = args.transfer_tokens
    if tokens is None:
        per_token = 2 * args.transfer_layers * 8 * 128 * (2 if device == "cuda" else 4)
        tokens = ([max(1, (mib << 20) // per_token) for mib in SIZES_MIB] if device == "cuda"
                  else 4096)
    r = measure(device, backend, tokens, args.transfer_layers, args.transfer_repeat,
                batch=BATCH if device == "cuda" and args.transfer_tokens is None else 0)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    where = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    print(f"kvcache bench --transfer: {where} x2 ({'nccl' if device == 'cuda' else 'gloo'}), "
          f"backend {backend}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"  one sequence of {r['layers']} layers, {r['kv_heads']} KV heads, head_dim "
          f"{r['head_dim']}, {r['dtype']}; medians of {r['repeat']} (receiver, barrier to usable)")
    print(f"  {'tokens':>7} {'MiB':>8}  {'send/recv ms':>12} {'GB/s':>7}  {'plain send ms':>13} "
          f"{'GB/s':>7}  {'ratio':>5}  bits  {'verify=False ms':>15} {'ratio':>5}")
    for row in r["rows"]:
        print(f"  {row['tokens']:7d} {row['bytes'] / 2**20:8.1f}  {row['kv_s'] * 1e3:12.3f} "
              f"{row['kv_gbps']:7.2f}  {row['plain_s'] * 1e3:13.3f} {row['plain_gbps']:7.2f}  "
              f"{row['ratio']:5.2f}  {'same' if row['bit_exact'] else 'DIFFER'}  "
              f"{row['unverified_s'] * 1e3:15.3f} {row['unverified_ratio']:5.2f}")
    b = r["batch_row"]
    if b:
        print(f"  {b['sequences']} sequences of {b['tokens'] // b['sequences']} tokens in one call "
              f"({b['bytes'] / 2**20:.1f} MiB): {b['kv_s'] * 1e3:.3f} ms, {b['kv_gbps']:.2f} GB/s "
              f"against a plain send of those bytes {b['plain_s'] * 1e3:.3f} ms: "
              f"{b['ratio']:.2f}; bits {'same' if b['bit_exact'] else 'DIFFER'}")
    ok = r["ratio"] >= TARGET
    print(f"target: sequence transfer / plain send bandwidth, smallest ratio {r['ratio']:.2f} "
          f"(target >= {TARGET}) {'met' if ok else 'MISSED'}; every copy bit for bit: "
          f"{'yes' if all(row['bit_exact'] for row in r['rows']) else 'NO'}")
    h = r["host_tier"]
    copy = "pinned copy_" if device == "cuda" else "numpy copy"
    print(f"  host tier ({h['bytes'] / 2**20:.1f} MiB, device checksums kept, hash chain "
          f"{'on' if h.get('verify') else 'off'} by default here): offload "
          f"{h['offload_s'] * 1e3:.3f} ms against a {copy} to host {h['d2h_s'] * 1e3:.3f} ms "
          f"({h['offload_ratio']:.2f}); restore {h['restore_s'] * 1e3:.3f} ms against "
          f"{h['h2d_s'] * 1e3:.3f} ms ({h['restore_ratio']:.2f})")
    if "chained_offload_s" in h:
        print(f"  (with the hash chain, verify=True: offload {h['chained_offload_s'] * 1e3:.3f} ms,"
              f" restore {h['chained_restore_s'] * 1e3:.3f} ms)")
    low = min(h["offload_ratio"], h["restore_ratio"])
    print(f"target: host tier / {copy}, smallest ratio {low:.2f} (target >= {TARGET}) "
          f"{'met' if low >= TARGET else 'MISSED'}")
    p = r["pipelined"]
    print(f"  prefill of {p['tokens']} tokens ({p['bytes'] / 2**20:.1f} MiB of KV) on rank 0, "
          f"its KV usable on rank 1: prefill alone {p['prefill_s'] * 1e3:.3f} ms; sent after "
          f"the forward {p['after_s'] * 1e3:.3f} ms; sent layer by layer from inside it "
          f"{p['during_s'] * 1e3:.3f} ms: the transfer adds "
          f"{(p['after_s'] - p['prefill_s']) * 1e3:.3f} ms after, "
          f"{(p['during_s'] - p['prefill_s']) * 1e3:.3f} ms inside; the copy bit for bit: "
          f"{'yes' if p['bit_exact'] else 'NO'}")
    return 0
