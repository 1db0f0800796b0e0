"""The family matrix of issue 27 on mlx-lm: for every family that mlx-lm ships (random weights,
float32, MLX's CPU device), the model's own attention code runs on the paged cache through
mlx-lm's cache protocol, and Engine.generate on the metal backend returns exactly the greedy
tokens of mlx-lm's own generation with its own KV cache (prompts of 3-45 tokens batched together,
chunked prefill, a shared prefix, sliding layers), with log-probabilities equal to a
teacher-forced re-score by the plain model. Families whose model computes attention itself
(gemma2, deepseek_v3's MLA) run with the cache holding what they fetch."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_lm_cases import (FAMILIES, MATRIX_NEW, NEEDS, OWN_ATTENTION, RUNS, WINDOW, backend_row,
                          make_model, make_prompts, matrix_case, metal_cpu_or_skip, mlx_greedy,
                          teacher_forced_logprobs)

from kvcache.backend import Capabilities  # noqa: E402
from kvcache.errors import UnsupportedFeatureError  # noqa: E402
from kvcache.integrations.mlx_lm import (Engine, cache_config, describe,  # noqa: E402
                                         layer_caches, sliding_windows)

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def _engine(model, backend="metal", **kw):
    return Engine(model, backend=backend, device="cpu",
                  **{"max_total_tokens": 2048, "prefill_chunk_size": 32, **kw})


def _check_family(family, backend):
    model, prompts, greedy = matrix_case(family)
    engine = _engine(model, backend)
    assert engine.cache.config.rope_mode == "none"
    out, logprobs = engine.generate(prompts, max_new_tokens=MATRIX_NEW, return_logprobs=True)
    # the model is as it was: its inner model is back in place
    assert "model" not in vars(model)
    for i, (o, want) in enumerate(zip(out, greedy)):
        assert o[0] == want, f"{family} on {backend}: prompt {i} ({len(prompts[i])} tokens)"
        np.testing.assert_allclose(logprobs[i][0], teacher_forced_logprobs(model, prompts[i], o[0]),
                                   rtol=1e-4, atol=1e-4, err_msg=f"{family}: prompt {i}")
    # the 45-token prompt ran in chunks; prompt 3 started from the whole pages of prompt 1's
    # first 20 tokens in the prefix cache
    ps = engine.cache.config.page_size
    assert 0 < 20 - 20 % ps <= engine.stats.prefix_hit_tokens
    assert engine.cache.is_empty


@pytest.mark.parametrize("family", RUNS)
def test_family_matches_mlx_lm(family):
    model = matrix_case(family)[0]
    caps = metal_cpu_or_skip(cache_config(model).head_dim)
    need = NEEDS.get(family)
    if need is None or getattr(caps, need, False):
        _check_family(family, "metal")
        return
    # metal lacks the capability: refused before anything runs, naming it; the integration
    # itself is checked on the reference backend, which has it
    with pytest.raises(UnsupportedFeatureError, match=need):
        _engine(model)
    if backend_row("reference")["class"].capabilities.describe().get(need):
        _check_family(family, "reference")
    pytest.xfail(f"metal: {Capabilities.reason(need)}")


def test_own_attention_families_store_what_they_fetch():
    """mlx-lm's gemma2 computes its soft-capped attention itself; its deepseek_v3 (MLA) attends
    over the latent and rotary keys it fetches with the rotary scores as a mask. Both were
    refused before; now the cache holds what they fetch (for MLA the compressed latent, one KV
    head of kv_lora_rank, the rotary key as the 'value') and the model attends over it."""
    d = describe(make_model("gemma2"))
    assert d.own_attention and (d.num_kv_heads, d.head_dim, d.head_dim_v) == (2, 16, 16)
    d = describe(make_model("deepseek_v3"))
    assert d.own_attention and (d.num_qo_heads, d.num_kv_heads, d.head_dim, d.head_dim_v) == (1, 1, 32, 8)
    assert not describe(make_model("llama")).own_attention
    assert set(OWN_ATTENTION) <= set(RUNS)


def test_own_attention_queued_forwards_read_at_the_end():
    """Decode steps queued with the host one step ahead (overlap) and a second generate call on
    the same engine: the history each sequence reads from the pages is its own."""
    metal_cpu_or_skip(16)
    model = make_model("gemma2", seed=3)
    prompts = make_prompts(seed=4)[:5]
    want = [mlx_greedy(model, p, 12) for p in prompts]
    engine = _engine(model, max_total_tokens=4096, prefill_chunk_size=16, overlap=True)
    assert [o[0] for o in engine.generate(prompts, max_new_tokens=12)] == want
    assert [o[0] for o in engine.generate(prompts[::-1], max_new_tokens=12)] == want[::-1]


def test_own_attention_model_refused_by_layer_caches():
    """One model call over every sequence's tokens cannot give each its own history: refused."""
    import kvcache
    model = make_model("gemma2")
    cache = kvcache.PagedKVCache(cache_config(model, max_total_tokens=256), backend="reference")
    cache.add_sequence(0)
    with cache.forward([0], [2]):
        with pytest.raises(UnsupportedFeatureError, match="computes attention itself"):
            layer_caches(model, cache)
        for layer in range(cache.config.num_layers):     # the forward can still finish
            z = cache.from_numpy(np.zeros((2, 2, 16)))
            cache.append_kv(layer, z, z)


class _Counted(nn.Module):
    """A submodule that counts its calls (the model's own q/k norm, still run by the model)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return self.inner(x)


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])
def test_model_attention_runs_its_q_k_norms(family):
    """The old integration re-implemented attention and skipped these norms (wrong tokens,
    silently): now every layer's own module runs, norms included, once per forward."""
    metal_cpu_or_skip(16)
    model = make_model(family, seed=1)
    prompts = make_prompts(seed=2)[:3]
    want = [mlx_greedy(model, p, 8) for p in prompts]
    norms = []
    for layer in model.layers:
        layer.self_attn.q_norm = _Counted(layer.self_attn.q_norm)
        layer.self_attn.k_norm = _Counted(layer.self_attn.k_norm)
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    engine = _engine(model, max_total_tokens=4096, prefill_chunk_size=256)
    before = [n.calls for n in norms]
    out = engine.generate(prompts, max_new_tokens=8)
    assert all(n.calls - b == engine.stats.forwards for n, b in zip(norms, before))
    assert [o[0] for o in out] == want


def test_sliding_window_layers_as_mlx_lm_defines_them():
    """Layers mlx-lm gives a RotatingKVCache of max_size w (llama's 'sliding_attention' layer
    types) see the previous w positions, itself included: token-identical with mlx-lm's own
    rotating cache where the backend has per-query windows, a typed error naming the capability
    before anything runs where it has not."""
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


def test_description_read_off_the_attention_calls():
    """Heads, head dims, windows and sinks come from what the layers hand the protocol, not
    from attribute names (gpt-oss names its heads num_attention_heads; phi3 fuses qkv)."""
    d = describe(make_model("gpt_oss", vocab=128))
    assert (d.num_layers, d.num_qo_heads, d.num_kv_heads, d.head_dim, d.head_dim_v) == (2, 4, 2, 16, 16)
    assert d.windows == {0: WINDOW} and d.sinks == (0, 1) and d.vocab_size == 128
    d = describe(make_model("phi3"))
    assert (d.num_qo_heads, d.num_kv_heads, d.head_dim, d.windows, d.sinks) == (2, 1, 96, {}, ())
    d = describe(make_model("gemma3_text"))
    assert d.windows == {0: WINDOW}


def test_refused_protocol_breaches():
    """A RoPE that needs a scalar offset (dynamic NTK scaling reads the sequence length), a cache
    type the paged cache cannot stand in for, a model computing attention without its cache:
    each refused naming the reason."""
    model = make_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0},
                       max_position_embeddings=64)
    with pytest.raises(UnsupportedFeatureError, match="cache.offset"):
        describe(model)

    from mlx_lm.models.cache import ArraysCache
    model = make_model("qwen2")
    object.__setattr__(model, "make_cache", lambda: [ArraysCache(2) for _ in model.layers])
    with pytest.raises(UnsupportedFeatureError, match="ArraysCache"):
        describe(model)

    # a window mask on a layer whose mlx-lm cache says full attention: which layers slide?
    from mlx_lm.models.cache import KVCache
    model = make_model("mistral", sliding_window=48, layer_types=["sliding_attention", "full_attention"])
    object.__setattr__(model, "make_cache", lambda: [KVCache() for _ in model.layers])
    with pytest.raises(UnsupportedFeatureError, match="sliding-window mask of 48"):
        describe(model)

    from mlx_lm.models import llama
    model = make_model("llama")
    original = llama.Attention.__call__

    def own_attention(self, x, mask=None, cache=None):
        return original(self, x, mask=None, cache=None)      # ignores the cache it is given

    llama.Attention.__call__ = own_attention
    try:
        with pytest.raises(UnsupportedFeatureError, match="never uses the cache object"):
            describe(model)
    finally:
        llama.Attention.__call__ = original


assert set(RUNS) == set(FAMILIES)
