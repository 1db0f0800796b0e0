"""Nemotron-H's Mamba-2 mixers on the cache's state slots through transformers (issue 56,
docs/hybrid.md "Built: increment 12"): a small random-weight Nemotron-H (blocks of one mixer
each: Mamba-2, attention without rotary, MLP, MoE; the MLP and MoE blocks get no cache layer)
generates greedily through the Engine (queued requests of different lengths sharing batches,
prompts in chunks of 8 tokens, the host one step ahead or not, preemption, ``n = 3`` forks,
prefix hits) and through the adapter in a loop of one's own, on the reference backend and
cuda's CPU mode, token for token equal to transformers' own ``generate``; and what is
refused, by name. Most cases are ``slow`` (``make test-all``): the suite's time budget."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import (assert_mixer_call_refusals, assert_state_engine_refusals, backend_or_skip,
                      chunked_logits, hf_greedy, random_hybrid, torch, transformers)
from hybrid_cases import (ENGINE, NEW, PAGE, assert_adapter_loop_greedy, assert_engine_greedy,
                          assert_preemption_and_forks, assert_prefix_hits, assert_refused,
                          assert_state_edits_refused, assert_warm_prefix_bits, forgetting,
                          once_per_family, shared_prefix_prompts)

import kvcache
from kvcache.integrations.transformers import (Engine, TransformersAdapter, cache_config,
                                               route_state_layers, state_kinds, stateful_layers)
from kvcache.integrations.transformers import states as states_module

slow = pytest.mark.slow

# mixer, attention, MLP, mixer, mixer, MoE, attention, MLP (the pattern "M*-MME*-"): the cache
# has a layer for each mixer and attention block only, in order
BLOCKS = ["linear_attention", "full_attention", "mlp", "linear_attention", "linear_attention",
          "moe", "full_attention", "mlp"]
MIXERS = (0, 3, 4)               # decoder layers
STATES = (0, 2, 3)               # their cache layers; attention at cache layers 1 and 4
# hidden 64, 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels, SSM chunks of 4 (a prefill chunk of 8 spans two); attention 4 query and 2
# KV heads of 16; MoE of 4 experts (2 a token) beside a shared expert
SMALL = dict(vocab_size=128, hidden_size=64, layers_block_type=BLOCKS, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_num_heads=4,
             mamba_head_dim=32, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=4,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             moe_shared_expert_intermediate_size=32, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, initializer_range=0.15, max_position_embeddings=256)
KIND = kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")


def make_nemotron_h(seed: int = 0, **overrides):
    """A float32 CPU Nemotron-H with seeded random weights (``BLOCKS``). The mixers' ``dt_bias``
    and ``D`` are drawn too, so every head's step size and skip differ (``dt_bias`` from
    N(0, 1): the mixers' lower time-step limit, ``time_step_min``, almost never bites)."""
    return random_hybrid("nemotron_h", dict(SMALL, **overrides), seed)


# (model, prompts, transformers' greedy tokens), built once
_case = once_per_family(make_nemotron_h, lambda model, prompt: hf_greedy(model, prompt, NEW))


def _engine(model, **kw):
    return Engine(model, **{**ENGINE, "backend": "reference", **kw})


def test_the_mixer_and_attention_blocks_are_the_cache_layers():
    """Eight blocks, five cache layers: the mixers' states at cache layers 0, 2 and 3, the
    attention pages at 1 and 4; the MLP and MoE blocks hold neither pages nor a state."""
    model, _, _ = _case()
    kinds = state_kinds(model)
    assert kinds == {i: KIND for i in STATES}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert cfg.num_layers == 5 and dict(cfg.layer_kinds) == kinds and cfg.full_layers == (1, 4)
    assert cfg.kv_bytes == cfg.num_pages * PAGE * 2 * 2 * 2 * 16 * 4     # 2 layers of pages
    assert cfg.state_bytes == 3 * 3 * (192 * 3 + 4 * 32 * 16) * 4
    assert states_module.cache_layers(model) == {0: 0, 1: 1, 3: 2, 4: 3, 6: 4}
    # the mixers still run transformers' own forward without the cache
    assert route_state_layers(model) == list(MIXERS)
    assert [i for i, _, _ in stateful_layers(model)] == list(MIXERS)


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=slow)])
@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=slow)])
def test_engine_greedy_equals_generate(backend, overlap, monkeypatch):
    """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of 8:
    prefill chunks and decode tokens of several sequences share forwards, each sequence's conv
    and SSM run from its own states, and the attention layers read their pages at cache layers
    1 and 4 (decoder layers 1 and 6)."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    engine = _engine(model, backend=name, device=device, overlap=overlap)
    assert dict(engine.config.layer_kinds) == state_kinds(model)
    assert engine.config.num_layers == 5 and engine.config.num_state_slots == 8
    assert engine.config.prefix_cache and not engine.graphs and engine.host_tier is None
    assert_engine_greedy(engine, prompts, want, f"{name}: ")


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_adapter_loop_greedy_equals_generate(backend, monkeypatch):
    """The adapter's forward in a loop of one's own (``cache_config(model)``: five cache
    layers, the state layers with them): every prompt prefilled in chunks of 8 together, then
    decoded together."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    adapter = TransformersAdapter(model)
    assert adapter.state_layers() == state_kinds(model)
    assert_adapter_loop_greedy(adapter, cache_config, model, prompts, want, f"{name}: ",
                               backend=name, device=device)


@slow
def test_a_prompt_in_uneven_chunks_gives_the_whole_prompts_logits():
    """A 37-token prompt prefilled in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a new
    sequence's one token, a one-token chunk with a past takes the recurrent step, chunks across
    SSM chunk boundaries): every position's logits are those of one forward over the whole
    prompt without a cache, within float32 rounding."""
    model, _, _ = _case()
    prompt = np.random.default_rng(1).integers(1, 128, 37)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
    got = chunked_logits(model, prompt, (1, 8, 1, 5, 8, 3, 11), PAGE)
    np.testing.assert_allclose(got, whole, atol=2e-5, rtol=0)


@slow
def test_the_time_step_limit_is_applied_as_the_chunked_form_applies_it():
    """Nemotron-H's mixer clamps ``dt`` to ``time_step_min`` in its chunked form (a prefill)
    and not in its recurrent step. With ``time_step_min=0.05`` the clamp bites (a whole forward
    with the limit lifted gives other logits), and a prompt prefilled in chunks of 8, 5, 8, 3
    and 13 (no one-token chunk: each runs the chunked form, as the whole forward does) gives
    the whole forward's logits."""
    model = make_nemotron_h(seed=4, time_step_min=0.05)
    mixers = [m for _, m in states_module.mamba_layers(model).values()]
    assert {m.time_step_limit for m in mixers} == {(0.05, float("inf"))}
    prompt = np.random.default_rng(2).integers(1, 128, 37)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        for m in mixers:
            m.time_step_limit = (0.0, float("inf"))
        loose = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
        for m in mixers:
            m.time_step_limit = (0.05, float("inf"))
    assert np.abs(loose - whole).max() > 1e-3          # the clamp changes the logits
    got = chunked_logits(model, prompt, (8, 5, 8, 3, 13), PAGE)
    np.testing.assert_allclose(got, whole, atol=2e-5, rtol=0)


@slow
@pytest.mark.parametrize("zeroed", ["conv", "ssm"])
def test_each_state_carries(zeroed, monkeypatch):
    """The same Engine with one of the two states read as zeros at every forward (a sequence
    that forgets its conv inputs, or its SSM state) gets the long prompts' tokens wrong: both
    states carry from forward to forward."""
    _, prompts, want = _case()
    monkeypatch.setattr(states_module, "mamba_forward",
                        forgetting(states_module.mamba_forward, zeroed))
    model = make_nemotron_h()     # routed afresh: its wrappers call the patched function
    out = _engine(model).generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out][3:] != want[3:]


@slow
def test_preemption_and_forks_recompute_the_state():
    """Four requests in a cache of 48 tokens: the scheduler preempts (the state slot comes back,
    the preempted request recomputes from fresh states), and ``n = 3`` samples fork at the
    prompt's end (the children's slots take copies of both states); the tokens are
    transformers'."""
    model, _, _ = _case()
    assert_preemption_and_forks(lambda **kw: _engine(model, **kw),
                                lambda prompt: hf_greedy(model, prompt, NEW))


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page
    (``state_checkpoint_interval=1``), SSM chunks of 8: the first request's prefill chunk
    16..24 gives the conv and SSM states at 20 (inside an SSM chunk), so the later requests
    start from 20 cached tokens with both states of every mixer restored; the greedy tokens are
    transformers' own."""
    model = make_nemotron_h(seed=2, chunk_size=8)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    prompts = shared_prefix_prompts()
    want = [hf_greedy(model, p, NEW) for p in prompts]
    engine = _engine(model, backend=name, device=device, state_checkpoint_interval=1)
    assert engine.config.prefix_cache and engine.config.state_checkpoint_interval == 1
    assert_prefix_hits(engine, prompts, want)


@slow
def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): the warm request restores that boundary's conv and
    SSM states beside the cached pages, and every logits row equals the cold run's bit for
    bit."""
    model, _, _ = _case()
    assert_warm_prefix_bits(lambda: _engine(model, prefill_chunk_size=4 * PAGE, overlap=False,
                                            state_checkpoint_interval=1))


@slow
def test_what_does_not_compose_is_refused_by_name():
    model, _, _ = _case()
    kw = assert_state_engine_refusals(model, "nemotron_h")
    engine = Engine(model, **kw)
    assert_state_edits_refused(engine, fork=False)


def _refused(model, match):
    assert_refused(lambda m: Engine(m, backend="reference", max_total_tokens=256), cache_config,
                   model, match)


@slow
def test_what_is_not_understood_is_refused():
    # a replaced mixer (a subclass computes what it likes)
    model = make_nemotron_h(seed=1)
    mixer = model.model.layers[3].mixer
    mixer.__class__ = type("NemotronHMamba2Mixer", (type(mixer),), {})
    _refused(model, r"layers\.3\.mixer \(NemotronHMamba2Mixer\) is not transformers' "
                    r"NemotronHMamba2Mixer")
    # an upper time-step limit (the family's mixer sets none: a changed module)
    model = make_nemotron_h(seed=1)
    model.model.layers[4].mixer.time_step_limit = (0.001, 0.5)
    _refused(model, r"layers\.4\.mixer \(NemotronHMamba2Mixer\): time_step_limit=\(0\.001, "
                    r"0\.5\): the cache serves \(time_step_min >= 0, inf\) only")
    # another activation after the conv
    _refused(make_nemotron_h(seed=1, mamba_hidden_act="gelu"), "activation 'gelu'")
    # a block type the family's reading does not know (a config changed after the build)
    model = make_nemotron_h(seed=1)
    model.config.layers_block_type = BLOCKS[:2] + ["sliding_attention"] + BLOCKS[3:]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 2 .*'sliding_attention'"):
        state_kinds(model)
    # an attention module in a block that holds nothing by its type
    model = make_nemotron_h(seed=1)
    model.model.layers[2].mixer = model.model.layers[1].mixer.__class__(model.config, 2)
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match="layer 2 is a block that holds nothing by its type"):
        TransformersAdapter(model)
    # the mixer called with a padding mask, or with its own cache beside the cache's
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[3].mixer)
