"""The Engine's tokens/s at one KV memory budget, every page kept vs window groups (issue 56,
increment 2): a random Gemma-3-style transformers model (6 layers, 5 sliding of
``sliding_window=65`` to 1 full; float32 on the CPU), 32 requests of 200 prompt tokens and 100
new ones, pages of 16, 16 sequences per forward, no prefix cache. The budget is the page bytes
of 2,048 tokens in every layer; each run takes the most ``max_total_tokens`` whose
``CacheConfig.kv_bytes`` fit it (window groups: the window pools first, the full layer the rest).
The two runs' tokens must be equal.

    python tools/window_groups_budget.py [BACKEND]     # default cuda (its CPU mode here)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

os.environ.setdefault("KVCACHE_CUDA_CPU", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from kvcache.integrations.transformers import Engine, cache_config  # noqa: E402

PS, BATCH, CHUNK, NEW = 16, 16, 256, 100


def model_and_prompts():
    cfg = transformers.AutoConfig.for_model(
        "gemma3_text", vocab_size=512, num_hidden_layers=6, hidden_size=128,
        intermediate_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        sliding_window=65, layer_types=["sliding_attention"] * 5 + ["full_attention"],
        max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    rng = np.random.default_rng(0)
    return model.float().eval(), [rng.integers(1, 512, 200).tolist() for _ in range(32)]


def tokens_for(model, budget: int, groups: bool) -> int:
    """The most max_total_tokens (whole pages) whose page arrays fit ``budget`` bytes."""
    lo, hi = PS, 1 << 20
    while hi - lo > PS:
        mid = (lo + hi) // 2 // PS * PS
        c = cache_config(model, page_size=PS, max_total_tokens=mid, max_batch_size=BATCH,
                         prefill_chunk_size=CHUNK, window_groups=groups)
        lo, hi = (mid, hi) if c.kv_bytes <= budget else (lo, mid)
    return lo


def main(backend: str) -> None:
    torch.set_num_threads(2)
    model, prompts = model_and_prompts()
    budget = cache_config(model, page_size=PS, max_total_tokens=2048, max_batch_size=BATCH,
                          prefill_chunk_size=CHUNK).kv_bytes
    results = {}
    for groups in (False, True):
        tokens = tokens_for(model, budget, groups)
        e = Engine(model, backend=backend, device="cpu", page_size=PS, max_total_tokens=tokens,
                   max_batch_size=BATCH, prefill_chunk_size=CHUNK, prefix_cache=False,
                   window_groups=groups, offload=False)
        e.generate(prompts[:2], max_new_tokens=4)                 # first-use costs
        before = dataclasses.replace(e.stats)
        t = time.perf_counter()
        out = e.generate(prompts, max_new_tokens=NEW)
        dt = time.perf_counter() - t
        n = sum(len(o[0]) for o in out)
        results[groups] = (out, n / dt)
        print(f"window_groups={groups}: max_total_tokens={tokens}, kv_bytes="
              f"{e.config.kv_bytes} of {budget}: {n / dt:.0f} tokens/s ({dt:.1f} s), "
              f"{e.stats.preemptions - before.preemptions} preemptions, "
              f"{e.stats.forwards - before.forwards} forwards", flush=True)
    assert results[True][0] == results[False][0], "the tokens differ"
    print(f"ratio: {results[True][1] / results[False][1]:.2f}x (target >= 1.5x)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "cuda")
