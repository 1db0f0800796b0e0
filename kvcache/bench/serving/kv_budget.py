"""``kvcache bench --serving --workload kv-budget``: what a quantized KV format buys at a fixed
memory budget (issue 32's target: more concurrent sequences and higher tokens/s than 16-bit
pages, at a budget where 16-bit pages must preempt).

System (a), our Engine, runs twice on the random workload's seeded prompts (``--requests``, all
added at once, ``--batch`` sequences per forward at most), with one KV memory budget in bytes
(``--kv-budget-mib``): once with ``kv_dtype="auto"`` (the compute dtype: bfloat16 on a GPU,
float32 on a CPU) and once with ``--kv-dtype`` ("auto" here: float8_e4m3 where the backend
declares it, else int8). The budget becomes each run's page count through the format's
``CacheConfig.token_kv_bytes`` (the page arrays, spare page included, stay within it), so a
format of fewer bytes holds more tokens. The default budget holds half of what the batch needs
at once in the auto format: ``batch * (mean prompt + new tokens) / 2`` tokens (at least the
longest request), so the auto run must queue or preempt.

Per run, measured after a warm-up run of the same shape on other prompts (it calibrates fp8
scales) and ``Engine.warm_up()`` (every graph bucket): tokens/s, the median and p90 time to
first token (from the moment every request was added), the peak number of sequences in
the cache at once (``Scheduler.num_running`` after each step), the Engine's
preemptions and recomputed tokens, the pages and their token capacity, and whether preempted
sequences were parked in the host tier (the Engine's default on a GPU, every format). For
the pair: the ratios
quantized / auto of tokens/s and peak concurrency (targets: > 1.0 each) and the requests whose
greedy tokens are equal (a count, not a verdict: quantization changes tokens). ``--runs N``:
each Engine's timed run N times, the two interleaved, the ratios the medians of the rounds'.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ...config import KV_FORMATS
from .report import print_runs
from .model import random_prompt_range, workload
from .prefix import budget_rounds
from .rounds import interleave, per_round, put_ratio, put_rows, runs_note

KV_DTYPES = ("auto",) + KV_FORMATS
"""``--kv-dtype``'s choices: "auto" is the compute dtype (for kv-budget's quantized run:
``default_kv_dtype``)."""
KV_BUDGET_SIZES = {"requests": (256, 8), "batch": (64, 8)}
"""Option: (default, default with --tiny) where they differ from the random workload's."""
TARGET_RATIO = 1.0
"""Quantized over auto, tokens/s and peak concurrency: more than this."""
PAGE = 16


def default_kv_dtype(declared) -> str:
    """The quantized run's format for ``--kv-dtype auto``: float8_e4m3 (the issue's target),
    else int8, whichever the backend declares (``declared``: ``Capabilities.kv_dtypes``)."""
    for name in ("float8_e4m3", "int8"):
        if name in declared:
            return name
    raise ValueError("declares neither float8_e4m3 nor int8")


def budget_tokens(budget: int, token_bytes: int) -> int:
    """``max_total_tokens`` whose page arrays (``CacheConfig.kv_bytes``: one page more than the
    capacity) fit ``budget`` bytes at ``token_bytes`` per token; 0 when not even two pages do."""
    return max(0, budget // (PAGE * token_bytes) - 1) * PAGE


def token_bytes(net, kv_dtype: str, rope: str) -> int:
    """``CacheConfig.token_kv_bytes`` of ``net``'s cache in ``kv_dtype``, as the Engine makes it
    (the affine formats' group as the Engine picks it)."""
    from ...integrations.engine import quant_group_for
    from ...integrations.transformers import cache_config
    cfg = cache_config(net, page_size=PAGE, rope=rope)
    return dataclasses.replace(cfg, kv_dtype=kv_dtype,
                               kv_quant_group=quant_group_for(cfg, kv_dtype)).token_kv_bytes


def run_kv_budget(args, net, device: str, backend: str, kv_dtype: str, say: Callable) -> dict:
    """The kv-budget workload's result (JSON-ready) for parsed ``args`` on ``net``: (a) with
    ``kv_dtype="auto"`` and with ``kv_dtype`` (quantized) at one budget in bytes."""
    from ...cli_kit import UsageError
    from ...integrations.transformers import Engine
    lo, hi = random_prompt_range(bool(args.tiny))
    vocab = net.config.vocab_size
    prompts = workload(args.requests, (lo, hi), vocab, args.seed)
    warm = workload(args.requests, (lo, hi), vocab, args.seed + 1000)
    tb = {k: token_bytes(net, k, args.rope) for k in ("auto", kv_dtype)}
    # the longest request's whole pages (its last token is never written): the Engine refuses
    # a request that does not fit alone
    one = -(-(max(map(len, prompts + warm)) + args.new_tokens - 1) // PAGE) * PAGE
    if args.kv_budget_mib is None:
        need = args.batch * ((lo + hi) / 2 + args.new_tokens) / 2
        budget = int(max(need, one + PAGE) * tb["auto"])
    else:
        budget = int(args.kv_budget_mib * 2**20)
    if budget_tokens(budget, tb["auto"]) < one:
        raise UsageError(f"--kv-budget-mib {args.kv_budget_mib:g} holds "
                         f"{budget_tokens(budget, tb['auto'])} tokens of auto KV "
                         f"({tb['auto']} bytes each); the longest request needs {one}: give at "
                         f"least {(one + 2 * PAGE) * tb['auto'] / 2**20:.4f}")
    result: dict = {"workload": {"kind": "kv-budget", "requests": args.requests,
                                 "prompt_range": [lo, hi], "new_tokens": args.new_tokens,
                                 "batch": args.batch, "page_size": PAGE, "layers": args.layers,
                                 "tiny": bool(args.tiny), "seed": args.seed,
                                 "kv_budget_bytes": budget, "kv_budget_mib": budget / 2**20,
                                 "kv_budget_given": args.kv_budget_mib is not None,
                                 "a_kv_dtype": kv_dtype, "kv_dtype_requested": args.kv_dtype,
                                 "a_rope": args.rope, "a_prefix_cache": args.prefix_cache,
                                 "arrival": "all added at once"},
                    "systems": {}, "skipped": {}, "ratios": {}}

    def rounds(key: str, kv: str):
        """One format's runs (``budget_rounds``) at the budget."""
        def make():
            return Engine(net, backend=backend, device=device, page_size=PAGE,
                          max_batch_size=args.batch,
                          max_total_tokens=budget_tokens(budget, tb[kv]), rope=args.rope,
                          prefix_cache=args.prefix_cache == "on", kv_dtype=kv)

        def describe(engine):
            cfg, pages = engine.config, engine.cache.num_total_pages
            return (f"kv_dtype {cfg.kv_dtype}", f"{pages} pages",
                    dict(kv_dtype=cfg.kv_dtype, kv_pages=pages, token_capacity=pages * PAGE,
                         token_kv_bytes=cfg.token_kv_bytes, kv_bytes=cfg.kv_bytes,
                         offload=engine.host_tier is not None))
        return budget_rounds(make, describe, key, budget, warm, prompts, args.new_tokens,
                             device, say, ("preemptions", "recomputed_tokens"), runs)

    runs = getattr(args, "runs", 1)
    done = interleave({"auto": lambda: rounds("auto", "auto"),
                       "quantized": lambda: rounds("quantized", kv_dtype)}, runs)
    put_rows(result, done, ("tokens_per_s", "wall_s", "ttft_median_ms", "ttft_p90_ms",
                            "peak_running", "preemptions", "recomputed_tokens"))
    base, quant = result["systems"]["auto"], result["systems"]["quantized"]
    # the greedy tokens of the first round (a count, not a verdict)
    result["same_tokens"] = sum(x == y for x, y in zip(done["auto"][0][1],
                                                       done["quantized"][0][1]))
    result["compared"] = len(prompts)
    for name, field in (("tokens_per_s_quantized_over_auto", "tokens_per_s"),
                        ("peak_running_quantized_over_auto", "peak_running")):
        put_ratio(result, name, per_round(quant, field), per_round(base, field))
    rt = result["ratios"]
    result["verdicts"] = {
        "more concurrent sequences": _verdict(rt["peak_running_quantized_over_auto"]),
        "higher tokens/s": _verdict(rt["tokens_per_s_quantized_over_auto"])}
    result["targets_judged"] = not args.tiny
    return result


def _verdict(ratio: float) -> str:
    return "PASS" if ratio > TARGET_RATIO else "MISS"


def print_kv_budget_result(res: dict) -> None:
    """The kv-budget result as a table, with the verdicts (a full run) or the ratios (--tiny)."""
    w = res["workload"]
    print(f"kvcache bench --serving --workload kv-budget: {res.get('device', '')} "
          f"{res.get('date', '')}")
    print(f"  workload: {w['requests']} requests ({w['arrival']}), prompts {w['prompt_range'][0]}-"
          f"{w['prompt_range'][1]} tokens, {w['new_tokens']} new tokens each, batch "
          f"{w['batch']}, {w['layers']} layers{' (tiny dims)' if w['tiny'] else ''}, "
          f"{w.get('dtype', '')}, page {w['page_size']}, seed {w['seed']}")
    print(f"  KV budget: {w['kv_budget_mib']:.3f} MiB ({w['kv_budget_bytes']} bytes) for each "
          f"run{'' if w['kv_budget_given'] else ' (default: half the batch in auto KV)'}")
    print(f"{'kv_dtype':<12} {'pages':>7} {'tokens':>8} {'tokens/s':>10} {'wall s':>8} "
          f"{'TTFT p50 ms':>12} {'peak seqs':>10} {'preempted':>10} {'offload':>8}")
    for key in ("auto", "quantized"):
        r = res["systems"][key]
        print(f"{r['kv_dtype']:<12} {r['kv_pages']:>7} {r['token_capacity']:>8} "
              f"{r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} {r['ttft_median_ms']:>12.1f} "
              f"{r['peak_running']:>10} {r['preemptions']:>10} "
              f"{'host' if r['offload'] else 'no':>8}")
    print(f"greedy tokens equal in both runs: {res['same_tokens']}/{res['compared']} requests "
          f"(a count, not a verdict: quantization changes tokens)")
    rt = res["ratios"]
    ratios = (f"tokens/s {rt['tokens_per_s_quantized_over_auto']:.2f}, peak concurrency "
              f"{rt['peak_running_quantized_over_auto']:.2f}")
    note = runs_note(res)
    if note:
        print_runs(res, {f"{r['kv_dtype']:<12}": r for r in res["systems"].values()},
                   (("tokens/s", "tokens_per_s", ".1f"), ("peak seqs", "peak_running", "g")),
                   {"tokens_per_s_quantized_over_auto": "quantized / auto tokens/s",
                    "peak_running_quantized_over_auto": "quantized / auto peak concurrency"})
        ratios += f" ({note})"
    if not res["targets_judged"]:
        print(f"targets: not judged on a --tiny smoke run (quantized / auto: {ratios})")
        return
    print(f"targets (quantized / auto > {TARGET_RATIO}): {ratios}")
    for label, verdict in res["verdicts"].items():
        print(f"  {verdict} {label}")
