"""``kvcache bench --serving --workload window-budget``: what window groups buy at a fixed KV
memory budget (issue 56 item 5: tokens/s at one budget, target >= 1.5x; docs/hybrid.md).

The model is Gemma-3-like: the random-weight ``gemma3_text`` family with the Llama-3-8B layer
shapes (``--tiny``: small dims), five sliding-window layers to one full-attention layer
(``sliding_window`` ``WINDOW``, 16 with ``--tiny``). System (a), our Engine, runs twice on the
same seeded prompts (``--requests`` of ``PROMPTS`` tokens, all added at once, ``--new-tokens``
each, ``--batch`` sequences per forward at most) with one KV budget in bytes
(``--kv-budget-mib``): once keeping every page of every layer (``window_groups=False``), once
with window groups (``window_groups=True``: a windowed layer keeps only the pages its window
still sees, so the full layer gets the rest of the budget). Both runs are eager (no graphs:
window groups do not compose with them yet) without the host tier, so they differ only in
memory. The budget becomes each run's ``max_total_tokens``: the most whose page arrays
(``CacheConfig.kv_bytes``, the window pools included) fit it. The default budget holds a third
of what the batch needs at once when every page is kept (at least the window pools and the
longest request), so that run must queue or preempt.

Per run, after a warm-up run on other prompts and ``Engine.warm_up()``: tokens/s, time to
first token, the peak number of sequences at once, preemptions, the tokens the cache holds. For the
pair: window groups / every page of tokens/s (target >= 1.5x) and peak concurrency, and the
requests whose greedy tokens are equal (a count: the batches differ between the runs, and
bfloat16 on a GPU parts at near-ties); up to ``RESCORE`` of those that differ are judged by a
teacher-forced re-score of both runs' tokens (a verdict: a key wrongly kept or dropped fails it).
"""

from __future__ import annotations

from typing import Callable

from .kv_budget import PAGE
from .model import workload
from .prefix import budget_run

WINDOW_BUDGET_SIZES = {"requests": (128, 4), "batch": (64, 4), "new_tokens": (256, 4),
                       "layers": (8, 6)}
"""Option: (default, default with --tiny) where they differ from the random workload's (six
layers with --tiny: five windowed to one full)."""
PROMPTS = {False: (2048, 4096), True: (24, 48)}
"""Prompt lengths (inclusive), by --tiny: several windows long, where window groups matter."""
WINDOW = {False: 512, True: 8}
"""The windowed layers' ``sliding_window`` (the model config's), by --tiny."""
CHUNK = {False: 2048, True: 16}
"""Both Engines' ``prefill_chunk_size`` (the window pools hold a chunk's keys), by --tiny."""
TARGET_RATIO = 1.5
"""Window groups over every page kept, tokens/s: at least this."""
RESCORE = 8
"""Requests whose tokens differ between the runs judged by the teacher-forced re-score."""


def build_window_model(layers: int, tiny: bool, device: str, dtype: str, seed: int):
    """The Gemma-3-like random-weight model (``gemma3_text``; every sixth layer full attention,
    the others ``sliding_window`` ``WINDOW[tiny]``), the Llama-3-8B layer shapes (head_dim 128)
    or ``TINY``'s, no EOS token."""
    import torch
    import transformers
    from .model import LLAMA3_8B_LAYER, TINY
    dims = dict(TINY if tiny else LLAMA3_8B_LAYER)
    dims["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    cfg = transformers.AutoConfig.for_model(
        "gemma3_text", **dims, num_hidden_layers=layers, sliding_window=WINDOW[tiny],
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                     for i in range(layers)],
        max_position_embeddings=8192, eos_token_id=None, bos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            net = transformers.AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(before)
    net.generation_config.eos_token_id = None
    net.generation_config.pad_token_id = 0
    return net.eval()


def tokens_in(net, budget: int, groups: bool, batch: int, chunk: int) -> int:
    """The most ``max_total_tokens`` (whole pages) whose page arrays fit ``budget`` bytes, with
    or without window groups (the Engine's config for ``batch`` and ``chunk``); 0: none."""
    from ...integrations.transformers import cache_config

    def size(tokens: int) -> int:
        return cache_config(net, page_size=PAGE, max_total_tokens=tokens, max_batch_size=batch,
                            prefill_chunk_size=chunk, window_groups=groups).kv_bytes
    lo, hi = 0, PAGE
    while size(hi) <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > PAGE:
        mid = (lo + hi) // 2 // PAGE * PAGE
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return lo


def run_window_budget(args, net, device: str, backend: str, say: Callable) -> dict:
    """The window-budget workload's result (JSON-ready) for parsed ``args`` on ``net``
    (``build_window_model``'s)."""
    from ...cli_kit import UsageError
    from ...integrations.transformers import Engine, cache_config
    tiny = bool(args.tiny)
    lo, hi = PROMPTS[tiny]
    chunk = CHUNK[tiny]
    vocab = net.config.vocab_size
    prompts = workload(args.requests, (lo, hi), vocab, args.seed)
    warm = workload(args.requests, (lo, hi), vocab, args.seed + 1000)
    per_token = cache_config(net, page_size=PAGE, window_groups=False).token_kv_bytes
    longest = max(map(len, prompts + warm)) + args.new_tokens
    if args.kv_budget_mib is None:
        need = args.batch * ((lo + hi) / 2 + args.new_tokens)
        budget = int(max(need / 3, longest + 2 * PAGE) * per_token)
        budget = max(budget, cache_config(net, page_size=PAGE, max_total_tokens=longest + PAGE,
                                          max_batch_size=args.batch, prefill_chunk_size=chunk,
                                          window_groups=True).kv_bytes)
    else:
        budget = int(args.kv_budget_mib * 2**20)
    runs = (("pages", False), ("window", True))
    tokens = {key: tokens_in(net, budget, groups, args.batch, chunk) for key, groups in runs}
    for key, n in tokens.items():
        if n < longest:
            raise UsageError(f"--kv-budget-mib {budget / 2**20:g}: with "
                             f"{'window groups' if key == 'window' else 'every page kept'} it "
                             f"holds {n} tokens; the longest request needs {longest}")
    result: dict = {"workload": {"kind": "window-budget", "requests": args.requests,
                                 "prompt_range": [lo, hi], "new_tokens": args.new_tokens,
                                 "batch": args.batch, "page_size": PAGE, "layers": args.layers,
                                 "window": WINDOW[tiny], "chunk": chunk, "tiny": tiny,
                                 "seed": args.seed, "kv_budget_bytes": budget,
                                 "kv_budget_mib": budget / 2**20,
                                 "kv_budget_given": args.kv_budget_mib is not None,
                                 "arrival": "all added at once"},
                    "systems": {}, "skipped": {}, "ratios": {}}
    outs = {}
    for key, groups in runs:
        def make(key=key, groups=groups):
            return Engine(net, backend=backend, device=device, page_size=PAGE,
                          max_batch_size=args.batch, max_total_tokens=tokens[key],
                          prefill_chunk_size=chunk, window_groups=groups, graphs=False,
                          mixed_graphs=False, offload=False)

        def describe(engine, key=key, groups=groups):
            return (f"window_groups={groups}", f"{tokens[key]} tokens",
                    dict(window_groups=groups, token_capacity=tokens[key],
                         kv_bytes=engine.config.kv_bytes))
        result["systems"][key], outs[key] = budget_run(
            make, describe, key, budget, warm, prompts, args.new_tokens, device, say,
            counters=("preemptions", "forwards"))
    pages, window = result["systems"]["pages"], result["systems"]["window"]
    result["same_tokens"] = sum(x == y for x, y in zip(outs["pages"], outs["window"]))
    result["compared"] = len(prompts)
    result["rescore"] = _rescore(net, prompts, outs)
    rt = result["ratios"] = {
        "tokens_per_s_window_over_pages": window["tokens_per_s"] / pages["tokens_per_s"],
        "peak_running_window_over_pages": window["peak_running"] / pages["peak_running"],
        "tokens_window_over_pages": window["token_capacity"] / pages["token_capacity"]}
    rs = result["rescore"]
    result["verdicts"] = {"tokens/s at one KV budget": (
        "PASS" if rt["tokens_per_s_window_over_pages"] >= TARGET_RATIO else "MISS"),
        "tokens of both runs pass the teacher-forced re-score": (
        "PASS" if rs["passed"] == rs["judged"] else "FAIL")}
    result["targets_judged"] = not tiny
    return result


def _rescore(net, prompts: list, outs: dict) -> dict:
    """The requests whose tokens differ between the runs (up to ``RESCORE``) judged by a
    teacher-forced re-score (``kvcache.demo.check.rescore_greedy``): each run's tokens the
    model's own argmax at every position, or within its dtype's near-tie margin. A bfloat16
    near-tie may part two batches' tokens; a wrong key kept or dropped by window groups makes a
    run's tokens fail it."""
    from ...demo.check import rescore_greedy
    dtype = str(net.dtype).replace("torch.", "")
    differ = [i for i, (x, y) in enumerate(zip(outs["pages"], outs["window"])) if x != y]
    judged = differ[:RESCORE]
    passed, ties, problems = 0, 0, []
    for i in judged:
        found = []
        for key in ("pages", "window"):
            n, problem = rescore_greedy(net, prompts[i], outs[key][i], dtype)
            ties += n
            if problem is not None:
                found.append(f"request {i} ({key}): {problem}")
        passed += not found
        problems += found
    return {"differ": len(differ), "judged": len(judged), "passed": passed, "near_ties": ties,
            "problems": problems}


def print_window_budget_result(res: dict) -> None:
    """The window-budget result as a table, with the verdict (a full run) or the ratios."""
    w = res["workload"]
    print(f"kvcache bench --serving --workload window-budget: {res.get('device', '')} "
          f"{res.get('date', '')}")
    print(f"  workload: {w['requests']} requests ({w['arrival']}), prompts {w['prompt_range'][0]}-"
          f"{w['prompt_range'][1]} tokens, {w['new_tokens']} new tokens each, batch "
          f"{w['batch']}, {w['layers']} layers (Gemma-3-like: 5 windowed of {w['window']} to 1 "
          f"full){' (tiny dims)' if w['tiny'] else ''}, {w.get('dtype', '')}, page "
          f"{w['page_size']}, chunks of {w['chunk']}, eager, no host tier, seed {w['seed']}")
    print(f"  KV budget: {w['kv_budget_mib']:.3f} MiB ({w['kv_budget_bytes']} bytes) for each "
          f"run{'' if w['kv_budget_given'] else ' (default: a third of the batch, every page)'}")
    print(f"{'pages kept':<14} {'tokens':>8} {'tokens/s':>10} {'wall s':>8} {'TTFT p50 ms':>12} "
          f"{'peak seqs':>10} {'preempted':>10} {'forwards':>9}")
    for key, label in (("pages", "every page"), ("window", "window groups")):
        r = res["systems"][key]
        print(f"{label:<14} {r['token_capacity']:>8} {r['tokens_per_s']:>10.1f} "
              f"{r['wall_s']:>8.2f} {r['ttft_median_ms']:>12.1f} {r['peak_running']:>10} "
              f"{r['preemptions']:>10} {r['forwards']:>9}")
    print(f"greedy tokens equal in both runs: {res['same_tokens']}/{res['compared']} requests "
          f"(a count: the batches differ between the runs)")
    rs = res["rescore"]
    if rs["judged"]:
        print(f"teacher-forced re-score of {rs['judged']} of the {rs['differ']} requests whose "
              f"tokens differ: {rs['passed']}/{rs['judged']} pass in both runs ({rs['near_ties']} "
              f"tokens at near-ties)")
        for problem in rs["problems"]:
            print(f"  {problem}")
    rt = res["ratios"]
    ratios = (f"tokens/s {rt['tokens_per_s_window_over_pages']:.2f}, tokens held "
              f"{rt['tokens_window_over_pages']:.2f}, peak concurrency "
              f"{rt['peak_running_window_over_pages']:.2f}")
    if not res["targets_judged"]:
        print(f"targets: not judged on a --tiny smoke run (window groups / every page: {ratios})")
        return
    print(f"targets (window groups / every page, tokens/s >= {TARGET_RATIO}): {ratios}")
    for label, verdict in res["verdicts"].items():
        print(f"  {verdict} {label}")
