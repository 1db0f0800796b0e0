"""The Mamba-2 mixers of Bamba and Granite-4.0-H (``granitemoehybrid``) on the cache's state
slots (issue 56, docs/hybrid.md "Built: increment 7"): a small random-weight Bamba (mamba and
attention layers, SSM chunks of 4 tokens) generates greedily through the Engine (queued
requests of different lengths sharing batches, prompts in chunks of 8 tokens, the host one
step ahead or not, preemption, ``n = 3`` forks) and through the adapter in a loop of one's
own, on the reference backend and cuda's CPU mode, token for token equal to transformers' own
``generate``; a Granite-4.0-H the same through the Engine; and what is refused, by name."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (assert_mixer_call_refusals, assert_state_engine_refusals, backend_or_skip,
                      chunked_logits, hf_greedy, random_hybrid, torch, transformers)
from hybrid_cases import (ENGINE, NEW, PAGE, KeywordDropped, assert_adapter_loop_greedy,
                          assert_engine_greedy, assert_preemption_and_forks, assert_prefix_hits,
                          assert_refused, assert_state_edits_refused, assert_warm_prefix_bits,
                          forgetting, full_conv, once_per_family, shared_prefix_prompts)

import kvcache
from kvcache.integrations.transformers import (Engine, TransformersAdapter, cache_config,
                                               route_state_layers, state_kinds, stateful_layers)
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


def make_bamba(model_type: str = "bamba", seed: int = 0, **overrides):
    """A float32 CPU Bamba-family model with seeded random weights (5 layers: mamba,
    attention, mamba, mamba, attention). The mixers' ``dt_bias`` and ``D`` (initialized to
    ones) are drawn too, so every head's step size and skip differ."""
    return random_hybrid(model_type, dict(SMALL, **FAMILY[model_type], **overrides), seed)


# (model, prompts, transformers' greedy tokens), once per family (none: bamba)
_case = once_per_family(make_bamba, lambda model, prompt: hf_greedy(model, prompt, NEW))


def _engine(model, **kw):
    return Engine(model, **{**ENGINE, "backend": "reference", **kw})


def test_the_mamba_layers_are_state_layers():
    model, _, _ = _case()
    kinds = state_kinds(model)
    # the SSM state in float32 (the model keeps it so under a 16-bit model)
    assert kinds == {i: kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")
                     for i in MAMBA}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == kinds and cfg.full_layers == (1, 4)
    assert cfg.num_state_slots == 3
    assert cfg.state_bytes == 3 * 3 * (192 * 3 + 4 * 32 * 16) * 4
    # the mixers still run transformers' own forward without the cache
    assert route_state_layers(model) == list(MAMBA)
    assert [i for i, _, _ in stateful_layers(model)] == list(MAMBA)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_engine_greedy_equals_generate(backend, overlap, monkeypatch):
    """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of 8:
    prefill chunks and decode tokens of several sequences share forwards, and each sequence's
    conv and SSM run from its own states (the 37-token prompt: 5 chunks, 10 SSM chunks)."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    engine = _engine(model, backend=name, device=device, overlap=overlap)
    assert dict(engine.config.layer_kinds) == state_kinds(model)
    assert engine.config.num_state_slots == 8          # 2 * max_batch_size
    # the prefix cache stays on (state checkpoints); nothing else was on here
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


def test_a_prompt_in_uneven_chunks_gives_the_whole_prompts_logits():
    """A 37-token prompt prefilled in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a new
    sequence's one token, one-token chunks that take the recurrent step, chunks across SSM
    chunk boundaries): every position's logits are those of one forward over the whole prompt
    without a cache, within float32 rounding."""
    model, _, _ = _case()
    prompt = np.random.default_rng(1).integers(1, 128, 37)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
    got = chunked_logits(model, prompt, (1, 8, 1, 5, 8, 3, 11), PAGE)
    np.testing.assert_allclose(got, whole, atol=2e-5, rtol=0)


@pytest.mark.parametrize("zeroed", ["conv", "ssm"])
def test_each_state_carries(zeroed, monkeypatch):
    """The same Engine with one of the two states read as zeros at every forward (a sequence
    that forgets its conv inputs, or its SSM state) gets the long prompts' tokens wrong: both
    states carry from forward to forward."""
    model, prompts, want = _case()
    monkeypatch.setattr(states_module, "mamba_forward",
                        forgetting(states_module.mamba_forward, zeroed))
    model = make_bamba()          # routed afresh: its wrappers call the patched function
    engine = _engine(model)
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out][3:] != want[3:]


def test_preemption_and_forks_recompute_the_state():
    """Four requests in a cache of 48 tokens: the scheduler preempts (the state slot comes back,
    the preempted request recomputes from fresh states), and ``n = 3`` samples fork at the
    prompt's end (the children's slots take copies of both states); the tokens are
    transformers'."""
    model, _, _ = _case()
    assert_preemption_and_forks(lambda **kw: _engine(model, **kw),
                                lambda prompt: hf_greedy(model, prompt, NEW))


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_granitemoehybrid_greedy_equals_generate(backend, monkeypatch):
    """Granite-4.0-H's mixer is Bamba's code: the same layers (its config names them mamba /
    attention), no rotary, residual multipliers; through the Engine as above."""
    model, prompts, want = _case("granitemoehybrid")
    assert state_kinds(model) == {i: kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)},
                                                   dtype="float32") for i in MAMBA}
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    engine = _engine(model, backend=name, device=device)
    assert engine.generate(prompts, max_new_tokens=NEW) == [[w] for w in want]
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def test_a_decoder_layer_that_does_not_pass_the_cache_down_still_reaches_the_states():
    """Each mixer loses ``kvcache=`` on its way in (as a release whose decoder layer does not
    pass its keywords down): the adapter's ``serving`` still routes it; outside the Engine the
    mixer is transformers' own again."""
    model, prompts, greedy = _case()
    with KeywordDropped(m for _, m in states_module.mamba_layers(model).values()):
        out = _engine(model, max_batch_size=3).generate(prompts, max_new_tokens=NEW)
        assert [o[0] for o in out] == greedy
    assert hf_greedy(model, prompts[2], NEW) == greedy[2]


def test_what_does_not_compose_is_refused_by_name():
    model, _, _ = _case()
    kw = assert_state_engine_refusals(model, "bamba")
    with pytest.raises(kvcache.UnsupportedFeatureError, match="rope='cache' with the bamba"):
        Engine(model, rope="cache", **kw)
    engine = Engine(model, **kw)
    assert_state_edits_refused(engine, fork=False)


def _refused(model, match):
    assert_refused(lambda m: Engine(m, backend="reference", max_total_tokens=256), cache_config,
                   model, match)


def test_what_is_not_understood_is_refused():
    # a replaced mixer (a subclass computes what it likes)
    model = make_bamba(seed=1)
    mixer = model.model.layers[2].mamba
    mixer.__class__ = type("BambaMixer", (type(mixer),), {})
    _refused(model, r"layers\.2\.mamba \(BambaMixer\) is not transformers' BambaMixer")
    # a time-step limit: transformers clamps dt in its chunked form only
    _refused(make_bamba(seed=1, time_step_limit=(0.0, 0.5)),
             r"layers\.0\.mamba \(BambaMixer\): time_step_limit=\(0\.0, 0\.5\)")
    # another activation after the conv
    _refused(make_bamba(seed=1, hidden_act="gelu"), "activation 'gelu'")
    # groups that do not match the conv (a mixer changed after it was built)
    model = make_bamba(seed=1)
    model.model.layers[3].mamba.n_groups = 1
    _refused(model, r"layers\.3\.mamba .*conv_dim=192 is not intermediate_size \+ 2 \* n_groups")
    # not depthwise: a full convolution over the channels (a conv changed after it was built)
    model = make_bamba(seed=1)
    channels = full_conv(model.model.layers[0].mamba, "conv1d")
    _refused(model, r"layers\.0\.mamba .*groups=1.*not a depthwise causal convolution over "
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


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page
    (``state_checkpoint_interval=1``), SSM chunks of 8: the first request's prefill chunk
    16..24 gives the conv and SSM states at 20 (inside an SSM chunk), so the later requests
    start from 20 cached tokens with both states restored; the greedy tokens are
    transformers' own."""
    model = make_bamba(seed=2, mamba_chunk_size=8)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    prompts = shared_prefix_prompts()
    want = [hf_greedy(model, p, NEW) for p in prompts]
    engine = _engine(model, backend=name, device=device, state_checkpoint_interval=1)
    assert engine.config.prefix_cache and engine.config.state_checkpoint_interval == 1
    assert_prefix_hits(engine, prompts, want)
    # the engine's own interval for these states: a checkpoint costs more than a page's KV
    assert _engine(model).config.state_checkpoint_interval > 1


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): the warm request restores that boundary's conv and
    SSM states beside the cached pages, and every logits row equals the cold run's bit for
    bit."""
    model, _, _ = _case()
    assert_warm_prefix_bits(lambda: _engine(model, prefill_chunk_size=4 * PAGE, overlap=False,
                                            state_checkpoint_interval=1))
