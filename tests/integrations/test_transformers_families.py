"""Token identity: for each supported family (random weights, float32, CPU), Engine.generate on
each backend returns exactly the greedy tokens of transformers' own generate, for 8 prompts of
5-300 tokens (chunked prefill, a shared prefix), and the first-step logits agree within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (BACKENDS, FAMILIES, FAMILY_CONFIGS, NEW_TOKENS, backend_or_skip,
                      family_case, hf_greedy, make_model, make_prompts, window_left_reason)
from engine_cases import first_step_logits

import kvcache  # noqa: E402
from kvcache.integrations.transformers import Engine, cache_config  # noqa: E402


def _head_dim(model):
    return cache_config(model).head_dim


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family, backend, monkeypatch):
    model, prompts, greedy, first = family_case(family)
    name, device = backend_or_skip(backend, monkeypatch, _head_dim(model))
    engine = Engine(model, backend=name, device=device, max_total_tokens=8192,
                    prefill_chunk_size=128)
    assert engine.cache.backend.name == name
    assert engine.cache.config.rope_mode == "none"
    out = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    assert len(out) == len(prompts) and all(len(o) == 1 for o in out)
    for i, (o, want) in enumerate(zip(out, greedy)):
        assert o[0] == want, f"{family} on {name}: prompt {i} ({len(prompts[i])} tokens) differs"
    # the shared 120-token prefix of prompts 1 and 7 was computed once and forked
    assert engine.stats.forks >= 2 and engine.stats.shared_prefix_tokens >= 2 * 120
    assert engine.stats.prefill_tokens == sum(map(len, prompts)) - 120
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


def test_families_table_matches_the_tested_configs():
    from kvcache.integrations.transformers import FAMILIES as SUPPORTED
    assert set(SUPPORTED) == set(FAMILY_CONFIGS)
