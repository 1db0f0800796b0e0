"""mlx-lm's Mamba-2 (``mamba2``) on the cache (issue 56 item 4, docs/hybrid.md "Built:
increment 13"): a model without attention, every layer a Mamba-2 mixer, so every cache layer is
a state layer and none has pages. A small random-weight mlx-lm Mamba-2 (float32) generates
greedily on the metal backend (MLX's CPU device) through the Engine (queued requests of
different lengths sharing forwards, prompts in chunks of 8 tokens, the host one step ahead or
not, preemption, forks, the prefix cache on: hits through state checkpoints alone) and through
the adapter in a loop of one's own, token for token equal to mlx-lm's own generation with its
own ``ArraysCache``; each state carries; and what is refused, by name. The mixer's path is
Granite-4.0-H's (test_mlx_lm_granite_hybrid.py runs it in CI), so most of this file runs in
``make test-all`` only."""

from __future__ import annotations

import pytest

from mlx_hybrid_cases import (assert_a_replaced_function_refused, assert_another_make_cache_refused,
                              assert_edit_refused, assert_prefix_hits_at_every_page,
                              assert_residual_blocks_refused, family_tests, random_model,
                              slow_except)
from mlx_lm_cases import mlx_greedy
from hybrid_cases import NEW, PAGE, once_per_family

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import (cache_config, route_state_layers, sliding_windows,  # noqa: E402
                                         state_kinds)

# 3 layers, each a Mamba-2 mixer: 4 heads of 16, 2 groups of a state of 16, a conv of 4 taps
# over 64 + 2 * 2 * 16 = 128 channels, its gated norm; an untied head
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
             num_heads=4, head_dim=16, state_size=16, layer_norm_epsilon=1e-5, conv_kernel=4,
             n_groups=2, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
             time_step_limit=(0.0, float("inf")), time_step_rank=4)
KIND = kvcache.State({"conv": (3, 128), "ssm": (4, 16, 16)}, dtype="float32")


def make_mamba2(seed: int = 0, **overrides):
    """A float32 mlx-lm Mamba-2 with seeded random weights (``SMALL``): matrices drawn with
    variance 1 / fan-in and every 1-D parameter (``A_log``, ``D``, ``dt_bias``, norms, biases)
    moved off its initial value, so that every head's step size differs and the greedy tokens
    vary."""
    return random_model("mamba2", "mamba2", dict(SMALL, **overrides), seed)


# (model, prompts, mlx-lm's greedy tokens), built once
_case = once_per_family(make_mamba2, lambda model, prompt: mlx_greedy(model, prompt, NEW))
# the tests every mlx-lm hybrid family file runs, under this file's ids; CI keeps the Engine's
globals().update(slow_except(family_tests(_case, "mamba2", pair=(2, 4), states=("conv", "ssm")),
                             "test_engine_greedy_equals_mlx_lm"))


def test_every_layer_is_a_state_layer_without_pages():
    """Every cache layer is a mixer's state layer (mlx-lm's ArraysCache entries), none has
    pages: the cache's attention shape is a placeholder no layer uses; the routed mixer class
    still runs mlx-lm's own layer with mlx-lm's own cache."""
    model, prompts, want = _case()
    assert state_kinds(model) == {i: KIND for i in range(3)}
    assert sliding_windows(model) == {}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == {i: KIND for i in range(3)} and cfg.full_layers == ()
    assert cfg.kv_bytes == 0 and cfg.dtype == "float32"
    assert route_state_layers(model) == [0, 1, 2]
    assert mlx_greedy(model, prompts[3], NEW) == want[3]


@pytest.mark.slow
def test_shared_prefixes_hit_through_state_checkpoints():
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the
    first request's prefill chunk 16..24 gives the states at 20, so the later ones start from
    20 cached tokens, their states restored (the pages hold nothing: the match is the token
    ids'); warm tokens equal the cold ones and mlx-lm's own."""
    assert_prefix_hits_at_every_page(_case()[0])


def test_what_is_not_understood_is_refused():
    import mlx.nn as nn
    # a replaced mixer, a replaced block, a conv that is not depthwise; another gated norm
    assert_residual_blocks_refused(make_mamba2, "Mamba2Block")
    assert_edit_refused(make_mamba2(seed=2), "layers.0.mixer.norm", nn.RMSNorm(64),
                        "layer 0 .*norm RMSNorm")
    # a mixer that make_cache() gives another cache; the module's SSM function replaced
    assert_another_make_cache_refused(make_mamba2(seed=2))
    assert_a_replaced_function_refused(make_mamba2(seed=2), "ssm_update")
