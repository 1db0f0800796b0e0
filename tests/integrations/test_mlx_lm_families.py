"""Token identity on mlx-lm: for each supported family (random weights, float32, MLX's CPU
device), Engine.generate on the metal backend returns exactly the greedy tokens of mlx-lm's own
generation with its own KV cache, for 8 prompts of 5-300 tokens (chunked prefill, a shared
prefix), and the first-step logits agree within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_lm_cases import (FAMILIES, NEW_TOKENS, family_case, make_model, make_prompts,
                          metal_cpu_or_skip, mlx_greedy)
from engine_cases import first_step_logits

from kvcache.errors import UnsupportedFeatureError  # noqa: E402
from kvcache.integrations.mlx_lm import Engine, cache_config, sliding_windows  # noqa: E402


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_mlx_lm(family):
    model, prompts, greedy, first = family_case(family)
    metal_cpu_or_skip(cache_config(model).head_dim)
    engine = Engine(model, backend="metal", device="cpu", max_total_tokens=8192,
                    prefill_chunk_size=128)
    assert engine.cache.backend.name == "metal"
    assert engine.cache.config.rope_mode == "none"
    attn = [layer.self_attn for layer in model.layers]
    out = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    # the model's own attention modules are back in place after generate
    assert all(a is layer.self_attn for a, layer in zip(attn, model.layers))
    assert len(out) == len(prompts) and all(len(o) == 1 for o in out)
    for i, (o, want) in enumerate(zip(out, greedy)):
        assert o[0] == want, f"{family}: prompt {i} ({len(prompts[i])} tokens) differs"
    # the shared 120-token prefix of prompts 1 and 7 was computed once and forked
    assert engine.stats.forks >= 2 and engine.stats.shared_prefix_tokens >= 2 * 120
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) - 120
    assert engine.cache.is_empty
    got = first_step_logits(engine, prompts)
    for i, (g, w) in enumerate(zip(got, first)):
        scale = np.abs(w).max()
        assert np.abs(g - w).max() <= 1e-4 * scale, f"{family}: prompt {i} logits"


def test_sliding_window_layers_as_mlx_lm_defines_them():
    """Layers listed as 'sliding_attention' see the previous sliding_window positions, itself
    included: token-identical with mlx-lm's rotating cache where the backend has per-query
    windows, a typed error naming the capability before anything runs where it has not."""
    model = make_model("mistral", seed=7, sliding_window=48,
                       layer_types=["sliding_attention", "full_attention"])
    assert sliding_windows(model) == {0: 48}
    caps = metal_cpu_or_skip(cache_config(model).head_dim)
    prompts = make_prompts(seed=5)[:4]
    engine = Engine(model, backend="metal", device="cpu", max_total_tokens=4096,
                    prefill_chunk_size=64)
    if not getattr(caps, "window_left", False):
        with pytest.raises(UnsupportedFeatureError, match="window_left") as err:
            engine.generate(prompts, max_new_tokens=32)
        assert "sliding_window=48" in str(err.value)
        assert engine.cache.is_empty and engine.stats.forwards == 0
        # sequences inside the window run without it
        short = [p[:10] for p in prompts]
        out = engine.generate(short, max_new_tokens=20)
        for i, p in enumerate(short):
            assert out[i][0] == mlx_greedy(model, p, 20), f"short prompt {i}"
        return
    out = engine.generate(prompts, max_new_tokens=32)
    for i, p in enumerate(prompts):
        assert out[i][0] == mlx_greedy(model, p, 32), f"prompt {i} ({len(p)} tokens)"
