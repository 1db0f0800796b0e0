"""mlx-lm's Qwen3-Next (``qwen3_next``) gated DeltaNet layers on the cache's state slots
(issue 56 item 4, docs/hybrid.md "Built: increment 11"): a small random-weight mlx-lm
Qwen3-Next (gated DeltaNet and gated full-attention layers with partial rotary, MoE MLPs,
float32) generates greedily on the metal backend (MLX's CPU device) through the Engine (queued
requests of different lengths sharing forwards, prompts in chunks of 8 tokens, the host one
step ahead or not, preemption, forks, the prefix cache on) and through the adapter in a loop
of one's own, token for token equal to mlx-lm's own generation with its own ``ArraysCache``;
prefix hits through state checkpoints inside a prefill chunk; each state carries; and what is
refused, by name."""

from __future__ import annotations

import importlib

import numpy as np

from mlx_hybrid_cases import (assert_a_mask_refused, assert_a_replaced_function_refused,
                              assert_a_subclass_refused, assert_another_make_cache_refused,
                              assert_edit_refused, assert_prefix_hits_at_every_page,
                              assert_state_layers, engine as _engine, family_tests,
                              randomize_weights, shared_prefix_case)
from mlx_lm_cases import mlx_greedy, mx
from hybrid_cases import NEW, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import cache_config, state_kinds  # noqa: E402

# 4 layers, every second one full attention: linear 0 and 2, attention 1 and 3. Gated
# DeltaNet: 2 key heads of 16, 4 value heads of 16 (each key head serves two value heads), a
# conv of 4 taps over 2 * 32 + 64 = 128 channels. Attention: 4 query heads and 2 KV heads of
# 16, a quarter of each head rotated (Qwen3-Next's partial_rotary_factor), the output gated.
# MoE MLPs (4 experts, 2 a token) beside a gated shared expert.
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
             num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=32,
             mlp_only_layers=[], moe_intermediate_size=32, rms_norm_eps=1e-5, rope_theta=10000.0,
             partial_rotary_factor=0.25, max_position_embeddings=256, norm_topk_prob=True,
             tie_word_embeddings=False, full_attention_interval=2)
LINEAR = (0, 2)
KIND = kvcache.State({"conv": (3, 128), "recurrent": (4, 16, 16)}, dtype="float32")


def make_qwen3_next(seed: int = 0, **overrides):
    """A float32 mlx-lm Qwen3-Next with seeded random weights (``SMALL``): matrices drawn with
    variance 1 / fan-in and every 1-D parameter (``A_log``, ``dt_bias``, norms) moved off its
    initial value, so that every head's decay differs and the greedy tokens vary."""
    module = importlib.import_module("mlx_lm.models.qwen3_next")
    args = module.ModelArgs.from_dict({"model_type": "qwen3_next", **dict(SMALL, **overrides)})
    mx.random.seed(seed)
    return randomize_weights(module.Model(args))


# (model, prompts, mlx-lm's greedy tokens), built once
_case = once_per_family(make_qwen3_next, lambda model, prompt: mlx_greedy(model, prompt, NEW))
# the tests every mlx-lm hybrid family file runs, under this file's ids
globals().update(family_tests(_case, "qwen3_next", pair=(2, 4),
                             states=("conv", "recurrent")))


def test_the_gated_deltanet_layers_are_state_layers():
    # mlx-lm's ArraysCache entries: the conv's last inputs (batch, kernel - 1, conv_dim), time
    # first, and the recurrent state (batch, value heads, head_v_dim, head_k_dim), float32
    assert_state_layers(_case(), {i: KIND for i in LINEAR}, (1, 3))
    want = _case()[2]
    assert len({tuple(w) for w in want}) == len(want)     # the prompts' tokens differ


def test_dense_mlps_and_as_many_key_heads_as_value_heads():
    """Another shape of the family: dense MLPs (``num_experts=0``), 4 key heads and 4 value
    heads (no key head repeated), a conv of 3 taps, full attention every third layer (6
    layers: linear 0, 1, 3, 4): the Engine's tokens are mlx-lm's."""
    model = make_qwen3_next(seed=2, num_experts=0, linear_num_key_heads=4,
                            linear_conv_kernel_dim=3, num_hidden_layers=6,
                            full_attention_interval=3)
    kinds = state_kinds(model)
    assert kinds == {i: kvcache.State({"conv": (2, 192), "recurrent": (4, 16, 16)},
                                      dtype="float32") for i in (0, 1, 3, 4)}
    prompts = list(_case()[1])
    want = [mlx_greedy(model, p, NEW) for p in prompts]
    assert _engine(model).generate(prompts, max_new_tokens=NEW) == [[w] for w in want]


def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the first
    request's prefill chunk 16..24 gives the conv and recurrent states at 20 (inside the chunk:
    the layer splits its ``gated_delta_update`` call there), so the later ones start from 20
    cached tokens with both states restored; warm tokens equal the cold ones and mlx-lm's
    own."""
    assert_prefix_hits_at_every_page(_case()[0])


def test_a_wrong_checkpoint_state_gives_wrong_warm_logits(monkeypatch):
    """The hits above restore the recurrent state from the checkpoint: with every checkpoint
    of the recurrent state stored as zeros, the warm requests hit as many tokens but their
    logits part from those of the same run with the true checkpoints (the restored state is
    what the warm tokens are computed from; the tests' model forgets fast, so the greedy
    tokens may survive the difference: the logits are compared)."""
    from engine_cases import logit_rows
    model, _, _ = _case()
    prompts, want = shared_prefix_case(model)
    cls = type(_engine(model).cache)
    original = cls.set_state_checkpoints

    def warm_rows(zero: bool):
        engine = _engine(model, state_checkpoint_interval=1)

        def stored(self, layer, name, values):
            return original(self, layer, name,
                            values * 0 if zero and name == "recurrent" else values)
        monkeypatch.setattr(cls, "set_state_checkpoints", stored)
        assert engine.generate(prompts[:1], max_new_tokens=NEW) == [[want[0]]]
        rows = logit_rows(engine)
        out = engine.generate(prompts[1:], max_new_tokens=NEW)
        monkeypatch.undo()
        assert engine.stats.prefix_hit_tokens == 3 * 20
        return rows, [o[0] for o in out]
    true_rows, true_tokens = warm_rows(False)
    zero_rows, _ = warm_rows(True)
    assert true_tokens == want[1:] and len(true_rows) == len(zero_rows)
    assert max(np.abs(a - b).max() for a, b in zip(true_rows, zero_rows)) > 1e-3


def test_what_is_not_understood_is_refused():
    import mlx.nn as nn
    # a replaced layer
    assert_a_subclass_refused(make_qwen3_next(seed=1), 2, "linear_attn",
                              "Qwen3NextGatedDeltaNet")
    # a decoder layer whose kind is not full_attention_interval's
    assert_edit_refused(make_qwen3_next(seed=1), "args.full_attention_interval", 4,
                        "layer 1 .*full_attention_interval=4")
    # not depthwise: a full convolution over the channels
    assert_edit_refused(make_qwen3_next(seed=1), "layers.0.linear_attn.conv1d",
                        nn.Conv1d(128, 128, 4, bias=False), "layer 0 .*groups=1")
    # value heads that the key heads do not divide
    assert_edit_refused(make_qwen3_next(seed=1), "layers.0.linear_attn.num_v_heads", 3,
                        "layer 0 .*num_v_heads=3", cache_config)
    # another gated norm
    assert_edit_refused(make_qwen3_next(seed=1), "layers.2.linear_attn.norm", nn.RMSNorm(16),
                        "layer 2 .*norm RMSNorm")
    # a linear layer that make_cache() gives another cache
    assert_another_make_cache_refused(make_qwen3_next(seed=1))
    # a model split over a pipeline
    assert_edit_refused(make_qwen3_next(seed=1), "model.pipeline_size", 2, "pipeline")
    # the module's delta rule replaced: not the one read
    assert_a_replaced_function_refused(make_qwen3_next(seed=1), "gated_delta_update")
    # the layer called with a mask array (padding)
    assert_a_mask_refused(_case()[0], "linear_attn")
