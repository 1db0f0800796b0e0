"""Nemotron-H's Mamba-2 mixers on the cache's state slots through transformers (issue 56,
docs/hybrid.md "Built: increment 12"): a small random-weight Nemotron-H (blocks of one mixer
each: Mamba-2, attention without rotary, MLP, MoE; the MLP and MoE blocks get no cache layer)
generates greedily through the Engine (queued requests of different lengths sharing batches,
prompts in chunks of 8 tokens, the host one step ahead or not, preemption, ``n = 3`` forks,
prefix hits) and through the adapter in a loop of one's own, on the reference backend and
cuda's CPU mode, token for token equal to transformers' own ``generate``; and what is
refused, by name. Most cases are ``slow`` (``make test-all``): the suite's time budget."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_mixer_call_refusals, chunked_logits, hf_greedy, random_hybrid, torch
from hybrid_cases import NEW, PAGE, once_per_family
from transformers_hybrid_cases import (Family, assert_a_subclass_refused, assert_state_layers,
                                       family_tests, refused)

import kvcache
from kvcache.integrations.transformers import TransformersAdapter, state_kinds
from kvcache.integrations.transformers import states as states_module

slow = pytest.mark.slow

# mixer, attention, MLP, mixer, mixer, MoE, attention, MLP (the pattern "M*-MME*-"): the cache
# has a layer for each mixer and attention block only, in order
BLOCKS = ["linear_attention", "full_attention", "mlp", "linear_attention", "linear_attention",
          "moe", "full_attention", "mlp"]
MIXERS = (0, 3, 4)               # decoder layers
STATES = (0, 2, 3)               # their cache layers; attention at cache layers 1 and 4
# hidden 64, 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels, SSM chunks of 4 (a prefill chunk of 8 spans two); attention 4 query and 2
# KV heads of 16; MoE of 4 experts (2 a token) beside a shared expert
SMALL = dict(vocab_size=128, hidden_size=64, layers_block_type=BLOCKS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4,
             mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=4,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, initializer_range=0.15, max_position_embeddings=256)
KIND = kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")


def make_nemotron_h(seed: int = 0, **overrides):
    """A float32 CPU Nemotron-H with seeded random weights (``BLOCKS``). The mixers' ``dt_bias``
    and ``D`` are drawn too, so every head's step size and skip differ (``dt_bias`` from
    N(0, 1): the mixers' lower time-step limit, ``time_step_min``, almost never bites)."""
    return random_hybrid("nemotron_h", dict(SMALL, **overrides), seed)


# (model, prompts, transformers' greedy tokens), built once
_case = once_per_family(make_nemotron_h, lambda model, prompt: hf_greedy(model, prompt, NEW))
# the tests every transformers hybrid family file runs, under this file's ids, all but the
# Engine's reference row slow. Nemotron-H's own detail: the attention layers read their pages at
# cache layers 1 and 4 (decoder layers 1 and 6); the prefix-hit model has SSM chunks of 8, so the
# checkpoint at 20 lies inside one; no rotary, so ``rope='cache'`` is not among the refusals
globals().update(family_tests(Family(
    "nemotron_h", _case, make_nemotron_h, cache_layers=5, slow=True, states=("conv", "ssm"),
    forward="mamba_forward", uneven_atol=2e-5,
    prefix_model=lambda: make_nemotron_h(seed=2, chunk_size=8), warm_prefix=True, compose=True,
    rope_refused=False)))


def test_the_mixer_and_attention_blocks_are_the_cache_layers():
    """Eight blocks, five cache layers: the mixers' states at cache layers 0, 2 and 3, the
    attention pages at 1 and 4; the MLP and MoE blocks hold neither pages nor a state."""
    model, _, _ = _case()
    cfg = assert_state_layers(model, {i: KIND for i in STATES}, (1, 4), MIXERS)
    assert cfg.num_layers == 5
    assert cfg.kv_bytes == cfg.num_pages * PAGE * 2 * 2 * 2 * 16 * 4     # 2 layers of pages
    assert cfg.state_bytes == 3 * 3 * (192 * 3 + 4 * 32 * 16) * 4
    assert states_module.cache_layers(model) == {0: 0, 1: 1, 3: 2, 4: 3, 6: 4}


@slow
def test_the_time_step_limit_is_applied_as_the_chunked_form_applies_it():
    """Nemotron-H's mixer clamps ``dt`` to ``time_step_min`` in its chunked form (a prefill)
    and not in its recurrent step. With ``time_step_min=0.05`` the clamp bites (a whole forward
    with the limit lifted gives other logits), and a prompt prefilled in chunks of 8, 5, 8, 3
    and 13 (no one-token chunk: each runs the chunked form, as the whole forward does) gives
    the whole forward's logits."""
    model = make_nemotron_h(seed=4, time_step_min=0.05)
    mixers = [m for _, m in states_module.mamba_layers(model).values()]
    assert {m.time_step_limit for m in mixers} == {(0.05, float("inf"))}
    prompt = np.random.default_rng(2).integers(1, 128, 37)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        for m in mixers:
            m.time_step_limit = (0.0, float("inf"))
        loose = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        for m in mixers:
            m.time_step_limit = (0.05, float("inf"))
    assert np.abs(loose - whole).max() > 1e-3          # the clamp changes the logits
    got = chunked_logits(model, prompt, (8, 5, 8, 3, 13), PAGE)
    np.testing.assert_allclose(got, whole, atol=2e-5, rtol=0)


@slow
def test_what_is_not_understood_is_refused():
    # a replaced mixer (a subclass computes what it likes)
    assert_a_subclass_refused(make_nemotron_h(seed=1), 3, "mixer")
    # an upper time-step limit (the family's mixer sets none: a changed module)
    model = make_nemotron_h(seed=1)
    model.model.layers[4].mixer.time_step_limit = (0.001, 0.5)
    refused(model, r"layers\.4\.mixer \(NemotronHMamba2Mixer\): time_step_limit=\(0\.001, "
                   r"0\.5\): the cache serves \(time_step_min >= 0, inf\) only")
    # another activation after the conv
    refused(make_nemotron_h(seed=1, mamba_hidden_act="gelu"), "activation 'gelu'")
    # a block type the family's reading does not know (a config changed after the build)
    model = make_nemotron_h(seed=1)
    model.config.layers_block_type = BLOCKS[:2] + ["sliding_attention"] + BLOCKS[3:]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 2 .*'sliding_attention'"):
        state_kinds(model)
    # an attention module in a block that holds nothing by its type
    model = make_nemotron_h(seed=1)
    model.model.layers[2].mixer = model.model.layers[1].mixer.__class__(model.config, 2)
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match="layer 2 is a block that holds nothing by its type"):
        TransformersAdapter(model)
    # the mixer called with a padding mask, or with its own cache beside the cache's
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[3].mixer)
