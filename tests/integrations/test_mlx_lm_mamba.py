"""mlx-lm's Mamba (``mamba``, Mamba-1) on the cache (issue 56 item 4, docs/hybrid.md "Built:
increment 13"): a model without attention, every layer a Mamba-1 mixer (a selective scan token
by token, its state in the model's dtype), so every cache layer is a state layer and none has
pages. A small random-weight mlx-lm Mamba (float32) generates greedily on the metal backend
(MLX's CPU device) through the Engine (queued requests of different lengths sharing forwards,
prompts in chunks of 8 tokens, the host one step ahead or not, preemption, forks, the prefix
cache on) and through the adapter in a loop of one's own, token for token equal to mlx-lm's own
generation with its own ``ArraysCache``; each state carries; prefix hits through state
checkpoints; and what is refused, by name. Most of this file runs in ``make test-all`` only."""

from __future__ import annotations

import pytest

from mlx_hybrid_cases import (assert_another_make_cache_refused, assert_edit_refused,
                              assert_generate_equals_mlx_lm, assert_prefix_hits_at_every_page,
                              assert_residual_blocks_refused, family_tests, random_model,
                              slow_except)
from mlx_lm_cases import mlx_greedy, mx
from hybrid_cases import NEW, PAGE, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import cache_config, route_state_layers, state_kinds  # noqa: E402

# 3 layers, each a Mamba-1 mixer: 128 channels (hidden 64 expanded twice), a state of 16 per
# channel, a conv of 4 taps, a time-step rank of 4; an untied head
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, state_size=16,
             num_hidden_layers=3, conv_kernel=4, use_bias=False, use_conv_bias=True,
             time_step_rank=4, tie_word_embeddings=False)
KIND = kvcache.State({"conv": (3, 128), "ssm": (128, 16)})


def make_mamba(seed: int = 0, model_type: str = "mamba", **overrides):
    """A float32 mlx-lm Mamba (``model_type``: ``"falcon_mamba"``, mlx-lm's same classes with
    ``use_bcdt_rms``) with seeded random weights (``SMALL``): matrices drawn with
    variance 1 / fan-in (``A_log`` too: any real one decays) and every 1-D parameter (``D``,
    norms, biases) moved off its initial value, so that the greedy tokens vary."""
    return random_model("mamba", model_type, dict(SMALL, **overrides), seed)


# (model, prompts, mlx-lm's greedy tokens), built once
_case = once_per_family(make_mamba, lambda model, prompt: mlx_greedy(model, prompt, NEW))
_falcon_mamba = once_per_family(lambda: make_mamba(seed=3, model_type="falcon_mamba"),
                                lambda model, prompt: mlx_greedy(model, prompt, NEW))
# the tests every mlx-lm hybrid family file runs, under this file's ids; CI keeps the Engine's
globals().update(slow_except(family_tests(_case, "mamba", pair=(2, 4), states=("conv", "ssm")),
                             "test_engine_greedy_equals_mlx_lm"))


def test_every_layer_is_a_state_layer_without_pages():
    """Every cache layer is a mixer's state layer (mlx-lm's ArraysCache entries: the conv's
    last inputs, time first, and the scan's state, in the model's dtype), none has pages; the
    routed mixer class still runs mlx-lm's own layer with mlx-lm's own cache."""
    model, prompts, want = _case()
    assert state_kinds(model) == {i: KIND for i in range(3)}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == {i: KIND for i in range(3)} and cfg.full_layers == ()
    assert cfg.kv_bytes == 0 and cfg.dtype == "float32"
    assert route_state_layers(model) == [0, 1, 2]
    assert mlx_greedy(model, prompts[3], NEW) == want[3]


@pytest.mark.slow
def test_falcon_mamba_greedy_equals_mlx_lm():
    """Falcon-Mamba (``falcon_mamba``): mlx-lm's Mamba classes with B, C and the time step
    RMS-normed in ``ssm_step`` (``use_bcdt_rms``): the Engine's tokens are mlx-lm's."""
    model = _falcon_mamba()[0]
    assert model.args.use_bcdt_rms and state_kinds(model) == {i: KIND for i in range(3)}
    assert_generate_equals_mlx_lm(_falcon_mamba())


@pytest.mark.slow
def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the
    first request's prefill chunk 16..24 gives the states at 20, so the later ones start from
    20 cached tokens, their states restored; warm tokens equal the cold ones and mlx-lm's."""
    assert_prefix_hits_at_every_page(_case()[0])


def test_what_is_not_understood_is_refused():
    # a replaced mixer, a replaced block, a conv that is not depthwise; A_log of another shape
    assert_residual_blocks_refused(make_mamba, "MambaBlock")
    assert_edit_refused(make_mamba(seed=2), "layers.0.mixer.A_log", mx.zeros((128,)),
                        r"layer 0 .*A_log \(128,\)")
    # a mixer that make_cache() gives another cache
    assert_another_make_cache_refused(make_mamba(seed=2))
