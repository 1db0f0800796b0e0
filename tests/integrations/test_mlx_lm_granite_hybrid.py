"""mlx-lm's Granite-4.0-H (``granitemoehybrid``) and Nemotron-H (``nemotron_h``) Mamba-2
mixers on the cache's state slots (issue 56 item 4, docs/hybrid.md "Built: increment 10"): a
small random-weight mlx-lm Granite-4.0-H (mamba and attention layers, float32) generates
greedily on the metal backend (MLX's CPU device) through the Engine (queued requests of
different lengths sharing forwards, prompts in chunks of 8 tokens, the host one step ahead or
not, preemption, forks, the prefix cache on) and through the adapter in a loop of one's own,
token for token equal to mlx-lm's own generation with its own ``ArraysCache``; prefix hits
through state checkpoints inside a prefill chunk; a Nemotron-H (mixers, attention, MLP and
MoE blocks: cache slots that are not decoder layers) the same through the Engine; and what is
refused, by name."""

from __future__ import annotations

import importlib

import pytest

from mlx_hybrid_cases import (assert_a_mask_refused, assert_a_replaced_function_refused,
                              assert_a_subclass_refused, assert_another_make_cache_refused,
                              assert_edit_refused, assert_generate_equals_mlx_lm,
                              assert_prefix_hits_at_every_page, assert_state_layers,
                              engine as _engine, family_tests, randomize_weights)
from mlx_lm_cases import mlx_greedy, mx
from hybrid_cases import NEW, assert_engine_greedy, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import cache_config, route_state_layers, state_kinds  # noqa: E402

TYPES = ["mamba", "attention", "mamba", "mamba", "attention"]
MAMBA = (0, 2, 3)
# hidden 64; 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels; attention of 4 query and 2 KV heads of 16
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=len(TYPES),
             max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=False, embedding_multiplier=1.0, attention_multiplier=0.25,
             logits_scaling=1.0, residual_multiplier=1.0, layer_types=TYPES, rms_norm_eps=1e-5,
             mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
             mamba_d_conv=4, mamba_conv_bias=True, mamba_proj_bias=False,
             position_embedding_type="rope", tie_word_embeddings=False)
# Granite-4.0-H's own shape of layer: no rotary (position_embedding_type "nope"), MoE beside a
# shared MLP, multipliers
MOE = dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
           position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
           logits_scaling=4.0, tie_word_embeddings=True)


# Nemotron-H: blocks M (Mamba-2 mixer), * (attention, no rotary), - (MLP), E (MoE); only M and
# * take a cache slot, so the slots are 0 M, 1 *, 2 M, 3 M, 4 *
NEMOTRON = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, attention_bias=False, mamba_num_heads=4, mamba_head_dim=32,
                mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
                mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                hybrid_override_pattern=["M", "*", "-", "M", "M", "E", "*", "-"],
                moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)


def _randomized(model, seed: int):
    """``model`` with seeded random weights: matrices drawn with variance 1 / fan-in and every
    1-D parameter (``A_log``, ``D``, ``dt_bias``, norms, biases) moved off its initial value,
    so that every head's step size differs and the greedy tokens vary."""
    mx.random.seed(seed)
    return randomize_weights(model)


def make_nemotron(seed: int = 0, **overrides):
    """A float32 mlx-lm Nemotron-H with seeded random weights (``NEMOTRON``'s 8 blocks)."""
    module = importlib.import_module("mlx_lm.models.nemotron_h")
    args = module.ModelArgs.from_dict({"model_type": "nemotron_h",
                                       **dict(NEMOTRON, **overrides)})
    mx.random.seed(seed)
    return _randomized(module.Model(args), seed)


def make_granite(seed: int = 0, **overrides):
    """A float32 mlx-lm Granite-4.0-H with seeded random weights (5 layers: mamba, attention,
    mamba, mamba, attention): matrices drawn with variance 1 / fan-in and every 1-D parameter
    (``A_log``, ``D``, ``dt_bias``, norms, biases) moved off its initial value, so that every
    head's step size differs and the greedy tokens vary."""
    module = importlib.import_module("mlx_lm.models.granitemoehybrid")
    args = module.ModelArgs.from_dict({"model_type": "granitemoehybrid",
                                       **dict(SMALL, **overrides)})
    mx.random.seed(seed)
    return _randomized(module.Model(args), seed)


def _make(kind: str):
    """The model of ``kind``: a Granite-4.0-H (``"dense"``), one of Granite-4.0-H's own layer
    shape (``"moe"``) or a Nemotron-H (``"nemotron_h"``)."""
    if kind == "nemotron_h":
        return make_nemotron()
    return make_granite(**(MOE if kind == "moe" else {}))


_cases = once_per_family(_make, lambda model, prompt: mlx_greedy(model, prompt, NEW))


def _case(kind: str = "dense"):
    """(model, prompts, mlx-lm's greedy tokens), once per kind."""
    return _cases(kind)


# the tests every mlx-lm hybrid family file runs, under this file's ids
globals().update(family_tests(_case, "granitemoehybrid", pair=(2, 4),
                             states=("conv", "ssm")))


KIND = kvcache.State({"conv": (3, 192), "ssm": (4, 32, 16)}, dtype="float32")


def test_the_mamba_layers_are_state_layers():
    # mlx-lm's ArraysCache entries: the conv's last inputs (batch, d_conv - 1, conv_dim), time
    # first, and the SSM state (batch, heads, head_dim, d_state), float32
    assert_state_layers(_case(), {i: KIND for i in MAMBA}, (1, 4))


def test_granite_moe_without_rope_greedy_equals_mlx_lm():
    """Granite-4.0-H's own layer shape: no rotary, MoE experts beside a shared MLP, the
    embedding / residual / logits multipliers, tied embeddings."""
    assert_generate_equals_mlx_lm(_case("moe"))


def test_nemotron_h_greedy_equals_mlx_lm():
    """Nemotron-H: the same mixer code, its gated norm per group; MLP and MoE blocks take no
    cache slot, so the state layers are cache slots 0, 2 and 3 (decoder layers 0, 3 and 4)
    and the attention slots 1 and 4 (layers 1 and 6)."""
    model, prompts, want = _case("nemotron_h")
    assert state_kinds(model) == {i: KIND for i in (0, 2, 3)}
    assert route_state_layers(model) == [0, 2, 3]
    engine = _engine(model)
    assert engine.config.num_layers == 5 and engine.config.full_layers == (1, 4)
    assert_engine_greedy(engine, prompts, want)


def test_nemotron_h_blocks_not_read_are_refused():
    assert_edit_refused(make_nemotron(seed=1), "args.hybrid_override_pattern",
                        ["M", "*", "-", "M", "M", "E", "*", "X"], "layer 7 .*'X'")
    assert_a_subclass_refused(make_nemotron(seed=1), 3, "mixer", "NemotronHMamba2Mixer",
                              state_kinds)
    gated = importlib.import_module("mlx_lm.models.granitemoehybrid").GraniteMoeHybridRMSNormGated
    assert_edit_refused(make_nemotron(seed=1), "layers.4.mixer.norm", gated(128),
                        "layer 4 .*norm GraniteMoeHybridRMSNormGated")


@pytest.mark.parametrize("kind", ["dense", "nemotron_h"])
def test_shared_prefixes_hit_through_state_checkpoints(kind):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the first
    request's prefill chunk 16..24 gives the conv and SSM states at 20 (inside the chunk: the
    mixer splits its SSM call there), so the later ones start from 20 cached tokens with both
    states restored; warm tokens equal the cold ones and mlx-lm's own (Granite-4.0-H and
    Nemotron-H)."""
    model, _, _ = _case(kind)
    engine = assert_prefix_hits_at_every_page(model)
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots
    # the engine's own interval for these states: a checkpoint costs more than a page's KV
    assert _engine(model).config.state_checkpoint_interval > 1


def test_what_is_not_understood_is_refused():
    import mlx.nn as nn
    # a layer type the family's state layers do not know
    assert_edit_refused(make_granite(seed=1), "args.layer_types",
                        ["mamba", "attention", "mamba", "hybrid", "attention"],
                        "layer 3 .*'hybrid'")
    # a replaced mixer
    assert_a_subclass_refused(make_granite(seed=1), 2, "mamba", "GraniteMoeHybridMamba2Mixer")
    # not depthwise: a full convolution over the channels
    assert_edit_refused(make_granite(seed=1), "layers.3.mamba.conv1d",
                        nn.Conv1d(192, 192, 4, bias=True), "layer 3 .*groups=1")
    # a time-step limit that is not (low, high)
    assert_edit_refused(make_granite(seed=1), "layers.0.mamba.time_step_limit", (0.0,),
                        "layer 0 .*time_step_limit", cache_config)
    # another gated norm
    assert_edit_refused(make_granite(seed=1), "layers.0.mamba.norm", nn.RMSNorm(128),
                        "layer 0 .*norm RMSNorm")
    # groups that do not divide the heads
    with pytest.raises(kvcache.UnsupportedFeatureError, match="n_groups=3"):
        state_kinds(make_granite(seed=1, mamba_n_heads=4, mamba_n_groups=3))
    # a mamba layer that make_cache() gives another cache
    assert_another_make_cache_refused(make_granite(seed=1))
    # the module's SSM function replaced: not the one read
    assert_a_replaced_function_refused(make_granite(seed=1), "ssm_update")
    # the mixer called with a mask array (padding)
    assert_a_mask_refused(_case()[0], "mamba")
