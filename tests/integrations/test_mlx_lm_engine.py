"""The Engine's features over an mlx-lm model on the metal backend (MLX's CPU device): parallel
samples forked from one prefill, reproducible sampling with log-probabilities that match
mlx-lm's own forward, preemption, EOS ids; a loop of one's own through layer_caches; the
missing extra."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from mlx_lm_cases import make_model, make_prompts, metal_cpu_or_skip, mlx_greedy, mlx_logits

import kvcache  # noqa: E402
import mlx.core as mx  # noqa: E402
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


def test_eos_ids_end_samples_unless_ignored(llama):
    """A sample ends at the model's EOS ids (as mlx-lm's generation stops at the tokenizer's),
    the EOS token its last; not with ignore_eos. The ids: explicit, else the tokenizer's
    (mlx_lm.load's), else the model args' eos_token_id; none: ()."""
    from types import SimpleNamespace
    prompt = make_prompts(seed=4)[2]
    want = mlx_greedy(llama, prompt, 12)
    k = next(i for i in range(3, 12) if want[i] not in want[:i])
    eos = want[k]
    engine = _engine(llama, eos_token_ids=[eos])
    assert engine.adapter.eos_token_ids() == (eos,)
    assert engine.generate([prompt], max_new_tokens=12)[0][0] == want[:k + 1]
    assert engine.generate([prompt], max_new_tokens=12, ignore_eos=True)[0][0] == want
    assert _engine(llama, tokenizer=SimpleNamespace(eos_token_ids={eos, 2})).adapter \
        .eos_token_ids() == tuple(sorted({eos, 2}))
    assert _engine(llama).adapter.eos_token_ids() == ()
    llama.args.eos_token_id = [5, 7]
    try:
        assert _engine(llama).adapter.eos_token_ids() == (5, 7)
    finally:
        del llama.args.eos_token_id


def test_own_loop_through_layer_caches(llama):
    """A loop of one's own: layer_caches(model, cache) inside cache.forward is the model's
    cache argument, the forward's tokens its batch rows; any model_type (no family list)."""
    from kvcache.integrations.mlx_lm import cache_config, layer_caches
    llama.args.model_type = "my_llama_variant"
    try:
        cache = kvcache.PagedKVCache(cache_config(llama, max_total_tokens=1024),
                                     backend="metal", device="cpu")
    finally:
        llama.args.model_type = "llama"
    a, b = make_prompts(seed=8)[2][:20], make_prompts(seed=8)[0]
    cache.add_sequence(0)
    cache.add_sequence(1)
    with cache.forward([0, 1], [12, len(b)]):          # a's first 12 tokens and all of b
        tokens = mx.array(a[:12] + b)[:, None]
        out = llama(tokens, cache=layer_caches(llama, cache))
        mx.eval(out)
    with cache.forward([0], [8]):                       # the rest of a on its history
        rest = llama(mx.array(a[12:])[:, None], cache=layer_caches(llama, cache))
        mx.eval(rest)
    got = np.concatenate([np.asarray(out[:12, 0]), np.asarray(rest[:, 0])])
    np.testing.assert_allclose(got, mlx_logits(llama, a), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(out[12:, 0]), mlx_logits(llama, b), rtol=1e-4, atol=1e-4)


def test_missing_mlx_lm_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)     # as if not installed
    monkeypatch.delitem(sys.modules, "kvcache.integrations.mlx_lm")
    with pytest.raises(MissingExtraError, match=r"pip install .\.\[mlx-lm\].") as err:
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
