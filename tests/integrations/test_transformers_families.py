"""Token identity: for every family of the matrix (random weights, float32, CPU), Engine.generate
on each backend returns exactly the greedy tokens of transformers' own generate, for 8 prompts of
5-300 tokens (chunked prefill, a shared prefix), the first-step logits agree within 1e-4, and the
returned log-probabilities equal a teacher-forced re-score by the model's own forward. There is
no family list: a model is refused only for a reason it is told (tested below)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import (BACKENDS, FAMILIES, NEW_TOKENS, backend_or_skip, family_case, hf_greedy,
                      hf_logits, make_model, make_prompts, model_needs_or_skip, torch,
                      window_left_reason)
from engine_cases import first_step_logits

import kvcache  # noqa: E402
from kvcache.integrations.transformers import Engine, cache_config  # noqa: E402


def _head_dim(model):
    return cache_config(model).head_dim


# on cuda's CPU mode a sample in CI (one family per feature: plain GQA, soft-capping + windows,
# sinks + windows, head_dim_v), the whole matrix with `make test-all`
CUDA_SAMPLE = ("llama3", "gemma2", "gpt_oss", "deepseek_v3")
# On the reference backend (the judge) every family whose attention reaches the cache in a form of
# its own. These families' attention reaches it exactly as llama3's does (with rope="model"): 4
# query / 2 KV heads of head_dim 32, the default scale, no window, soft-cap or sinks; what is their
# own (q/k norms, MoE, interleaved, partial or no RoPE, biases, LayerNorm) is the model's code on
# either side of the attention call. They run with `make test-all`.
SAME_AS_LLAMA3 = ("qwen3", "qwen3_moe", "mixtral", "olmo2", "cohere", "glm4", "starcoder2",
                  "smollm3")


def _sampled(family, backend):
    if backend == "reference":
        return family not in SAME_AS_LLAMA3
    return family in CUDA_SAMPLE


@pytest.mark.parametrize("family, backend", [
    pytest.param(f, b, marks=() if _sampled(f, b) else pytest.mark.slow)
    for f in FAMILIES for b in BACKENDS])
def test_greedy_tokens_match_transformers(family, backend, monkeypatch):
    model, prompts, greedy, first = family_case(family)
    name, device = backend_or_skip(backend, monkeypatch, _head_dim(model))
    model_needs_or_skip(name, model)
    engine = Engine(model, backend=name, device=device, max_total_tokens=8192,
                    prefill_chunk_size=128)
    assert engine.cache.backend.name == name
    assert engine.cache.config.rope_mode == "none"
    out, logprobs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, return_logprobs=True)
    assert len(out) == len(prompts) and all(len(o) == 1 for o in out)
    for i, (o, want) in enumerate(zip(out, greedy)):
        assert o[0] == want, f"{family} on {name}: prompt {i} ({len(prompts[i])} tokens) differs"
    for i in (0, 1, 7):          # teacher-forced re-score by the model's own forward
        p, toks = prompts[i], out[i][0]
        table = hf_logits(model, p + toks[:-1])[len(p) - 1:]
        table = table - np.logaddexp.reduce(table, axis=-1, keepdims=True)
        want_lp = table[np.arange(len(toks)), toks]
        assert np.allclose(logprobs[i][0], want_lp, atol=2e-4), f"{family} on {name}: prompt {i} log-probs"
    # the shared 120-token prefix of prompts 1 and 7 was computed once: prompt 7 waited for
    # prompt 1 and started from its whole pages in the prefix cache
    ps = engine.cache.config.page_size
    assert engine.stats.prefix_hit_tokens == 120 - 120 % ps and engine.stats.forks == 0
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) - (120 - 120 % ps)
    assert engine.cache.is_empty
    got = first_step_logits(engine, prompts)
    for i, (g, w) in enumerate(zip(got, first)):
        scale = np.abs(w).max()
        assert np.abs(g - w).max() <= 1e-4 * scale, f"{family} on {name}: prompt {i} logits"


@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_smaller_than_the_sequence(backend, monkeypatch):
    """Sliding-window attention as transformers defines it (each query sees the previous
    sliding_window positions, itself included) once sequences outgrow the window."""
    model = make_model("mistral", seed=7, sliding_window=48)
    name, device = backend_or_skip(backend, monkeypatch, _head_dim(model))
    caps = kvcache.list_backends("cpu")
    caps = {r["name"]: r["class"].capabilities for r in caps if r["class"] is not None}[name]
    if not getattr(caps, "window_left", False):
        pytest.skip(f"{name}: {window_left_reason()}")
    prompts = make_prompts(seed=5)[:4]
    engine = Engine(model, backend=name, device=device, max_total_tokens=4096, prefill_chunk_size=64)
    out = engine.generate(prompts, max_new_tokens=32)
    for i, p in enumerate(prompts):
        assert out[i][0] == hf_greedy(model, p, 32), f"prompt {i}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_the_backend_cannot_run_is_refused(backend, monkeypatch):
    model = make_model("mistral", seed=7, sliding_window=48)
    name, device = backend_or_skip(backend, monkeypatch, _head_dim(model))
    engine = Engine(model, backend=name, device=device, max_total_tokens=4096)
    if getattr(engine.cache.capabilities, "window_left", False):
        pytest.skip(f"{name} declares window_left: the window runs (see the test above)")
    short = make_prompts()[0]                      # 5 + 16 tokens: inside the window, runs
    assert len(engine.generate([short], max_new_tokens=16)[0][0]) == 16
    with pytest.raises(kvcache.UnsupportedFeatureError, match="window_left") as err:
        engine.generate([short, list(range(1, 40))], max_new_tokens=16)
    assert "prompt 1" in str(err.value) and "sliding_window=48" in str(err.value)
    assert engine.cache.is_empty


def test_no_family_list():
    """Any model whose layers call transformers' attention interface runs: nothing lists them."""
    import kvcache.integrations.transformers as kvt
    assert not hasattr(kvt, "FAMILIES")


def test_a_layer_that_bypasses_the_attention_interface_is_refused():
    """A layer computing attention by itself would leave the cache without its K/V: refused,
    naming the layer, instead of running with a cache that misses a layer."""
    model = make_model("llama", seed=2)
    attn = model.model.layers[1].self_attn
    original = attn.forward

    def own_attention(hidden_states, *args, **kwargs):      # never calls the interface
        return attn.o_proj(attn.q_proj(hidden_states)[..., :attn.o_proj.in_features]), None

    attn.forward = own_attention
    engine = Engine(model, backend="reference", max_total_tokens=1024)
    with pytest.raises(kvcache.UnsupportedFeatureError, match=r"layers \[1\].*attention interface"):
        engine.generate([[1, 2, 3]], max_new_tokens=2)
    assert engine.cache.is_empty
    attn.forward = original


def test_an_unknown_attention_keyword_is_refused():
    """A keyword the cache does not implement (here a chunked-attention size) is named."""
    from kvcache.integrations.transformers import attention, cache_config
    model = make_model("llama", seed=2)
    cache = kvcache.PagedKVCache(cache_config(model, max_total_tokens=256), backend="reference")
    cache.add_sequence(0)
    q = torch.zeros(1, 4, 3, 64)
    kv = torch.zeros(1, 2, 3, 64)
    with cache.forward([0], [3]) as _:
        with pytest.raises(kvcache.UnsupportedFeatureError, match="attention_chunk_size"):
            attention(model.model.layers[0].self_attn, q, kv, kv, None, kvcache=cache,
                      attention_chunk_size=8)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="dropout"):
            attention(model.model.layers[0].self_attn, q, kv, kv, None, dropout=0.1, kvcache=cache)
        cache.abort_forward()
    assert cache.sequence_length(0) == 0


@pytest.mark.parametrize("family, capability", [("gemma2", "logit_softcap"),
                                                ("gpt_oss", "attention_sinks")])
def test_a_backend_without_the_feature_is_refused_up_front(family, capability, monkeypatch):
    """A model needing soft-capping or sinks on a backend without them: refused when the Engine
    is built, naming the capability (never run without them)."""
    from kvcache.reference import ReferenceBackend
    caps = dataclasses.replace(ReferenceBackend.capabilities, **{capability: False})
    monkeypatch.setattr(ReferenceBackend, "capabilities", caps)
    with pytest.raises(kvcache.UnsupportedFeatureError, match=capability):
        Engine(make_model(family, seed=1), backend="reference", max_total_tokens=1024)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eos_ends_a_sequence_as_generate_does(backend, monkeypatch):
    """The model's EOS ids (generation config) end a sample, the EOS kept, as transformers'
    generate stops; ignore_eos=True goes on; stop_token_ids end it too."""
    model = make_model("qwen3", seed=4)
    name, device = backend_or_skip(backend, monkeypatch, _head_dim(model))
    prompts = make_prompts(seed=9)[:3]
    free = [hf_greedy(model, p, 24) for p in prompts]
    eos = free[0][5]                                   # a token the first sample makes at step 6
    model.generation_config.eos_token_id = [eos, 10**6]
    engine = Engine(model, backend=name, device=device, max_total_tokens=4096)
    out = engine.generate(prompts, max_new_tokens=24)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            hf = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)
        assert out[i][0] == hf[0, len(p):].tolist(), f"prompt {i}"
    assert out[0][0][-1] == eos and len(out[0][0]) <= 6
    assert engine.generate(prompts, max_new_tokens=24, ignore_eos=True) == [[f] for f in free]
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    stop = free[1][3]
    got = engine.generate(prompts[1:2], max_new_tokens=24, stop_token_ids=[stop])[0][0]
    assert got == free[1][:free[1].index(stop) + 1]
