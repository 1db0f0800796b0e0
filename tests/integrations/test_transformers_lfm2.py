"""LFM2's short convolutions on the cache's state slots (issue 56, docs/hybrid.md "Built:
increment 5"): a small random-weight LFM2 (conv and attention layers) generates greedily
through the Engine (queued requests of different lengths sharing batches, prompts in chunks
of 8 tokens, the host one step ahead or not, preemption, ``n = 3`` forks) and through the
adapter in a loop of one's own, on the reference backend and cuda's CPU mode, token for token
equal to transformers' own ``generate``; and what is refused, by name."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import backend_or_skip, hf_greedy, torch, transformers
from hybrid_cases import (CHUNK, NEW, PAGE, assert_prefix_hits, assert_state_edits_refused,
                          assert_state_slots_wait, assert_warm_prefix_bits, full_conv,
                          once_per_family, shared_prefix_prompts)
from transformers_hybrid_cases import Family, assert_state_layers, engine, family_tests

import kvcache
from kvcache.integrations.transformers import Engine, TransformersAdapter, cache_config, state_kinds

TYPES = ["conv", "full_attention", "conv", "conv", "full_attention"]
SMALL = dict(vocab_size=128, num_hidden_layers=len(TYPES), hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, layer_types=TYPES, conv_L_cache=3,
             pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.15,
             tie_word_embeddings=False, max_position_embeddings=256)


def make_lfm2(model_type: str = "lfm2", seed: int = 0, **overrides):
    """A float32 CPU LFM2-family model with seeded random weights (5 layers: conv, attention,
    conv, conv, attention; hidden 64, a kernel of 3 taps)."""
    kw = dict(SMALL, **overrides)
    if model_type == "lfm2_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  num_dense_layers=1)
    config = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.to(torch.float32).eval()


# (model, prompts, transformers' greedy tokens), once per family (none: lfm2)
_case = once_per_family(make_lfm2, lambda model, prompt: hf_greedy(model, prompt, NEW))
# the tests every transformers hybrid family file runs, under this file's ids. LFM2's own
# detail: one state a layer (the conv's), so no state to forget alone; the decoder-layer test
# is the H200's failure (transformers 5.17): the Engine's memory probe called the conv layers
# without ``kvcache=``, they ran transformers' own convolution and wrote no state
# (``ForwardStateError`` at ``end_forward``), until the adapter named the forward's cache for
# the routed convs of the call too
globals().update(family_tests(Family(
    "lfm2", _case, make_lfm2, cache_layers=5, adapter_chunk=16, layer_modules="conv_layers",
    outside_prompt=0)))


def test_the_conv_layers_are_state_layers():
    kinds = {i: kvcache.State({"conv": (64, 2)}) for i in (0, 2, 3)}
    cfg = assert_state_layers(_case()[0], kinds, (1, 4), (0, 2, 3))
    assert cfg.num_state_slots == 3 and cfg.state_bytes == 3 * 3 * 64 * 2 * 4


def test_lfm2_moe_greedy_equals_generate():
    model, prompts, want = _case("lfm2_moe")
    eng = engine(model)
    assert dict(eng.config.layer_kinds) == state_kinds(model)
    assert eng.generate(prompts, max_new_tokens=NEW) == [[w] for w in want]


def test_what_does_not_compose_is_refused_by_name(tmp_path):
    model, _, _ = _case()
    kw = dict(backend="reference", page_size=PAGE, max_total_tokens=256)
    for bad in ("graphs", "mixed_graphs", "offload", "deterministic"):
        with pytest.raises(kvcache.UnsupportedFeatureError,
                           match=f"{bad}=True with the lfm2 model's state layers"):
            Engine(model, **{**kw, bad: True})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="prefix_file=None"):
        Engine(model, prefix_file=tmp_path / "none.kvp", **kw)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="rope='cache' with the lfm2"):
        Engine(model, rope="cache", **kw)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="no sliding-window layer"):
        Engine(model, window_groups=True, **kw)
    eng = Engine(model, **kw)
    assert eng.state_layers_off is None and eng.window_groups_off is None
    # what the cache refuses for state layers: popn, a fork below the length, exports
    assert_state_edits_refused(eng)


def test_what_is_not_understood_is_refused():
    # a layer type the family's state layers do not know
    other = make_lfm2(seed=1)
    other.config.layer_types = ["conv", "sliding_attention", "conv", "conv", "full_attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 1 .*'sliding_attention'"):
        state_kinds(other)
    # fewer layer types than layers: which layers convolve is not known
    other.config.layer_types = ["conv", "full_attention", "conv"]
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"has 3 layer_types for 5 layers: which layers are short "
                             r"convolutions is not understood"):
        state_kinds(other)
    # a replaced conv module (a subclass computes what it likes)
    model = make_lfm2(seed=1)
    conv = model.model.layers[2].conv
    conv.__class__ = type("Lfm2ShortConv", (type(conv),), {})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layers.2.conv .*not transformers'"):
        Engine(model, backend="reference", max_total_tokens=256)
    # a kernel of one tap keeps no state: not what was read
    with pytest.raises(kvcache.UnsupportedFeatureError, match="kernel of 1 taps"):
        cache_config(make_lfm2(seed=1, conv_L_cache=1))
    # not depthwise: a full convolution over the channels (a conv changed after it was built)
    model = make_lfm2(seed=1)
    assert full_conv(model.model.layers[3].conv, "conv") == 64
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"layers\.3\.conv .*groups=1.*not a depthwise causal convolution "
                             r"over hidden_size=64 channels"):
        cache_config(model)
    # a module whose kernel size is not its conv's
    model = make_lfm2(seed=1)
    model.model.layers[0].conv.conv_kernel_size += 1
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"layers\.0\.conv .*conv_kernel_size=\d+ is not config\.conv_L_cache"):
        cache_config(model)
    # the conv called with a padding mask
    model, prompts, _ = _case()
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=64,
                                              max_batch_size=1), backend="reference")
    cache.add_sequence(0)
    adapter = TransformersAdapter(model)
    with adapter.session(cache), adapter.step_context(cache):
        with pytest.raises(kvcache.UnsupportedFeatureError, match="padding mask"):
            with cache.forward([0], [3]):
                model.model.layers[0].conv(hidden_states=torch.zeros(1, 3, 64),
                                           attention_mask=torch.tensor([[0, 1, 1]]),
                                           kvcache=cache)
    assert cache.sequence_length(0) == 0


def test_state_slots_running_short_wait_rather_than_preempt_forever(monkeypatch):
    """One state slot per batch row (``STATE_SLOTS_PER_ROW = 1``) and ``n = 5`` samples of two
    prompts with 3 rows: the samples' prefixes and samples need more slots than the cache has.
    The scheduler admits no more sequences to a forward than there are free slots (before the
    fix an admission failed, preempted the sequence admitted just before it and the same
    forward was planned again, forever); the tokens are transformers'."""
    model, prompts, want = _case()
    assert_state_slots_wait(lambda **kw: engine(model, **kw), prompts[3:], want[3:],
                            monkeypatch)


# ---------------------------------------------------------------------------- prefix hits
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
    """Requests sharing a 22-token prefix through the Engine's default (prefix cache on): the
    first one's forwards keep the conv states at every page boundary, those inside a prefill
    chunk too (the boundary at 20 lies inside the chunk 16..24: the conv gives it,
    ``set_state_checkpoints``), so the later ones start from 20 cached tokens with the states
    restored; the greedy tokens are transformers' own, within a call and across calls."""
    model, _, _ = _case()
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    prompts = shared_prefix_prompts()
    want = [hf_greedy(model, p, NEW) for p in prompts]
    eng = engine(model, backend=name, device=device)
    # as many checkpoints as slots, one page apart (a conv state is smaller than a page's KV)
    assert eng.config.prefix_cache and eng.config.num_state_checkpoints == 8
    assert eng.config.state_checkpoint_interval == 1
    assert_prefix_hits(eng, prompts, want)
    out = eng.generate(prompts[:2], max_new_tokens=NEW)     # cached across calls
    assert [o[0] for o in out] == want[:2]
    assert eng.stats.prefix_hit_tokens >= 3 * 20 + 2 * 20   # (8 rows: 24 may be gone)
    assert eng.cache.num_available_state_slots == eng.config.num_state_slots


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit_with_state_layers():
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): the warm request restores the conv states of that
    boundary beside the cached pages, and every logits row equals the cold run's bit for
    bit."""
    model, _, _ = _case()
    assert_warm_prefix_bits(lambda: Engine(model, backend="reference", page_size=PAGE,
                                           max_total_tokens=512, prefill_chunk_size=4 * PAGE,
                                           overlap=False))


def test_a_checkpoint_miss_is_counted_and_recomputed():
    """Too few checkpoints for every boundary (the Engine keeps as many as slots: 2 here): a
    request sharing a
    prefix whose boundary lost its checkpoint starts from a shallower one (or none), the stats
    say why ("checkpoint"), and the tokens are still transformers' own."""
    model, _, _ = _case()
    rng = np.random.default_rng(8)
    shared = rng.integers(1, 128, 22).tolist()
    first = shared + rng.integers(1, 128, 3).tolist()
    others = [rng.integers(1, 128, 30).tolist() for _ in range(2)]
    second = shared + rng.integers(1, 128, 4).tolist()
    eng = Engine(model, backend="reference", page_size=PAGE, max_total_tokens=512,
                 prefill_chunk_size=CHUNK, max_batch_size=1)
    eng.cache.clear()
    assert eng.config.num_state_checkpoints == 2
    for p in [first] + others + [second]:
        assert eng.generate([p], max_new_tokens=2)[0][0] == hf_greedy(model, p, 2)
    assert eng.stats.prefix_miss_tokens_by_reason["checkpoint"] > 0


def test_the_engines_checkpoint_interval_follows_the_state_size():
    """``checkpoints_for``: as many checkpoints as slots, and the fewest pages whose attention
    KV takes at least one checkpoint's bytes (LFM2's conv states: one page; a state of a
    Mamba-2 size: many)."""
    from kvcache.integrations.engine import checkpoints_for
    model, _, _ = _case()
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=2)
    small = checkpoints_for(cfg, state_kinds(model), 4)
    assert small == dict(max_state_checkpoints=4, state_checkpoint_interval=1)
    big = {0: kvcache.State({"ssm": (8, 16, 32)}), 2: kvcache.State({"ssm": (8, 16, 32)})}
    page_kv = cfg.token_kv_bytes // cfg.num_layers * (cfg.num_layers - 2) * PAGE
    interval = checkpoints_for(cfg, big, 4)["state_checkpoint_interval"]
    state = 2 * 8 * 16 * 32 * 4
    assert interval > 1 and (interval - 1) * page_kv < state <= interval * page_kv
    assert checkpoints_for(cfg, {}, 4) == {}
