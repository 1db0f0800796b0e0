"""H100 check of the transformers integration at a realistic size: Llama-3-8B layer shapes with
4 layers (phi3: head_dim 96), random seeded weights, bfloat16 on cuda. For each family: the
first-step logits of ``Engine`` on the cache vs transformers' own sdpa forward, and the greedy
tokens of ``Engine.generate`` vs ``model.generate`` (its own cache, sdpa) for 8 prompts of 5-300
tokens, 64 new tokens each.

    python tools/gpu_hf_check.py [--families llama,mistral,phi3] [--layers 4]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import transformers

from kvcache.integrations.transformers import Engine

DIMS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
            rope_theta=500000.0, initializer_range=0.1, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(head_dim=128)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=128, sliding_window=4096)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(hidden_size=3072, intermediate_size=8192)),
}
LENGTHS = [5, 300, 37, 128, 64, 211, 9, 150]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (cuda's CPU test mode, --tiny)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, vocab 512: a smoke run")
    args = p.parse_args()
    dims = dict(DIMS, **(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512) if args.tiny else {}))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 500, n).tolist() for n in LENGTHS]
    print(torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch", torch.__version__, "transformers", transformers.__version__)
    for fam in args.families.split(","):
        cname, mname, kw = FAMILIES[fam]
        kw = dict(kw, **(dict(hidden_size=384, intermediate_size=512) if args.tiny and fam == "phi3" else {}))
        cfg = getattr(transformers, cname)(**{**dims, **kw, "num_hidden_layers": args.layers})
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device(args.device):
            model = getattr(transformers, mname)(cfg).to(torch.bfloat16).eval()
        t0 = time.perf_counter()
        want, first_ref = [], []
        with torch.no_grad():
            for pr in prompts:
                ids = torch.tensor([pr], device=args.device)
                first_ref.append(model(ids).logits[0, -1].float().cpu().numpy())
                out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
                want.append(out[0, len(pr):].tolist())
        t_hf = time.perf_counter() - t0
        eng = Engine(model, backend="cuda", device=args.device, max_total_tokens=16384,
                     prefill_chunk_size=512)
        rows = []
        fwd = eng.adapter.forward

        def spy(cache, tokens, positions, wanted):
            out = fwd(cache, tokens, positions, wanted)
            if len(wanted):
                rows.append(eng.adapter.to_numpy(out))
            return out
        eng.adapter.forward = spy
        first = []
        for pr in prompts:
            rows.clear()
            eng.generate([pr], max_new_tokens=1)
            first.append(np.asarray(rows[0][0], np.float32))
        eng.adapter.forward = fwd
        t0 = time.perf_counter()
        got = [o[0] for o in eng.generate(prompts, max_new_tokens=args.new)]
        t_eng = time.perf_counter() - t0
        rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(first, first_ref))
        top1 = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(first, first_ref))
        same = sum(int(x == y) for g, w in zip(got, want) for x, y in zip(g, w))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w)) for g, w in zip(got, want))
        total = sum(len(w) for w in want)
        print(f"{fam}: head_dim {cfg.hidden_size // cfg.num_attention_heads if fam == 'phi3' else kw['head_dim']}, "
              f"{args.layers} layers, bf16: first-step logits max|diff|/max|logit| {rel:.2e}, "
              f"top-1 equal {top1}/{len(prompts)}; greedy tokens equal position-wise {same}/{total} "
              f"({100 * same / total:.1f}%), equal before the first divergence {prefix}/{total} "
              f"({100 * prefix / total:.1f}%); time hf {t_hf:.1f}s, engine {t_eng:.1f}s")
        del model, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
