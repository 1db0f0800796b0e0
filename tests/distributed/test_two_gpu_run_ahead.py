"""Cross-process run-ahead on two GPUs (NCCL): transfers queued behind forwards with no host
wait for them, every output read only at the end, equal bit for bit to one GPU doing the same.

Rank 0 prefills sequences and decodes them a few steps, keeps the GPU busy (a long sleep kernel
queued first), sends the sequences while that work is still queued, then goes on decoding its own
copies: its outputs after the send are the single-GPU run. Rank 1 keeps its own GPU busy too,
receives the sequences (the writes queue behind the data's arrival; ``wait()`` returns at once)
and decodes them with the same inputs (drawn on each GPU from one seed). Nothing is read on the
host until the end; then rank 1's outputs go to rank 0 and are compared with its own. The
``inside-the-prefill`` case sends from inside the prefill forward instead (each layer as it is
written; rank 1's ``wait()`` waits for the last message on its side stream only).

Runs where the host has two CUDA GPUs (``tools/gpu_two.sh``'s ``runahead`` step); elsewhere it is
skipped: the same protocol runs over gloo in ``test_distributed.py``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
        and torch.distributed.is_nccl_available()):
    pytest.skip("needs two CUDA GPUs and NCCL", allow_module_level=True)

from kvcache.distributed.tp import spawn  # noqa: E402

LAYERS, HQ, HKV, D = 4, 8, 2, 64
LENGTHS = (37, 300, 5, 128)
STEPS = 6


def _draw(gen, device, *shape):
    return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)


def _decode(cache, ids, gen, device, outs):
    """STEPS decode steps over ``ids``; every output kept on the device (a copy, queued),
    read at the end."""
    for _ in range(STEPS):
        with cache.forward(ids, [1] * len(ids)):
            for layer in range(LAYERS):
                n = len(ids)
                q, k, v = (_draw(gen, device, n, h, D) for h in (HQ, HKV, HKV))
                outs.append(cache.attention(layer, q, k, v).clone())


def _rank(rank: int, world: int, streamed: bool = False) -> dict:
    import torch.distributed as dist

    import kvcache
    from kvcache.distributed import recv_sequence, send_sequence
    device = f"cuda:{rank}"
    torch.cuda.set_device(device)
    cfg = kvcache.CacheConfig(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                              page_size=16, dtype="bfloat16", rope_mode="none",
                              max_total_tokens=4096, max_batch_size=8, prefill_chunk_size=1024)
    cache = kvcache.PagedKVCache(cfg, backend="cuda", device=device)
    ids = list(range(len(LENGTHS)))
    after: list = []
    with torch.inference_mode():
        torch.cuda._sleep(200_000_000)          # ~0.1 s of GPU time queued ahead of everything
        if rank == 0:
            gen = torch.Generator(device=device).manual_seed(1)
            for sid in ids:
                cache.add_sequence(sid)
            with cache.forward(ids, list(LENGTHS)):
                # streamed: sent from inside the prefill, each layer as it is written
                handles = [send_sequence(cache, ids, dst=1)] if streamed else []
                for layer in range(LAYERS):
                    t = sum(LENGTHS)
                    q, k, v = (_draw(gen, device, t, h, D) for h in (HQ, HKV, HKV))
                    cache.attention(layer, q, k, v)
            if not streamed:
                _decode(cache, ids, gen, device, [])
                # sent while the prefill and decode steps above may still be queued; half the
                # batches in messages of one layer each
                handles = [send_sequence(cache, ids[:2], dst=1),
                           send_sequence(cache, ids[2:], dst=1, message_bytes=1)]
            cont = torch.Generator(device=device).manual_seed(2)
            _decode(cache, ids, cont, device, after)        # the single-GPU continuation
            for h in handles:
                h.wait()
            theirs = [torch.empty_like(o) for o in after]
            for t in theirs:
                dist.recv(t, 1)
            same = all(torch.equal(a, b) for a, b in zip(after, theirs))
            return {"same": same, "outputs": len(after),
                    "nonzero": bool(all(a.abs().sum() > 0 for a in after))}
        if streamed:
            got = recv_sequence(cache, ids, src=0).wait()
        else:
            got = (recv_sequence(cache, ids[:2], src=0).wait()
                   + recv_sequence(cache, ids[2:], src=0).wait())
        cont = torch.Generator(device=device).manual_seed(2)
        _decode(cache, got, cont, device, after)
        lengths = [cache.sequence_length(s) for s in got]
        for t in after:                                     # read only now, at the end
            dist.send(t.contiguous(), 0)
        torch.cuda.synchronize(device)
        return {"lengths": lengths}


@pytest.mark.parametrize("streamed", [False, True], ids=["after", "inside-the-prefill"])
def test_transfers_queued_behind_forwards_match_one_gpu(streamed):
    ranks = spawn(_rank, 2, args=(streamed,), backend="nccl", timeout_s=300)
    assert ranks[0]["outputs"] == STEPS * LAYERS and ranks[0]["nonzero"]
    assert ranks[0]["same"]
    assert ranks[1]["lengths"] == [n + STEPS * (1 if streamed else 2) for n in LENGTHS]
