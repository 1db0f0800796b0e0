"""Falcon-H1's Mamba-2 mixers on the cache's state slots through transformers (issue 56,
docs/hybrid.md "Built: increment 12"): every Falcon-H1 layer runs attention and a Mamba-2
mixer side by side on the same input, so each takes two cache layers (the mixer's state, then
the attention's pages). A small random-weight Falcon-H1 (3 layers, muP multipliers other than
1) generates greedily through the Engine (queued requests of different lengths sharing
batches, prompts in chunks of 8 tokens, the host one step ahead or not, preemption, ``n = 3``
forks, prefix hits) and through the adapter in a loop of one's own, on the reference backend
and cuda's CPU mode, token for token equal to transformers' own ``generate``; with and without
the mixer's gated norm; and what is refused, by name. Most cases are ``slow`` (``make
test-all``): the suite's time budget."""

from __future__ import annotations

import pytest

from conftest import (assert_mixer_call_refusals, assert_state_engine_refusals, backend_or_skip,
                      hf_greedy, random_hybrid, torch)
from hybrid_cases import (NEW, PAGE, assert_engine_greedy, assert_state_edits_refused,
                          once_per_family)
from transformers_hybrid_cases import (Family, assert_a_subclass_refused, assert_state_layers,
                                       engine, family_tests, refused)

import kvcache
from kvcache.integrations.transformers import Engine, cache_config
from kvcache.integrations.transformers import states as states_module

slow = pytest.mark.slow

# hidden 64, 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels, SSM chunks of 4; attention 4 query and 2 KV heads of 16 with rotary; the
# muP multipliers (Falcon-H1's own: on the mixer's input and each projected part, the mixer's
# and attention's outputs, the keys, embeddings, MLP and LM head) all other than 1
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_d_ssm=128,
             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2,
             mamba_d_conv=4, mamba_chunk_size=4, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, initializer_range=0.15, max_position_embeddings=256,
             tie_word_embeddings=False, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
             ssm_in_multiplier=1.3, ssm_out_multiplier=0.9, attention_in_multiplier=1.1,
             attention_out_multiplier=0.8, key_multiplier=1.2, embedding_multiplier=1.5,
             lm_head_multiplier=0.7, mlp_multipliers=[1.2, 0.9])
KIND = kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")
STATES = (0, 2, 4)              # each layer's mixer; its attention at the next cache layer


def make_falcon_h1(seed: int = 0, **overrides):
    """A float32 CPU Falcon-H1 with seeded random weights (``SMALL``; ``mamba_rms_norm``
    False, the family's default: the mixer's output gated by SiLU alone). The mixers'
    ``dt_bias`` and ``D`` are drawn too."""
    return random_hybrid("falcon_h1", dict(SMALL, **overrides), seed)


# (model, prompts, transformers' greedy tokens), once per gated-norm setting (none: without)
_case = once_per_family(lambda *norm: make_falcon_h1(mamba_rms_norm=bool(norm and norm[0])),
                        lambda model, prompt: hf_greedy(model, prompt, NEW))
# the tests every transformers hybrid family file runs, under this file's ids, all but the
# Engine's reference row slow. Falcon-H1's own detail: in every layer the mixer runs from its
# states at cache layer 2i and the attention reads its pages at 2i + 1, so a preempted request
# gives back a state slot and pages, a prefix hit restores both; the prefix-hit model has SSM
# chunks of 8. Its refusals of what does not compose are in test_what_is_not_understood_is_refused
globals().update(family_tests(Family(
    "falcon_h1", _case, lambda: make_falcon_h1(mamba_rms_norm=False), cache_layers=6, slow=True,
    states=("conv", "ssm"), forward="mamba_forward", uneven_atol=2e-5,
    prefix_model=lambda: make_falcon_h1(seed=2, mamba_chunk_size=8), warm_prefix=True)))


def test_each_layer_is_two_cache_layers():
    """Three layers, six cache layers: each layer's mixer state at cache layer 2i, its
    attention's pages at 2i + 1; the module list matches."""
    model, _, _ = _case()
    cfg = assert_state_layers(model, {i: KIND for i in STATES}, (1, 3, 5), (0, 1, 2))
    assert cfg.num_layers == 6
    assert cfg.kv_bytes == cfg.num_pages * PAGE * 3 * 2 * 2 * 16 * 4     # 3 layers of pages
    assert states_module.cache_layers(model) == {0: 0, 1: 2, 2: 4}
    layers = [type(m).__name__ if m is not None else None
              for m in kvcache.integrations.transformers.attention_layers(model)]
    assert layers == [None, "FalconH1Attention"] * 3


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_with_the_gated_norm_greedy_equals_generate(backend, monkeypatch):
    """``mamba_rms_norm=True``: the mixer's output through its gated RMS norm (the model's own
    module, its input in the model dtype after a decode step, float32 after a prefill)."""
    model, prompts, want = _case(True)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    assert_engine_greedy(engine(model, backend=name, device=device), prompts, want, f"{name}: ")


@slow
def test_what_is_not_understood_is_refused():
    model, _, _ = _case()
    kw = assert_state_engine_refusals(model, "falcon_h1")
    assert_state_edits_refused(Engine(model, **kw), fork=False)
    # a replaced mixer (a subclass computes what it likes)
    assert_a_subclass_refused(make_falcon_h1(seed=1), 1, "mamba")
    # a time-step limit, as Bamba's
    refused(make_falcon_h1(seed=1, time_step_limit=(0.0, 0.5)),
            r"layers\.0\.mamba \(FalconH1Mixer\): time_step_limit=\(0\.0, 0\.5\)")
    # multipliers not one per projected value, a norm where the forward skips it
    model = make_falcon_h1(seed=1)
    model.model.layers[2].mamba.mup_vector = torch.ones(1, 1, 7)
    refused(model, r"layers\.2\.mamba .*mup_vector \(1, 1, 7\): not \(1, 1, 324\)")
    model = make_falcon_h1(seed=1)
    model.model.layers[0].mamba.norm = make_falcon_h1(seed=1, mamba_rms_norm=True) \
        .model.layers[0].mamba.norm
    refused(model, r"norm FalconH1RMSNormGated with mamba_rms_norm=False")
    # the mixer called with a padding mask
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[0].mamba, own_cache=False)
