"""Qwen3-Next (gated DeltaNet layers on state slots, issue 56, docs/hybrid.md increment 9) on a
GPU: a random-weight Qwen3-Next (linear-attention and gated full-attention layers, MoE MLPs)
served by the Engine on the cuda backend, greedy, against transformers' own ``generate`` on
the same model, in bfloat16 then float32; then half the prompts again behind a shared system
prompt sent twice, to count the prefix hits through state checkpoints (the Engine's own
checkpoint interval: the pages whose KV takes a checkpoint's bytes, some hundreds of tokens
for these states, so the system prompt is longer than that).

In bfloat16 a request whose tokens differ is judged by a teacher-forced re-score
(``kvcache.demo.check.rescore_greedy``: every token the argmax or within the bfloat16 near-tie
margin), and the report says how many parted that way: the cache keeps the recurrent state in
the cache dtype (bfloat16) where transformers keeps it in float32, so near-ties may part. In
float32 the tokens must be equal, unless transformers runs the layer with the
``flash-linear-attention`` (``fla``) / ``causal_conv1d`` kernels here (other summation orders
than its PyTorch path, which the cache follows): then differing requests are judged by the
re-score at float32's margin and counted.

    python tools/gpu_qwen3_next_check.py [--layers 8] [--hidden 512] [--requests 12]
        [--new 24] [--experts 8] [--system 600]
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import torch
import transformers

from kvcache.demo.check import check_greedy
from kvcache.integrations.transformers import Engine, state_kinds


def model_of(layers: int, hidden: int, experts: int, dtype, seed: int = 0):
    """A random Qwen3-Next on the GPU: every fourth layer full attention (its order in the
    released model), the others gated DeltaNet (4 key heads and 8 value heads of 64, a conv of
    4 taps), MoE MLPs of ``experts`` experts (2 per token) beside a shared expert, ``dt_bias``
    drawn."""
    types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)]
    kw = dict(vocab_size=1024, num_hidden_layers=layers, hidden_size=hidden,
              intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, num_experts=experts, num_experts_per_tok=2,
              moe_intermediate_size=hidden // 2, shared_expert_intermediate_size=hidden // 2,
              linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
              linear_num_key_heads=4, linear_num_value_heads=8, layer_types=types,
              pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.05,
              tie_word_embeddings=False, max_position_embeddings=4096)
    config = transformers.AutoConfig.for_model("qwen3_next", **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.dt_bias.normal_(0.0, 1.0)
    return model.to("cuda", dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--system", type=int, default=600)
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="the halves to run, comma-separated")
    a = p.parse_args()
    kernels = [k for k in ("fla", "causal_conv1d") if importlib.util.find_spec(k)]
    print(f"transformers {transformers.__version__}; its gated DeltaNet kernels here: "
          f"{', '.join(kernels) or 'none (its PyTorch path)'}")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 1024, int(n)).tolist() for n in rng.integers(3, 300, a.requests)]
    system = rng.integers(1, 1024, a.system).tolist()
    bad = 0
    halves = (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    for name, dtype in [h for h in halves if h[0] in a.dtypes.split(",")]:
        model = model_of(a.layers, a.hidden, a.experts, dtype)
        engine = Engine(model, backend="cuda", device="cuda", max_batch_size=8,
                        prefill_chunk_size=128)
        out = [o[0] for o in engine.generate(prompts, max_new_tokens=a.new, ignore_eos=True)]
        # a shared system prompt: the first call computes its checkpoints, the second hits them
        behind = [system + q[:20] for q in prompts[: len(prompts) // 2]]
        engine.generate(behind[:1], max_new_tokens=a.new, ignore_eos=True)
        hits0 = engine.stats.prefix_hit_tokens
        later = [o[0] for o in engine.generate(behind[1:], max_new_tokens=a.new,
                                               ignore_eos=True)]
        hits = engine.stats.prefix_hit_tokens - hits0
        total = len(prompts) + len(behind) - 1
        # float32 on transformers' PyTorch path (no fla / conv kernels) sums in the cache's
        # order; the control (transformers' own generate judged by the same re-score) runs in
        # bfloat16, and wherever a failure is judged by the re-score
        strict = name == "float32" and not kernels
        res = check_greedy(model, prompts + behind[1:], out + later, a.new, name, strict=strict,
                           control=name != "float32" or not strict)
        bad += res.failed
        if name != "float32":
            print(f"  {name}: transformers' own generate fails the same re-score on "
                  f"{res.own_failed}/{total} requests ({res.own_failed_of_failed} of those whose "
                  f"Engine tokens fail it)")
        print(f"qwen3_next {a.layers} layers ({len(state_kinds(model))} gated DeltaNet), hidden "
              f"{a.hidden}, {a.experts} experts, {name} on the GPU: {res.same}/{total} requests "
              f"token-identical to transformers' generate" + res.parted_text()
              + f"; {hits} prompt tokens hit the prefix cache behind the shared system prompt of "
              f"{a.system} (a checkpoint every "
              f"{engine.config.state_checkpoint_interval * engine.config.page_size} tokens; "
              f"misses {dict(engine.stats.prefix_miss_tokens_by_reason)}); graphs "
              f"{bool(engine.graphs)}; {engine.state_layers_off}")
        del engine, model
        torch.cuda.empty_cache()
    print("OK" if not bad else f"FAILED ({bad})")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
