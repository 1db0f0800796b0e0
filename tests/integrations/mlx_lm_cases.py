"""Small random-weight mlx-lm models of every family of issue 27 that mlx-lm ships (float32, MLX's
CPU device), built from each family's own ModelArgs, and the reference of mlx-lm's own
generation with its own KV cache (computed once per family)."""

from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import kvcache  # noqa: E402
from kvcache.backend import Capabilities  # noqa: E402

from engine_cases import LENGTHS, NEW_TOKENS, VOCAB, make_prompts  # noqa: E402,F401

COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-5)
_GQA = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
WINDOW = 8
"""The sliding window of the matrix's windowed families (its prompts are longer)."""
# name -> (mlx_lm.models module, ModelArgs keywords): every family of issue 27 that mlx-lm ships
# (mlx-lm runs Mistral on its llama model), each as small as it goes, with what makes its
# attention its own switched on; ModelArgs.from_dict drops what a family does not take
FAMILY_CONFIGS = {
    "llama": ("llama", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)),
    # llama3 rotary scaling (most frequencies scaled: a short original context)
    "llama3": ("llama", dict(_GQA, model_type="llama", head_dim=16, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16})),
    # a Mistral config: sliding_window without layer_types is full attention in mlx-lm
    "mistral": ("llama", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, sliding_window=4096)),
    "qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1, tie_word_embeddings=False)),     # qkv bias
    "qwen3": ("qwen3", dict(_GQA, head_dim=16, max_position_embeddings=1024, rope_theta=1e6,
                            tie_word_embeddings=False)),                           # q/k RMSNorm
    "qwen3_moe": ("qwen3_moe", dict(_GQA, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    decoder_sparse_step=1, mlp_only_layers=[],
                                    moe_intermediate_size=32, rope_theta=1e6,
                                    tie_word_embeddings=False, max_position_embeddings=1024,
                                    norm_topk_prob=True)),
    "mixtral": ("mixtral", dict(_GQA, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("phi3", dict(hidden_size=192, intermediate_size=256, num_attention_heads=2,
                          num_key_value_heads=1)),                     # fused qkv, head_dim 96
    "gemma": ("gemma", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256)),
    # computes its soft-capped attention itself (own-attention mode)
    "gemma2": ("gemma2", dict(_GQA, head_dim=16, attn_logit_softcapping=3.0,
                              final_logit_softcapping=10.0, query_pre_attn_scalar=24)),
    # q/k norms, query_pre_attn_scalar, local/global RoPE bases, sliding and full layers
    "gemma3_text": ("gemma3_text", dict(_GQA, head_dim=16, sliding_window=WINDOW,
                                        sliding_window_pattern=2, query_pre_attn_scalar=24)),
    "granite": ("granite", dict(_GQA, attention_multiplier=0.05, embedding_multiplier=3.0,
                                residual_multiplier=0.5, logits_scaling=2.0,
                                max_position_embeddings=1024, attention_bias=False,
                                mlp_bias=False, rope_theta=10000.0)),      # its own scales
    "olmo2": ("olmo2", dict(_GQA)),                                    # q/k RMSNorm over heads
    "cohere": ("cohere", dict(_GQA, use_qk_norm=True, logit_scale=0.5)),   # interleaved RoPE
    "glm4": ("glm4", dict(_GQA, head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
                          rope_theta=10000.0)),                        # partial interleaved RoPE
    "starcoder2": ("starcoder2", dict(_GQA)),                          # biases, LayerNorm
    "smollm3": ("smollm3", dict(_GQA, no_rope_layer_interval=2)),      # layer 1 without RoPE
    # learned sinks, sliding and full layers, MoE
    "gpt_oss": ("gpt_oss", dict(_GQA, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=WINDOW)),
    # MLA over the latent and rotary keys it fetches, the rotary scores passed as a mask
    # (own-attention mode: the cache stores the compressed latent)
    "deepseek_v3": ("deepseek_v3", dict(_GQA, num_key_value_heads=4, moe_intermediate_size=32,
                                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
                                        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                                        num_experts_per_tok=2, first_k_dense_replace=1)),
}
FAMILIES = list(FAMILY_CONFIGS)
OWN_ATTENTION = ("gemma2", "deepseek_v3")
"""Families whose mlx-lm attention is computed by the model over the keys and values the cache
returns (the cache's kernels do not attend)."""
RUNS = list(FAMILIES)
NEEDS = {"gpt_oss": "attention_sinks"}
"""Families that need a backend capability beyond plain attention (and sliding windows)."""


def make_model(family: str, seed: int = 0, vocab: int = VOCAB, **overrides):
    """A float32 mlx-lm model of ``family`` (a ``FAMILY_CONFIGS`` name) with seeded random
    weights (2 layers, small): every 1-D parameter (biases, norm weights, sinks) is moved off
    its initial value so that it changes the output."""
    from mlx.utils import tree_flatten
    module_name, kw = FAMILY_CONFIGS[family]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = module.ModelArgs.from_dict({"model_type": family, **COMMON, "vocab_size": vocab,
                                       **kw, **overrides})
    mx.random.seed(seed)
    model = module.Model(args)
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:
            sd = 2.0 if name.endswith("sinks") else 0.3
            updates.append((name, p + sd * mx.random.normal(p.shape)))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    return model


def greedy_sampler(logprobs):
    return mx.argmax(logprobs, axis=-1)


def mlx_greedy(model, prompt, new_tokens=NEW_TOKENS) -> list:
    """mlx-lm's own greedy generation (generate_step with its own KV cache)."""
    from mlx_lm.generate import generate_step
    steps = generate_step(mx.array(prompt), model, max_tokens=new_tokens, sampler=greedy_sampler)
    return [int(token) for token, _ in steps]


def mlx_logits(model, tokens) -> np.ndarray:
    """mlx-lm's own forward (no cache) logits, (len(tokens), vocab) float64."""
    out = model(mx.array(tokens)[None])[0]
    return np.asarray(out.astype(mx.float32)).astype(np.float64)


def teacher_forced_logprobs(model, prompt, tokens) -> np.ndarray:
    """The plain model's log-probabilities of ``tokens`` following ``prompt`` (one forward)."""
    logits = mlx_logits(model, list(prompt) + list(tokens))[len(prompt) - 1:-1]
    top = logits.max(-1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
    return logits[np.arange(len(tokens)), tokens] - logz


MATRIX_VOCAB = 128
MATRIX_NEW = 10
MATRIX_LENGTHS = [3, 45, 17, 12]
"""Prompt lengths of the matrix; prompt 3 is prompt 1's first 20 tokens and 12 more (a shared
prefix longer than a page: prefilled once, forked), prompts longer than WINDOW."""


def matrix_prompts(seed: int = 3) -> list:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, MATRIX_VOCAB, n).tolist() for n in MATRIX_LENGTHS]
    prompts[3] = prompts[1][:20] + prompts[3]
    return prompts


@functools.lru_cache(maxsize=None)
def matrix_case(family: str):
    """(model, prompts, mlx-lm's greedy tokens per prompt), once per family."""
    model = make_model(family, seed=FAMILIES.index(family), vocab=MATRIX_VOCAB)
    prompts = matrix_prompts()
    return model, prompts, [mlx_greedy(model, p, MATRIX_NEW) for p in prompts]


def backend_row(name: str):
    rows = {r["name"]: r for r in kvcache.list_backends("cpu")}
    return rows.get(name)


def metal_cpu_or_skip(head_dim: int):
    """The metal backend's capabilities on MLX's CPU device, or skip: not installed or
    unavailable, or lacking the head_dim (by capability)."""
    row = backend_row("metal")
    if row is None or not row["available"]:
        pytest.skip(f"backend 'metal' not available: {row['reason'] if row else 'not installed'}")
    caps = row["class"].capabilities
    if head_dim not in caps.head_dims:
        pytest.skip(f"metal: {Capabilities.reason('head_dims')}")
    return caps
