"""mlx-lm's Falcon-H1 (``falcon_h1``) on the cache (issue 56 item 4, docs/hybrid.md "Built:
increment 13"): every decoder layer runs a Mamba-2 mixer beside attention, and the cache gives
each its own cache slot (the mixer's states in slot ``2 i``, the attention's pages in slot ``2 i
+ 1``). A small random-weight mlx-lm Falcon-H1 (float32) generates greedily on the metal
backend (MLX's CPU device) through the Engine (queued requests of different lengths sharing
forwards, prompts in chunks of 8 tokens, the host one step ahead or not, preemption, forks, the
prefix cache on) and through the adapter in a loop of one's own, token for token equal to
mlx-lm's own generation with its own ``CacheList(ArraysCache, KVCache)`` entries; prefix hits
through state checkpoints inside a prefill chunk; each state carries; and what is refused, by
name. The Mamba-2 mixer's path is Granite-4.0-H's (test_mlx_lm_granite_hybrid.py runs it in
CI), so most of this file runs in ``make test-all`` only."""

from __future__ import annotations

import pytest

from mlx_hybrid_cases import (assert_a_mask_refused, assert_a_replaced_function_refused,
                              assert_a_subclass_refused, assert_another_make_cache_refused,
                              assert_edit_refused, assert_generate_equals_mlx_lm,
                              assert_prefix_hits_at_every_page, assert_state_layers,
                              family_tests, random_model, slow_except)
from mlx_lm_cases import mlx_greedy, mx
from hybrid_cases import NEW, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import Engine, layer_caches, state_kinds  # noqa: E402

# 3 layers, each a Mamba-2 mixer (4 heads of 16, 2 groups of a state of 16, a conv of 4 taps
# over 64 + 2 * 2 * 16 = 128 channels, its gated norm) beside attention (4 query and 2 KV heads
# of 16); tied embeddings, so the head's muP multipliers apply (the others are folded into
# checkpoints' weights by sanitize)
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
             mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
             mamba_d_conv=4, mamba_rms_norm=True, rope_theta=10000.0,
             max_position_embeddings=256, tie_word_embeddings=True)
MIXERS, ATTENTION = (0, 2, 4), (1, 3, 5)
KIND = kvcache.State({"conv": (3, 128), "ssm": (4, 16, 16)}, dtype="float32")


def make_falcon(seed: int = 0, **overrides):
    """A float32 mlx-lm Falcon-H1 with seeded random weights (``SMALL``): matrices drawn with
    variance 1 / fan-in and every 1-D parameter (``A_log``, ``D``, ``dt_bias``, norms, biases)
    moved off its initial value, so that every head's step size differs and the greedy tokens
    vary."""
    return random_model("falcon_h1", "falcon_h1", dict(SMALL, **overrides), seed)


def _make(kind: str = "gated"):
    """The tests' Falcon-H1 (``"gated"``), or one whose mixers gate by SwiGLU without their
    gated norm (``mamba_rms_norm=False``) and whose head is its own (``"swiglu"``)."""
    if kind == "swiglu":
        return make_falcon(seed=1, mamba_rms_norm=False, tie_word_embeddings=False)
    return make_falcon()


_cases = once_per_family(_make, lambda model, prompt: mlx_greedy(model, prompt, NEW))


def _case(kind: str = "gated"):
    """(model, prompts, mlx-lm's greedy tokens), once per kind."""
    return _cases(kind)


# the tests every mlx-lm hybrid family file runs, under this file's ids; CI keeps the Engine's
globals().update(slow_except(family_tests(_case, "falcon_h1", pair=(2, 4),
                                          states=("conv", "ssm")),
                             "test_engine_greedy_equals_mlx_lm"))


def test_each_layer_takes_a_state_slot_and_an_attention_slot():
    """Decoder layer ``i``'s mixer is state layer ``2 i`` (mlx-lm's ArraysCache entries: the
    conv's last inputs, time first, and the SSM state, float32), its attention the paged layer
    ``2 i + 1``; ``layer_caches`` hands the model one (mixer's, attention's) pair per layer, as
    its ``make_cache()`` holds ``CacheList`` pairs."""
    model = _case()[0]
    cfg = assert_state_layers(_case(), {i: KIND for i in MIXERS}, ATTENTION)
    assert cfg.num_layers == 6
    cache = kvcache.PagedKVCache(cfg, backend="metal", device="cpu")
    cache.add_sequence(0)
    with cache.forward([0], [1]):
        caches = layer_caches(model, cache)
        assert [tuple(c.layer for c in pair) for pair in caches] == [(0, 1), (2, 3), (4, 5)]
        model(mx.array([[3]]), cache=caches)


@pytest.mark.slow
def test_the_gate_without_the_gated_norm_greedy_equals_mlx_lm():
    """Mixers without ``mamba_rms_norm`` (the gate is SwiGLU alone, the module's own) and an
    untied head: the Engine's tokens are mlx-lm's."""
    assert_generate_equals_mlx_lm(_case("swiglu"))


@pytest.mark.slow
def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the
    first request's prefill chunk 16..24 gives the mixers' conv and SSM states at 20, so the
    later ones start from 20 cached tokens with the states restored beside the attention's
    pages; warm tokens equal the cold ones and mlx-lm's own."""
    engine = assert_prefix_hits_at_every_page(_case()[0])
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def test_what_is_not_understood_is_refused():
    import mlx.nn as nn
    from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache
    # a replaced mixer, a replaced decoder layer (it decides which cache each module gets)
    assert_a_subclass_refused(make_falcon(seed=2), 1, "mamba", "FalconH1Mixer")
    model = make_falcon(seed=2)
    model.layers[2].__class__ = type("FalconH1DecoderLayer", (type(model.layers[2]),), {})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 2 .*a subclass"):
        Engine(model, backend="metal", device="cpu", max_total_tokens=256)
    # not depthwise: a full convolution over the channels
    assert_edit_refused(make_falcon(seed=2), "layers.2.mamba.conv1d",
                        nn.Conv1d(128, 128, 4, bias=True), "layer 2 .*groups=1")
    # another gated norm
    assert_edit_refused(make_falcon(seed=2), "layers.0.mamba.norm", nn.RMSNorm(64),
                        "layer 0 .*norm RMSNorm")
    # a mixer that make_cache() gives another cache, or a pair of other caches
    assert_another_make_cache_refused(make_falcon(seed=2))
    model = make_falcon(seed=2)
    object.__setattr__(model, "make_cache", lambda: [
        CacheList(ArraysCache(size=2), RotatingKVCache(max_size=8)) for _ in model.layers])
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"gives layer 0 .*CacheList\(ArraysCache, RotatingKVCache\)"):
        state_kinds(model)
    # the module's SSM function replaced: not the one read
    assert_a_replaced_function_refused(make_falcon(seed=2), "ssm_update")
    # the mixer called with a mask array (padding)
    assert_a_mask_refused(_case()[0], "mamba", slot=lambda caches: caches[0][0])
