"""Small random-weight mlx-lm models of each supported family (float32, MLX's CPU device) and
the reference tokens of mlx-lm's own generation with its own cache (computed once per family)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

import kvcache  # noqa: E402
from kvcache.backend import Capabilities  # noqa: E402

from engine_cases import LENGTHS, NEW_TOKENS, VOCAB, make_prompts  # noqa: E402,F401

COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, rms_norm_eps=1e-5)
FAMILY_CONFIGS = {
    "llama": ("llama", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)),
    # llama3 rotary scaling: the model's own RoPE function runs at per-token positions
    "llama3-scaled": ("llama", dict(model_type="llama", hidden_size=128, intermediate_size=192,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64})),
    # mlx-lm runs Mistral on its llama model (a window only on layers listed as sliding)
    "mistral": ("llama", dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, sliding_window=4096)),
    "qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1, tie_word_embeddings=False)),
    "phi3": ("phi3", dict(hidden_size=192, intermediate_size=256, num_attention_heads=2,
                          num_key_value_heads=1)),
    "gemma": ("gemma", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256)),
}
FAMILIES = list(FAMILY_CONFIGS)


def make_model(family: str, seed: int = 0, **overrides):
    """A float32 mlx-lm model of ``family`` with seeded random weights (2 layers, small)."""
    import importlib
    module_name, kw = FAMILY_CONFIGS[family]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = module.ModelArgs(**{"model_type": family, **COMMON, **kw, **overrides})
    mx.random.seed(seed)
    model = module.Model(args)
    mx.eval(model.parameters())
    return model


def mlx_greedy(model, prompt, new_tokens=NEW_TOKENS) -> list:
    """mlx-lm's own greedy generation (generate_step with its own KV cache)."""
    from mlx_lm.generate import generate_step
    steps = generate_step(mx.array(prompt), model, max_tokens=new_tokens,
                          sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
    return [int(token) for token, _ in steps]


def mlx_logits(model, tokens) -> np.ndarray:
    """mlx-lm's own forward (no cache) logits, (len(tokens), vocab) float64."""
    out = model(mx.array(tokens)[None])[0]
    return np.asarray(out.astype(mx.float32)).astype(np.float64)


@functools.lru_cache(maxsize=None)
def family_case(family: str):
    """(model, prompts, greedy tokens per prompt, first-step logits per prompt), once."""
    model = make_model(family, seed=FAMILIES.index(family))
    prompts = make_prompts()
    greedy = [mlx_greedy(model, p) for p in prompts]
    first = [mlx_logits(model, p)[-1] for p in prompts]
    return model, prompts, greedy, first


def metal_cpu_or_skip(head_dim: int):
    """The metal backend's capabilities on MLX's CPU device, or skip: not installed or
    unavailable, or lacking the head_dim (by capability)."""
    rows = {r["name"]: r for r in kvcache.list_backends("cpu")}
    row = rows.get("metal")
    if row is None or not row["available"]:
        pytest.skip(f"backend 'metal' not available: {row['reason'] if row else 'not installed'}")
    caps = row["class"].capabilities
    if head_dim not in caps.head_dims:
        pytest.skip(f"metal: {Capabilities.reason('head_dims')}")
    return caps
