"""One rank of the two-process transfer test (run by test_distributed.py, not by pytest):
``python dist_worker.py RANK INIT_FILE``. Rank 0 sends, rank 1 receives; both build the
same seeded source caches, so rank 1 checks what arrived against its own copy bit by bit."""

from __future__ import annotations

import os
import sys
import time

os.environ["KVCACHE_CUDA_CPU"] = "1"

import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402

import kvcache  # noqa: E402
from kvcache.distributed import recv_sequence, send_sequence  # noqa: E402
from transfer_cases import (assert_same_kv, build_workload, config, fp8_codes,  # noqa: E402
                            make_cache, run_forward, snapshot)

FP8 = "float8_e4m3"
ROUNDS = [
    # (source backend, page size, destination backend, page size, dtype, rope, sliding,
    #  kv_dtype, sequences)
    ("reference", 4, "cuda", 16, "bfloat16", "inline", True, "auto", 100),
    ("cuda", 16, "reference", 3, "float32", "normal", False, "auto", 100),
    # fp8 pages (issue 32): the values with the scales, which the receiver adopts
    ("reference", 4, "cuda", 16, "bfloat16", "inline", True, FP8, 40),
    ("cuda", 16, "reference", 3, "float32", "normal", False, FP8, 40),
    # int8 / int4 pages: the packed rows, stored unchanged (the same codes)
    ("reference", 4, "reference", 3, "bfloat16", "inline", True, "int4", 40),
    ("reference", 3, "reference", 16, "float32", "normal", False, "int8", 40),
]
CHUNKS = 4
CONTINUED = []          # rank 0: the transfers whose JSON went on past the head message


def _counting_heads():
    from kvcache.distributed import send        # where send_sequence looks head_message up
    real = send.head_message

    def head_message(body, *args):
        head, rest = real(body, *args)
        if rest:
            CONTINUED.append(len(body))
        return head, rest
    send.head_message = head_message


def chunks(ids):
    size = -(-len(ids) // CHUNKS)
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def plan(wl, chunk):
    """Per sequence of a chunk: (first token sent, parent on the receiver, fork_pos)."""
    out = []
    for sid in chunk:
        if sid in wl.forks:
            parent, pos = wl.forks[sid]
            out.append((pos, parent, pos))
        else:
            out.append((0, None, None))
    return out


def one_round(rank, n, src_backend, ps_a, dst_backend, ps_b, dtype, rope, sliding, kv_dtype,
              count):
    cfg = dict(max_total_tokens=8192, kv_dtype=kv_dtype)
    source = make_cache(src_backend, config(ps_a, dtype, rope, sliding, **cfg))
    wl = build_workload(source, np.random.default_rng(100 + n), count=count)
    assert len(wl.forks) > 4, "the workload should hold forks"
    fp8 = kv_dtype == FP8
    layers = range(source.config.num_layers)
    if rank == 0:
        handles = []
        for i, chunk in enumerate(chunks(wl.ids)):
            starts = [p[0] for p in plan(wl, chunk)]
            # every other batch one layer a message: the multi-message path a large transfer takes
            handles.append(send_sequence(source, chunk, dst=1, starts=starts,
                                         message_bytes=1 if i % 2 else None))
        # the source may change at once: its rows were copied out
        for sid in wl.ids[::3]:
            source.remove_sequence(sid)
        for h in handles:
            assert h.wait() == h.seq_ids
        return
    dest = make_cache(dst_backend, config(ps_b, dtype, rope, sliding, **cfg))
    for chunk in chunks(wl.ids):
        p = plan(wl, chunk)
        h = recv_sequence(dest, chunk, src=0, parent_ids=[x[1] for x in p],
                          fork_pos=[x[2] for x in p])
        assert not set(chunk) & set(dest.sequence_ids), "sequences appear only at wait()"
        if fp8 and dest.is_empty:
            assert [dest.kv_scales(x) for x in layers] == [None] * len(layers), \
                "scales are adopted at wait(), not before"
        assert h.wait() == chunk and h.is_completed()
    dest.state.pt.check_invariants()
    assert sorted(dest.sequence_ids) == sorted(wl.ids)
    if fp8:
        assert [dest.kv_scales(x) for x in layers] == [source.kv_scales(x) for x in layers]
    for sid in wl.ids:
        assert_same_kv(source, sid, dest, sid)
        assert dest.state.seq(sid).window == source.state.seq(sid).window
        if fp8:
            assert np.array_equal(fp8_codes(source, sid), fp8_codes(dest, sid)), sid
        if kv_dtype in ("int8", "int4"):         # the packed rows (codes, scales, biases)
            a, b = source.export_sequence(sid), dest.export_sequence(sid)
            assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v), sid
    shared = sum(1 for sid in wl.forks if wl.forks[sid][1] >= ps_b)
    print(f"round {n}: {count} sequences ({len(wl.forks)} forks, {shared} sharing a page) "
          f"{src_backend}/{ps_a} -> {dst_backend}/{ps_b} {dtype} {rope} kv_dtype={kv_dtype} "
          f"ok", flush=True)


def refused_then_in_step(rank):
    """A receiver that refuses a header drains the data: the next transfer still pairs up."""
    cfg = config(4, "float32", "none")
    source = kvcache.PagedKVCache(cfg, backend="reference")
    source.add_sequence(1)
    run_forward(source, [1], [13], np.random.default_rng(0))
    if rank == 0:
        send_sequence(source, 1, dst=1).wait()
        send_sequence(source, [1], dst=1).wait()
        return
    import dataclasses
    narrow = kvcache.PagedKVCache(dataclasses.replace(cfg, num_kv_heads=1), backend="reference")
    try:
        recv_sequence(narrow, 5, src=0)
    except kvcache.InvalidArgumentError as exc:
        assert "num_kv_heads=2, this cache num_kv_heads=1" in str(exc), exc
    else:
        raise AssertionError("a mismatched header was accepted")
    assert narrow.is_empty
    dest = kvcache.PagedKVCache(cfg, backend="cuda", device="cpu")
    dest.add_sequence(9)
    run_forward(dest, [9], [2], np.random.default_rng(1))
    h = recv_sequence(dest, [5], src=0)
    dest.begin_forward([9], [1])
    try:
        h.wait()
    except kvcache.ForwardStateError:
        pass
    else:
        raise AssertionError("wait() inside a forward committed the sequences")
    dest.abort_forward()
    assert h.wait() == [5]
    assert_same_kv(source, 1, dest, 5)
    print("refused header drained; wait inside a forward retried ok", flush=True)


def _raw_send(msg: dict, k: np.ndarray, v: np.ndarray, dst: int, text: bytes = None,
              fixed: dict = None, corrupt: str = None) -> None:
    """A transfer written by hand (the wire format of kvcache.distributed), so that its header
    can be what no sender of ours writes."""
    import json
    import torch
    from kvcache.distributed.endpoints import _sums
    from kvcache.distributed.send import _tail
    from kvcache.distributed.transfer import head_message
    body = text if text is not None else json.dumps(msg).encode()
    nbytes, layers = k.nbytes, k.shape[0]
    per = 3                         # K and V of up to 3 layers a message (several messages)
    head, rest = head_message(body, nbytes, layers, per)
    if corrupt == "json":           # a JSON byte changed after its CRC was taken
        head[64 + body.index(b'"start"') + 3] ^= 0x01
    if fixed:                       # a fixed part no sender writes, and no data after it
        head[:40].view(np.int64)[:] = [fixed.get(f, x) for f, x in zip(
            ("magic", "size", "nbytes", "layers", "per"), head[:40].view(np.int64))]
        dist.send(torch.from_numpy(head), dst)
        return
    dist.send(torch.from_numpy(head), dst)
    if rest:
        dist.send(torch.frombuffer(bytearray(rest), dtype=torch.uint8), dst)
    sums = []
    for first in range(0, layers, per):
        part = torch.from_numpy(np.concatenate(
            [np.ascontiguousarray(a[first:first + per]).reshape(-1).view(np.uint8) for a in (k, v)]))
        sums.append(_sums(torch, part))
        if corrupt in ("K", "V") and (first == 0) == (corrupt == "K"):
            # one bit flipped after the sender's sums: in K of the first message, V of the last
            part = part.clone()
            part[3 if corrupt == "K" else -5] ^= 0x04
        dist.send(part, dst)
    dist.send(_tail(torch, True, sums, torch.device("cpu")), dst)


MALFORMED = [
    # (label, what the receiver's error names)
    ("no shape", "lacks ['shape']"),
    ("no nbytes", "lacks ['nbytes']"),
    ("a payload without head_dim", "lacks ['head_dim']"),
    ("top-level kv_dtype float16 over float32 payloads", "bytes"),
    ("a payload kv_dtype float16 under a float32 transfer", "kv_dtype=float16"),
    ("tokens that do not add up", "tokens"),
    ("not JSON", "not JSON"),
    # fixed parts no sender writes (issue 51: a negative size raised an untyped RuntimeError)
    ("a negative byte count", "announced -4096 bytes"),
    ("more bytes than the cache could hold", "more than this cache could hold"),
    ("a negative header size", "a header of -5 bytes"),
    ("another magic", "not a kvcache transfer of this version"),
]
FIXED = {"a negative byte count": {"nbytes": -4096},
         "more bytes than the cache could hold": {"nbytes": 1 << 40},
         "a negative header size": {"size": -5},
         "another magic": {"magic": 0x6B76_6361_6368_65}}


def malformed_then_in_step(rank):
    """Headers the receiver refuses (issue 28: a missing field left the K/V unconsumed and the
    next transfer aborted the process): each refused, typed, the cache unchanged, the data
    drained, and a good transfer after them all arrives bit for bit."""
    import copy
    import json
    cfg = config(4, "float32", "none")
    source = kvcache.PagedKVCache(cfg, backend="reference")
    source.add_sequence(1)
    run_forward(source, [1], [13], np.random.default_rng(2))
    headers, k, v = source.export_sequences([1])
    shape = list(k.shape)
    good = {"version": 1, "kv_dtype": "float32", "shape": shape, "nbytes": k.nbytes,
            "payloads": [h.header() for h in headers]}
    if rank == 0:
        for label, _ in MALFORMED:
            msg, text = copy.deepcopy(good), None
            if label == "no shape":
                del msg["shape"]
            elif label == "no nbytes":
                del msg["nbytes"]
            elif label.startswith("a payload without"):
                del msg["payloads"][0]["head_dim"]
            elif label.startswith("top-level"):
                msg["kv_dtype"] = "float16"
            elif label.startswith("a payload kv_dtype"):
                msg["payloads"][0]["kv_dtype"] = "float16"
            elif label.startswith("tokens"):
                msg["payloads"][0]["num_tokens"] = 12
            elif label == "not JSON":
                text = b"{not json"
            _raw_send(msg, k, v, 1, text, FIXED.get(label))
        send_sequence(source, [1], dst=1).wait()
        return
    # KVCACHE_TRANSFER_GPU=1: the receiving cache on the GPU (gloo stages through the host)
    gpu = os.environ.get("KVCACHE_TRANSFER_GPU") == "1"
    dest = kvcache.PagedKVCache(cfg, backend="cuda", device="cuda" if gpu else "cpu")
    free = dest.num_available_pages
    for label, names in MALFORMED:
        try:
            recv_sequence(dest, 5, src=0)
        except kvcache.KVCacheError as exc:
            assert names in str(exc), (label, exc)
        else:
            raise AssertionError(f"a transfer with {label} was accepted")
        assert dest.is_empty and dest.num_available_pages == free, label
    assert recv_sequence(dest, [5], src=0).wait() == [5]
    assert_same_kv(source, 1, dest, 5)
    print(f"{len(MALFORMED)} malformed headers refused and drained; the next transfer arrived "
          f"(receiver on {dest.backend.device})", flush=True)


def quantized_edges(rank):
    """fp8 into a plain cache only with convert_dtype (the values, as they read); packed int8
    rows into an int4 cache (or one of another group size) refused with the data drained, into
    an int8 cache of the same group stored unchanged: the transfers still pair up."""
    fp8 = kvcache.PagedKVCache(config(4, "float32", "normal", kv_dtype=FP8), backend="reference")
    fp8.add_sequence(1)
    run_forward(fp8, [1], [11], np.random.default_rng(3))
    plain_cfg = config(4, "float32", "normal")
    plain = kvcache.PagedKVCache(plain_cfg, backend="reference")
    plain.add_sequence(1)
    run_forward(plain, [1], [6], np.random.default_rng(4))
    int8 = kvcache.PagedKVCache(config(4, "float32", "normal", kv_dtype="int8"),
                                backend="reference")
    int8.add_sequence(1)
    run_forward(int8, [1], [3], np.random.default_rng(5))
    if rank == 0:
        send_sequence(fp8, [1], dst=1).wait()             # refused: no convert_dtype
        send_sequence(fp8, [1], dst=1).wait()             # taken with convert_dtype
        send_sequence(int8, [1], dst=1).wait()            # refused by an int4 receiver
        send_sequence(int8, [1], dst=1).wait()            # refused by a group-32 int8 one
        send_sequence(int8, [1], dst=1).wait()            # taken by an int8 one
        send_sequence(plain, [1], dst=1).wait()           # the next one pairs up
        return
    dest = kvcache.PagedKVCache(plain_cfg, backend="cuda", device="cpu")
    free = dest.num_available_pages
    try:
        recv_sequence(dest, [5], src=0)
    except kvcache.InvalidArgumentError as exc:
        assert "convert_dtype=True" in str(exc), exc
    else:
        raise AssertionError("an fp8 transfer was taken by a plain cache without conversion")
    assert dest.is_empty and dest.num_available_pages == free
    assert recv_sequence(dest, [5], src=0, convert_dtype=True).wait() == [5]
    assert_same_kv(fp8, 1, dest, 5)
    for other in (dict(kv_dtype="int4"), dict(kv_dtype="int8", kv_quant_group=32)):
        wrong = kvcache.PagedKVCache(config(4, "float32", "normal", **other),
                                     backend="reference")
        try:
            recv_sequence(wrong, [5], src=0, convert_dtype=True)
        except kvcache.InvalidArgumentError as exc:
            assert "stored unchanged" in str(exc), exc
        else:
            raise AssertionError(f"packed int8 rows were taken by a cache of {other}")
        assert wrong.is_empty and wrong.num_available_pages == wrong.num_total_pages
    same = kvcache.PagedKVCache(config(4, "float32", "normal", kv_dtype="int8"),
                                backend="reference")
    assert recv_sequence(same, [5], src=0).wait() == [5]
    assert_same_kv(int8, 1, same, 5)
    a, b = int8.export_sequence(1), same.export_sequence(5)
    assert np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)
    assert recv_sequence(dest, [6], src=0).wait() == [6]
    assert_same_kv(plain, 1, dest, 6)
    print("fp8 into a plain cache only converted; packed int8 rows only into int8 of the same "
          "group, in step", flush=True)


def long_header_in_step(rank):
    """One batch of 160 short sequences: its JSON header outgrows the fixed-size head message
    and goes on in a second one; everything arrives, and the next transfer is in step."""
    cfg = config(4, "float32", "normal", max_total_tokens=4096)
    source = kvcache.PagedKVCache(cfg, backend="reference")
    ids = list(range(160))
    rng = np.random.default_rng(5)
    for sid in ids:
        source.add_sequence(sid)
        run_forward(source, [sid], [3], rng)
    if rank == 0:
        send_sequence(source, ids, dst=1).wait()
        send_sequence(source, [7], dst=1).wait()
        assert CONTINUED, "the batch's JSON fit the head: the test does not reach the second message"
        return
    dest = kvcache.PagedKVCache(cfg, backend="reference")
    assert recv_sequence(dest, ids, src=0).wait() == ids
    assert recv_sequence(dest, [1000], src=0).wait() == [1000]
    for sid in ids:
        assert_same_kv(source, sid, dest, sid)
    assert_same_kv(source, 7, dest, 1000)
    print("a header longer than the head message arrives in two; in step after", flush=True)


def corrupted_on_the_wire(rank):
    """Issue 51: K/V on the wire carried no checksum, so a flipped bit arrived silently, and a
    changed header was read as sent. A bit of K in the first data message, of V in the last,
    a byte of the JSON: each refused typed (the data's at wait(), naming the layers), the cache
    unchanged, and the next transfer arrives bit for bit."""
    cfg = config(4, "float32", "none", layers=5)
    source = kvcache.PagedKVCache(cfg, backend="reference")
    source.add_sequence(1)
    run_forward(source, [1], [11], np.random.default_rng(8))
    headers, k, v = source.export_sequences([1])
    msg = {"version": 1, "kv_dtype": "float32", "shape": list(k.shape), "nbytes": k.nbytes,
           "payloads": [h.header() for h in headers]}
    cases = ("K", "V", "json")
    if rank == 0:
        for corrupt in cases:
            _raw_send(msg, k, v, 1, corrupt=corrupt)
        send_sequence(source, [1], dst=1).wait()
        return
    dest = kvcache.PagedKVCache(cfg, backend="reference")
    before = snapshot(dest)
    for corrupt in cases:
        try:
            recv_sequence(dest, [5], src=0).wait()
        except kvcache.KVCacheError as exc:
            want = "CRC-32" if corrupt == "json" else "changed on the way"
            assert want in str(exc), (corrupt, exc)
            if corrupt == "K":
                assert "layers [0, 1, 2]" in str(exc), exc
            if corrupt == "V":
                assert "layers [3, 4]" in str(exc), exc
        else:
            raise AssertionError(f"a transfer with a changed {corrupt} was kept")
        assert snapshot(dest) == before, corrupt
    assert recv_sequence(dest, [5], src=0).wait() == [5]
    assert_same_kv(source, 1, dest, 5)
    print("a flipped bit of K, of V, of the JSON: refused; in step after", flush=True)


def streamed_in_step(rank, backend):
    """send_sequence inside the forward that writes the sequences (issue 50: a prefill rank
    sends layer i while layer i+1 computes): each layer's message is posted before the next
    layer's attention is called, what arrives is the sequences after the forward bit for bit;
    a send begun after some layers ran and grouped two layers a message too; a send whose
    forward is aborted leaves the receiver unchanged with a typed error, in step for the next."""
    import torch
    cfg = config(4, "bfloat16" if backend == "cuda" else "float32", "normal", layers=5)
    rng = np.random.default_rng(11)
    source = make_cache(backend, cfg)
    for sid in (1, 2):
        source.add_sequence(sid)
        run_forward(source, [sid], [6 + sid], rng)
    if rank == 0:
        events = []
        real = dist.isend

        def isend(tensor, dst, *args, **kw):
            events.append("send")
            return real(tensor, dst, *args, **kw)
        dist.isend = isend
        try:
            def forward(ids, lens, send_at, abort=False, **kw):
                h = None
                cache_before = source.sequence_length(ids[0])
                source.begin_forward(ids, lens)
                for layer in range(cfg.num_layers):
                    if layer == send_at:
                        h = send_sequence(source, ids, dst=1, **kw)
                        try:
                            h.wait()
                        except kvcache.ForwardStateError:
                            pass
                        else:
                            raise AssertionError("a send's wait() returned inside its forward")
                    x = [source.from_numpy(rng.standard_normal(
                        (sum(lens), h_, cfg.head_dim)).astype(np.float32))
                         for h_ in (cfg.num_qo_heads, cfg.num_kv_heads, cfg.num_kv_heads)]
                    events.append(f"layer {layer}")
                    source.attention(layer, *x)
                    if abort and layer == 2:
                        source.abort_forward()
                        assert source.sequence_length(ids[0]) == cache_before
                        return h
                source.end_forward()
                return h
            events.clear()
            h = forward([1, 2], [5, 3], send_at=0)
            assert h.wait() == [1, 2]
            order = [e for e in events if e.startswith("layer") or e == "send"]
            # the head first, then each layer's message right after that layer, then the status
            want = ["send"] + [x for layer in range(5) for x in (f"layer {layer}", "send")] + ["send"]
            assert order == want, order
            send_sequence(source, [1, 2], dst=1).wait()     # the same, sent after the forward
            h = forward([2], [4], send_at=2, message_bytes=1 << 40)   # the rest in one message
            assert h.wait() == [2]
            send_sequence(source, [2], dst=1).wait()
            h = forward([1], [2], send_at=1, abort=True)
            assert h.wait() == [1]          # the sender's side finished its messages
            send_sequence(source, [1], dst=1).wait()
        finally:
            dist.isend = real
        return
    dest = make_cache(backend, cfg)
    assert recv_sequence(dest, [10, 20], src=0).wait() == [10, 20]
    assert recv_sequence(dest, [11, 21], src=0).wait() == [11, 21]
    assert recv_sequence(dest, [30], src=0).wait() == [30]
    assert recv_sequence(dest, [31], src=0).wait() == [31]
    before = snapshot(dest)
    h = recv_sequence(dest, [40], src=0)
    try:
        h.wait()
    except kvcache.KVCacheError as exc:
        assert "aborted the forward" in str(exc), exc
    else:
        raise AssertionError("a transfer whose forward was aborted was kept")
    assert snapshot(dest) == before
    assert recv_sequence(dest, [50], src=0).wait() == [50]
    # each streamed copy against the same sequences sent after their forward
    for streamed, plain in ((10, 11), (20, 21), (30, 31), (50, 11)):
        assert_same_kv(dest, plain, dest, streamed)
    assert [dest.sequence_length(x) for x in (10, 20, 30)] == [7 + 5, 8 + 3, 8 + 3 + 4]
    print(f"sends inside their forwards ({backend}): layer by layer, grouped, aborted; in step",
          flush=True)


def main():
    rank, init = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    t0 = time.perf_counter()
    _counting_heads()
    try:
        for n, case in enumerate(ROUNDS):
            one_round(rank, n, *case)
        long_header_in_step(rank)
        corrupted_on_the_wire(rank)
        streamed_in_step(rank, "reference")
        streamed_in_step(rank, "cuda")
        refused_then_in_step(rank)
        malformed_then_in_step(rank)
        quantized_edges(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    print(f"rank {rank} done in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
