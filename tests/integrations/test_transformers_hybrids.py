"""Hybrid families are refused (issue 51, item 0; LFM2's short convolutions are served since
issue 56's increment 5, ``SERVED``): a model that keeps, beside (or instead of) its
attention, state the cache does not hold (a Mamba / SSM mixer, linear attention or gated
DeltaNet, a recurrent block, a short convolution, a relative position bias) would run with that
state lost between steps, its tokens differing from transformers' own generation without an
error (Falcon-H1 did: 83 of 192 greedy tokens right). Every such family the installed
transformers ships is built here tiny (random weights, no download) and must be refused by the
Engine and by ``cache_config`` with an ``UnsupportedFeatureError`` naming the model type, the
layer, the module and the reason; a second test keeps the list complete."""

from __future__ import annotations

import pytest

from conftest import torch, transformers

import kvcache
from kvcache.integrations.transformers import (STATE_FAMILIES, Engine, cache_config,
                                               state_kinds, stateful_layers)
from kvcache.integrations.transformers import states as states_module

_SMALL = dict(vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4)
_DELTA_FIRST = dict(layer_types=["linear_attention", "full_attention"])
_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16)

# text model type -> (what keeps the state, config keywords): each family built with attention
# layers beside the layers (or modules) that keep state, as small as it goes
HYBRIDS = {
    "falcon_h1": ("mixer", dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                mamba_d_state=16, mamba_n_groups=1)),    # both in every layer
    "bamba": ("mixer", dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                            mamba_d_state=16, mamba_n_groups=1)),
    "jamba": ("mixer", dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                            expert_layer_offset=1, num_experts=2, mamba_d_state=8)),
    "granitemoehybrid": ("mamba", dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                       mamba_d_head=32, mamba_d_state=16,
                                       shared_intermediate_size=64, num_local_experts=4)),
    "nemotron_h": ("mixer", dict(layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                                 mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                 n_routed_experts=4, moe_intermediate_size=32,
                                 moe_shared_expert_intermediate_size=32)),
    "zamba": ("'hybrid' layer", dict(num_hidden_layers=3,
                                     layers_block_type=["mamba", "hybrid", "hybrid"],
                                     mamba_d_state=8, n_mamba_heads=2, attention_hidden_size=128,
                                     attention_head_dim=32)),
    "zamba2": ("mixer", dict(layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
                             n_mamba_heads=4, mamba_headdim=32, attention_hidden_size=128,
                             attention_head_dim=32, num_mem_blocks=1)),
    "zaya": ("convolution", dict(_MOE, num_experts_per_tok=1)),
    "qwen3_next": ("linear attention", dict(_LINEAR, **_MOE, **_DELTA_FIRST,
                                            shared_expert_intermediate_size=32)),
    "qwen3_5_text": ("linear attention", dict(_LINEAR, **_DELTA_FIRST)),
    "qwen3_5_moe_text": ("linear attention", dict(_LINEAR, **_MOE, **_DELTA_FIRST,
                                                  shared_expert_intermediate_size=32)),
    "qwen4_exp_text": ("linear attention", dict(
        _LINEAR, **_MOE, shared_expert_intermediate_size=32,
        layer_types=["linear_attention", "indexed_attention"], indexer_n_heads=2,
        indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        ngram_vocab_size_base=256, split_ngram_parts=2, hc_lowrank=8)),
    "olmo_hybrid": ("linear attention", dict(_LINEAR, **_DELTA_FIRST)),
    "lara_mini": ("linear attention", dict(_LINEAR, **_MOE, **_DELTA_FIRST,
                                           shared_expert_intermediate_size=32)),
    "kimi_linear": ("linear attention", dict(_MOE, **_MLA, linear_attn_config={
        "full_attn_layers": [2], "kda_layers": [1], "num_heads": 4, "head_dim": 16,
        "short_conv_kernel_size": 4})),
    "bailing_hybrid": ("linear attention", dict(_MOE, **_MLA, **_DELTA_FIRST, linear_num_heads=4,
                                                linear_head_dim=16, first_k_dense_replace=2)),
    "minimax": ("linear attention", dict(_DELTA_FIRST, num_local_experts=4)),
    "recurrent_gemma": ("recurrent", dict(block_types=["recurrent", "attention"], lru_width=64,
                                          attention_window_size=16)),
    "lfm2": ("convolution", dict(full_attn_idxs=[1])),
    "lfm2_moe": ("convolution", dict(layer_types=["conv", "full_attention"], num_dense_layers=1,
                                     **_MOE)),
    "lfm3": ("convolution", dict(layer_types=["conv", "full_attention"])),
    # a short convolution on k (and v) inside the attention; inkling2 a relative position bias too
    "inkling_text": ("convolution", dict(_MOE, n_routed_experts=4, unpadded_vocab_size=128)),
    "inkling2_text": ("position bias", dict(_MOE, n_routed_experts=4, unpadded_vocab_size=128)),
    "inkling2_loop_text": ("position bias", dict(_MOE, n_routed_experts=4,
                                                 unpadded_vocab_size=128)),
    # no attention at all: refused for the state they keep
    "mamba": ("'linear_attention' layer", dict(state_size=8)),
    "mamba2": ("'linear_attention' layer", dict(num_heads=8, head_dim=16, state_size=8,
                                                n_groups=1)),
    "falcon_mamba": ("'linear_attention' layer", dict(state_size=8)),
}


def _installed(model_type: str) -> bool:
    return model_type in transformers.CONFIG_MAPPING


def build(model_type: str):
    """A float32 CPU model of ``model_type`` with seeded random weights, tiny."""
    _, kw = HYBRIDS[model_type]
    config = transformers.AutoConfig.for_model(model_type, **{**_SMALL, **kw})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.float32).eval()


# the families whose state layers run on the cache (docs/hybrid.md, increments 5, 7, 9 and 12):
# served, not refused (tests/integrations/test_transformers_lfm2.py, test_transformers_bamba.py,
# test_transformers_qwen3_next.py, test_transformers_nemotron_h.py,
# test_transformers_falcon_h1.py)
SERVED = frozenset(STATE_FAMILIES)


@pytest.mark.parametrize("model_type", [t for t in HYBRIDS if t not in SERVED])  # about 3 s
def test_a_hybrid_family_is_refused_naming_the_layer_module_and_reason(model_type):
    if not _installed(model_type):
        pytest.skip(f"transformers {transformers.__version__} does not ship {model_type}")
    model = build(model_type)
    what = HYBRIDS[model_type][0]
    before = model.config._attn_implementation
    with pytest.raises(kvcache.UnsupportedFeatureError) as err:
        Engine(model, backend="reference", max_total_tokens=256)
    text = str(err.value)
    assert f"the {model_type} model ({type(model).__name__})" in text
    assert "keeps state the cache does not hold" in text and "lost between steps" in text
    assert "layer 0: " in text and what in text.lower(), text
    assert ("served for the short convolutions of lfm2, lfm2_moe, the Mamba-2 mixers of "
            "bamba, falcon_h1, granitemoehybrid, nemotron_h and the gated DeltaNet layers of "
            "qwen3_next only") in text
    found = stateful_layers(model)
    assert found and found[0][0] == 0
    if not what.startswith("'"):                # the module by its path and class
        where = found[0][1]
        assert where.split(" (")[0].count(".") >= 2 and where.endswith(")") and where in text
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match="keeps state the cache does not hold"):
        cache_config(model)                     # your own loop: refused the same way
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_a_served_family_builds_its_state_layers(model_type):
    """The same tiny LFM2, Bamba-family, Nemotron-H, Falcon-H1 and Qwen3-Next models are
    accepted: their conv layers, Mamba mixers and gated DeltaNet layers are state layers, at
    their decoder layers' first cache layers (Falcon-H1: two a layer; their tokens:
    test_transformers_lfm2.py, test_transformers_bamba.py, test_transformers_nemotron_h.py,
    test_transformers_falcon_h1.py, test_transformers_qwen3_next.py)."""
    model = build(model_type)
    kinds = state_kinds(model)
    found = [i for i, _, _ in stateful_layers(model)]
    first = states_module.cache_layers(model)
    assert found[0] == 0 and sorted(kinds) == [first[i] for i in found]
    assert dict(cache_config(model).layer_kinds) == kinds


def test_falcon_h1_keeps_both_of_each_layer():
    """The issue's case: Falcon-H1 runs attention and a Mamba2 mixer side by side in every layer,
    so every layer has an attention module and the layer check alone accepted it, losing the
    mixer's state (83 of 192 greedy tokens right). Served since increment 12: each layer is two
    cache layers, the mixer's state and the attention's pages."""
    if not _installed("falcon_h1"):
        pytest.skip("this transformers does not ship falcon_h1")
    model = build("falcon_h1")
    assert sorted(state_kinds(model)) == [0, 2]
    cfg = cache_config(model)
    assert cfg.num_layers == 4 and cfg.full_layers == (1, 3)


def _keeps_state(config) -> bool:
    """Whether transformers' own cache keeps a recurrent or convolution state for a layer of
    ``config``, or the config sizes a Mamba, SSM or short-convolution block: the families
    ``HYBRIDS`` must cover (independent of the integration's module scan)."""
    from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING,
                                          LinearAttentionCacheLayerMixin)
    stateful = {name for name, cls in DYNAMIC_LAYER_TYPE_MAPPING.items()
                if isinstance(cls, type) and issubclass(cls, LinearAttentionCacheLayerMixin)}
    try:
        types = set(getattr(config, "layer_types", None) or ())
    except Exception:
        types = set()
    keys = config.to_dict()
    sized = any(k.startswith(("mamba_", "ssm_", "linear_conv", "conv_L_cache", "lru_",
                              "short_conv")) for k in keys)
    return bool(types & (stateful | {"mamba", "recurrent"})) or sized


def test_every_family_transformers_ships_that_keeps_state_is_in_the_list():
    """Every causal-LM family of the installed transformers whose layers keep a recurrent or
    convolution state (by transformers' own cache layer types, or Mamba / SSM / convolution
    sizes in its config) is built and refused above: a new hybrid family fails here until it
    is added."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    missing = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            config = transformers.AutoConfig.for_model(model_type)
            text = config.get_text_config(decoder=True)
        except Exception:           # (a config that needs arguments, or a missing extra)
            continue
        if _keeps_state(text) and text.model_type not in HYBRIDS:
            missing.append(f"{model_type} ({text.model_type})")
    assert not missing, f"hybrid families not covered by HYBRIDS: {missing}"
