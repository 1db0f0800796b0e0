"""The cache's fused RoPE append in place of the model's own rotary (``Engine(model,
rope="cache")``): greedy tokens identical to transformers' own generate for a llama3-scaled
Llama, a plain Llama and a partial-rotary Phi-3; the refusals (YaRN attention factor, dynamic
frequencies, a backend without ``rope_frequencies``, a cache that rotates differently); the
model's rotary restored afterwards; the double-rotation guard for everyone else."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from conftest import (BACKENDS, NEW_TOKENS, backend_or_skip, family_case, hf_greedy, hf_logits,
                      make_model, make_prompts, torch)

import kvcache
from kvcache.integrations import transformers as kvt
from kvcache.integrations.transformers import Engine

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@functools.lru_cache(maxsize=None)
def rope_case(name: str):
    """(model, prompts, transformers' greedy tokens per prompt) for a rotary variant, once."""
    if name == "plain":
        model, prompts, greedy, _ = family_case("llama")
        return model, prompts, greedy
    if name == "llama3":
        # prompts up to 300 tokens run far past the 64-token original context: the scaled
        # low frequencies matter
        model = make_model("llama", seed=21, rope_theta=500000.0, rope_scaling=LLAMA3)
    else:                                           # "phi3_partial": the first 48 of 96 dims
        model = make_model("phi3", seed=22, partial_rotary_factor=0.5)
    prompts = make_prompts(seed=4)
    return model, prompts, [hf_greedy(model, p) for p in prompts]


# "plain" (theta's own table) takes llama3's path: the cache is handed the model's inv_freq table
# either way, and llama3's scaled one is the stricter case; it runs with `make test-all`
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["llama3", pytest.param("plain", marks=pytest.mark.slow),
                                  "phi3_partial"])
def test_fused_rope_greedy_matches_the_models_own_rope(case, backend, monkeypatch):
    model, prompts, greedy = rope_case(case)
    name, device = backend_or_skip(backend, monkeypatch, kvt.cache_config(model).head_dim)
    engine = Engine(model, backend=name, device=device, max_total_tokens=8192,
                    prefill_chunk_size=128, rope="cache")
    cfg = engine.cache.config
    inv_freq = model.model.rotary_emb.inv_freq.double().numpy()
    assert cfg.rope_mode == "normal" and cfg.effective_rope_mode == "normal"
    np.testing.assert_array_equal(np.asarray(cfg.rope_inv_freq), inv_freq)
    head_dim = cfg.head_dim
    if case == "llama3":        # a real scaled table, not theta's
        assert not np.allclose(inv_freq, 500000.0 ** (-np.arange(0, head_dim, 2) / head_dim))
    assert cfg.rope_rotary_dim == (48 if case == "phi3_partial" else 0)
    out = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    for i, (o, want) in enumerate(zip(out, greedy)):
        assert o[0] == want, f"{case} on {name}: prompt {i} ({len(prompts[i])} tokens) differs"
    # the shared prefix came from the prefix cache (its positions carry on)
    assert engine.stats.prefix_hit_tokens > 0
    assert not model.model.rotary_emb._forward_hooks


def test_the_cache_really_rotates_and_the_model_does_not(monkeypatch):
    """If the model's rotary kept rotating, q/k would be rotated twice: the tokens differ."""
    model, prompts, greedy = rope_case("llama3")
    # patched where fused_rope and the wrapped apply_rotary_pos_emb look them up
    monkeypatch.setattr(kvt.rope, "_unrotated", lambda module, args, output: output)
    monkeypatch.setattr(kvt.rope, "_rotation_skipped", lambda: False)
    out = Engine(model, backend="reference", max_total_tokens=8192,
                 rope="cache").generate(prompts[:3], max_new_tokens=8)
    assert all(o[0] != want[:8] for o, want in zip(out, greedy[:3]))


def test_the_model_skips_its_rotation_inside_fused_rope_only():
    # inside fused_rope the layers' apply_rotary_pos_emb hands q and k back (no rotate_half
    # kernels); outside it, and in another thread meanwhile, it is transformers' own
    import sys
    import threading
    model, prompts, greedy = rope_case("plain")
    family = sys.modules[type(model.model.layers[0].self_attn).__module__]
    calls = []
    real = family.rotate_half
    family.rotate_half = lambda x: calls.append(1) or real(x)
    try:
        out = Engine(model, backend="reference", max_total_tokens=8192,
                     rope="cache").generate(prompts[:2], max_new_tokens=4)
        assert not calls and [o[0] for o in out] == [g[:4] for g in greedy[:2]]
        assert hf_greedy(model, prompts[0], 4) == greedy[0][:4] and calls
        q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
        cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
        want = real_rotation = family.apply_rotary_pos_emb(q, k, cos, sin)
        cache = kvcache.PagedKVCache(kvt.cache_config(model, rope="cache", max_total_tokens=256),
                                     backend="reference")
        seen = {}
        with kvt.fused_rope(model, cache):
            inside = family.apply_rotary_pos_emb(q, k, cos, sin)
            t = threading.Thread(target=lambda: seen.update(
                other=family.apply_rotary_pos_emb(q, k, cos, sin)))
            t.start()
            t.join()
        assert inside[0] is q and inside[1] is k
        for got, w in zip(seen["other"], want):
            torch.testing.assert_close(got, w)
        after = family.apply_rotary_pos_emb(q, k, cos, sin)
        torch.testing.assert_close(after[0], real_rotation[0])
        assert not torch.equal(after[0], q)
    finally:
        family.rotate_half = real


def test_yarn_attention_factor_and_dynamic_frequencies_are_refused():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    model = make_model("llama", seed=5, rope_scaling=yarn)
    scaling = model.model.rotary_emb.attention_scaling
    assert scaling != 1.0
    with pytest.raises(kvcache.UnsupportedFeatureError, match="attention_scaling") as err:
        Engine(model, backend="reference", rope="cache")
    assert str(scaling) in str(err.value) and "rope='model'" in str(err.value)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="attention_scaling"):
        kvt.cache_config(model, rope="cache")
    # the model's own RoPE still runs it
    assert Engine(model, backend="reference").cache.config.rope_mode == "none"
    # YaRN with attention factor 1: frequencies only, which the cache reproduces
    flat = make_model("llama", seed=5, rope_scaling={**yarn, "attention_factor": 1.0})
    cfg = kvt.cache_config(flat, rope="cache")
    np.testing.assert_array_equal(np.asarray(cfg.rope_inv_freq),
                                  flat.model.rotary_emb.inv_freq.double().numpy())
    dynamic = make_model("llama", seed=5, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="'dynamic'"):
        Engine(dynamic, backend="reference", rope="cache")
    with pytest.raises(kvcache.InvalidArgumentError, match="rope='both'"):
        Engine(flat, backend="reference", rope="both")


def test_a_backend_without_model_frequencies_is_refused():
    model = family_case("llama")[0]
    rows = [r for r in kvcache.list_backends("cpu") if r["available"] and r["class"] is not None
            and not r["class"].capabilities.rope_frequencies
            and kvt.cache_config(model).head_dim in r["class"].capabilities.head_dims]
    if not rows:
        pytest.skip("every available backend declares rope_frequencies")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="rope_frequencies"):
        Engine(model, backend=rows[0]["name"], device="cpu", rope="cache")
    Engine(model, backend=rows[0]["name"], device="cpu")         # the model's RoPE: fine


def test_the_models_rotary_is_restored_after_generate():
    model, prompts, greedy = rope_case("llama3")
    emb = model.model.rotary_emb
    pos = torch.arange(40)[None]
    before = emb(torch.zeros(1), pos)
    engine = Engine(model, backend="reference", max_total_tokens=8192, rope="cache")
    seen = []
    forward = engine.adapter.forward

    def spy(cache, tokens, positions, rows):         # inside generate: cos=1, sin=0
        cos, sin = emb(torch.zeros(1), torch.from_numpy(positions)[None])
        seen.append(bool((cos == 1).all() and (sin == 0).all()))
        if len(seen) == 3:
            raise RuntimeError("stop here")
        return forward(cache, tokens, positions, rows)

    engine.adapter.forward = spy
    with pytest.raises(RuntimeError, match="stop here"):  # an error mid-generate restores too
        engine.generate(prompts[:2], max_new_tokens=4)
    engine.adapter.forward = forward
    assert seen == [True] * 3 and engine.cache.is_empty
    engine.generate(prompts[:2], max_new_tokens=4)
    after = emb(torch.zeros(1), pos)
    assert not emb._forward_hooks
    for b, a in zip(before, after):
        assert torch.equal(b, a) and not torch.equal(a, torch.ones_like(a))
    assert model.config._attn_implementation != kvt.ATTN_IMPLEMENTATION
    assert hf_greedy(model, prompts[0]) == greedy[0]
    # outside the engine the rotating cache is refused again (no double rotation)
    _assert_refused(model, engine.cache)


def _assert_refused(model, cache):
    cache.add_sequence(0)
    kvt.register()
    model.set_attn_implementation(kvt.ATTN_IMPLEMENTATION)
    try:
        with pytest.raises(kvcache.InvalidArgumentError, match="second time"):
            with cache.forward([0], [4]), torch.no_grad():
                model(torch.tensor([[1, 2, 3, 4]]), position_ids=torch.arange(4)[None],
                      use_cache=False, kvcache=cache)
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.sequence_length(0) == 0
    cache.clear()


def test_user_loop_with_fused_rope():
    """Your own loop: cache_config(model, rope='cache') + fused_rope(model, cache)."""
    model, prompts, _ = rope_case("llama3")
    cache = kvcache.PagedKVCache(kvt.cache_config(model, rope="cache", max_total_tokens=2048),
                                 backend="reference")
    _assert_refused(model, cache)                 # without fused_rope: refused
    a, b = prompts[2], prompts[3]
    cache.add_sequence(0)
    cache.add_sequence(1)
    ids = torch.tensor([a + b])
    pos = torch.tensor([list(range(len(a))) + list(range(len(b)))])
    kvt.register()
    model.set_attn_implementation(kvt.ATTN_IMPLEMENTATION)
    try:
        with kvt.fused_rope(model, cache), cache.forward([0, 1], [len(a), len(b)]), \
                torch.no_grad():
            logits = model(ids, position_ids=pos, use_cache=False, kvcache=cache,
                           logits_to_keep=torch.tensor([len(a) - 1, len(a) + len(b) - 1])).logits[0]
        # a cache that rotates with theta's frequencies, not the model's: refused
        other = kvcache.CacheConfig(**{**_fields(cache.config), "rope_inv_freq": ()})
        with pytest.raises(kvcache.InvalidArgumentError, match="does not rotate exactly"):
            with kvt.fused_rope(model, kvcache.PagedKVCache(other, backend="reference")):
                pass
    finally:
        model.set_attn_implementation("sdpa")
    assert not model.model.rotary_emb._forward_hooks
    np.testing.assert_allclose(logits[0].numpy(), hf_logits(model, a)[-1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits[1].numpy(), hf_logits(model, b)[-1], rtol=1e-4, atol=1e-4)


def _fields(cfg):
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_the_rotary_is_proven_once_not_at_every_step():
    """fused_rope is entered at every step: it probed the rotary on the device each time (a
    host sync, which held the host to the GPU: about half of each step idle on the H200) and
    walked every module. Now the proof is kept per model while ``inv_freq`` is the same
    tensor unchanged; a changed ``inv_freq`` is probed again and refused."""
    model, prompts, greedy = rope_case("plain")
    emb = model.model.rotary_emb
    probes = []
    handle = emb.register_forward_hook(lambda m, a, out: probes.append(1))
    try:
        out = Engine(model, backend="reference", max_total_tokens=8192,
                     rope="cache").generate(prompts[:2], max_new_tokens=6)
        assert [o[0] for o in out] == [g[:6] for g in greedy[:2]]
        cache = kvcache.PagedKVCache(kvt.cache_config(model, rope="cache", max_total_tokens=256),
                                     backend="reference")
        forwards = len(probes)          # the model's own calls (one a step) and the probes
        for _ in range(3):
            with kvt.fused_rope(model, cache):
                pass
        assert len(probes) == forwards          # no probe: the proof was kept
        with torch.no_grad():
            emb.inv_freq.mul_(1.5)              # in place: the proof no longer holds
        with pytest.raises(kvcache.UnsupportedFeatureError, match="inv_freq"):
            with kvt.fused_rope(model, cache):
                pass
    finally:
        handle.remove()
