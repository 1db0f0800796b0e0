"""``kvcache demo --model llama|qwen2|mistral|phi3|gemma|PATH``: the serving workload on a real
model architecture through the transformers ``Engine``.

Without a checkpoint the model is built from a small config of that family with random weights
(seeded); a directory is loaded with transformers (``config.json`` + safetensors, no network).
The workload: requests sharing system prompts (their pages are shared), long prompts (chunked
prefill), parallel samples (forked after one prefill) and a cache small enough that requests are
preempted and recomputed. The check replays a sample of the greedy requests through
transformers' own ``generate`` (its own cache) and requires identical tokens, and re-scores a
sample of the sampled sequences with the model's own forward (log-probabilities within 1e-3).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import numpy as np

from . import non_negative_int, positive_int

FAMILY_SHAPES = {
    # family: (config class, model class, config fields)
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                   num_key_value_heads=2, head_dim=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                   num_key_value_heads=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=64, sliding_window=4096)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=192, intermediate_size=512, num_attention_heads=2,
                  num_key_value_heads=2)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=256, intermediate_size=512, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=256)),
}
VOCAB = 2048


def build_model(name: str, seed: int, dtype: str = "float32"):
    """A transformers causal LM: a family's small random model (seeded), or a local checkpoint
    directory. Returns (model, description)."""
    from kvcache.integrations import require
    torch = require("torch", "transformers")
    transformers = require("transformers", "transformers", "5.17")
    tdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    if os.path.isdir(name):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, local_files_only=True, dtype=tdtype)
        return model.eval(), f"{model.config.model_type} checkpoint {name}"
    if name not in FAMILY_SHAPES:
        raise SystemExit(f"kvcache demo: --model {name!r} is neither a family "
                         f"({', '.join(FAMILY_SHAPES)}, synthetic) nor a directory")
    config_name, model_name, shape = FAMILY_SHAPES[name]
    config = getattr(transformers, config_name)(
        vocab_size=VOCAB, num_hidden_layers=4, max_position_embeddings=4096,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
        tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(tdtype).eval()
    params = sum(p.numel() for p in model.parameters())
    return model, f"{name}, random weights (seed {seed}), {params / 1e6:.1f}M parameters"


@dataclasses.dataclass
class Workload:
    greedy: list            # prompts generated greedily
    sampled: list           # prompts with parallel samples
    features: dict          # feature name -> count


def make_workload(requests: int, seed: int, vocab: int, long_prompt: int) -> Workload:
    """Prompts of a chat service: two system prompts shared by most requests, a few long
    documents, short questions; a quarter of the requests ask for parallel samples."""
    rng = np.random.default_rng([seed, 0xD3])
    systems = [rng.integers(1, vocab, int(n)).tolist() for n in (160, 96)]
    greedy, sampled = [], []
    feats = {"shared system prompt": 0, "long prompt (chunked)": 0, "parallel samples": 0}
    for r in range(requests):
        if r % 7 == 3:
            prompt = rng.integers(1, vocab, long_prompt + int(rng.integers(0, 200))).tolist()
            feats["long prompt (chunked)"] += 1
        else:
            prompt = rng.integers(1, vocab, int(rng.integers(8, 120))).tolist()
            if r % 5 != 4:
                prompt = systems[r % 2] + prompt
                feats["shared system prompt"] += 1
        if r % 4 == 1:
            sampled.append(prompt)
            feats["parallel samples"] += 1
        else:
            greedy.append(prompt)
    return Workload(greedy, sampled, feats)


def add_workload_options(p: argparse.ArgumentParser, *, requests: int, max_output: int,
                         long_prompt: int) -> None:
    """The workload options the real-model demos share (``make_workload``'s inputs)."""
    p.add_argument("--seed", type=int, default=0, help="workload and weight seed (default 0)")
    p.add_argument("--requests", type=positive_int, default=requests,
                   help=f"number of requests (default {requests})")
    p.add_argument("--max-output", type=positive_int, default=max_output,
                   help=f"new tokens per request (default {max_output})")
    p.add_argument("--long-prompt", type=positive_int, default=long_prompt,
                   help=f"tokens of a long prompt (default {long_prompt})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcache demo --model FAMILY|PATH",
        description="The serving workload on a real architecture through the transformers Engine "
                    "(shared system prompts, chunked long prompts, parallel samples, preemption), "
                    "checked against transformers' own generation.")
    p.add_argument("--model", required=True, help="llama, qwen2, mistral, phi3, gemma, or a "
                   "checkpoint directory (config.json + safetensors)")
    p.add_argument("--backend", default="auto", help="backend name or 'auto' (default)")
    p.add_argument("--device", default=None, help="torch device of the model (default: cuda if "
                   "available, else cpu)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="model and cache dtype (default float32 on the CPU, bfloat16 on a GPU)")
    add_workload_options(p, requests=28, max_output=24, long_prompt=700)
    p.add_argument("--samples", type=positive_int, default=3,
                   help="parallel samples per sampled request (default 3)")
    p.add_argument("--max-total-tokens", type=positive_int, default=2560,
                   help="cache capacity in tokens (default 2560, small: requests get preempted)")
    p.add_argument("--max-batch-size", type=positive_int, default=16,
                   help="sequences in one forward (default 16)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=256,
                   help="most tokens in one forward (default 256)")
    p.add_argument("--check-requests", type=non_negative_int, default=4,
                   help="greedy requests replayed through transformers' generate (0: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON (for machines) instead of a table; implies --quiet")
    return p


def _print_table(title: str, rows: list) -> None:
    if not sys.stdout.isatty():      # a file or a pipe: plain lines, no box drawing
        print(title)
        for k, v in rows:
            print(f"  {k + ':':<26}{v}")
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:       # pragma: no cover - rich is in the 'demo' extra
        print(title)
        for k, v in rows:
            print(f"  {k:<26}{v}")
        return
    table = Table(title=title, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("")
    for k, v in rows:
        if k == "check":
            v = f"[green]{v}[/green]" if v.startswith("PASSED") else f"[bold red]{v}[/bold red]"
        table.add_row(k, v)
    Console().print(table)


def run(opts) -> dict:
    """Run the workload and the check; returns a summary dict (``ok``: the check passed)."""
    from kvcache.integrations import require
    torch = require("torch", "transformers")
    from kvcache.integrations.transformers import Engine

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        torch.set_num_threads(1)     # small models: torch's thread pool costs more than it gives
    dtype = opts.dtype or ("float32" if device == "cpu" else "bfloat16")
    model, what = build_model(opts.model, opts.seed, dtype)
    model = model.to(device)
    work = make_workload(opts.requests, opts.seed, model.config.vocab_size, opts.long_prompt)
    engine = Engine(model, backend=opts.backend, max_total_tokens=opts.max_total_tokens,
                    max_batch_size=opts.max_batch_size, prefill_chunk_size=opts.prefill_chunk_size)
    engine.progress = False if opts.quiet else None
    t0 = time.perf_counter()
    greedy = engine.generate(work.greedy, max_new_tokens=opts.max_output)
    sampled, logprobs = engine.generate(work.sampled, max_new_tokens=opts.max_output,
                                        n=opts.samples, temperature=0.8, seed=opts.seed,
                                        return_logprobs=True)
    wall = time.perf_counter() - t0
    failures, checked = [], 0
    rng = np.random.default_rng([opts.seed, 0xC4])
    k = min(opts.check_requests, len(work.greedy))
    t1 = time.perf_counter()
    # always replay a long prompt and a shared-prefix one when there are some
    order = sorted(range(len(work.greedy)), key=lambda i: -len(work.greedy[i]))
    picks = list(dict.fromkeys(order[:1] + rng.permutation(len(work.greedy)).tolist()))[:k]
    with torch.inference_mode():
        for i in picks:
            prompt = work.greedy[i]
            out = model.generate(torch.tensor([prompt], device=device),
                                 max_new_tokens=opts.max_output, min_new_tokens=opts.max_output,
                                 do_sample=False)
            want = out[0, len(prompt):].tolist()
            checked += 1
            if greedy[i][0] != want:
                first = next(t for t in range(len(want)) if greedy[i][0][t] != want[t])
                failures.append(f"greedy request {i} ({len(prompt)} tokens): token {first} is "
                                f"{greedy[i][0][first]}, transformers generates {want[first]}")
        tol = 1e-3 if dtype == "float32" else 5e-2
        for i in range(min(2, len(work.sampled)) if k else 0):
            prompt = work.sampled[i]
            for j, sample in enumerate(sampled[i]):
                logits = model(torch.tensor([prompt + sample], device=device)).logits[0].double()
                lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
                want = lp[torch.arange(len(sample)), torch.tensor(sample, device=device)].cpu().numpy()
                err = float(np.abs(np.asarray(logprobs[i][j]) - want).max())
                checked += 1
                if err > tol:
                    failures.append(f"sampled request {i} sample {j}: log-probabilities differ "
                                    f"from the model's own forward by {err:.2g} (tol {tol:g})")
    check_s = time.perf_counter() - t1
    s = engine.stats
    new_tokens = sum(len(o[0]) for o in greedy) + sum(len(x) for o in sampled for x in o)
    distinct = [len({tuple(x) for x in o}) for o in sampled]
    return dict(
        model=what, backend=engine.cache.backend.name, device=device, dtype=dtype,
        requests=len(work.greedy) + len(work.sampled), features=work.features,
        new_tokens=new_tokens, wall=wall, stats=s, failures=failures, checked=checked,
        check_s=check_s, distinct=distinct, pages=engine.cache.num_total_pages,
        ok=not failures, samples=opts.samples)


def main(argv) -> int:
    opts = build_parser().parse_args(argv)
    import kvcache
    from kvcache.cli import UsageError, backend_for
    if opts.backend != "auto":
        backend_for(opts.backend, None)         # before the model is built
    try:
        import transformers  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        raise UsageError("--model needs torch and transformers: pip install 'kvcache[transformers]'") from None
    if opts.json:
        opts.quiet = True
    try:
        r = run(opts)
    except (kvcache.KVCacheError, ImportError) as exc:
        print(f"kvcache demo: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    s = r["stats"]
    if opts.json:
        print(json.dumps({
            "model": r["model"], "backend": r["backend"], "device": str(r["device"]),
            "dtype": r["dtype"], "requests": r["requests"], "features": dict(r["features"]),
            "new_tokens": r["new_tokens"], "wall_s": r["wall"], "forwards": s.forwards,
            "prefill_tokens": s.prefill_tokens, "decode_tokens": s.decode_tokens,
            "forks": s.forks, "shared_prefix_tokens": s.shared_prefix_tokens,
            "preemptions": s.preemptions, "recomputed_tokens": s.recomputed_tokens,
            "pages": r["pages"], "checked": r["checked"], "check_ok": r["ok"],
            "failures": list(r["failures"])}, indent=2, default=str))
        return 0 if r["ok"] else 1
    check = (f"PASSED: {r['checked']} requests/samples replayed through transformers "
             f"({r['check_s']:.1f} s), tokens identical, log-probabilities within tolerance"
             if r["ok"] else "FAILED: " + "; ".join(r["failures"]))
    rows = [
        ("model", r["model"]),
        ("requests", f"{r['requests']} (" + ", ".join(f"{v} {k}" for k, v in r["features"].items()) + ")"),
        ("new tokens", f"{r['new_tokens']:,} in {r['wall']:.1f} s ({r['new_tokens'] / r['wall']:,.0f} tokens/s)"),
        ("forwards", f"{s.forwards:,}: {s.prefill_tokens:,} prompt tokens, {s.decode_tokens:,} decode tokens"),
        ("shared pages", f"{s.forks} forks, {s.shared_prefix_tokens:,} prompt tokens not recomputed"),
        ("parallel samples", f"{r['samples']} per sampled request, distinct per request: {r['distinct']}"),
        ("preemptions", f"{s.preemptions} ({s.recomputed_tokens:,} tokens recomputed; cache of {r['pages']} pages)"),
        ("check", check),
    ]
    _print_table(f"kvcache demo: {r['model']} on backend {r['backend']} ({r['device']}, {r['dtype']})", rows)
    if not r["ok"]:
        print("kvcache demo: the check FAILED", file=sys.stderr)
        return 1
    return 0
