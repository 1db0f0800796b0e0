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

import numpy as np
import pytest

from conftest import (assert_mixer_call_refusals, assert_state_engine_refusals, backend_or_skip,
                      chunked_logits, hf_greedy, random_hybrid, torch, transformers)
from hybrid_cases import (ENGINE, NEW, PAGE, KeywordDropped, assert_adapter_loop_greedy,
                          assert_engine_greedy, assert_preemption_and_forks, assert_prefix_hits,
                          assert_refused, assert_state_edits_refused, forgetting, full_conv,
                          once_per_family, prompts as _prompts, shared_prefix_prompts)

import kvcache
from kvcache.integrations.transformers import (Engine, TransformersAdapter, cache_config,
                                               route_state_layers, state_kinds, stateful_layers)
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


def _engine(model, **kw):
    return Engine(model, **{**ENGINE, "backend": "reference", **kw})


def test_the_linear_attention_layers_are_state_layers():
    model, _, _ = _case()
    kinds = state_kinds(model)
    assert kinds == {i: kvcache.State({"conv": (128, 3), "recurrent": (4, 16, 16)},
                                      dtype="float32")
                     for i in LINEAR}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == kinds and cfg.full_layers == (1,)
    assert cfg.num_state_slots == 3
    assert cfg.state_bytes == 3 * 3 * (128 * 3 + 4 * 16 * 16) * 4
    # the layers still run transformers' own forward without the cache
    assert route_state_layers(model) == list(LINEAR)
    assert [i for i, _, _ in stateful_layers(model)] == list(LINEAR)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_engine_greedy_equals_generate(backend, overlap, monkeypatch):
    """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of 8:
    prefill chunks and decode tokens of several sequences share forwards, and each sequence's
    conv and delta rule run from its own states (the 37-token prompt: 5 chunks)."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    engine = _engine(model, backend=name, device=device, overlap=overlap)
    assert dict(engine.config.layer_kinds) == state_kinds(model)
    assert engine.config.num_state_slots == 8          # 2 * max_batch_size
    assert engine.config.prefix_cache and not engine.graphs and engine.host_tier is None
    assert engine.state_layers_off is None
    assert_engine_greedy(engine, prompts, want, f"{name}: ")


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_adapter_loop_greedy_equals_generate(backend, monkeypatch):
    """The adapter's forward in a loop of one's own (``cache_config(model)``: the state layers
    come with it): every prompt prefilled in chunks of 8 together, then decoded together."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    adapter = TransformersAdapter(model)
    assert adapter.state_layers() == state_kinds(model)
    assert_adapter_loop_greedy(adapter, cache_config, model, prompts, want, f"{name}: ",
                               backend=name, device=device)


def test_as_many_key_heads_as_value_heads():
    """Key heads that are not repeated over value heads (4 of each): the same tokens as
    ``generate`` through the Engine."""
    model = make_qwen3_next(seed=4, linear_num_key_heads=4)
    assert state_kinds(model)[0] == kvcache.State({"conv": (192, 3), "recurrent": (4, 16, 16)},
                                                  dtype="float32")
    prompts = _prompts(9)[2:]
    out = _engine(model).generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out] == [hf_greedy(model, p, NEW) for p in prompts]


def test_a_prompt_in_uneven_chunks_gives_the_whole_prompts_logits():
    """A 37-token prompt prefilled in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a new
    sequence's one token, one-token chunks that take the recurrent form, chunks continuing
    from a state): every position's logits are those of transformers' own run in the same
    chunks (its cache), within 2e-5 (1.1e-5 seen), and those of one forward over the whole
    prompt without a cache within 6e-5: the chunked rule rounds differently from chunk to
    chunk (transformers' own chunked run is 4.1e-5 off its whole-prompt forward here)."""
    model, _, _ = _case()
    prompt = np.random.default_rng(1).integers(1, 128, 37)
    chunks = (1, 8, 1, 5, 8, 3, 11)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        own = transformers.DynamicCache(config=model.config)
        theirs, at = [], 0
        for n in chunks:
            theirs.append(model(torch.from_numpy(prompt[at:at + n])[None], cache=own,
                                use_cache=True, position_ids=torch.arange(at, at + n)[None]
                                ).logits[0].numpy())
            at += n
    got = chunked_logits(model, prompt, chunks, PAGE)
    np.testing.assert_allclose(got, np.concatenate(theirs), atol=2e-5, rtol=0)
    np.testing.assert_allclose(got, whole, atol=6e-5, rtol=0)


@pytest.mark.parametrize("zeroed", ["conv", "recurrent"])
def test_each_state_carries(zeroed, monkeypatch):
    """The same Engine with one of the two states read as zeros at every forward (a sequence
    that forgets its conv inputs, or its recurrent state) gets the long prompts' tokens wrong:
    both states carry from forward to forward."""
    model, prompts, want = _case()
    monkeypatch.setattr(states_module, "gdn_forward",
                        forgetting(states_module.gdn_forward, zeroed))
    model = make_qwen3_next()     # routed afresh: its wrappers call the patched function
    engine = _engine(model)
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out][3:] != want[3:]
    assert all(o[0] != w for o, w in zip(out[3:], want[3:]))


def test_preemption_and_forks_recompute_the_state():
    """Four requests in a cache of 48 tokens: the scheduler preempts (the state slot comes back,
    the preempted request recomputes from fresh states), and ``n = 3`` samples fork at the
    prompt's end (the children's slots take copies of both states); the tokens are
    transformers'."""
    model, _, _ = _case()
    assert_preemption_and_forks(lambda **kw: _engine(model, **kw),
                                lambda prompt: hf_greedy(model, prompt, NEW))


def test_a_decoder_layer_that_does_not_pass_the_cache_down_still_reaches_the_states():
    """Each gated DeltaNet loses ``kvcache=`` on its way in (as a release whose decoder layer
    does not pass its keywords down): the adapter's ``serving`` still routes it; outside the
    Engine the layer is transformers' own again."""
    model, prompts, greedy = _case()
    with KeywordDropped(m for _, m in states_module.gdn_layers(model).values()):
        out = _engine(model, max_batch_size=3).generate(prompts, max_new_tokens=NEW)
        assert [o[0] for o in out] == greedy
    assert hf_greedy(model, prompts[2], NEW) == greedy[2]


def test_what_does_not_compose_is_refused_by_name():
    model, _, _ = _case()
    kw = assert_state_engine_refusals(model, "qwen3_next")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="rope='cache' with the qwen3_next"):
        Engine(model, rope="cache", **kw)
    engine = Engine(model, **kw)
    assert_state_edits_refused(engine, fork=False)


def _refused(model, match):
    assert_refused(lambda m: Engine(m, backend="reference", max_total_tokens=256), cache_config,
                   model, match)


def test_what_is_not_understood_is_refused(monkeypatch):
    # a replaced layer (a subclass computes what it likes)
    model = make_qwen3_next(seed=1)
    gdn = model.model.layers[2].linear_attn
    gdn.__class__ = type("Qwen3NextGatedDeltaNet", (type(gdn),), {})
    _refused(model, r"layers\.2\.linear_attn \(Qwen3NextGatedDeltaNet\) is not transformers' "
                    r"Qwen3NextGatedDeltaNet")
    # heads that do not match the conv (a layer changed after it was built)
    model = make_qwen3_next(seed=1)
    model.model.layers[3].linear_attn.value_dim = 32
    _refused(model, r"layers\.3\.linear_attn .*value_dim=32")
    # an activation transformers does not name
    model = make_qwen3_next(seed=1)
    model.model.layers[0].linear_attn.activation = "made_up"
    _refused(model, r"layers\.0\.linear_attn .*activation 'made_up'")
    # a chunk length of the chunked rule other than the one read
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    def other(query, key, value, g, beta, chunk_size=32, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        """(a stand-in signature)"""
    with monkeypatch.context() as patch:
        patch.setattr(hf, "torch_chunk_gated_delta_rule", other)
        _refused(make_qwen3_next(seed=1), "chunks of 32 tokens")
    # not depthwise: a full convolution over the channels (a conv changed after it was built)
    model = make_qwen3_next(seed=1)
    channels = full_conv(model.model.layers[0].linear_attn, "conv1d")
    _refused(model, r"layers\.0\.linear_attn .*groups=1.*not a depthwise causal convolution over "
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


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page
    (``state_checkpoint_interval=1``): the first request's prefill chunk 16..24 gives the conv
    and recurrent states at 20 (inside the chunk), so the later requests start from 20 cached
    tokens with both states restored; the greedy tokens are transformers' own."""
    model = make_qwen3_next(seed=2)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    prompts = shared_prefix_prompts()
    want = [hf_greedy(model, p, NEW) for p in prompts]
    engine = _engine(model, backend=name, device=device, state_checkpoint_interval=1)
    assert engine.config.prefix_cache and engine.config.state_checkpoint_interval == 1
    assert_prefix_hits(engine, prompts, want)
