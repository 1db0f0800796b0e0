"""Issue 51 through the transformers Engine (tiny llama, reference backend; fp8 also on cuda's
CPU mode):

* item 1: one overflowing first prompt (a token whose embedding is inf: NaN K/V in every layer
  from its position on) must not give NaN to later requests of an fp8 engine. Its scales are
  calibrated from the prompt's finite values, so the later request's tokens and log-probs equal
  those of an engine whose first prompt was the same one without the overflowing token.
* item 2: aborting every request that shares a prefix still being prefilled leaves the engine
  idle over an empty cache, and the next ``generate`` works.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import backend_or_skip, make_model

from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine

BAD = 511                                   # the token whose embedding overflows (VOCAB - 1)


@pytest.fixture(scope="module")
def overflowing_llama():
    model = make_model("llama", seed=3)
    with torch.no_grad():
        model.model.embed_tokens.weight[BAD] = float("inf")
    return model


def _clean(n, seed):
    return np.random.default_rng(seed).integers(1, BAD, n).tolist()


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_an_overflowing_first_prompt_gives_no_nan_to_later_requests(overflowing_llama, backend,
                                                                    monkeypatch):
    model = overflowing_llama
    name, device = backend_or_skip(backend, monkeypatch, model.config.head_dim)
    first = _clean(21, 0)
    later = _clean(19, 1)                   # shares no page with the first prompt
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for opening in (first + [BAD], first):  # the overflowing prompt, and it without the token
        engine = Engine(model, backend=name, device=device, max_total_tokens=256, page_size=8,
                        kv_dtype="float8_e4m3", prefix_cache=False, graphs=False)
        engine.generate([opening], greedy)
        scales = [engine.cache.kv_scales(layer) for layer in range(model.config.num_hidden_layers)]
        tokens, logprobs = engine.generate([later], greedy, return_logprobs=True)
        assert np.isfinite(logprobs[0][0]).all(), logprobs
        assert all(math.isfinite(s) for layer in scales for kv in layer for s in kv), scales
        runs.append((scales, tokens, logprobs))
    (scales, tokens, logprobs), (scales_ok, tokens_ok, logprobs_ok) = runs
    assert scales == scales_ok                      # calibrated from the same finite values
    assert tokens == tokens_ok and logprobs == logprobs_ok


def test_aborting_every_request_on_a_half_prefilled_prefix_leaves_generate_working():
    model = make_model("llama", seed=5)
    engine = Engine(model, backend="reference", max_total_tokens=1024, page_size=8,
                    prefill_chunk_size=16, prefix_cache=False, graphs=False)
    shared = _clean(48, 2)                          # 6 pages, prefilled 16 tokens a step
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(shared + _clean(3, 10 + i), params) for i in range(3)]
    engine.step()
    assert not engine.cache.is_empty                # the shared prefix, partly prefilled
    for rid in ids:
        engine.abort(rid)
    outs = engine.step()
    assert sorted(o.finish_reason for o in outs) == ["abort"] * 3
    assert not engine.has_unfinished()
    assert engine.cache.is_empty
    assert engine.cache.num_available_pages == engine.cache.num_total_pages
    prompt = shared + [7]
    fresh = Engine(model, backend="reference", max_total_tokens=1024, page_size=8,
                   prefill_chunk_size=16, prefix_cache=False, graphs=False)
    assert engine.generate([prompt], params) == fresh.generate([prompt], params)
