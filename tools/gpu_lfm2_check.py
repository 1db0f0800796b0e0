"""LFM2 (short convolutions on state slots, issue 56) on a GPU in bfloat16: a random-weight
LFM2 (conv and attention layers) served by the Engine on the cuda backend, greedy, against
transformers' own ``generate`` on the same model; a request whose tokens differ is judged by
a teacher-forced re-score (``kvcache.demo.check.rescore_greedy``: every token the argmax or
within the bfloat16 near-tie margin), and the report says how many parted that way. Then the
same in float32, where the tokens must be equal. Half the prompts share a 200-token system
prompt and are sent after the others, so that they hit the prefix cache through the state
checkpoints (docs/hybrid.md increment 8); the hit and miss tokens are printed.

    python tools/gpu_lfm2_check.py [--layers 8] [--hidden 512] [--requests 12] [--new 24]
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import transformers

from kvcache.demo.check import check_greedy
from kvcache.integrations.transformers import Engine


def model_of(layers: int, hidden: int, dtype, seed: int = 0):
    types = ["full_attention" if i % 3 == 1 else "conv" for i in range(layers)]
    config = transformers.AutoConfig.for_model(
        "lfm2", vocab_size=1024, num_hidden_layers=layers, hidden_size=hidden,
        intermediate_size=2 * hidden, num_attention_heads=8, num_key_value_heads=4,
        layer_types=types, conv_L_cache=3, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, initializer_range=0.05, tie_word_embeddings=False,
        max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to("cuda", dtype).eval()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--new", type=int, default=24)
    a = p.parse_args()
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 1024, int(n)).tolist() for n in rng.integers(3, 300, a.requests)]
    system = rng.integers(1, 1024, 200).tolist()
    half = a.requests // 2
    prompts = prompts[:half] + [system + p[:40] for p in prompts[half:]]
    bad = 0
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        model = model_of(a.layers, a.hidden, dtype)
        engine = Engine(model, backend="cuda", device="cuda", max_batch_size=8,
                        prefill_chunk_size=128)
        out = [o[0] for o in engine.generate(prompts[:half + 1], max_new_tokens=a.new,
                                             ignore_eos=True)]
        out += [o[0] for o in engine.generate(prompts[half + 1:], max_new_tokens=a.new,
                                              ignore_eos=True)]
        # float32 runs the PyTorch path's summation order: its tokens must be equal
        res = check_greedy(model, prompts, out, a.new, name, strict=name == "float32")
        bad += res.failed
        print(f"LFM2 {a.layers} layers, hidden {a.hidden}, {name} on the GPU: {res.same}/"
              f"{len(prompts)} requests token-identical to transformers' generate"
              + res.parted_text() + f"; graphs {bool(engine.graphs)}; prefix cache "
              f"{engine.config.prefix_cache}: {engine.stats.prefix_hit_tokens} tokens hit, "
              f"misses {engine.stats.prefix_miss_tokens_by_reason}")
        del engine, model
        torch.cuda.empty_cache()
    print("OK" if not bad else f"FAILED ({bad})")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
