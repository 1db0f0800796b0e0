"""``kvcache demo --disaggregate``: prefill and decode in two processes, the KV moving between them.

Rank 0 is the prefill worker: it runs each request's prompt through the model on its own cache
(chunked), picks the first new token, and sends the sequences' KV to rank 1 with
``kvcache.distributed.send_sequence`` (one call per group of requests, asynchronous: it prefills
the next group while the last one is on the wire). Rank 1 is the decode worker: it receives each
group with ``recv_sequence`` and decodes every received sequence greedily, batched, to
``--max-output`` tokens. The check: rank 1's tokens equal those of the single-process ``Engine``
on the same model and prompts, for every request.

Both ranks build the same model from the same seed (a family's small random model, or a local
checkpoint directory). Transport: gloo on CPUs; NCCL when the device is a GPU and the host has
two (rank r on ``cuda:r``), else the ranks run on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .real import add_workload_options, build_model, make_workload
from . import non_negative_int, positive_int

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache demo --disaggregate",
        description="Prefill on one process, decode on another: each request's KV moves from the "
                    "prefill rank's cache to the decode rank's cache over torch.distributed; the "
                    "tokens are checked against the single-process Engine.")
    p.add_argument("--disaggregate", action="store_true", required=True)
    p.add_argument("--model", default="llama", help="llama (default), qwen2, mistral, phi3, gemma, "
                   "or a checkpoint directory")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="cpu, or cuda (needs two GPUs: rank r on cuda:r; default: cuda if the host "
                        "has two, else cpu)")
    add_workload_options(p, requests=12, max_output=16, long_prompt=300)
    p.add_argument("--group", type=positive_int, default=4,
                   help="requests per transfer (one send_sequence call; default 4)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=128,
                   help="most tokens in one prefill forward (default 128)")
    p.add_argument("--timeout", type=non_negative_int, default=600,
                   help="seconds the two processes may take (default 600)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _setup(opts: dict, rank: int):
    """This rank's model (built from the seed, as on every rank), cache and adapter."""
    import torch

    import kvcache
    from kvcache.integrations.transformers import TransformersAdapter, cache_config
    device = f"cuda:{rank}" if opts["device"] == "cuda" else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    model, _ = build_model(opts["model"], opts["seed"], opts["dtype"])
    model = model.to(device)
    adapter = TransformersAdapter(model, "model")
    total = opts["capacity"]
    cfg = cache_config(model, max_total_tokens=total, max_batch_size=max(opts["group"], 1) * 2,
                       prefill_chunk_size=opts["prefill_chunk_size"])
    cache = kvcache.PagedKVCache(cfg, backend=opts["backend"], device=device)
    return torch, model, adapter, cache


def _prefill_rank(opts: dict, prompts: list) -> dict:
    """Rank 0: prefill each group, send its KV and first tokens to rank 1."""
    import torch.distributed as dist

    from kvcache.distributed import send_sequence
    torch, model, adapter, cache = _setup(opts, 0)
    chunk = opts["prefill_chunk_size"]
    sent_tokens, forwards, pending = 0, 0, []
    t0 = time.perf_counter()
    with adapter.session(cache), torch.inference_mode():
        for g0 in range(0, len(prompts), opts["group"]):
            ids = list(range(g0, min(g0 + opts["group"], len(prompts))))
            firsts = []
            for sid in ids:
                prompt = prompts[sid]
                cache.add_sequence(sid)
                for c0 in range(0, len(prompt), chunk):
                    part = prompt[c0:c0 + chunk]
                    last = c0 + len(part) == len(prompt)
                    with cache.forward([sid], [len(part)]):
                        logits = adapter.forward(
                            cache, np.asarray(part, np.int64), np.arange(c0, c0 + len(part)),
                            np.asarray([len(part) - 1] if last else [], np.int64))
                    forwards += 1
                firsts.append(int(adapter.greedy(logits)[0][0]))
            handle = send_sequence(cache, ids, dst=1)
            first = torch.tensor(firsts, dtype=torch.int64)
            dist.send(first.to(opts["wire"]), 1)
            sent_tokens += sum(len(prompts[s]) for s in ids)
            pending.append((handle, ids))
            # the sequences leave this cache once their pages are on the wire
            while pending and pending[0][0].is_completed():
                done, gone = pending.pop(0)
                done.wait()
                for sid in gone:
                    cache.remove_sequence(sid)
        for handle, gone in pending:
            handle.wait()
            for sid in gone:
                cache.remove_sequence(sid)
    return dict(prefill_s=time.perf_counter() - t0, prompt_tokens=sent_tokens, forwards=forwards,
                kv_bytes=sent_tokens * cache.config.token_kv_bytes)


def _decode_rank(opts: dict, prompts: list) -> dict:
    """Rank 1: receive each group and decode it greedily to ``max_output`` tokens."""
    import torch.distributed as dist

    from kvcache.distributed import recv_sequence
    torch, model, adapter, cache = _setup(opts, 1)
    new = opts["max_output"]
    out: dict = {}
    recv_s, forwards = 0.0, 0
    t0 = time.perf_counter()
    with adapter.session(cache), torch.inference_mode():
        for g0 in range(0, len(prompts), opts["group"]):
            ids = list(range(g0, min(g0 + opts["group"], len(prompts))))
            t1 = time.perf_counter()
            recv_sequence(cache, ids, src=0).wait()
            first = torch.zeros(len(ids), dtype=torch.int64, device=opts["wire"])
            dist.recv(first, 0)
            recv_s += time.perf_counter() - t1
            for sid, tok in zip(ids, first.tolist()):
                out[sid] = [int(tok)]
            live = list(ids)
            while live:
                toks = np.asarray([out[s][-1] for s in live], np.int64)
                pos = np.asarray([cache.sequence_length(s) for s in live], np.int64)
                with cache.forward(live, [1] * len(live)):
                    logits = adapter.forward(cache, toks, pos, np.arange(len(live), dtype=np.int64))
                forwards += 1
                picks = adapter.greedy(logits)[0]
                for s, tok in zip(live, picks.tolist()):
                    out[s].append(int(tok))
                for s in [s for s in live if len(out[s]) >= new]:
                    cache.remove_sequence(s)
                live = [s for s in live if len(out[s]) < new]
    return dict(decode_s=time.perf_counter() - t0, recv_s=recv_s, forwards=forwards,
                tokens=[out[i] for i in range(len(prompts))])


def _rank_main(rank: int, world: int, opts: dict, prompts: list) -> dict:
    return (_prefill_rank if rank == 0 else _decode_rank)(opts, prompts)


def run(opts) -> dict:
    """Run the two ranks and the single-process check; returns a summary (``ok``)."""
    from kvcache.distributed.tp import spawn
    from kvcache.integrations import require
    torch = require("torch", "transformers")
    from kvcache.integrations.transformers import Engine

    device = opts.device or ("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= 2
                             else "cpu")
    if device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"kvcache demo --disaggregate: --device cuda needs two GPUs, this host "
                         f"has {torch.cuda.device_count()}")
    dtype = "float32" if device == "cpu" else "bfloat16"
    model, what = build_model(opts.model, opts.seed, dtype)
    work = make_workload(opts.requests, opts.seed, model.config.vocab_size, opts.long_prompt)
    prompts = work.greedy + work.sampled              # every request greedy here
    longest = max(len(p) for p in prompts) + opts.max_output + 16
    shared = dict(model=opts.model, seed=opts.seed, dtype=dtype, device=device,
                  backend=opts.backend, group=opts.group, max_output=opts.max_output,
                  prefill_chunk_size=opts.prefill_chunk_size, capacity=opts.group * longest * 2,
                  wire="cuda" if device == "cuda" else "cpu")
    t0 = time.perf_counter()
    ranks = spawn(_rank_main, 2, args=(shared, prompts),
                  backend="nccl" if device == "cuda" else "gloo", timeout_s=opts.timeout)
    wall = time.perf_counter() - t0
    # the single-process Engine on the same model and prompts: the tokens to match
    model = model.to("cuda:0" if device == "cuda" else "cpu")
    engine = Engine(model, backend=opts.backend, max_total_tokens=shared["capacity"] * 2,
                    prefill_chunk_size=opts.prefill_chunk_size)
    engine.progress = False
    want = [o[0] for o in engine.generate(prompts, max_new_tokens=opts.max_output)]
    got = ranks[1]["tokens"]
    failures = []
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            first = next(t for t in range(len(w)) if g[t] != w[t])
            failures.append(f"request {i} ({len(prompts[i])} prompt tokens): token {first} is "
                            f"{g[first]} on the decode rank, {w[first]} in one process")
    same = sum(int(g == w) for g, w in zip(got, want))
    return dict(model=what, device=device, dtype=dtype, backend=engine.cache.backend.name,
                requests=len(prompts), identical=same, wall=wall, prefill=ranks[0],
                decode={k: v for k, v in ranks[1].items() if k != "tokens"},
                failures=failures, ok=not failures)


def main(argv) -> int:
    opts = build_parser().parse_args(argv)
    from kvcache.cli import backend_for
    if opts.backend != "auto":
        backend_for(opts.backend, None)
    r = run(opts)
    if opts.json:
        print(json.dumps(r, indent=2, default=str))
    else:
        p, d = r["prefill"], r["decode"]
        print(f"kvcache demo --disaggregate: {r['model']}, backend {r['backend']} on {r['device']}, "
              f"{r['dtype']}, 2 processes")
        print(f"  rank 0 (prefill): {r['requests']} prompts, {p['prompt_tokens']} tokens in "
              f"{p['forwards']} forwards, {p['prefill_s']:.2f} s; KV sent: "
              f"{p['kv_bytes'] / 2**20:.1f} MiB in groups of {opts.group} requests")
        print(f"  rank 1 (decode):  {opts.max_output} tokens per request in {d['forwards']} "
              f"forwards, {d['decode_s']:.2f} s (waiting for KV {d['recv_s']:.2f} s)")
        print(f"  check: {r['identical']}/{r['requests']} requests token-identical to the "
              f"single-process Engine")
        for f in r["failures"][:10]:
            print(f"    {f}")
        print(f"  {'OK' if r['ok'] else 'FAILED'} ({r['wall']:.1f} s for the two processes)")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
