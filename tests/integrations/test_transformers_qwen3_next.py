"""Qwen3-Next's gated DeltaNet layers on the cache's state slots (issue 56, docs/hybrid.md
"Built: increment 9"): a small random-weight Qwen3-Next (linear-attention and gated
full-attention layers, partial RoPE, one MoE layer of 2 experts) generates greedily through
the Engine (queued requests of different lengths sharing batches, prompts in chunks of 8
tokens, the host one step ahead or not, preemption, ``n = 3`` forks, prefix hits through state
checkpoints) and through the adapter in a loop of one's own, on the reference backend and
cuda's CPU mode, token for token equal to transformers' own ``generate``; and what is refused,
by name. The chunk length of the chunked rule is not a config field (transformers' default,
64): every prefill chunk here fits one rule chunk, and the rule's own tests call it with
chunks of 4."""

from __future__ import annotations

import pytest

from conftest import assert_mixer_call_refusals, hf_greedy, random_hybrid, torch
from hybrid_cases import NEW, full_conv, once_per_family, prompts as _prompts
from transformers_hybrid_cases import (Family, assert_a_subclass_refused, assert_state_layers,
                                       engine, family_tests, refused)

import kvcache
from kvcache.integrations.transformers import cache_config, state_kinds
from kvcache.integrations.transformers import states as states_module

LINEAR = (0, 2, 3)              # layer 1 attends
TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
# hidden 64; 2 key heads and 4 value heads of 16 (each key head serves two value heads); a
# conv of 4 taps over 2 * 32 + 64 = 128 channels; gated attention of 4 query heads of 16 (2
# KV heads), a quarter of each head rotated; dense MLPs but layer 3's MoE (2 experts, the MoE
# is slow on a CPU)
SMALL = dict(vocab_size=128, num_hidden_layers=4, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, pad_token_id=0,
             bos_token_id=None, eos_token_id=None, num_experts=2, num_experts_per_tok=1,
             mlp_only_layers=[0, 1, 2], moe_intermediate_size=32,
             shared_expert_intermediate_size=32, linear_conv_kernel_dim=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, initializer_range=0.15, layer_types=TYPES,
             tie_word_embeddings=False, max_position_embeddings=256)


def make_qwen3_next(seed: int = 0, **overrides):
    """A float32 CPU Qwen3-Next with seeded random weights (4 layers: linear attention, full
    attention, linear attention, linear attention). The layers' ``dt_bias`` (initialized to
    ones) is drawn too, so every head's decay differs."""
    return random_hybrid("qwen3_next", {**SMALL, **overrides}, seed, draw_d=False)


# (model, prompts, transformers' greedy tokens), once
_case = once_per_family(make_qwen3_next, lambda model, prompt: hf_greedy(model, prompt, NEW))
# the tests every transformers hybrid family file runs, under this file's ids. Qwen3-Next's own
# detail: the chunked rule rounds differently from chunk to chunk, so the uneven chunks' logits
# are held to transformers' own run in the same chunks within 2e-5 (1.1e-5 seen) and to one
# forward over the whole prompt within 6e-5 (transformers' own chunked run is 4.1e-5 off it
# here); with the conv or the recurrent state forgotten every long prompt goes wrong
globals().update(family_tests(Family(
    "qwen3_next", _case, make_qwen3_next, cache_layers=4, states=("conv", "recurrent"),
    forward="gdn_forward", every_long_prompt_wrong=True, uneven_atol=6e-5, own_chunks_atol=2e-5,
    layer_modules="gdn_layers", prefix_model=lambda: make_qwen3_next(seed=2), compose=True)))


def test_the_linear_attention_layers_are_state_layers():
    kind = kvcache.State({"conv": (128, 3), "recurrent": (4, 16, 16)}, dtype="float32")
    cfg = assert_state_layers(_case()[0], {i: kind for i in LINEAR}, (1,), LINEAR)
    assert cfg.num_state_slots == 3
    assert cfg.state_bytes == 3 * 3 * (128 * 3 + 4 * 16 * 16) * 4


def test_as_many_key_heads_as_value_heads():
    """Key heads that are not repeated over value heads (4 of each): the same tokens as
    ``generate`` through the Engine."""
    model = make_qwen3_next(seed=4, linear_num_key_heads=4)
    assert state_kinds(model)[0] == kvcache.State({"conv": (192, 3), "recurrent": (4, 16, 16)},
                                                  dtype="float32")
    prompts = _prompts(9)[2:]
    out = engine(model).generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out] == [hf_greedy(model, p, NEW) for p in prompts]


def test_what_is_not_understood_is_refused(monkeypatch):
    # a replaced layer (a subclass computes what it likes)
    assert_a_subclass_refused(make_qwen3_next(seed=1), 2, "linear_attn")
    # heads that do not match the conv (a layer changed after it was built)
    model = make_qwen3_next(seed=1)
    model.model.layers[3].linear_attn.value_dim = 32
    refused(model, r"layers\.3\.linear_attn .*value_dim=32")
    # an activation transformers does not name
    model = make_qwen3_next(seed=1)
    model.model.layers[0].linear_attn.activation = "made_up"
    refused(model, r"layers\.0\.linear_attn .*activation 'made_up'")
    # a chunk length of the chunked rule other than the one read
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def other(query, key, value, g, beta, chunk_size=32, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """(a stand-in signature)"""
    with monkeypatch.context() as patch:
        patch.setattr(hf, "torch_chunk_gated_delta_rule", other)
        refused(make_qwen3_next(seed=1), "chunks of 32 tokens")
    # not depthwise: a full convolution over the channels (a conv changed after it was built)
    model = make_qwen3_next(seed=1)
    channels = full_conv(model.model.layers[0].linear_attn, "conv1d")
    refused(model, r"layers\.0\.linear_attn .*groups=1.*not a depthwise causal convolution over "
                   rf"conv_dim={channels} channels")
    # a layer type the family does not know
    model = make_qwen3_next(seed=1)
    model.config.layer_types = ["linear_attention", "sliding_attention", "linear_attention",
                                "linear_attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 1 .*'sliding_attention'"):
        state_kinds(model)
    # the layer called with a padding mask, with its own cache beside the cache's, or with a
    # keyword it does not implement on the cache
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[0].linear_attn,
                               ("cu_seq_lens_q", torch.tensor([0, 3])))


def test_the_other_linear_attention_families_are_still_refused_by_name():
    """Qwen3.5, OLMo-hybrid, Kimi-Linear, MiniMax keep linear-attention state the cache does
    not serve: refused, naming the served families."""
    from test_transformers_hybrids import _installed, build
    for model_type in ("qwen3_5_text", "olmo_hybrid", "kimi_linear", "minimax"):
        if not _installed(model_type):
            continue
        with pytest.raises(kvcache.UnsupportedFeatureError,
                           match=f"the {model_type} model .*keeps state the cache does not hold"
                                 f".*gated DeltaNet layers of qwen3_next only"):
            cache_config(build(model_type))


# ---------------------------------------------------------------------------- the rule
def _rule_inputs(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, n, 2, 16, generator=g) for _ in range(2))
    v = torch.randn(1, n, 4, 16, generator=g)
    decay = -torch.rand(1, n, 4, generator=g)
    beta = torch.rand(1, n, 4, generator=g)
    state = torch.randn(1, 4, 16, 16, generator=g)
    return q, k, v, decay, beta, state


def test_the_rule_is_transformers_rule():
    """The cache's chunked and recurrent forms of the gated delta rule give transformers' own
    outputs and states bit for bit (float32, chunks of 4 and 64, from a state)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    q, k, v, decay, beta, state = _rule_inputs(13)
    for size in (4, 64):
        want, want_state = hf.torch_chunk_gated_delta_rule(
            q, k, v, g=decay, beta=beta, chunk_size=size, initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        got, got_state, _ = states_module._gdn_chunked(q, k, v, decay, beta, state, size)
        assert torch.equal(got, want) and torch.equal(got_state, want_state), size
    one = [t[:, :1] for t in (q, k, v, decay, beta)]
    want, want_state = hf.torch_recurrent_gated_delta_rule(
        *one[:3], g=one[3], beta=one[4], initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    got, got_state = states_module._gdn_step(*one, state)
    assert torch.equal(got, want) and torch.equal(got_state, want_state)


def test_a_checkpoint_inside_a_chunk_is_the_state_a_run_ending_there_reaches():
    """``_gdn_chunked(..., at=...)``: the state after the first ``r`` tokens of a prefill
    chunk (a page boundary inside it: a prefix-cache checkpoint) equals the final state of
    transformers' chunked rule over those ``r`` tokens alone, at rule-chunk starts and inside
    rule chunks."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    q, k, v, decay, beta, state = _rule_inputs(13, seed=1)
    at = (1, 4, 6, 8, 11, 12)
    _, _, inner = states_module._gdn_chunked(q, k, v, decay, beta, state, 4, at)
    for r, got in zip(at, inner):
        _, want = hf.torch_chunk_gated_delta_rule(
            q[:, :r], k[:, :r], v[:, :r], g=decay[:, :r], beta=beta[:, :r], chunk_size=4,
            initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert torch.allclose(got, want[0], atol=1e-6, rtol=1e-6), r
