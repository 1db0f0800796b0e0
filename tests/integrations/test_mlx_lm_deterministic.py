"""``Engine(deterministic=True)`` with an mlx-lm model on the metal backend (MLX's CPU device):
the model's linear layers in fixed 32-row blocks (``kvcache.integrations.mlx_lm.invariant``), the
cache's batch-invariant attention. One greedy and one sampled request give the same tokens and
log-probabilities, bit for bit, served alone, beside seven other prompts with the prompt cut
into 7-token chunks, beside 64 random short prompts, from a prefix-cache hit, under preemption
with recompute and through the host tier, with the host not running ahead, and (greedy)
prefilled by another engine whose KV the decoding one imports; the greedy tokens are mlx-lm's
own generation. Without the flag the batched run parts in the last bits (the case is not vacuous). Every family
the mode takes is checked alone against batched-and-chunked; what it cannot see is refused."""

from __future__ import annotations

import functools

import pytest

from mlx_lm_cases import make_model, make_prompts, metal_cpu_or_skip, mlx_greedy
from engine_cases import (TARGET_NEW, WAYS, assert_same_bits, prefilled_elsewhere, serve_target,
                          served_every_way)

from kvcache.errors import UnsupportedFeatureError  # noqa: E402
from kvcache.integrations.mlx_lm import Engine  # noqa: E402
from kvcache.integrations.mlx_lm.invariant import FAMILIES  # noqa: E402



OPTS = dict(backend="metal", device="cpu", max_total_tokens=4096, max_batch_size=8)
"""The test engines' options: the metal backend on MLX's CPU device."""


def _serve(model, prompts, **kw):
    """``serve_target`` on the mlx-lm Engine."""
    return serve_target(Engine, model, prompts, **{**OPTS, **kw})


def _case(family="llama"):
    prompts = make_prompts(seed=13)
    return make_model(family, seed=3), prompts[3], [p for i, p in enumerate(prompts) if i != 3][:7]


# The conditions (engine_cases.WAYS), sampled: CI serves the request in 7-token chunks beside
# seven others and from a prefix-cache hit, with the prefill on another engine and the
# not-vacuous check (every condition runs in CI on the transformers Engine's reference backend:
# test_engine_deterministic.py); `make test-all` the other conditions here too.
IN_CI = ("beside seven others, in 7-token chunks", "from a prefix-cache hit")


@pytest.mark.parametrize("ways", [pytest.param(IN_CI, id="sampled"),
                                  pytest.param(tuple(w for w in WAYS if w not in IN_CI),
                                               id="other-ways", marks=pytest.mark.slow)])
def test_a_request_gets_the_same_bits_however_it_is_served(ways):
    metal_cpu_or_skip(64)
    model, target, others = _case()
    serve = functools.partial(_serve, model)
    want, _ = serve([target])
    assert want[0] == mlx_greedy(model, target, TARGET_NEW)     # mlx-lm's own greedy generation
    assert_same_bits(served_every_way(serve, target, others, ways), want)
    assert prefilled_elsewhere(Engine, model, target, **OPTS) == want[:2]
    plain, _ = serve([target], deterministic=False)
    batched, _ = serve([target] + others, deterministic=False, prefill_chunk_size=7)
    assert plain[1] != batched[1] or plain[3] != batched[3]


# llama is the test above; the others are one condition each (the one that parts without the
# flag), in `make test-all`
@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES if f != "llama"])
def test_every_family_it_takes_is_batch_invariant(family):
    metal_cpu_or_skip(64)
    model, target, others = _case(family)
    alone, _ = _serve(model, [target])
    batched, _ = _serve(model, [target] + others, prefill_chunk_size=7)
    assert alone == batched


@pytest.mark.parametrize("family, why", [("gemma2", "own-attention"),
                                         ("qwen3_moe", "gather_mm"),
                                         ("cohere", "not among the families proven")])
def test_what_it_cannot_see_is_refused(family, why):
    metal_cpu_or_skip(64)
    with pytest.raises(UnsupportedFeatureError, match=why):
        Engine(make_model(family, seed=3), backend="metal", device="cpu", deterministic=True,
               max_total_tokens=256)
