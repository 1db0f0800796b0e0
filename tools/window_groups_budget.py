"""The Engine's tokens/s at one KV memory budget, every page kept vs window groups (issue 56,
increment 2): a random Gemma-3-style transformers model (by default 6 layers, 5 sliding of
``sliding_window=65`` to 1 full; float32 on the CPU), 32 requests of 200 prompt tokens and 100
new ones, pages of 16, 16 sequences per forward, no prefix cache. The budget is the page bytes
of 2,048 tokens (``--budget-tokens``) in every layer; each run takes the most
``max_total_tokens`` whose ``CacheConfig.kv_bytes`` fit it (window groups: the window pools
first, the full layers the rest). On the CPU the two runs' tokens must be equal; on a GPU
(``--device cuda``, batches that differ between the runs) the count of equal requests is printed.

    python tools/window_groups_budget.py [BACKEND]     # default cuda (its CPU mode here)
    python tools/window_groups_budget.py cuda --device cuda --dtype bfloat16 --layers 12 \
        --hidden 1024 --heads 8 --kv-heads 4 --head-dim 128 --window 512 --prompt 2048 \
        --new 64 --requests 64 --batch 32 --chunk 2048 --budget-tokens 16384

``--profile``: after each timed run, the same requests again under cProfile (the host's
functions by own time, where a device wait shows as the call that synchronizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kvcache.integrations.transformers import Engine, cache_config  # noqa: E402

PS = 16


def model_and_prompts(a):
    layers = a.layers
    cfg = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=512, num_hidden_layers=layers, hidden_size=a.hidden,
        intermediate_size=a.hidden * 3 // 2, num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads, head_dim=a.head_dim, sliding_window=a.window,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention"
                     for i in range(layers)],
        max_position_embeddings=max(4096, 2 * (a.prompt + a.new)), bos_token_id=None,
        eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.to(device=a.device, dtype=getattr(torch, a.dtype)).eval()
    rng = np.random.default_rng(0)
    return model, [rng.integers(1, 512, a.prompt).tolist() for _ in range(a.requests)]


def tokens_for(model, budget: int, groups: bool, a) -> int:
    """The most max_total_tokens (whole pages) whose page arrays fit ``budget`` bytes."""
    lo, hi = PS, 1 << 24
    while hi - lo > PS:
        mid = (lo + hi) // 2 // PS * PS
        c = cache_config(model, page_size=PS, max_total_tokens=mid, max_batch_size=a.batch,
                         prefill_chunk_size=a.chunk, window_groups=groups)
        lo, hi = (mid, hi) if c.kv_bytes <= budget else (lo, mid)
    return lo


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("backend", nargs="?", default="cuda")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    for name, default in (("layers", 6), ("hidden", 128), ("heads", 4), ("kv-heads", 2),
                          ("head-dim", 32), ("window", 65), ("prompt", 200), ("new", 100),
                          ("requests", 32), ("batch", 16), ("chunk", 256),
                          ("budget-tokens", 2048)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile", action="store_true")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = _args(argv)
    if a.device == "cpu":
        os.environ.setdefault("KVCACHE_CUDA_CPU", "1")
        torch.set_num_threads(2)
    model, prompts = model_and_prompts(a)
    budget = cache_config(model, page_size=PS, max_total_tokens=a.budget_tokens,
                          max_batch_size=a.batch, prefill_chunk_size=a.chunk).kv_bytes
    results = {}
    for groups in (False, True):
        tokens = tokens_for(model, budget, groups, a)
        e = Engine(model, backend=a.backend, device=a.device, dtype=a.dtype, page_size=PS,
                   max_total_tokens=tokens, max_batch_size=a.batch, prefill_chunk_size=a.chunk,
                   prefix_cache=False, window_groups=groups, offload=False,
                   graphs=False, mixed_graphs=False)
        e.generate(prompts[:2], max_new_tokens=4)                 # first-use costs
        before = dataclasses.replace(e.stats)
        t = time.perf_counter()
        out = e.generate(prompts, max_new_tokens=a.new)
        dt = time.perf_counter() - t
        n = sum(len(o[0]) for o in out)
        results[groups] = (out, n / dt)
        if a.profile:
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.runcall(e.generate, prompts, max_new_tokens=a.new)
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        print(f"window_groups={groups}: max_total_tokens={tokens}, kv_bytes="
              f"{e.config.kv_bytes} of {budget}: {n / dt:.0f} tokens/s ({dt:.1f} s), "
              f"{e.stats.preemptions - before.preemptions} preemptions, "
              f"{e.stats.forwards - before.forwards} forwards", flush=True)
    same = sum(x == y for x, y in zip(results[True][0], results[False][0]))
    print(f"ratio: {results[True][1] / results[False][1]:.2f}x (target >= 1.5x); requests with "
          f"equal tokens: {same}/{len(prompts)}")
    if a.device == "cpu":
        assert same == len(prompts), "the tokens differ"


if __name__ == "__main__":
    main()
