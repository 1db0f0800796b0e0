"""``kvcache demo --disaggregate``: prefill and decode in two processes, the KV moving between them.

Both ranks drive an ``Engine`` (the transformers one) through its online API; the only code here
is the hand-off between them:

* rank 0, the prefill worker, adds each prompt with ``hold_kv=True`` and ``max_tokens=1``: the
  engine prefills it (chunked, batched with the others, shared system prompts forked) and picks
  the first new token; the finished request keeps its sequence in the cache, exactly the
  prompt's KV, named by its last ``RequestOutput.seq_id``. When every request of a group (of
  ``--group``) has finished, rank 0 sends the group's sequences with one
  ``kvcache.distributed.send_sequence`` call (asynchronous) and their first tokens, then
  ``release``\\ s them. The next group is queued while one is in flight, so the engine prefills it
  while the last one is on the wire;
* rank 1, the decode worker, receives each group with ``recv_sequence`` under ids from
  ``engine.new_seq_id()`` and adds each request as its prompt plus the first token with
  ``kv_seq_id=`` that sequence: the engine runs only the first token (as the prompt's last
  chunk) and decodes the rest, greedily, to ``--max-output`` tokens.

The check: rank 1's tokens equal those of the single-process ``Engine`` on the same model and
prompts, for every request. On a GPU every Engine runs with ``deterministic=True`` (unless
``--no-deterministic``), so identity is asked in bfloat16 too; without it a 16-bit run's
differing token is judged by a teacher-forced near-tie re-score, and said so. Both ranks build the same model from the same seed (a family's small
random model, or a local checkpoint directory). Transport: gloo on CPUs; NCCL when the device is
a GPU and the host has two (rank r on ``cuda:r``), else the ranks run on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from . import non_negative_int, positive_int
from .check import rescore_greedy
from .real import build_model
from .workload import make_workload

__all__ = ["build_parser", "main", "run"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache demo --disaggregate",
        description="Prefill on one process, decode on another, each driving an Engine: each "
                    "request's KV moves from the prefill rank's cache to the decode rank's cache "
                    "over torch.distributed; the tokens are checked against the single-process "
                    "Engine.")
    p.add_argument("--disaggregate", action="store_true", required=True)
    p.add_argument("--model", default="llama", help="llama (default), qwen2, mistral, phi3, gemma, "
                   "or a checkpoint directory")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="cpu, or cuda (needs two GPUs: rank r on cuda:r; default: cuda if the host "
                        "has two, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="workload and weight seed (default 0)")
    p.add_argument("--requests", type=positive_int, default=12, help="number of requests (default 12)")
    p.add_argument("--max-output", type=positive_int, default=16,
                   help="new tokens per request (default 16)")
    p.add_argument("--long-prompt", type=positive_int, default=300,
                   help="tokens of a long prompt (default 300)")
    p.add_argument("--group", type=positive_int, default=4,
                   help="requests per transfer (one send_sequence call; default 4)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=128,
                   help="most tokens in one prefill forward (default 128)")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="every Engine (both ranks and the single-process one) with "
                        "deterministic=True, so the check asks for identical tokens (default: on "
                        "with --device cuda, whose bfloat16 rounding would otherwise depend on "
                        "the batch; off on the CPU, whose float32 check asks for identity "
                        "anyway)")
    p.add_argument("--timeout", type=non_negative_int, default=600,
                   help="seconds the two processes may take (default 600)")
    p.add_argument("--quiet", action="store_true", help="no status line on stderr")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _engine(opts: dict, rank: int, prompts: list):
    """This rank's model (built from the seed, as on every rank) and Engine."""
    import torch

    from kvcache.integrations.transformers import Engine
    device = f"cuda:{rank}" if opts["device"] == "cuda" else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    model, _ = build_model(opts["model"], opts["seed"], opts["dtype"])
    model = model.to(device)
    engine = Engine(model, backend=opts["backend"], max_total_tokens=opts["capacity"],
                    max_batch_size=opts["group"] * 2, prefill_chunk_size=opts["prefill_chunk_size"],
                    deterministic=opts["deterministic"])
    engine.progress = False
    _warm_up(engine, opts, prompts)
    return torch, engine


def _warm_up(engine, opts: dict, prompts: list) -> None:
    """The workload once through ``engine`` before the clock starts, its token ids shifted (the
    same shapes, nothing for the prefix cache to reuse), so that kernel compiles and graph
    captures are not counted as time to first token."""
    engine.generate(_shifted(engine, prompts), max_new_tokens=opts["max_output"], ignore_eos=True)


def _shifted(engine, prompts: list) -> list:
    vocab = engine.adapter.vocab_size
    return [[1 + (t % (vocab - 1)) for t in p] for p in prompts]


def _counters(engine) -> dict:
    import dataclasses
    return {k: v for k, v in dataclasses.asdict(engine.stats).items() if isinstance(v, int)}


def _since(engine, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in _counters(engine).items()}


def _groups(count: int, size: int) -> list:
    return [list(range(g, min(g + size, count))) for g in range(0, count, size)]


def _prefill_groups(engine, prompts: list, group: int, hand_off) -> list:
    """Prefill ``prompts`` on ``engine`` (``hold_kv``, first token only) in groups of ``group``,
    one group queued ahead; ``hand_off(g, [(sequence id, first token)])`` takes each finished
    group before its requests are released. Returns when each prompt's first token was picked
    (``time.monotonic()``), in prompt order."""
    from kvcache.integrations import SamplingParams
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    groups = _groups(len(prompts), group)
    held: dict = {}                 # request id -> (sequence id, first token)
    first_at: dict = {}             # request id -> when its first token was picked

    def queue(g: int) -> list:
        return [engine.add_request(prompts[i], first, hold_kv=True) for i in groups[g]]

    queued = [queue(g) for g in range(min(2, len(groups)))]
    for g in range(len(groups)):
        while not all(r in held for r in queued[g]):
            for out in engine.step():
                if out.finished:
                    held[out.request_id] = (out.seq_id, out.new_token_ids[0])
                    first_at[out.request_id] = time.monotonic()
        hand_off(g, [held[r] for r in queued[g]])
        for r in queued[g]:         # the rows are copied out: the pages may go
            engine.release(r)
        if g + 2 < len(groups):     # one group ahead: prefilled while this one is on the wire
            queued.append(queue(g + 2))
    return [first_at[r] for q in queued for r in q]


def _prefill_rank(opts: dict, prompts: list) -> dict:
    """Rank 0: prefill every prompt (``hold_kv``), send each group's KV and first tokens."""
    import torch.distributed as dist

    from kvcache.distributed import send_sequence
    torch, engine = _engine(opts, 0, prompts)
    # the prefill side's own shapes (its groups, one token each) once more before the clock
    _prefill_groups(engine, _shifted(engine, prompts), opts["group"], lambda g, held: None)
    handles: list = []

    def hand_off(g: int, held: list) -> None:
        handles.append(send_sequence(engine.cache, [sid for sid, _ in held], dst=1))
        tokens = torch.tensor([tok for _, tok in held], dtype=torch.int64)
        dist.send(tokens.to(opts["wire"]), 1)

    before = _counters(engine)
    dist.barrier()                  # both engines warm: the clock starts on both ranks now
    t0 = time.monotonic()
    first_at = _prefill_groups(engine, prompts, opts["group"], hand_off)
    for handle in handles:
        handle.wait()
    s = _since(engine, before)
    sent_tokens = sum(len(p) for p in prompts)
    return dict(prefill_s=time.monotonic() - t0, prompt_tokens=sent_tokens,
                forwards=s["forwards"], prefill_tokens=s["prefill_tokens"], forks=s["forks"],
                shared_prefix_tokens=s["shared_prefix_tokens"],
                kv_bytes=sent_tokens * engine.cache.config.token_kv_bytes,
                first_token_s=[t - t0 for t in first_at])


def _decode_rank(opts: dict, prompts: list) -> dict:
    """Rank 1: receive each group, adopt its sequences and decode them to ``max_output``."""
    import torch.distributed as dist

    from kvcache.distributed import recv_sequence
    from kvcache.integrations import SamplingParams
    torch, engine = _engine(opts, 1, prompts)
    new = opts["max_output"]
    rest = SamplingParams(max_tokens=max(new - 1, 1), temperature=0.0, ignore_eos=True)
    out: dict = {}
    done_at: dict = {}              # prompt index -> when its last token was picked
    recv_s = 0.0
    before = _counters(engine)
    dist.barrier()
    t0 = time.monotonic()
    for ids in _groups(len(prompts), opts["group"]):
        t1 = time.monotonic()
        sids = [engine.new_seq_id() for _ in ids]
        recv_sequence(engine.cache, sids, src=0).wait()
        first = torch.zeros(len(ids), dtype=torch.int64, device=opts["wire"])
        dist.recv(first, 0)
        recv_s += time.monotonic() - t1
        by_request = {}
        for i, sid, tok in zip(ids, sids, first.tolist()):
            out[i] = [int(tok)]
            if new > 1:
                by_request[engine.add_request(prompts[i] + [int(tok)], rest, kv_seq_id=sid)] = i
            else:
                engine.cache.remove_sequence(sid)
                done_at[i] = time.monotonic()
        while engine.has_unfinished():
            for o in engine.step():
                out[by_request[o.request_id]].extend(o.new_token_ids)
                if o.finished:
                    done_at[by_request[o.request_id]] = time.monotonic()
    s = _since(engine, before)
    return dict(decode_s=time.monotonic() - t0, recv_s=recv_s, forwards=s["forwards"],
                prefill_tokens=s["prefill_tokens"], decode_tokens=s["decode_tokens"],
                graph_forwards=s["graph_forwards"], tokens=[out[i] for i in range(len(prompts))],
                last_token_s=[done_at[i] - t0 for i in range(len(prompts))])


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
        from kvcache.cli_kit import UsageError
        raise UsageError(f"--device cuda needs two GPUs for --disaggregate, this host has "
                         f"{torch.cuda.device_count()}; leave out --device (two GPUs, else the "
                         f"CPU) or pass --device cpu")
    dtype = "float32" if device == "cpu" else "bfloat16"
    deterministic = device == "cuda" if opts.deterministic is None else opts.deterministic
    model, what_model = build_model(opts.model, opts.seed, dtype)
    work = make_workload(opts.requests, opts.seed, model.config.vocab_size,
                         long_prompt=opts.long_prompt, max_output=opts.max_output)
    prompts = [r.prompt for r in sorted(work.requests, key=lambda r: r.rid)]   # all greedy here
    longest = max(len(p) for p in prompts) + opts.max_output + 16
    shared = dict(model=opts.model, seed=opts.seed, dtype=dtype, device=device,
                  backend=opts.backend, group=opts.group, max_output=opts.max_output,
                  prefill_chunk_size=opts.prefill_chunk_size, capacity=opts.group * longest * 2,
                  wire="cuda" if device == "cuda" else "cpu", deterministic=deterministic)
    if not opts.quiet:
        print(f"kvcache demo --disaggregate: {len(prompts)} requests, 2 processes "
              f"({'nccl' if device == 'cuda' else 'gloo'}) ...", file=sys.stderr)
    t0 = time.perf_counter()
    ranks = spawn(_rank_main, 2, args=(shared, prompts),
                  backend="nccl" if device == "cuda" else "gloo", timeout_s=opts.timeout)
    wall = time.perf_counter() - t0
    # the single-process Engine on the same model and prompts, on one device doing both: the
    # tokens to match, and the times to compare with
    model = model.to("cuda:0" if device == "cuda" else "cpu")
    engine = Engine(model, backend=opts.backend, max_total_tokens=shared["capacity"] * 2,
                    prefill_chunk_size=opts.prefill_chunk_size, deterministic=deterministic)
    engine.progress = False
    _warm_up(engine, shared, prompts)
    want, one = _serve_online(engine, prompts, opts.max_output)
    got = ranks[1]["tokens"]
    failures, judged, ties = [], [], 0
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        first = next(t for t in range(min(len(g), len(w))) if g[t] != w[t])
        # the decode rank's tokens re-scored by the model, teacher-forced (no cache, no batch):
        # a 16-bit run may part at a near-tie that the batch's rounding flipped
        near, problem = rescore_greedy(model, prompts[i], g, dtype)
        what = (f"request {i} ({len(prompts[i])} prompt tokens): token {first} is {g[first]} on "
                f"the decode rank, {w[first]} in one process")
        if problem is None and dtype != "float32" and not deterministic:
            ties += near
            judged.append(f"{what}; re-score: every token its argmax or a near-tie ({near})")
        else:
            asks = "a deterministic run" if deterministic else "a float32 run"
            failures.append(f"{what}; re-score: {problem or asks + ' asks for identity'}")
    same = sum(int(g == w) for g, w in zip(got, want))
    first_s = ranks[0]["first_token_s"]
    two = dict(ttft_s=first_s, tpot_s=[(e - f) / max(opts.max_output - 1, 1)
                                       for f, e in zip(first_s, ranks[1]["last_token_s"])])
    return dict(model=what_model, device=device, dtype=dtype, backend=engine.cache.backend.name,
                deterministic=deterministic,
                requests=len(prompts), identical=same, judged=judged, near_ties=ties, wall=wall,
                prefill=ranks[0], decode={k: v for k, v in ranks[1].items() if k != "tokens"},
                latency={"disaggregated": _latency(two), "one_device": _latency(one)},
                failures=failures, ok=not failures)


def _serve_online(engine, prompts: list, max_output: int) -> tuple:
    """Every prompt added at once to ``engine`` and stepped to the end: (tokens per prompt,
    per-request time to first token and time per later token, in seconds)."""
    from kvcache.integrations import SamplingParams
    params = SamplingParams(max_tokens=max_output, temperature=0.0, ignore_eos=True)
    t0 = time.monotonic()
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict = {r: [] for r in ids}
    first: dict = {}
    last: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            now = time.monotonic()
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now - t0
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                last[out.request_id] = now - t0
    return ([tokens[r] for r in ids],
            dict(ttft_s=[first[r] for r in ids],
                 tpot_s=[(last[r] - first[r]) / max(max_output - 1, 1) for r in ids]))


def _latency(times: dict) -> dict:
    import statistics
    return {f"{k[:-2]}_ms": {"median": 1e3 * statistics.median(v), "max": 1e3 * max(v)}
            for k, v in times.items()}


def main(argv) -> int:
    from kvcache.cli_kit import UsageError, backend_for
    if any(a == "--plot" or a.startswith("--plot=") for a in argv):
        raise UsageError("--plot draws the single-engine run; --disaggregate prints its two "
                         "ranks' numbers instead (leave out --plot)")
    parser = build_parser()
    opts, rest = parser.parse_known_args(argv)
    from . import build_parser as single_engine_parser
    single = {flag for action in single_engine_parser()._actions for flag in action.option_strings}
    theirs = sorted({a.split("=", 1)[0] for a in rest} & single)
    if theirs:
        raise UsageError(f"{' and '.join(theirs)} {'is' if len(theirs) == 1 else 'are'} the "
                         "single-engine demo's, not --disaggregate's (`kvcache demo "
                         "--disaggregate --help` lists its options)")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if opts.model == "synthetic":
        raise UsageError("--disaggregate runs a real architecture (--model llama, the default, "
                         "qwen2, mistral, phi3, gemma or a checkpoint directory), not the "
                         "synthetic model")
    from .real import check_model_name
    check_model_name(opts.model)                    # a bad --model: usage error, exit 2
    if opts.backend != "auto":
        backend_for(opts.backend, opts.device)
    if opts.json:
        opts.quiet = True
    r = run(opts)
    if opts.json:
        print(json.dumps(r, indent=2, default=str))
    else:
        p, d = r["prefill"], r["decode"]
        print(f"kvcache demo --disaggregate: {r['model']}, backend {r['backend']} on {r['device']}, "
              f"{r['dtype']}, 2 processes, each driving an Engine"
              f"{' (deterministic=True)' if r['deterministic'] else ''}")
        print(f"  rank 0 (prefill): {r['requests']} prompts, {p['prompt_tokens']} tokens "
              f"({p['prefill_tokens']} computed, {p['shared_prefix_tokens']} shared by "
              f"{p['forks']} forks) in {p['forwards']} forwards, {p['prefill_s']:.2f} s; KV "
              f"sent: {p['kv_bytes'] / 2**20:.1f} MiB in groups of {opts.group} requests")
        print(f"  rank 1 (decode):  {opts.max_output} tokens per request in {d['forwards']} "
              f"forwards ({d['prefill_tokens']} prompt tokens run: the first token of each), "
              f"{d['decode_s']:.2f} s (waiting for KV {d['recv_s']:.2f} s)")
        d1, one = r["latency"]["disaggregated"], r["latency"]["one_device"]
        print(f"  latency, median (max) over requests: time to first token "
              f"{d1['ttft_ms']['median']:.1f} ({d1['ttft_ms']['max']:.1f}) ms, per output token "
              f"{d1['tpot_ms']['median']:.2f} ({d1['tpot_ms']['max']:.2f}) ms; one device doing "
              f"both: {one['ttft_ms']['median']:.1f} ({one['ttft_ms']['max']:.1f}) ms, "
              f"{one['tpot_ms']['median']:.2f} ({one['tpot_ms']['max']:.2f}) ms")
        print(f"  check: {r['identical']}/{r['requests']} requests token-identical to the "
              f"single-process Engine" + (
                  f"; {len(r['judged'])} parted at near-ties only ({r['near_ties']} tokens), "
                  f"judged by a teacher-forced re-score on the model ({r['dtype']} without "
                  f"--deterministic)" if r["judged"] else ""))
        for f in (r["failures"] + r["judged"])[:10]:
            print(f"    {f}")
        print(f"  {'OK' if r['ok'] else 'FAILED'} ({r['wall']:.1f} s for the two processes)")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
