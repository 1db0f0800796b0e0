"""Bamba (Mamba-2 mixers on state slots, issue 56, docs/hybrid.md increment 7) on a GPU: a
random-weight Bamba (mamba and attention layers) served by the Engine on the cuda backend,
greedy, against transformers' own ``generate`` on the same model, in bfloat16 then float32.

In bfloat16 a request whose tokens differ is judged by a teacher-forced re-score
(``kvcache.demo.check.rescore_greedy``: every token the argmax or within the bfloat16 near-tie
margin), and the report says how many parted that way: the cache keeps the SSM state in the
cache dtype (bfloat16) where transformers keeps it in float32, so near-ties may part. In
float32 the tokens must be equal, unless transformers runs the mixer with the ``mamba_ssm`` /
``causal_conv1d`` kernels here (other summation orders than its PyTorch path, which the cache
follows): then differing requests are judged by the re-score at float32's margin and counted.

Half the prompts share a 200-token system prompt and come in a second call, with a state
checkpoint every ``--interval`` pages, so that they hit the prefix cache through the
checkpoints (docs/hybrid.md increment 8); the hit and miss tokens are printed.

    python tools/gpu_bamba_check.py [--family bamba|granitemoehybrid|nemotron_h|falcon_h1]
        [--layers 8]
        [--hidden 512] [--requests 12] [--new 24] [--interval 4]
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
import torch
import transformers

from kvcache.demo.check import check_greedy
from kvcache.integrations.transformers import Engine, state_kinds


def model_of(family: str, layers: int, hidden: int, dtype, seed: int = 0):
    """A random ``family`` model on the GPU: every third layer attention, the others Mamba-2
    mixers (16 heads of ``2 * hidden / 16``, 2 groups, a state of 64, a conv of 4 taps, SSM
    chunks of 64 tokens), ``dt_bias`` and ``D`` drawn."""
    attn = [i for i in range(layers) if i % 3 == 1]
    kw = dict(vocab_size=1024, num_hidden_layers=layers, hidden_size=hidden,
              intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=4,
              mamba_n_heads=16, mamba_d_head=2 * hidden // 16, mamba_d_state=64,
              mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=64, pad_token_id=0,
              bos_token_id=None, eos_token_id=None, initializer_range=0.05,
              tie_word_embeddings=False, max_position_embeddings=4096)
    if family == "nemotron_h":
        # blocks: mixer, attention, MLP, mixer, mixer, MoE, attention, MLP, ... (the tests'
        # pattern); the older configs' spelling, which 5.24 still reads
        pattern = "M*-MME*-" * (-(-layers // 8))
        kw = dict(vocab_size=1024, hidden_size=hidden, hybrid_override_pattern=pattern[:layers],
                  num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                  intermediate_size=2 * hidden, mamba_num_heads=16, mamba_head_dim=2 * hidden // 16,
                  ssm_state_size=64, n_groups=2, conv_kernel=4, chunk_size=64,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                  moe_shared_expert_intermediate_size=hidden // 2, pad_token_id=0,
                  bos_token_id=None, eos_token_id=None, initializer_range=0.05,
                  max_position_embeddings=4096)
    elif family == "falcon_h1":
        # every layer a Mamba-2 mixer beside attention; the muP multipliers all other than 1
        kw = dict(vocab_size=1024, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=hidden // 8,
                  intermediate_size=2 * hidden, mamba_d_ssm=2 * hidden, mamba_n_heads=16,
                  mamba_d_head=2 * hidden // 16, mamba_d_state=64, mamba_n_groups=2,
                  mamba_d_conv=4, mamba_chunk_size=64, pad_token_id=0, bos_token_id=None,
                  eos_token_id=None, initializer_range=0.05, max_position_embeddings=4096,
                  tie_word_embeddings=False, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
                  ssm_in_multiplier=1.3, ssm_out_multiplier=0.9, attention_in_multiplier=1.1,
                  attention_out_multiplier=0.8, key_multiplier=1.2, embedding_multiplier=1.5,
                  lm_head_multiplier=0.7, mlp_multipliers=[1.2, 0.9])
    elif family == "bamba":
        kw["attn_layer_indices"] = attn
    else:
        kw.update(layer_types=["attention" if i in attn else "mamba" for i in range(layers)],
                  shared_intermediate_size=2 * hidden, num_local_experts=0)
    config = transformers.AutoConfig.for_model(family, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.dt_bias.normal_(0.0, 1.0)
                m.D.normal_(0.0, 1.0)
    return model.to("cuda", dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--family", choices=("bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"),
                   default="bamba")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--interval", type=int, default=4)
    p.add_argument("--dtypes", default="bfloat16,float32",
                   help="the halves to run, comma-separated")
    a = p.parse_args()
    kernels = [k for k in ("mamba_ssm", "causal_conv1d") if importlib.util.find_spec(k)]
    print(f"transformers {transformers.__version__}; its mixer kernels here: "
          f"{', '.join(kernels) or 'none (its PyTorch path)'}")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 1024, int(n)).tolist() for n in rng.integers(3, 300, a.requests)]
    system = rng.integers(1, 1024, 200).tolist()
    half = a.requests // 2
    prompts = prompts[:half] + [system + p[:40] for p in prompts[half:]]
    bad = 0
    halves = (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    for name, dtype in [h for h in halves if h[0] in a.dtypes.split(",")]:
        model = model_of(a.family, a.layers, a.hidden, dtype)
        engine = Engine(model, backend="cuda", device="cuda", max_batch_size=8,
                        prefill_chunk_size=128, state_checkpoint_interval=a.interval)
        out = [o[0] for o in engine.generate(prompts[:half + 1], max_new_tokens=a.new,
                                             ignore_eos=True)]
        out += [o[0] for o in engine.generate(prompts[half + 1:], max_new_tokens=a.new,
                                              ignore_eos=True)]
        # float32 on transformers' PyTorch path (no mixer kernels) sums in the cache's order
        res = check_greedy(model, prompts, out, a.new, name,
                           strict=name == "float32" and not kernels)
        bad += res.failed
        print(f"{a.family} {a.layers} layers ({len(state_kinds(model))} mamba), hidden "
              f"{a.hidden}, {name} on the GPU: {res.same}/{len(prompts)} requests "
              f"token-identical to transformers' generate" + res.parted_text()
              + f"; graphs {bool(engine.graphs)}; "
              f"{engine.state_layers_off}; prefix cache: {engine.stats.prefix_hit_tokens} "
              f"tokens hit, misses {engine.stats.prefix_miss_tokens_by_reason}")
        del engine, model
        torch.cuda.empty_cache()
    print("OK" if not bad else f"FAILED ({bad})")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
