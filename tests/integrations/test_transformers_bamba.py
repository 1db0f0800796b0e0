"""The Mamba-2 mixers of Bamba and Granite-4.0-H (``granitemoehybrid``) on the cache's state
slots (issue 56, docs/hybrid.md "Built: increment 7"): a small random-weight Bamba (mamba and
attention layers, SSM chunks of 4 tokens) generates greedily through the Engine (queued
requests of different lengths sharing batches, prompts in chunks of 8 tokens, the host one
step ahead or not, preemption, ``n = 3`` forks) and through the adapter in a loop of one's
own, on the reference backend and cuda's CPU mode, token for token equal to transformers' own
``generate``; a Granite-4.0-H the same through the Engine; and what is refused, by name."""

from __future__ import annotations

import pytest

from conftest import (assert_mixer_call_refusals, backend_or_skip, hf_greedy, random_hybrid,
                      torch)
from hybrid_cases import NEW, PAGE, full_conv, once_per_family
from transformers_hybrid_cases import (Family, assert_a_subclass_refused, assert_state_layers,
                                       engine, family_tests, refused)

import kvcache
from kvcache.integrations.transformers import cache_config, state_kinds
from kvcache.integrations.transformers import states as states_module

MAMBA = (0, 2, 3)               # layers 1 and 4 attend
# hidden 64, 4 SSM heads of 32 (expand 2), 2 groups of a state of 16, a conv of 4 taps over
# 128 + 2 * 2 * 16 = 192 channels, SSM chunks of 4 (a prefill chunk of 8 spans two)
SMALL = dict(vocab_size=128, num_hidden_layers=5, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=32,
             mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=4,
             pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.15,
             tie_word_embeddings=False, max_position_embeddings=256)
FAMILY = {"bamba": dict(attn_layer_indices=[1, 4]),
          "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "mamba",
                                                "attention"],
                                   shared_intermediate_size=64, num_local_experts=0)}
KIND = kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")


def make_bamba(model_type: str = "bamba", seed: int = 0, **overrides):
    """A float32 CPU Bamba-family model with seeded random weights (5 layers: mamba,
    attention, mamba, mamba, attention). The mixers' ``dt_bias`` and ``D`` (initialized to
    ones) are drawn too, so every head's step size and skip differ."""
    return random_hybrid(model_type, dict(SMALL, **FAMILY[model_type], **overrides), seed)


# (model, prompts, transformers' greedy tokens), once per family (none: bamba)
_case = once_per_family(make_bamba, lambda model, prompt: hf_greedy(model, prompt, NEW))
# the tests every transformers hybrid family file runs, under this file's ids. Bamba's own
# detail: the 37-token prompt spans 5 prefill chunks and 10 SSM chunks; the prefix-hit model
# has SSM chunks of 8, so the checkpoint at 20 lies inside one
globals().update(family_tests(Family(
    "bamba", _case, make_bamba, cache_layers=5, states=("conv", "ssm"), forward="mamba_forward",
    uneven_atol=2e-5, layer_modules="mamba_layers",
    prefix_model=lambda: make_bamba(seed=2, mamba_chunk_size=8), own_interval_over_one=True,
    warm_prefix=True, compose=True)))


def test_the_mamba_layers_are_state_layers():
    # the SSM state in float32 (the model keeps it so under a 16-bit model)
    cfg = assert_state_layers(_case()[0], {i: KIND for i in MAMBA}, (1, 4), MAMBA)
    assert cfg.num_state_slots == 3
    assert cfg.state_bytes == 3 * 3 * (192 * 3 + 4 * 32 * 16) * 4


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_granitemoehybrid_greedy_equals_generate(backend, monkeypatch):
    """Granite-4.0-H's mixer is Bamba's code: the same layers (its config names them mamba /
    attention), no rotary, residual multipliers; through the Engine as above."""
    model, prompts, want = _case("granitemoehybrid")
    assert state_kinds(model) == {i: KIND for i in MAMBA}
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    eng = engine(model, backend=name, device=device)
    assert eng.generate(prompts, max_new_tokens=NEW) == [[w] for w in want]
    assert eng.cache.num_available_state_slots == eng.config.num_state_slots


def test_what_is_not_understood_is_refused():
    # a replaced mixer (a subclass computes what it likes)
    assert_a_subclass_refused(make_bamba(seed=1), 2, "mamba")
    # a time-step limit: transformers clamps dt in its chunked form only
    refused(make_bamba(seed=1, time_step_limit=(0.0, 0.5)),
            r"layers\.0\.mamba \(BambaMixer\): time_step_limit=\(0\.0, 0\.5\)")
    # another activation after the conv
    refused(make_bamba(seed=1, hidden_act="gelu"), "activation 'gelu'")
    # groups that do not match the conv (a mixer changed after it was built)
    model = make_bamba(seed=1)
    model.model.layers[3].mamba.n_groups = 1
    refused(model, r"layers\.3\.mamba .*conv_dim=192 is not intermediate_size \+ 2 \* n_groups")
    # not depthwise: a full convolution over the channels (a conv changed after it was built)
    model = make_bamba(seed=1)
    channels = full_conv(model.model.layers[0].mamba, "conv1d")
    refused(model, r"layers\.0\.mamba .*groups=1.*not a depthwise causal convolution over "
                   rf"conv_dim={channels} channels")
    # a layer type the family does not know
    model = make_bamba("granitemoehybrid", seed=1)
    model.config.layer_types = ["mamba", "sliding_attention", "mamba", "mamba", "attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 1 .*'sliding_attention'"):
        state_kinds(model)
    model.config.layer_types = ["mamba", "attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"has 2 layers_block_type / layer_types for 5 layers: which layers "
                             r"are Mamba mixers"):
        state_kinds(model)
    # the mixer called with a padding mask, or with its own cache beside the cache's
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[0].mamba,
                               ("seq_idx", torch.zeros(1, 3, dtype=torch.int32)))


def test_positional_arguments_are_read_off_the_mixers_signature():
    """Releases order a mixer's parameters differently (an older one: ``hidden_states,
    cache_params, cache_position, attention_mask, seq_idx``): the routed call maps positional
    arguments by the forward's own signature, and its own cache under any of the names is
    refused beside the cache's."""
    def older(hidden_states, cache_params=None, cache_position=None, attention_mask=None,
              seq_idx=None, **kwargs):
        """(a stand-in signature)"""
    assert states_module._positional_names(older) == (
        "hidden_states", "cache_params", "cache_position", "attention_mask", "seq_idx")
    fresh = make_bamba(seed=1).model.layers[0].mamba.forward      # (not routed yet)
    names = states_module._positional_names(fresh)                 # (5.24: hidden_states,
    assert names[0] == "hidden_states" and "attention_mask" in names  # cache, attention_mask)
    model, _, _ = _case()
    mixer = model.model.layers[0].mamba
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=64,
                                              max_batch_size=1), backend="reference")
    cache.add_sequence(0)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="own cache"):
        with cache.forward([0], [3]):
            states_module._routed_call(mixer, cache, (torch.zeros(1, 3, 64), object()), {},
                                       states_module._positional_names(older),
                                       states_module.mamba_forward)
    assert cache.sequence_length(0) == 0


def test_the_families_still_not_served_are_refused_by_name():
    """Zamba2 and Jamba keep Mamba state the cache does not serve: refused, naming the served
    families (Nemotron-H and Falcon-H1 are served since increment 12:
    test_transformers_nemotron_h.py, test_transformers_falcon_h1.py)."""
    from test_transformers_hybrids import _installed, build
    for model_type in ("zamba2", "jamba"):
        if not _installed(model_type):
            continue
        with pytest.raises(kvcache.UnsupportedFeatureError,
                           match=f"the {model_type} model .*keeps state the cache does not hold"
                                 f".*Mamba-2 mixers of bamba, falcon_h1, granitemoehybrid, "
                                 f"nemotron_h and the gated DeltaNet layers of qwen3_next only"):
            cache_config(build(model_type))


# ---------------------------------------------------------------------------- prefix hits
def test_a_checkpoint_inside_a_scan_is_the_state_a_scan_ending_there_reaches():
    """``_ssm_chunked(..., at=...)``: the state after the first ``r`` tokens of a prefill
    chunk (a page boundary inside it: a prefix-cache checkpoint) equals the final state of a
    scan over those ``r`` tokens alone, at chunk starts and inside chunks."""
    model = make_bamba(seed=3, mamba_chunk_size=4)
    m = model.model.layers[0].mamba
    g = torch.Generator().manual_seed(0)
    n, heads, hd, groups, ds = 13, 4, 32, 2, 16
    state = torch.randn(1, heads, hd, ds, generator=g)
    x = torch.randn(1, n, heads, hd, generator=g)
    dt = torch.randn(1, n, heads, generator=g)
    B, C = (torch.randn(1, n, groups, ds, generator=g) for _ in range(2))
    A = -torch.exp(m.A_log.float())
    at = (1, 4, 6, 8, 11, 12)
    with torch.no_grad():
        _, _, inner = states_module._ssm_chunked(m, state, x, dt, A, B, C, at)
        for r, got in zip(at, inner):
            _, want, _ = states_module._ssm_chunked(m, state, x[:, :r], dt[:, :r], A,
                                                    B[:, :r], C[:, :r])
            assert torch.allclose(got, want[0], atol=1e-5, rtol=1e-5), r
