"""mlx-lm's Jamba (``jamba``) on the cache (issue 56 item 4, docs/hybrid.md "Built: increment
13"): Mamba-1 mixers (``JambaMambaMixer``: its scan over a call's tokens, the time step, B and C
RMS-normed) in some layers, attention (no rotary) in the others, MoE MLPs. A small
random-weight mlx-lm Jamba (float32) generates greedily on the metal backend (MLX's CPU device)
through the Engine (queued requests, chunks of 8, the host one step ahead or not, preemption,
forks, the prefix cache on) and through the adapter in a loop of one's own, token for token
equal to mlx-lm's own generation with its own caches; each state carries; prefix hits through
state checkpoints; and what is refused, by name. Most of this file runs in ``make test-all``
only."""

from __future__ import annotations

import pytest

from mlx_hybrid_cases import (assert_a_subclass_refused, assert_another_make_cache_refused,
                              assert_edit_refused, assert_prefix_hits_at_every_page,
                              assert_state_layers, family_tests, random_model, slow_except)
from mlx_lm_cases import mlx_greedy, mx
from hybrid_cases import NEW, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import state_kinds  # noqa: E402

# 4 layers: mamba, attention, mamba, attention (attn_layer_period 2, offset 1); MoE MLPs in
# layers 1 and 3 (4 experts, 2 a token). Mixer: 128 channels (hidden 64 expanded twice), a
# state of 16 per channel, a conv of 4 taps, a time-step rank of 4. Attention: 4 query and 2 KV
# heads of 16.
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, attn_layer_offset=1,
             attn_layer_period=2, expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4,
             mamba_d_state=16, mamba_expand=2, num_experts=4, num_experts_per_tok=2,
             rms_norm_eps=1e-5, max_position_embeddings=256, mamba_dt_rank=4,
             tie_word_embeddings=False)
MIXERS = (0, 2)
KIND = kvcache.State({"conv": (3, 128), "ssm": (128, 16)})


def make_jamba(seed: int = 0, **overrides):
    """A float32 mlx-lm Jamba with seeded random weights (``SMALL``): matrices drawn with
    variance 1 / fan-in (``A_log`` too: any real one decays) and every 1-D parameter (``D``,
    norms, biases) moved off its initial value, so that the greedy tokens vary."""
    return random_model("jamba", "jamba", dict(SMALL, **overrides), seed)


# (model, prompts, mlx-lm's greedy tokens), built once
_case = once_per_family(make_jamba, lambda model, prompt: mlx_greedy(model, prompt, NEW))
# the tests every mlx-lm hybrid family file runs, under this file's ids; CI keeps the Engine's
globals().update(slow_except(family_tests(_case, "jamba", pair=(2, 4), states=("conv", "ssm")),
                             "test_engine_greedy_equals_mlx_lm"))


def test_the_mixers_are_state_layers():
    # mlx-lm's ArraysCache entries: the conv's last inputs (batch, d_conv - 1, channels), time
    # first, and the scan's state (batch, channels, d_state), in the model's dtype
    assert_state_layers(_case(), {i: KIND for i in MIXERS}, (1, 3))


@pytest.mark.slow
def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the
    first request's prefill chunk 16..24 gives the states at 20 (the mixer splits its scan
    there), so the later ones start from 20 cached tokens with the states restored beside the
    attention's pages; warm tokens equal the cold ones and mlx-lm's own."""
    assert_prefix_hits_at_every_page(_case()[0])


def test_what_is_not_understood_is_refused():
    import mlx.nn as nn
    # a layer type the family's state layers do not know; a replaced mixer
    assert_edit_refused(make_jamba(seed=2), "args.layers_block_type",
                        ["mamba", "attention", "hybrid", "attention"], "layer 2 .*'hybrid'")
    assert_a_subclass_refused(make_jamba(seed=2), 2, "mamba", "JambaMambaMixer")
    # not depthwise; A_log of another shape
    assert_edit_refused(make_jamba(seed=2), "layers.2.mamba.conv1d",
                        nn.Conv1d(128, 128, 4, bias=True), "layer 2 .*groups=1")
    assert_edit_refused(make_jamba(seed=2), "layers.0.mamba.A_log", mx.zeros((128,)),
                        r"layer 0 .*A_log \(128,\)")
    # a mixer that make_cache() gives another cache
    assert_another_make_cache_refused(make_jamba(seed=2))
    assert state_kinds(make_jamba(seed=2)) == {i: KIND for i in MIXERS}
