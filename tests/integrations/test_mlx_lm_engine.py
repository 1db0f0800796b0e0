"""The Engine's features over an mlx-lm model on the metal backend (MLX's CPU device): parallel
samples forked from one prefill, reproducible sampling with log-probabilities that match
mlx-lm's own forward, preemption; unsupported families; the missing extra."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from mlx_lm_cases import make_model, make_prompts, metal_cpu_or_skip, mlx_greedy, mlx_logits

import kvcache  # noqa: E402
from kvcache.errors import UnsupportedFeatureError  # noqa: E402
from kvcache.integrations import MissingExtraError  # noqa: E402
from kvcache.integrations.mlx_lm import Engine  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    model = make_model("llama", seed=3)
    metal_cpu_or_skip(64)
    return model


def _engine(model, **kw):
    return Engine(model, backend="metal", device="cpu", **{"max_total_tokens": 4096, **kw})


def test_parallel_samples_prefill_once_and_match_teacher_forcing(llama):
    prompt = make_prompts(seed=11)[3]                     # 128 tokens
    n, new = 4, 24
    engine = _engine(llama, prefill_chunk_size=256)
    calls = []
    forward = engine.adapter.forward

    def counting(cache, tokens, positions, rows):
        calls.append(len(tokens))
        return forward(cache, tokens, positions, rows)

    engine.adapter.forward = counting
    out, logprobs = engine.generate([prompt], max_new_tokens=new, n=n, temperature=1.0, seed=5,
                                    return_logprobs=True)
    # the prompt ran once (one forward of 128 tokens), then every step decodes the n samples
    assert calls[0] == len(prompt) and sum(calls) == len(prompt) + n * (new - 1)
    assert engine.stats.prefill_tokens == len(prompt)
    assert engine.stats.decode_tokens == n * (new - 1)
    samples = out[0]
    assert len(samples) == n and all(len(s) == new for s in samples)
    assert len({tuple(s) for s in samples}) == n, "the samples should differ"
    # the same seed gives the same samples (a fresh engine), another seed other samples
    assert _engine(llama).generate([prompt], max_new_tokens=new, n=n, temperature=1.0,
                                   seed=5)[0] == samples
    assert engine.generate([prompt], max_new_tokens=new, n=n, temperature=1.0,
                           seed=6)[0] != samples
    # every sampled sequence re-scored by mlx-lm's own forward (teacher forcing)
    for s, lp in zip(samples, logprobs[0]):
        logits = mlx_logits(llama, prompt + s)[len(prompt) - 1:-1]
        top = logits.max(-1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
        want = logits[np.arange(len(s)), s] - logz
        np.testing.assert_allclose(lp, want, rtol=1e-4, atol=1e-4)


def test_preemption_recomputes_and_keeps_the_tokens(llama):
    prompts = make_prompts(seed=14)[:4]      # (seed 13 has a greedy near-tie: 6e-7 apart)
    # too few pages for all four at once: sequences are preempted and recomputed
    engine = _engine(llama, max_total_tokens=512, page_size=16, prefill_chunk_size=128)
    out = engine.generate(prompts, max_new_tokens=16)
    assert engine.stats.preemptions >= 1 and engine.stats.recomputed_tokens > 0
    for i, p in enumerate(prompts):
        assert out[i][0] == mlx_greedy(llama, p, 16), f"prompt {i}"
    assert engine.cache.is_empty


def test_unsupported_family_is_named():
    from mlx_lm.models import qwen3
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=1,
                           intermediate_size=96, num_attention_heads=2, rms_norm_eps=1e-5,
                           vocab_size=64, num_key_value_heads=1, max_position_embeddings=256,
                           rope_theta=10000.0, head_dim=32, tie_word_embeddings=True)
    with pytest.raises(UnsupportedFeatureError, match=r"'qwen3'.*supported: gemma"):
        Engine(qwen3.Model(args), backend="metal", device="cpu")
    # a supported module with another model_type is refused too
    model = make_model("llama", seed=0)
    model.args.model_type = "llama4"
    try:
        with pytest.raises(UnsupportedFeatureError, match="'llama4'"):
            Engine(model, backend="metal", device="cpu")
    finally:
        model.args.model_type = "llama"


def test_missing_mlx_lm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)     # as if not installed
    monkeypatch.delitem(sys.modules, "kvcache.integrations.mlx_lm")
    with pytest.raises(MissingExtraError, match=r"kvcache\[mlx-lm\]") as err:
        importlib.import_module("kvcache.integrations.mlx_lm")
    assert isinstance(err.value, ImportError) and isinstance(err.value, kvcache.KVCacheError)


def test_other_backends_take_converted_arrays():
    """On a backend whose arrays are not MLX's (reference, numpy) q/k/v are converted; the
    tokens are still mlx-lm's own."""
    model = make_model("qwen2", seed=3)
    prompts = make_prompts(seed=14)[:3]
    engine = Engine(model, backend="reference", device="cpu", max_total_tokens=2048)
    out = engine.generate(prompts, max_new_tokens=16)
    for i, p in enumerate(prompts):
        assert out[i][0] == mlx_greedy(model, p, 16), f"prompt {i}"
