"""``kvcache bench --serving --workload shared-prefix | multi-turn``: what automatic prefix
caching buys, with the cache on and off in one run, and transformers' continuous batching on the
same prompts.

* ``shared-prefix``: ``--requests`` requests sharing one ``--system``-token system prompt, each
  with its own 16-64 token question, arriving one per engine step through ``add_request`` (a
  server's requests are not known in advance: with the cache off, only requests that arrive in
  the same step share their prefix, by a fork).
* ``multi-turn``: ``--requests`` conversations of ``--turns`` turns; each turn's prompt is the
  last turn's prompt and answer plus a 64-token message, the conversations of a turn added
  together (one ``generate``-like call per turn).

Per system: ``tokens_per_s`` (new tokens over the wall time of the measured run, after a warm-up
run of the same shape on other prompts), the median and p90 time to first token (from the
request's ``add_request`` to the step output carrying its first token), and with the cache on
the hit rate against the ideal: the tokens a cache of unbounded size would have held for each
request (whole pages of the longest prefix, at most ``len - 1``, that an earlier request had
computed before it arrived). Greedy tokens of the two Engine runs are compared.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Generator, Optional

import numpy as np

WORKLOADS = ("random", "shared-prefix", "multi-turn", "kv-budget", "window-budget", "tp")
TARGET_TOKENS = 3.0
"""Shared prefix: tokens/s with the cache over without: at least this."""
TARGET_TTFT = 5.0
"""Shared prefix: median time to first token without the cache over with: at least this."""
TARGET_HIT = 0.95
"""Hit tokens over the ideal's: at least this."""

PREFIX_SIZES = {"shared-prefix": {"requests": (256, 6), "new_tokens": (32, 4),
                                  "system": (2000, 40)},
                "multi-turn": {"requests": (32, 3), "new_tokens": (64, 4), "system": (512, 24)}}
"""Per workload, option: (default, default with --tiny); ``system`` is the first turn's prompt
length for multi-turn."""
TURNS = (4, 3)
MESSAGE = (64, 6)


def shared_prefix_prompts(requests: int, system: int, question: tuple, vocab: int,
                          seed: int) -> list:
    """``requests`` prompts: one random ``system``-token prefix, then a random question of
    ``question`` (inclusive range) tokens each; ids in ``[1, vocab)``."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, vocab, size=system).tolist()
    lengths = rng.integers(question[0], question[1] + 1, size=requests)
    return [head + rng.integers(1, vocab, size=int(n)).tolist() for n in lengths]


def ideal_hits(arrivals: list, page_size: int) -> list:
    """Per group of sequences (in arrival order: ``[(prompt, known_after)]`` per group, where
    ``known_after`` is what the cache may hold of that request once it is done, e.g. its prompt
    and answer): the hit tokens of an unbounded cache holding every earlier request's whole
    pages. Returns one list of hits per group."""
    seen: set = set()
    out = []
    for group in arrivals:
        hits = []
        for prompt, _ in group:
            best, h = 0, 0
            for d in range((len(prompt) - 1) // page_size):
                h = hash((h, tuple(prompt[d * page_size:(d + 1) * page_size])))
                if h not in seen:
                    break
                best = (d + 1) * page_size
            hits.append(best)
        for _, known in group:
            h = 0
            for d in range(len(known) // page_size):
                h = hash((h, tuple(known[d * page_size:(d + 1) * page_size])))
                seen.add(h)
        out.append(hits)
    return out


class Online:
    """Serve through an Engine's online API: ``groups`` of prompts, a group added before each
    step (the next only once the engine has stepped), greedy ``new_tokens`` each. Returns
    (tokens per prompt, time to first token per prompt in s, wall s). ``track_running``: keep
    ``peak_running``, the most sequences in the cache after any step (off by default: a walk
    over the sequences per step)."""

    def __init__(self, engine, new_tokens: int, track_running: bool = False):
        self.engine, self.new_tokens = engine, new_tokens
        self.track_running = track_running
        self.peak_running = 0

    def run(self, groups: list, wait_for_group: bool = False) -> tuple:
        from ...integrations.sampling import SamplingParams
        params = SamplingParams(max_tokens=self.new_tokens, temperature=0.0)
        eng = self.engine
        out: dict = {}
        added: dict = {}
        first: dict = {}
        order = []
        t0 = time.perf_counter()
        pending = list(groups)
        while pending or eng.has_unfinished():
            if pending and not (wait_for_group and eng.has_unfinished()):
                for prompt in pending.pop(0):
                    rid = eng.add_request(prompt, params)
                    added[rid] = time.perf_counter()
                    out[rid] = []
                    order.append(rid)
            for o in eng.step():
                if o.new_token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter()
                out[o.request_id].extend(o.new_token_ids)
            if self.track_running:
                self.peak_running = max(self.peak_running, eng.scheduler.num_running)
        wall = time.perf_counter() - t0
        return ([out[r] for r in order], [first[r] - added[r] for r in order], wall)


def _row(name: str, tokens: list, ttft: list, wall: float, hits: Optional[int],
         ideal: Optional[int]) -> dict:
    new = sum(len(t) for t in tokens)
    row = {"system": name, "new_tokens": new, "wall_s": wall, "tokens_per_s": new / wall,
           "ttft_median_ms": statistics.median(ttft) * 1e3 if ttft else None,
           "ttft_p90_ms": float(np.percentile(ttft, 90)) * 1e3 if ttft else None}
    if hits is not None:
        row.update(hit_tokens=hits, ideal_hit_tokens=ideal,
                   hit_rate_of_ideal=hits / ideal if ideal else None)
    return row


def run_prefix(args, net, device: str, backend: str, skip: set, say: Callable) -> dict:
    """The prefix workloads' result (JSON-ready) for parsed ``args`` on ``net``."""
    from ...integrations.transformers import Engine
    from .runners import GenerateBatchRunner, mixed_graphs_arg
    tiny = bool(args.tiny)
    # --deterministic: both Engines batch-invariant, so the cache on and off must give the same
    # tokens for every request (judged below)
    deterministic = bool(getattr(args, "deterministic", False))
    sizes = PREFIX_SIZES[args.workload]
    for name, (full, small) in sizes.items():
        if getattr(args, name, None) is None:
            setattr(args, name, small if tiny else full)
    page = 16
    vocab = net.config.vocab_size
    multi = args.workload == "multi-turn"
    turns = TURNS[1] if tiny else TURNS[0]
    message = MESSAGE[1] if tiny else MESSAGE[0]
    question = (2, 6) if tiny else (16, 64)
    if multi:
        longest = args.system + turns * (message + args.new_tokens)
    else:
        longest = args.system + question[1] + args.new_tokens
    batch = min(args.batch, args.requests) if multi else args.batch
    max_total = batch * (-(-longest // page) + 2) * page

    def make_groups(seed: int):
        """(groups of prompts per step or turn, the next turn's prompt from an answer)."""
        if multi:
            rng = np.random.default_rng(seed)
            firsts = [rng.integers(1, vocab, size=args.system).tolist() for _ in range(args.requests)]
            msgs = [[rng.integers(1, vocab, size=message).tolist() for _ in range(args.requests)]
                    for _ in range(turns)]
            return firsts, msgs
        prompts = shared_prefix_prompts(args.requests, args.system, question, vocab, seed)
        return [[p] for p in prompts], None

    def serve(engine, seed: int) -> tuple:
        runner = Online(engine, args.new_tokens)
        first, msgs = make_groups(seed)
        if not multi:
            tokens, ttft, wall = runner.run(first)
            return tokens, ttft, wall, [[(g[0], g[0])] for g in first]
        prompts, all_tokens, all_ttft, wall, arrivals = first, [], [], 0.0, []
        for t in range(turns):
            tokens, ttft, w = runner.run([prompts])
            all_tokens += tokens
            all_ttft += ttft
            wall += w
            # the last answer token was never fed to the model: its KV is not there
            arrivals.append([(p, p + a[:-1]) for p, a in zip(prompts, tokens)])
            prompts = [p + a + m for p, a, m in zip(prompts, tokens, msgs[t])]
        return all_tokens, all_ttft, wall, arrivals

    result: dict = {"workload": {"kind": args.workload, "requests": args.requests,
                                 "new_tokens": args.new_tokens, "page_size": page,
                                 "layers": args.layers, "tiny": tiny, "seed": args.seed,
                                 "a_kv_dtype": getattr(args, "kv_dtype", "auto"),
                                 "mixed_graphs": getattr(args, "mixed_graphs", None) or "default",
                                 "deterministic": deterministic},
                    "systems": {}, "skipped": {}, "ratios": {}}
    w = result["workload"]
    if multi:
        w.update(turns=turns, first_prompt=args.system, message=message)
    else:
        w.update(system=args.system, question=list(question), arrival="one request per step")
    outs = {}
    for key, on in (("on", True), ("off", False)):
        say(f"({key}) kvcache Engine, prefix cache {key}: warm-up run")
        engine = Engine(net, backend=backend, device=device, page_size=page,
                        max_batch_size=batch, max_total_tokens=max_total, prefix_cache=on,
                        kv_dtype=getattr(args, "kv_dtype", "auto"),
                        mixed_graphs=mixed_graphs_arg(args), deterministic=deterministic)
        engine.progress = False
        try:
            serve(engine, args.seed + 1000)             # other prompts: the measured run is cold
            before = engine.stats.prefix_hit_tokens
            say(f"({key}) measured run")
            tokens, ttft, wall, arrivals = serve(engine, args.seed)
            hits = engine.stats.prefix_hit_tokens - before if on else None
            ideal = sum(sum(h) for h in ideal_hits(arrivals, page)) if on else None
            result["systems"][key] = _row(f"kvcache Engine, prefix cache {key} "
                                          f"({engine.cache.backend.name})", tokens, ttft, wall,
                                          hits, ideal)
            outs[key] = tokens
            say(f"({key}) {result['systems'][key]['tokens_per_s']:.1f} tokens/s")
        finally:
            del engine
            _free(device)
    result["same_tokens_on_off"] = sum(a == b for a, b in zip(outs["on"], outs["off"]))
    result["compared"] = len(outs["on"])
    if "b" in skip:
        result["skipped"]["b"] = "--skip"
    else:
        say("(b) transformers generate_batch (paged|sdpa): all prompts at once per turn")
        runner = None
        try:
            runner = GenerateBatchRunner(net, None if device.startswith("cuda") else {
                "num_blocks": -(-max_total // 32) + 8, "block_size": 32, "max_batch_tokens": 256})
            first, msgs = make_groups(args.seed)
            t0 = time.perf_counter()
            new = 0
            if multi:
                prompts = first
                for t in range(turns):
                    got = runner.run(prompts, args.new_tokens)
                    new += sum(len(g) for g in got)
                    prompts = [p + a + m for p, a, m in zip(prompts, got, msgs[t])]
            else:
                new = sum(len(g) for g in runner.run([g[0] for g in first], args.new_tokens))
            wall = time.perf_counter() - t0
            result["systems"]["b"] = {"system": "transformers generate_batch (paged|sdpa), "
                                      "every prompt of a turn at once, one run (no warm-up)",
                                      "new_tokens": new, "wall_s": wall,
                                      "tokens_per_s": new / wall}
        except Exception as exc:        # a peer that cannot run here is reported, not hidden
            result["skipped"]["b"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        finally:
            if runner is not None:
                runner.close()
            _free(device)
    on, off = result["systems"]["on"], result["systems"]["off"]
    result["ratios"] = {"tokens_per_s_on_over_off": on["tokens_per_s"] / off["tokens_per_s"],
                        "ttft_median_off_over_on": off["ttft_median_ms"] / on["ttft_median_ms"],
                        "hit_rate_of_ideal": on["hit_rate_of_ideal"]}
    return result


def _free(device: str) -> None:
    import gc
    gc.collect()
    if device.startswith("cuda"):
        import torch
        torch.cuda.empty_cache()


def budget_run(make: Callable, describe: Callable, key: str, budget: int, warm: list,
               prompts: list, new_tokens: int, device: str, say: Callable,
               counters: tuple = ("preemptions",)) -> tuple:
    """One Engine's measured run of a fixed-budget workload (kv-budget, window-budget): the one
    round of ``budget_rounds`` (its arguments)."""
    rounds = budget_rounds(make, describe, key, budget, warm, prompts, new_tokens, device, say,
                           counters)
    try:
        return next(rounds)
    finally:
        rounds.close()


def budget_rounds(make: Callable, describe: Callable, key: str, budget: int, warm: list,
                  prompts: list, new_tokens: int, device: str, say: Callable,
                  counters: tuple = ("preemptions",),
                  rounds: int = 1) -> Generator[tuple, None, None]:
    """One Engine's measured runs of a fixed-budget workload (kv-budget, window-budget): the
    Engine ``make()`` builds, its page arrays refused over ``budget`` bytes, a warm-up run on
    the ``warm`` prompts and ``Engine.warm_up()`` (every graph bucket), then ``rounds`` timed
    runs of ``prompts`` (all added at once, ``new_tokens`` greedy tokens each), each from an
    empty prefix cache. ``describe(engine)``: ``(label, held, fields)``: the run in words
    (``"kv_dtype int8"``), what its pages hold in words (``"512 tokens"``), and the row's own
    fields. ``key``: the run's name in ``say``'s progress lines; ``counters``: the
    ``engine.stats`` fields counted over each timed run; ``device``: freed when closed. Yields
    ``(row, tokens)`` per round: ``_row``'s row with ``fields``, ``peak_running`` and the
    counters, and the greedy tokens per prompt."""
    # the Engine lives in this frame only (its runner too), so that it is freed (del, _free)
    # before the caller builds the next one
    engine = make()
    engine.progress = False
    cfg = engine.config
    label, held, fields = describe(engine)
    if cfg.kv_bytes > budget:           # the caller's sizing disagrees with the Engine's config
        raise RuntimeError(f"{label}: {cfg.kv_bytes} bytes of pages over the budget")
    runner = None
    try:
        say(f"({key}) kvcache Engine, {label}: {held} in {cfg.kv_bytes / 2**20:.2f} MiB; "
            f"warm-up run")
        runner = Online(engine, new_tokens, track_running=True)
        # other prompts first (they calibrate fp8 scales from real tokens), then every graph
        # bucket (other prompts meet fewer batch sizes than the measured run: the fp8 run of
        # kv-budget, holding more sequences, captured 9 graphs inside its timed run, 0.61x
        # then, 1.48x without)
        runner.run([warm])
        engine.warm_up()
        for i in range(rounds):
            # every round cold and alike: an earlier round left the same prompts' pages (the
            # warm-up run, other prompts' pages that the budget had to evict)
            engine.cache.clear_prefix_cache()
            before = dataclasses.replace(engine.stats)
            runner.peak_running = 0
            say(f"({key}) measured run" + (f" {i + 1}/{rounds}" if rounds > 1 else ""))
            tokens, ttft, wall = runner.run([prompts])
            row = _row(f"kvcache Engine, {label} ({engine.cache.backend.name})", tokens, ttft,
                       wall, None, None)
            row.update(fields, peak_running=runner.peak_running,
                       **{c: getattr(engine.stats, c) - getattr(before, c) for c in counters})
            say(f"({key}) {row['tokens_per_s']:.1f} tokens/s, peak {row['peak_running']} "
                f"sequences, {row['preemptions']} preemptions")
            yield row, tokens
    finally:
        del engine, runner
        _free(device)


def print_prefix_result(res: dict) -> None:
    w = res["workload"]
    if w["kind"] == "multi-turn":
        what = (f"{w['requests']} conversations x {w['turns']} turns (first prompt "
                f"{w['first_prompt']} tokens, then +{w['new_tokens']} answer +{w['message']} "
                f"message per turn)")
    else:
        what = (f"{w['requests']} requests: a {w['system']}-token system prompt + "
                f"{w['question'][0]}-{w['question'][1]} token questions, {w['arrival']}")
    print(f"kvcache bench --serving --workload {w['kind']}: {res.get('device', '')} "
          f"{res.get('date', '')}")
    print(f"  workload: {what}; {w['new_tokens']} new tokens each, {w['layers']} layers"
          f"{' (tiny dims)' if w['tiny'] else ''}, page {w['page_size']}, seed {w['seed']}"
          f"{'' if w.get('a_kv_dtype', 'auto') == 'auto' else ', kv ' + w['a_kv_dtype']}")
    print(f"{'system':<58} {'tokens/s':>10} {'wall s':>8} {'TTFT p50 ms':>12} "
          f"{'TTFT p90 ms':>12} {'hit/ideal':>10}")
    for key in ("on", "off", "b"):
        r = res["systems"].get(key)
        if r is None:
            print(f"({key}) skipped: {res['skipped'].get(key)}")
            continue
        p50 = "n/a" if r.get("ttft_median_ms") is None else f"{r['ttft_median_ms']:.1f}"
        p90 = "n/a" if r.get("ttft_p90_ms") is None else f"{r['ttft_p90_ms']:.1f}"
        hit = "" if r.get("hit_rate_of_ideal") is None else \
            f"{r['hit_tokens']}/{r['ideal_hit_tokens']}"
        print(f"({key:>3}) {r['system']:<52} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} "
              f"{p50:>12} {p90:>12} {hit:>10}")
    det = w.get("deterministic", False)
    print(f"greedy tokens equal with the cache on and off: {res['same_tokens_on_off']}/"
          f"{res['compared']} requests" + (" (deterministic=True: every one must be)" if det else
                                           " (deterministic=False: a 16-bit run may part at "
                                           "near-ties; --deterministic asks for every one)"))
    rt = res["ratios"]
    if det:
        same = res["same_tokens_on_off"] == res["compared"]
        print(f"  deterministic: every request's tokens equal with the cache on and off: "
              f"{'met' if same else 'MISSED'}")
    if w["tiny"]:
        print("targets: not judged on a --tiny smoke run")
        return
    print("targets (ratios; met when the comparison holds):")
    judged = [("hit rate / ideal", rt["hit_rate_of_ideal"], TARGET_HIT)]
    if w["kind"] == "shared-prefix":
        judged = [("tokens/s on / off", rt["tokens_per_s_on_over_off"], TARGET_TOKENS),
                  ("median TTFT off / on", rt["ttft_median_off_over_on"], TARGET_TTFT)] + judged
    else:
        print(f"  tokens/s on / off: {rt['tokens_per_s_on_over_off']:.2f}; median TTFT off / on: "
              f"{rt['ttft_median_off_over_on']:.2f} (not judged)")
    for label, x, target in judged:
        met = x is not None and x >= target
        shown = "n/a" if x is None else f"{x:.2f}"
        print(f"  {label}: {shown} (target >= {target}) {'met' if met else 'MISSED'}")
