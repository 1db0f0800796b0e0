"""H100 check of the transformers integration at a realistic size: Llama-3-8B layer shapes with
2 layers (each family's own head dims), random seeded weights, bfloat16 on cuda. For each family: the
first-step logits of ``Engine`` on the cache vs transformers' own sdpa forward, and the greedy
tokens of ``Engine.generate`` vs ``model.generate`` (its own cache, sdpa) for 8 prompts of 5-300
tokens, 64 new tokens each.

Random bf16 weights make greedy decoding chaotic (near-tied logits over 128k tokens): one rounding
difference early changes the rest of the continuation, so free-running agreement mostly measures
where the first flip happens. Two more numbers separate that from a cache error:
  * teacher-forced top-1: the cache (the user-loop path, ``attn_implementation="kvcache"``)
    prefills each prompt, then decodes transformers' own greedy tokens one step at a time (all 8
    prompts in one batch); at each step its argmax is compared with transformers' token;
  * the library's own noise floor: transformers' ``eager`` attention, free-running and
    teacher-forced (one forward over prompt + tokens), against its ``sdpa`` generation.

``--near-ties`` classifies each teacher-forced step where the cache's argmax ``a`` differs from
transformers' token ``w``: a float32 copy of the same weights scores prompt + tokens (one
forward), and the step is a near-tie when its float32 logit gap ``|z32[w] - z32[a]|`` is within
transformers' own bfloat16 error at that step (``max_v |z16[v] - z32[v]|``, its bfloat16
teacher-forced logits against the float32 ones): the two tokens are tied within the rounding of
the library itself. It also prints how far the cache's and transformers' bfloat16 logits are
from float32 (median over steps of the max over the vocabulary).

    python tools/gpu_hf_check.py [--families llama,gemma2,gpt_oss] [--layers 2] [--near-ties]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

import kvcache
from kvcache.integrations import transformers as kvt
from kvcache.integrations.transformers import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integrations"))
from engine_cases import first_step_logits  # noqa: E402  (the tests' helper, one copy)

DIMS = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
            rope_theta=500000.0, initializer_range=0.1, tie_word_embeddings=False,
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
# name -> (model_type, what differs from DIMS): 8B-like attention shapes (32 query heads, 8 KV
# heads, head_dim 128 unless the family fixes its own), the features of issue 27 switched on
FAMILIES = {
    "llama": ("llama", dict(head_dim=128, rope_scaling=LLAMA3)),
    "qwen2": ("qwen2", dict(num_attention_heads=28, num_key_value_heads=4, hidden_size=3584)),
    "qwen3": ("qwen3", dict(head_dim=128)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=128, moe_intermediate_size=1536, num_experts=8,
                                    num_experts_per_tok=2)),
    "mistral": ("mistral", dict(head_dim=128, sliding_window=256)),
    "mixtral": ("mixtral", dict(head_dim=128, **_MOE)),
    "phi3": ("phi3", dict(hidden_size=3072, intermediate_size=8192)),
    "gemma": ("gemma", dict(num_attention_heads=16, num_key_value_heads=16, head_dim=256,
                            hidden_size=3072)),
    "gemma2": ("gemma2", dict(num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                              hidden_size=3584, sliding_window=128, attn_logit_softcapping=50.0,
                              query_pre_attn_scalar=256)),
    "gemma3_text": ("gemma3_text", dict(num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=256, hidden_size=3840, sliding_window=128,
                                        layer_types=["sliding_attention", "full_attention"])),
    "granite": ("granite", dict(attention_multiplier=0.0078125)),
    "olmo2": ("olmo2", dict()),
    "cohere": ("cohere", dict()),
    "glm4": ("glm4", dict(head_dim=128, num_key_value_heads=2)),
    "starcoder2": ("starcoder2", dict(num_key_value_heads=4)),
    "smollm3": ("smollm3", dict(num_attention_heads=16, num_key_value_heads=4, hidden_size=2048)),
    "gpt_oss": ("gpt_oss", dict(head_dim=64, num_attention_heads=64, hidden_size=2880,
                                intermediate_size=2880, sliding_window=128, **_MOE)),
    "deepseek_v3": ("deepseek_v3", dict(num_attention_heads=32, num_key_value_heads=32,
                                        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                        qk_rope_head_dim=64, v_head_dim=128,
                                        moe_intermediate_size=1408, n_routed_experts=8,
                                        num_experts_per_tok=2, n_group=1, topk_group=1,
                                        first_k_dense_replace=1)),
}
# sdpa refuses soft-capping and sinks: the reference generation of those runs on transformers' eager
EAGER_REFERENCE = ("gemma2", "gpt_oss")
LENGTHS = [5, 300, 37, 128, 64, 211, 9, 150]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run (cuda's CPU test mode, --tiny)")
    p.add_argument("--tiny", action="store_true", help="hidden 256, vocab 512: a smoke run")
    p.add_argument("--fp32-reference", action="store_true",
                   help="transformers' reference tokens and logits from a float32 copy")
    p.add_argument("--near-ties", action="store_true",
                   help="classify teacher-forced mismatches against a float32 copy (see above); "
                        "skips the eager noise floor")
    args = p.parse_args()
    dims = dict(DIMS, **(dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=512) if args.tiny else {}))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 500, n).tolist() for n in LENGTHS]
    print(torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch", torch.__version__, "transformers", transformers.__version__)
    # the CPU smoke runs the Triton interpreter, which has no bfloat16
    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16
    for fam in args.families.split(","):
        model_type, kw = FAMILIES[fam]
        if args.tiny:
            kw = {k: v for k, v in kw.items() if k not in ("hidden_size", "intermediate_size",
                                                             "num_attention_heads", "num_key_value_heads")}
            kw.update(hidden_size=384 if fam == "phi3" else 256, intermediate_size=512)
            if "head_dim" in kw:
                kw["head_dim"] = min(kw["head_dim"], 64)
            if model_type == "deepseek_v3":      # MLA expands to one KV head per query head
                kw.update(num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
                          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
        cfg = transformers.AutoConfig.for_model(model_type, **{**dims, **kw, "num_hidden_layers": args.layers})
        ref_attn = "eager" if fam in EAGER_REFERENCE else "sdpa"
        torch.manual_seed(0)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(
                cfg, attn_implementation=ref_attn).to(dtype).eval()
        t0 = time.perf_counter()
        want, first_ref = [], []
        # --fp32-reference: the reference is the same weights in float32 (for families whose
        # eager attention runs its softmax in bfloat16, e.g. gpt-oss's sinks path); the "eager vs
        # sdpa" numbers then compare the bfloat16 model's own eager run with that reference
        ref_model = copy.deepcopy(model).float() if args.fp32_reference else model
        with torch.no_grad():
            for pr in prompts:
                ids = torch.tensor([pr], device=args.device)
                first_ref.append(ref_model(ids).logits[0, -1].float().cpu().numpy())
                out = ref_model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
                want.append(out[0, len(pr):].tolist())
        t_hf = time.perf_counter() - t0
        if ref_model is not model:
            del ref_model
            torch.cuda.empty_cache()
        ties = forced_logits(model, prompts, want, args.device) if args.near_ties else None
        # the library's noise floor: eager attention against sdpa, free-running and forced
        model.set_attn_implementation("eager")
        eager_free, eager_forced = 0, 0
        with torch.no_grad():
            for pr, w in zip(prompts if ties is None else [], want):
                ids = torch.tensor([pr], device=args.device)
                out = model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
                eager_free += sum(int(x == y) for x, y in zip(out[0, len(pr):].tolist(), w))
                full = torch.tensor([pr + w[:-1]], device=args.device)
                top = model(full).logits[0, len(pr) - 1:].argmax(-1).tolist()
                eager_forced += sum(int(x == y) for x, y in zip(top, w))
        steps: list = []
        forced = teacher_forced(model, prompts, want, args.device, steps)
        model.set_attn_implementation(ref_attn)
        if ties is not None:
            print(f"{fam}: " + near_ties(steps, ties, want))
        eng = Engine(model, backend="cuda", device=args.device, max_total_tokens=16384,
                     prefill_chunk_size=512)
        first = [np.asarray(row, np.float32) for row in first_step_logits(eng, prompts)]
        t0 = time.perf_counter()
        got = [o[0] for o in eng.generate(prompts, max_new_tokens=args.new, ignore_eos=True)]
        t_eng = time.perf_counter() - t0
        rel = max(float(np.abs(a - b).max() / np.abs(b).max()) for a, b in zip(first, first_ref))
        top1 = sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(first, first_ref))
        same = sum(int(x == y) for g, w in zip(got, want) for x, y in zip(g, w))
        prefix = sum(next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), len(w)) for g, w in zip(got, want))
        total = sum(len(w) for w in want)
        dims_qk_v = kvt.head_dims(cfg)
        print(f"{fam}: head_dim {dims_qk_v[0]}/{dims_qk_v[1]}, "
              f"{args.layers} layers, bf16: first-step logits max|diff|/max|logit| {rel:.2e}, "
              f"top-1 equal {top1}/{len(prompts)}; greedy tokens equal position-wise {same}/{total} "
              f"({100 * same / total:.1f}%), equal before the first divergence {prefix}/{total} "
              f"({100 * prefix / total:.1f}%); teacher-forced top-1 through the cache {forced}/{total} "
              f"({100 * forced / total:.1f}%); transformers eager vs sdpa: free-running {eager_free}/{total} "
              f"({100 * eager_free / total:.1f}%), teacher-forced {eager_forced}/{total} "
              f"({100 * eager_forced / total:.1f}%); time hf {t_hf:.1f}s, engine {t_eng:.1f}s")
        del model, eng
        torch.cuda.empty_cache()


def forced_logits(model, prompts, want, device) -> tuple:
    """Teacher-forced logits of prompt + ``want`` by ``model`` (bfloat16, its reference
    attention) and by a float32 copy: two lists (one per prompt) of (len(want[i]), vocab)
    float32 tensors, the logits that predict each of ``want[i]``."""
    out = []
    ref32 = copy.deepcopy(model).float()
    for m in (model, ref32):
        rows = []
        with torch.no_grad():
            for pr, w in zip(prompts, want):
                ids = torch.tensor([pr + w[:-1]], device=device)
                rows.append(m(ids).logits[0, len(pr) - 1:].float())
        out.append(rows)
    del ref32
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out[0], out[1]


def near_ties(steps, ties, want) -> str:
    """The teacher-forced mismatches of the cache (``steps``: per step, (prompts, vocab)
    logits) classified against float32 (see the module docstring)."""
    z16, z32 = ties
    mism = tied = 0
    dev_cache, dev_hf, gaps = [], [], []
    for t, logits in enumerate(steps):
        for i, w in enumerate(want):
            ours, ref, lib = logits[i].float(), z32[i][t], z16[i][t]
            dev_cache.append(float((ours - ref).abs().max()))
            noise = float((lib - ref).abs().max())
            dev_hf.append(noise)
            a = int(ours.argmax())
            if a != w[t]:
                mism += 1
                gap = float((ref[w[t]] - ref[a]).abs())
                gaps.append(gap / max(noise, 1e-12))
                tied += int(gap <= noise)
    total = len(steps) * len(want)
    worst = f", largest gap / bf16 error {max(gaps):.2f}" if gaps else ""
    return (f"teacher-forced top-1 {total - mism}/{total} ({100 * (total - mism) / total:.1f}%); "
            f"mismatches {mism}, near-ties {tied}/{mism} (float32 gap within transformers' own "
            f"bfloat16 error at the step{worst}); logits vs float32, median of max|diff|: cache "
            f"{np.median(dev_cache):.3g}, transformers bfloat16 {np.median(dev_hf):.3g}")


def teacher_forced(model, prompts, want, device, steps=None) -> int:
    """Prefill every prompt through the cache, then decode ``want`` one token per step (the whole
    batch per forward); count the steps whose argmax equals transformers' own greedy token.
    ``steps``: a list to which each step's (prompts, vocab) logits are appended."""
    kvt.register()
    model.set_attn_implementation("kvcache")
    cache = kvcache.PagedKVCache(kvt.cache_config(model, max_total_tokens=16384), backend="cuda",
                                 device=device)
    ids = list(range(len(prompts)))
    for i in ids:
        cache.add_sequence(i)
    hits = 0
    feeds = [list(p) for p in prompts]
    start = [0] * len(prompts)
    with torch.no_grad():
        for step in range(len(want[0])):
            toks = [t for f, s0 in zip(feeds, start) for t in f[s0:]]
            pos = [p for f, s0 in zip(feeds, start) for p in range(s0, len(f))]
            lens = [len(f) - s0 for f, s0 in zip(feeds, start)]
            last = np.cumsum(lens) - 1
            with cache.forward(ids, lens):
                logits = model(torch.tensor([toks], device=device),
                               position_ids=torch.tensor([pos], device=device), use_cache=False,
                               kvcache=cache, logits_to_keep=torch.tensor(last, device=device)).logits
            top = logits[0].argmax(-1).tolist()
            if steps is not None:
                steps.append(logits[0].float())
            for i in ids:
                hits += int(top[i] == want[i][step])
                start[i] = len(feeds[i])
                feeds[i].append(want[i][step])
    return hits


if __name__ == "__main__":
    main()
