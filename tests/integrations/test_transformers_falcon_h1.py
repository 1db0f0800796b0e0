"""Falcon-H1's Mamba-2 mixers on the cache's state slots through transformers (issue 56,
docs/hybrid.md "Built: increment 12"): every Falcon-H1 layer runs attention and a Mamba-2
mixer side by side on the same input, so each takes two cache layers (the mixer's state, then
the attention's pages). A small random-weight Falcon-H1 (3 layers, muP multipliers other than
1) generates greedily through the Engine (queued requests of different lengths sharing
batches, prompts in chunks of 8 tokens, the host one step ahead or not, preemption, ``n = 3``
forks, prefix hits) and through the adapter in a loop of one's own, on the reference backend
and cuda's CPU mode, token for token equal to transformers' own ``generate``; with and without
the mixer's gated norm; and what is refused, by name. Most cases are ``slow`` (``make
test-all``): the suite's time budget."""

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

# hidden 64, 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels, SSM chunks of 4; attention 4 query and 2 KV heads of 16 with rotary; the
# muP multipliers (Falcon-H1's own: on the mixer's input and each projected part, the mixer's
# and attention's outputs, the keys, embeddings, MLP and LM head) all other than 1
SMALL = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, intermediate_size=128, mamba_d_ssm=128,
             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2,
             mamba_d_conv=4, mamba_chunk_size=4, pad_token_id=0, bos_token_id=None,
             eos_token_id=None, initializer_range=0.15, max_position_embeddings=256,
             tie_word_embeddings=False, ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.7],
             ssm_in_multiplier=1.3, ssm_out_multiplier=0.9, attention_in_multiplier=1.1,
             attention_out_multiplier=0.8, key_multiplier=1.2, embedding_multiplier=1.5,
             lm_head_multiplier=0.7, mlp_multipliers=[1.2, 0.9])
KIND = kvcache.State({"conv": (192, 3), "ssm": (4, 32, 16)}, dtype="float32")
STATES = (0, 2, 4)              # each layer's mixer; its attention at the next cache layer


def make_falcon_h1(seed: int = 0, **overrides):
    """A float32 CPU Falcon-H1 with seeded random weights (``SMALL``; ``mamba_rms_norm``
    False, the family's default: the mixer's output gated by SiLU alone). The mixers'
    ``dt_bias`` and ``D`` are drawn too."""
    return random_hybrid("falcon_h1", dict(SMALL, **overrides), seed)


# (model, prompts, transformers' greedy tokens), once per gated-norm setting (none: without)
_case = once_per_family(lambda *norm: make_falcon_h1(mamba_rms_norm=bool(norm and norm[0])),
                        lambda model, prompt: hf_greedy(model, prompt, NEW))


def _engine(model, **kw):
    return Engine(model, **{**ENGINE, "backend": "reference", **kw})


def test_each_layer_is_two_cache_layers():
    """Three layers, six cache layers: each layer's mixer state at cache layer 2i, its
    attention's pages at 2i + 1; the module list matches."""
    model, _, _ = _case()
    kinds = state_kinds(model)
    assert kinds == {i: KIND for i in STATES}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert cfg.num_layers == 6 and dict(cfg.layer_kinds) == kinds and cfg.full_layers == (1, 3, 5)
    assert cfg.kv_bytes == cfg.num_pages * PAGE * 3 * 2 * 2 * 16 * 4     # 3 layers of pages
    assert states_module.cache_layers(model) == {0: 0, 1: 2, 2: 4}
    layers = [type(m).__name__ if m is not None else None
              for m in kvcache.integrations.transformers.attention_layers(model)]
    assert layers == [None, "FalconH1Attention"] * 3
    assert route_state_layers(model) == [0, 1, 2]
    assert [i for i, _, _ in stateful_layers(model)] == [0, 1, 2]


@pytest.mark.parametrize("overlap", [True, pytest.param(False, marks=slow)])
@pytest.mark.parametrize("backend", ["reference", pytest.param("cuda", marks=slow)])
def test_engine_greedy_equals_generate(backend, overlap, monkeypatch):
    """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of 8:
    in every layer the mixer runs from its states at cache layer 2i and the attention reads
    its pages at 2i + 1, for prefill chunks and decode tokens of several sequences at once."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    engine = _engine(model, backend=name, device=device, overlap=overlap)
    assert engine.config.num_layers == 6 and engine.config.num_state_slots == 8
    assert engine.config.prefix_cache and not engine.graphs and engine.host_tier is None
    assert_engine_greedy(engine, prompts, want, f"{name}: ")


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_with_the_gated_norm_greedy_equals_generate(backend, monkeypatch):
    """``mamba_rms_norm=True``: the mixer's output through its gated RMS norm (the model's own
    module, its input in the model dtype after a decode step, float32 after a prefill)."""
    model, prompts, want = _case(True)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    assert_engine_greedy(_engine(model, backend=name, device=device), prompts, want, f"{name}: ")


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_adapter_loop_greedy_equals_generate(backend, monkeypatch):
    """The adapter's forward in a loop of one's own (``cache_config(model)``: six cache
    layers): every prompt prefilled in chunks of 8 together, then decoded together."""
    model, prompts, want = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    adapter = TransformersAdapter(model)
    assert adapter.state_layers() == state_kinds(model)
    assert_adapter_loop_greedy(adapter, cache_config, model, prompts, want, f"{name}: ",
                               backend=name, device=device)


@slow
def test_a_prompt_in_uneven_chunks_gives_the_whole_prompts_logits():
    """A 37-token prompt prefilled in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens: every
    position's logits are those of one forward over the whole prompt without a cache, within
    float32 rounding."""
    model, _, _ = _case()
    prompt = np.random.default_rng(1).integers(1, 128, 37)
    with torch.no_grad():
        whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
    got = chunked_logits(model, prompt, (1, 8, 1, 5, 8, 3, 11), PAGE)
    np.testing.assert_allclose(got, whole, atol=2e-5, rtol=0)


@slow
@pytest.mark.parametrize("zeroed", ["conv", "ssm"])
def test_each_state_carries(zeroed, monkeypatch):
    """The same Engine with one of the two states read as zeros at every forward gets the long
    prompts' tokens wrong: both states carry from forward to forward (the attention beside
    them does not make up for them)."""
    _, prompts, want = _case()
    monkeypatch.setattr(states_module, "mamba_forward",
                        forgetting(states_module.mamba_forward, zeroed))
    model = make_falcon_h1(mamba_rms_norm=False)     # routed afresh: calls the patched function
    out = _engine(model).generate(prompts, max_new_tokens=NEW)
    assert [o[0] for o in out][3:] != want[3:]


@slow
def test_preemption_and_forks_recompute_the_state():
    """Four requests in a cache of 48 tokens: the scheduler preempts (state slot and pages
    back, recomputed from fresh states), and ``n = 3`` samples fork at the prompt's end; the
    tokens are transformers'."""
    model, _, _ = _case()
    assert_preemption_and_forks(lambda **kw: _engine(model, **kw),
                                lambda prompt: hf_greedy(model, prompt, NEW))


@slow
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page, SSM
    chunks of 8: the later requests start from 20 cached tokens, every layer's pages and both
    mixer states restored; the greedy tokens are transformers' own."""
    model = make_falcon_h1(seed=2, mamba_chunk_size=8)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    prompts = shared_prefix_prompts()
    want = [hf_greedy(model, p, NEW) for p in prompts]
    engine = _engine(model, backend=name, device=device, state_checkpoint_interval=1)
    assert_prefix_hits(engine, prompts, want)


@slow
def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
    """docs/prefix-caching.md's condition: the warm request restores the boundary's conv and
    SSM states beside the cached pages, and every logits row equals the cold run's bit for
    bit."""
    model, _, _ = _case()
    assert_warm_prefix_bits(lambda: _engine(model, prefill_chunk_size=4 * PAGE, overlap=False,
                                            state_checkpoint_interval=1))


def _refused(model, match):
    assert_refused(lambda m: Engine(m, backend="reference", max_total_tokens=256), cache_config,
                   model, match)


@slow
def test_what_is_not_understood_is_refused():
    model, _, _ = _case()
    kw = assert_state_engine_refusals(model, "falcon_h1")
    assert_state_edits_refused(Engine(model, **kw), fork=False)
    # a replaced mixer (a subclass computes what it likes)
    model = make_falcon_h1(seed=1)
    mixer = model.model.layers[1].mamba
    mixer.__class__ = type("FalconH1Mixer", (type(mixer),), {})
    _refused(model, r"layers\.1\.mamba \(FalconH1Mixer\) is not transformers' FalconH1Mixer")
    # a time-step limit, as Bamba's
    _refused(make_falcon_h1(seed=1, time_step_limit=(0.0, 0.5)),
             r"layers\.0\.mamba \(FalconH1Mixer\): time_step_limit=\(0\.0, 0\.5\)")
    # multipliers not one per projected value, a norm where the forward skips it
    model = make_falcon_h1(seed=1)
    model.model.layers[2].mamba.mup_vector = torch.ones(1, 1, 7)
    _refused(model, r"layers\.2\.mamba .*mup_vector \(1, 1, 7\): not \(1, 1, 324\)")
    model = make_falcon_h1(seed=1)
    model.model.layers[0].mamba.norm = make_falcon_h1(seed=1, mamba_rms_norm=True) \
        .model.layers[0].mamba.norm
    _refused(model, r"norm FalconH1RMSNormGated with mamba_rms_norm=False")
    # the mixer called with a padding mask
    model, _, _ = _case()
    assert_mixer_call_refusals(model, model.model.layers[0].mamba, own_cache=False)
