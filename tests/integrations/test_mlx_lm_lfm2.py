"""mlx-lm's LFM2 short convolutions on the cache's state slots (issue 56, docs/hybrid.md "Built:
increment 6"): a small random-weight mlx-lm LFM2 (conv and attention layers, float32) generates
greedily on the metal backend (MLX's CPU device) through the Engine (queued requests of
different lengths sharing forwards, prompts in chunks of 8 tokens, the host one step ahead or
not, preemption, forks) and through the adapter in a loop of one's own, token for token equal
to mlx-lm's own generation with its own ``ArraysCache``; and what is refused, by name."""

from __future__ import annotations

import importlib

import pytest

from mlx_lm_cases import mlx_greedy
from mlx_hybrid_cases import (assert_a_mask_refused, assert_a_subclass_refused,
                              assert_another_make_cache_refused, assert_edit_refused,
                              assert_generate_equals_mlx_lm, assert_state_layers, engine as _engine,
                              family_tests, random_model, shared_prefix_case)
from hybrid_cases import (NEW, assert_prefix_hits, assert_state_slots_wait, once_per_family)

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import Engine, cache_config, state_kinds  # noqa: E402

TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
SMALL = dict(vocab_size=128, num_hidden_layers=len(TYPES), hidden_size=64, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, norm_eps=1e-5, conv_bias=True,
             conv_L_cache=3, block_dim=64, block_multiple_of=16, block_ffn_dim_multiplier=None,
             block_auto_adjust_ff_dim=False, block_ff_dim=128, intermediate_size=128,
             layer_types=TYPES)
MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
           use_expert_bias=True, num_dense_layers=1)


def make_lfm2(model_type: str = "lfm2", seed: int = 0, **overrides):
    """A float32 mlx-lm LFM2-family model with seeded random weights (5 layers: conv,
    attention, conv, conv, attention; hidden 64, a kernel of 3 taps): matrices drawn with
    variance 1 / fan-in and every 1-D parameter moved off its initial value, so that the
    greedy tokens vary (mlx-lm's own initialisation repeats one token)."""
    kw = dict(SMALL, **(MOE if model_type == "lfm2_moe" else {}), **overrides)
    return random_model(model_type, model_type, kw, seed, "conv.weight")


# (model, prompts, mlx-lm's greedy tokens), once per family (none: lfm2)
_case = once_per_family(make_lfm2, lambda model, prompt: mlx_greedy(model, prompt, NEW))
# the tests every mlx-lm hybrid family file runs, under this file's ids
globals().update(family_tests(_case, "lfm2", pair=(2, 3)))


def test_the_conv_layers_are_state_layers():
    # mlx-lm's ArraysCache entry: (batch, conv_L_cache - 1, hidden), time first
    cfg = assert_state_layers(_case(), {i: kvcache.State({"conv": (2, 64)}) for i in (0, 2, 3)},
                              (1, 4), routed=2)
    assert cfg.num_state_slots == 3 and cfg.state_bytes == 3 * 3 * 2 * 64 * 4


def test_lfm2_moe_greedy_equals_mlx_lm():
    assert_generate_equals_mlx_lm(_case("lfm2_moe"))


def test_state_slots_running_short_wait_rather_than_preempt_forever(monkeypatch):
    """One state slot per batch row and ``n = 5`` samples of two prompts with 3 rows: the
    samples' prefixes and samples need more slots than the cache has; the forwards wait for
    slots and the tokens are mlx-lm's."""
    model, prompts, want = _case()
    assert_state_slots_wait(lambda **kw: _engine(model, **kw), prompts[3:], want[3:],
                            monkeypatch)


def test_what_is_not_understood_is_refused():
    # a layer type the family's state layers do not know
    assert_edit_refused(make_lfm2(seed=1), "args.layer_types",
                        ["conv", "sliding_attention", "conv", "conv", "full_attention"],
                        "layer 1 .*'sliding_attention'")
    # a replaced conv module
    assert_a_subclass_refused(make_lfm2(seed=1), 2, "conv", "ShortConv")
    # a kernel of one tap keeps no state: not what was read
    with pytest.raises(kvcache.UnsupportedFeatureError, match="kernel of 1 taps"):
        cache_config(make_lfm2(seed=1, conv_L_cache=1))
    # not depthwise: a full convolution over the channels
    import mlx.nn as nn
    assert_edit_refused(make_lfm2(seed=1), "layers.3.conv.conv", nn.Conv1d(64, 64, 3, bias=True),
                        "layer 3 .*groups=1")
    # a conv layer that make_cache() gives another cache
    assert_another_make_cache_refused(make_lfm2(seed=1))
    # the conv called with a mask array (padding)
    assert_a_mask_refused(_case()[0], "conv")


S = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
OTHERS = {
    "rwkv7": dict(S, norm_eps=1e-5, head_dim=16, a_low_rank_dim=8, v_low_rank_dim=8,
                  gate_low_rank_dim=8, decay_low_rank_dim=8),
    "recurrent_gemma": dict(S, attention_bias=False, conv1d_width=4, logits_soft_cap=30.0,
                            num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6,
                            rope_theta=10000.0, attention_window_size=16,
                            block_types=["recurrent", "attention"]),
}


@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_recurrent_families_stay_refused(family):
    """mlx-lm's other families with recurrent caches (RWKV-7, RecurrentGemma) are refused at
    construction, naming the family and the cache, never run with a wrong state
    (Granite-4.0-H's and Nemotron-H's Mamba-2 mixers are served:
    test_mlx_lm_granite_hybrid.py; Qwen3-Next's gated DeltaNet: test_mlx_lm_qwen3_next.py;
    Falcon-H1's mixers beside attention: test_mlx_lm_falcon_h1.py; Mamba-2's and Mamba-1's,
    without attention: test_mlx_lm_mamba2.py, test_mlx_lm_mamba.py; Jamba's Mamba-1 mixers:
    test_mlx_lm_jamba.py)."""
    module = importlib.import_module(f"mlx_lm.models.{family}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": family, **OTHERS[family]}))
    assert state_kinds(model) == {}
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=f"of the {family} model uses mlx-lm's (ArraysCache|MambaCache)"
                             f".*short convolutions of lfm2, lfm2_moe, the Mamba-2 "
                             f"mixers of falcon_h1, granitemoehybrid, mamba2, nemotron_h, the "
                             f"Mamba-1 mixers of falcon_mamba, jamba, mamba and the gated "
                             f"DeltaNet layers of qwen3_next only"):
        Engine(model, backend="metal", device="cpu", max_total_tokens=64)
    with pytest.raises(kvcache.UnsupportedFeatureError, match=f"{family} model"):
        cache_config(model)


def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine's default (prefix cache on): the
    first one's forwards keep the conv states at every page boundary, the one at 20 inside the
    prefill chunk 16..24 too (the conv gives it, ``set_state_checkpoints``), so the later
    ones start from 20 cached tokens with the states restored; the greedy tokens are mlx-lm's
    own."""
    model, _, _ = _case()
    assert_prefix_hits(_engine(model), *shared_prefix_case(model))
