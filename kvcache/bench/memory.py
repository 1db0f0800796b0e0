"""``kvcache bench --memory``: what window groups save (docs/hybrid.md, increment 1).

A hybrid model's windowed layers keep only the pages their window still sees. The bench builds
two caches of one shape and capacity, a 5:1 local:global mix of layers (``--memory-local``
windowed layers of ``Window(--memory-window)`` per full-attention layer) and the same cache
without groups, each holding ``sequences`` sequences of ``--memory-context`` tokens
(``max_total_tokens = sequences * context``, ``max_batch_size = sequences``), and reports the
tokens each holds per GiB of KV, from the page arrays as the backend allocated them (the sum
of their sizes, not a formula). Target: at least 3x at 32k context with w = 1024."""

from __future__ import annotations

import argparse
import dataclasses

TARGET = 3.0
"""The ratio docs/hybrid.md asks of a 5:1 mix at 32k context (tokens per GiB, grouped over
plain)."""
TARGET_LOCAL = 5
"""The mix ``TARGET`` is asked of (windowed layers per full one); another mix (gpt-oss's 1:1)
is printed against its ceiling, ``local + 1``: a full layer keeps every page either way."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", action="store_true",
                   help="tokens held per GiB of KV with window groups (a 5:1 local:global mix) "
                        "against the same cache without them, from the allocated page arrays")
    p.add_argument("--memory-context", type=int, default=32768, metavar="TOKENS",
                   help="--memory: tokens per sequence (default 32768)")
    p.add_argument("--memory-window", type=int, default=1024, metavar="W",
                   help="--memory: the local layers' Window(W) (default 1024)")
    p.add_argument("--memory-local", type=int, default=5, metavar="N",
                   help="--memory: windowed layers per full-attention layer (default 5)")


def nbytes(backend, array) -> int:
    """Bytes of one allocated page array (numpy, torch or mlx)."""
    if hasattr(array, "nbytes"):
        return int(array.nbytes)
    return int(array.numel() * array.element_size())          # torch before .nbytes


def memory_rows(context: int = 32768, window: int = 1024, local: int = 5,
                sequences=(1, 8), backend: str = "reference", device=None, *,
                page_size: int = 16, prefill_chunk_size: int = 4096, num_kv_heads: int = 4,
                head_dim: int = 256, dtype: str = "float16") -> list:
    """One row per number of sequences: the bytes of both caches' page arrays as allocated,
    the tokens they hold, tokens per GiB and the ratio. The layers are one block of ``local``
    windowed layers and one full layer (a model repeats the block; the ratio is the block's)."""
    import kvcache
    layers = local + 1
    rows = []
    for n in sequences:
        plain = kvcache.CacheConfig(
            num_layers=layers, num_qo_heads=2 * num_kv_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, max_batch_size=n,
            max_total_tokens=n * context, prefill_chunk_size=min(prefill_chunk_size, context),
            dtype=dtype, rope_mode="none")
        grouped = dataclasses.replace(plain, layer_kinds={
            layer: kvcache.Window(window) for layer in range(local)})
        row = {"sequences": n, "context": context, "window": window, "layers": layers,
               "local": local, "tokens": n * context}
        for name, config in (("plain", plain), ("grouped", grouped)):
            cache = kvcache.PagedKVCache(config, backend=backend, device=device)
            size = sum(nbytes(cache.backend, p) for p in cache.pages)
            assert size == config.kv_bytes, (size, config.kv_bytes)
            row[f"{name}_bytes"] = size
            row[f"{name}_pages"] = dict(cache.num_total_pages_by_group)
            row[f"{name}_tokens_per_gib"] = n * context / (size / 2**30)
            del cache
        row["ratio"] = row["grouped_tokens_per_gib"] / row["plain_tokens_per_gib"]
        rows.append(row)
    return rows


def print_memory(rows: list) -> None:
    r0 = rows[0]
    print(f"window groups: {r0['local']} x Window({r0['window']}) : 1 full layer, "
          f"{r0['context']} tokens per sequence (page arrays as allocated)")
    print(f"{'sequences':>9}  {'tokens':>9}  {'plain GiB':>9}  {'grouped GiB':>11}  "
          f"{'plain tok/GiB':>13}  {'grouped tok/GiB':>15}  {'ratio':>6}  target")
    for r in rows:
        if r["local"] == TARGET_LOCAL:
            verdict = f">= {TARGET}x {'met' if r['ratio'] >= TARGET else 'MISSED'}"
        else:       # another mix: its ceiling, every windowed layer's pages saved
            ceiling = r["local"] + 1
            verdict = f"not judged ({r['ratio'] / ceiling:.0%} of this mix's {ceiling}x ceiling)"
        print(f"{r['sequences']:>9}  {r['tokens']:>9}  {r['plain_bytes'] / 2**30:>9.2f}  "
              f"{r['grouped_bytes'] / 2**30:>11.2f}  {r['plain_tokens_per_gib']:>13,.0f}  "
              f"{r['grouped_tokens_per_gib']:>15,.0f}  {r['ratio']:>5.2f}x  {verdict}")


def main(args) -> int:
    import json
    rows = memory_rows(args.memory_context, args.memory_window, args.memory_local,
                       backend=args.backend or "reference", device=args.device)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print_memory(rows)
    return 0
