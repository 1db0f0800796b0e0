"""mlx-lm's Granite-4.0-H (``granitemoehybrid``) and Nemotron-H (``nemotron_h``) Mamba-2
mixers on the cache's state slots (issue 56 item 4, docs/hybrid.md "Built: increment 10"): a
small random-weight mlx-lm Granite-4.0-H (mamba and attention layers, float32) generates
greedily on the metal backend (MLX's CPU device) through the Engine (queued requests of
different lengths sharing forwards, prompts in chunks of 8 tokens, the host one step ahead or
not, preemption, forks, the prefix cache on) and through the adapter in a loop of one's own,
token for token equal to mlx-lm's own generation with its own ``ArraysCache``; prefix hits
through state checkpoints inside a prefill chunk; a Nemotron-H (mixers, attention, MLP and
MoE blocks: cache slots that are not decoder layers) the same through the Engine; and what is
refused, by name."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from mlx_hybrid_cases import (assert_layer_caches_loop_greedy, assert_odd_chunks_equal_one_forward,
                              randomize_weights, read_state_as_zeros)
from mlx_lm_cases import metal_cpu_or_skip, mlx_greedy, mx
from conftest import own_loop_greedy

import kvcache  # noqa: E402
from kvcache.integrations import SamplingParams  # noqa: E402
from kvcache.integrations.mlx_lm import (Engine, MlxLmAdapter, cache_config,  # noqa: E402
                                         layer_caches, route_state_layers, sliding_windows,
                                         state_kinds)

PAGE = 4
NEW = 10
CHUNK = 8                       # prompts of 19 and 37 tokens span 3 and 5 chunks
LENGTHS = (1, 2, 5, 19, 37)
TYPES = ["mamba", "attention", "mamba", "mamba", "attention"]
MAMBA = (0, 2, 3)
# hidden 64; 4 SSM heads of 32, 2 groups of a state of 16, a conv of 4 taps over 128 + 2 * 2 *
# 16 = 192 channels; attention of 4 query and 2 KV heads of 16
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=len(TYPES),
             max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=False, embedding_multiplier=1.0, attention_multiplier=0.25,
             logits_scaling=1.0, residual_multiplier=1.0, layer_types=TYPES, rms_norm_eps=1e-5,
             mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16,
             mamba_d_conv=4, mamba_conv_bias=True, mamba_proj_bias=False,
             position_embedding_type="rope", tie_word_embeddings=False)
# Granite-4.0-H's own shape of layer: no rotary (position_embedding_type "nope"), MoE beside a
# shared MLP, multipliers
MOE = dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
           position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
           logits_scaling=4.0, tie_word_embeddings=True)


# Nemotron-H: blocks M (Mamba-2 mixer), * (attention, no rotary), - (MLP), E (MoE); only M and
# * take a cache slot, so the slots are 0 M, 1 *, 2 M, 3 M, 4 *
NEMOTRON = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                max_position_embeddings=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, attention_bias=False, mamba_num_heads=4, mamba_head_dim=32,
                mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
                mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
                hybrid_override_pattern=["M", "*", "-", "M", "M", "E", "*", "-"],
                moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0)


def _randomized(model, seed: int):
    """``model`` with seeded random weights: matrices drawn with variance 1 / fan-in and every
    1-D parameter (``A_log``, ``D``, ``dt_bias``, norms, biases) moved off its initial value,
    so that every head's step size differs and the greedy tokens vary."""
    mx.random.seed(seed)
    return randomize_weights(model)


def make_nemotron(seed: int = 0, **overrides):
    """A float32 mlx-lm Nemotron-H with seeded random weights (``NEMOTRON``'s 8 blocks)."""
    module = importlib.import_module("mlx_lm.models.nemotron_h")
    args = module.ModelArgs.from_dict({"model_type": "nemotron_h",
                                       **dict(NEMOTRON, **overrides)})
    mx.random.seed(seed)
    return _randomized(module.Model(args), seed)


def make_granite(seed: int = 0, **overrides):
    """A float32 mlx-lm Granite-4.0-H with seeded random weights (5 layers: mamba, attention,
    mamba, mamba, attention): matrices drawn with variance 1 / fan-in and every 1-D parameter
    (``A_log``, ``D``, ``dt_bias``, norms, biases) moved off its initial value, so that every
    head's step size differs and the greedy tokens vary."""
    module = importlib.import_module("mlx_lm.models.granitemoehybrid")
    args = module.ModelArgs.from_dict({"model_type": "granitemoehybrid",
                                       **dict(SMALL, **overrides)})
    mx.random.seed(seed)
    return _randomized(module.Model(args), seed)


def _prompts(seed=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 128, n).tolist() for n in LENGTHS]


_CASES: dict = {}


def _case(kind="dense"):
    """(model, prompts, mlx-lm's greedy tokens), once per kind."""
    if kind not in _CASES:
        model = (make_nemotron() if kind == "nemotron_h"
                 else make_granite(**(MOE if kind == "moe" else {})))
        prompts = _prompts()
        _CASES[kind] = (model, prompts, [mlx_greedy(model, p, NEW) for p in prompts])
    return _CASES[kind]


def _engine(model, **kw):
    metal_cpu_or_skip(cache_config(model).head_dim)
    opts = dict(backend="metal", device="cpu", page_size=PAGE, max_total_tokens=512,
                prefill_chunk_size=CHUNK, max_batch_size=4)
    return Engine(model, **{**opts, **kw})


def test_the_mamba_layers_are_state_layers():
    model, prompts, want = _case()
    kinds = state_kinds(model)
    # mlx-lm's ArraysCache entries: the conv's last inputs (batch, d_conv - 1, conv_dim), time
    # first, and the SSM state (batch, heads, head_dim, d_state), float32
    assert kinds == {i: kvcache.State({"conv": (3, 192), "ssm": (4, 32, 16)}, dtype="float32")
                     for i in MAMBA}
    assert sliding_windows(model) == {}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == kinds and cfg.full_layers == (1, 4)
    assert (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert route_state_layers(model) == list(MAMBA)
    # the routed class still runs mlx-lm's own mixer with mlx-lm's own cache
    assert mlx_greedy(model, prompts[3], NEW) == want[3]


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_greedy_equals_mlx_lm(overlap):
    """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of 8:
    prefill chunks and decode tokens of several sequences share forwards, each sequence's
    conv and SSM run from its own states, and the tokens are mlx-lm's own."""
    model, prompts, want = _case()
    engine = _engine(model, overlap=overlap)
    assert dict(engine.config.layer_kinds) == state_kinds(model)
    assert engine.config.prefix_cache and engine.state_layers_off is None
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
    got: dict = {rid: [] for rid in ids}
    shared, mixed = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        shared = max(shared, engine.cache.num_sequences)
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
        mixed += engine.stats.prefill_tokens > 0 and engine.stats.decode_tokens > 0
    for i, rid in enumerate(ids):
        assert got[rid] == want[i], f"prompt {i} ({len(prompts[i])} tokens)"
    assert shared == 4 and mixed
    assert engine.cache.is_empty
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def test_adapter_loop_greedy_equals_mlx_lm():
    """The adapter's forward in a loop of one's own (``cache_config(model)``: the state layers
    come with it): every prompt prefilled in chunks of 8 together, then decoded together."""
    model, prompts, want = _case()
    metal_cpu_or_skip(cache_config(model).head_dim)
    adapter = MlxLmAdapter(model)
    assert adapter.state_layers() == state_kinds(model)
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=512, max_batch_size=len(prompts))
    cache = kvcache.PagedKVCache(cfg, backend="metal", device="cpu")
    out = own_loop_greedy(adapter, cache, prompts, NEW, chunk=CHUNK)
    for i in range(len(prompts)):
        assert out[i][:NEW] == want[i], f"prompt {i}"


def test_layer_caches_loop_greedy_equals_mlx_lm():
    """The model's own call with ``layer_caches`` (no adapter): two prompts prefilled in one
    forward, then decoded together."""
    model, prompts, want = _case()
    assert_layer_caches_loop_greedy(model, prompts, want, (2, 4))


def test_odd_chunks_give_the_logits_of_one_forward():
    """A 37-token prompt in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a one-token chunk with a
    past takes mlx-lm's decode step): every position's logits are those of mlx-lm's forward
    over the whole prompt without a cache, within float32 rounding."""
    model, prompts, _ = _case()
    assert_odd_chunks_equal_one_forward(model, prompts[4])


@pytest.mark.parametrize("zeroed", ["conv", "ssm"])
def test_each_state_carries(zeroed, monkeypatch):
    """The Engine with one of the states read as zeros at every forward gets the long prompts'
    tokens wrong: both states carry from chunk to chunk and step to step."""
    model, prompts, want = _case()
    read_state_as_zeros(monkeypatch, zeroed)
    out = _engine(model).generate(prompts, max_new_tokens=NEW)
    assert out[3][0] != want[3] and out[4][0] != want[4]


def test_preemption_and_forks_recompute_the_state():
    """Four requests in a cache of 48 tokens: the scheduler preempts (the preempted request
    recomputes from fresh states), and ``n = 3`` samples fork at the prompt's end (the child's
    slot takes a copy of both states); the tokens are mlx-lm's."""
    model, _, _ = _case()
    engine = _engine(model, max_total_tokens=48)
    prompts = [list(range(i, i + 18)) for i in range(1, 5)]
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    for i, p in enumerate(prompts):
        assert out[i][0] == mlx_greedy(model, p, NEW), f"prompt {i}"
    small = _engine(model, max_total_tokens=256, max_batch_size=1)
    three = small.generate([prompts[0][:11]], SamplingParams(max_tokens=NEW, n=3))
    assert three[0] == [mlx_greedy(model, prompts[0][:11], NEW)] * 3
    assert small.stats.forks >= 3 and small.cache.is_empty


def test_an_aborted_forward_keeps_the_states():
    """A forward that raises after the model ran (its conv and SSM states staged) is aborted:
    the sequence keeps its states and length, and the prompt's rest sent again, then decoded,
    gives mlx-lm's tokens (states advanced over the aborted tokens would not)."""
    model, prompts, want = _case()
    metal_cpu_or_skip(cache_config(model).head_dim)
    prompt = prompts[4]
    adapter = MlxLmAdapter(model)
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=128,
                                              max_batch_size=1), backend="metal", device="cpu")
    cache.add_sequence(0)

    def forward(tokens, at, fail=False):
        n = len(tokens)
        with adapter.session(cache), adapter.step_context(cache), cache.forward([0], [n]):
            logits = adapter.forward(cache, np.asarray(tokens, np.int64),
                                     np.arange(at, at + n, dtype=np.int64),
                                     np.asarray([n - 1], np.int64))
            if fail:
                raise RuntimeError("the step failed after the model ran")
        return int(adapter.greedy(logits, logprobs=False)[0][0])
    forward(prompt[:20], 0)
    with pytest.raises(RuntimeError, match="after the model ran"):
        forward(prompt[20:28], 20, fail=True)
    assert cache.sequence_length(0) == 20
    out = [forward(prompt[20:], 20)]
    while len(out) < NEW:
        out.append(forward(out[-1:], len(prompt) + len(out) - 1))
    assert out == want[4]


def test_granite_moe_without_rope_greedy_equals_mlx_lm():
    """Granite-4.0-H's own layer shape: no rotary, MoE experts beside a shared MLP, the
    embedding / residual / logits multipliers, tied embeddings."""
    model, prompts, want = _case("moe")
    engine = _engine(model)
    assert dict(engine.config.layer_kinds) == state_kinds(model)
    assert engine.generate(prompts, max_new_tokens=NEW) == [[w] for w in want]


def test_nemotron_h_greedy_equals_mlx_lm():
    """Nemotron-H: the same mixer code, its gated norm per group; MLP and MoE blocks take no
    cache slot, so the state layers are cache slots 0, 2 and 3 (decoder layers 0, 3 and 4)
    and the attention slots 1 and 4 (layers 1 and 6)."""
    model, prompts, want = _case("nemotron_h")
    kinds = state_kinds(model)
    assert kinds == {i: kvcache.State({"conv": (3, 192), "ssm": (4, 32, 16)}, dtype="float32")
                     for i in (0, 2, 3)}
    assert route_state_layers(model) == [0, 2, 3]
    engine = _engine(model)
    assert engine.config.num_layers == 5 and engine.config.full_layers == (1, 4)
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
    got: dict = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    assert [got[rid] for rid in ids] == want
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def test_nemotron_h_blocks_not_read_are_refused():
    model = make_nemotron(seed=1)
    model.args.hybrid_override_pattern = ["M", "*", "-", "M", "M", "E", "*", "X"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 7 .*'X'"):
        state_kinds(model)
    model = make_nemotron(seed=1)
    mixer = model.layers[3].mixer
    mixer.__class__ = type("NemotronHMamba2Mixer", (type(mixer),), {})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 3 .*a subclass"):
        state_kinds(model)
    model = make_nemotron(seed=1)
    model.layers[4].mixer.norm = importlib.import_module(
        "mlx_lm.models.granitemoehybrid").GraniteMoeHybridRMSNormGated(128)
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match="layer 4 .*norm GraniteMoeHybridRMSNormGated"):
        state_kinds(model)


def _shared_prefix_case(kind="dense"):
    model, _, _ = _case(kind)
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 128, 22).tolist()
    prompts = [shared + rng.integers(1, 128, n).tolist() for n in (5, 9, 2, 13)]
    return model, prompts, [mlx_greedy(model, p, NEW) for p in prompts]


@pytest.mark.parametrize("kind", ["dense", "nemotron_h"])
def test_shared_prefixes_hit_through_state_checkpoints(kind):
    """Requests sharing a 22-token prefix through the Engine, checkpoints every page: the first
    request's prefill chunk 16..24 gives the conv and SSM states at 20 (inside the chunk: the
    mixer splits its SSM call there), so the later ones start from 20 cached tokens with both
    states restored; warm tokens equal the cold ones and mlx-lm's own (Granite-4.0-H and
    Nemotron-H)."""
    model, prompts, want = _shared_prefix_case(kind)
    engine = _engine(model, state_checkpoint_interval=1)
    assert engine.config.prefix_cache and engine.config.state_checkpoint_interval == 1
    cold = engine.generate(prompts[:1], max_new_tokens=NEW)
    assert cold == [[want[0]]] and engine.stats.prefix_hit_tokens == 0
    warm = engine.generate(prompts[1:], max_new_tokens=NEW)
    assert [o[0] for o in warm] == want[1:]
    assert engine.stats.prefix_hit_tokens == 3 * 20
    assert engine.stats.prefix_miss_tokens_by_reason == {}
    # the first prompt again, warm (its deeper checkpoints may have gone to the later
    # requests: 8 rows): the cold run's tokens
    again = engine.generate(prompts[:1], max_new_tokens=NEW)
    assert again == cold and engine.stats.prefix_hit_tokens >= 3 * 20 + 20
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots
    # the engine's own interval for these states: a checkpoint costs more than a page's KV
    assert _engine(model).config.state_checkpoint_interval > 1


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): the warm request restores that boundary's conv and
    SSM states beside the cached pages, and every logits row equals the cold run's bit for
    bit."""
    from engine_cases import logit_rows
    model, _, _ = _case()
    rng = np.random.default_rng(3)
    system = rng.integers(1, 128, 4 * PAGE).tolist()
    question, other = rng.integers(1, 128, 7).tolist(), rng.integers(1, 128, 9).tolist()
    kw = dict(prefill_chunk_size=4 * PAGE, overlap=False, state_checkpoint_interval=1)
    cold = _engine(model, **kw)
    cold_rows = logit_rows(cold)
    want = cold.generate([system + question], max_new_tokens=6)
    assert cold.stats.prefix_hit_tokens == 0
    warm = _engine(model, **kw)
    warm.generate([system + other], max_new_tokens=3)
    warm_rows = logit_rows(warm)
    got = warm.generate([system + question], max_new_tokens=6)
    assert warm.stats.prefix_hit_tokens == 4 * PAGE
    assert got == want == [[mlx_greedy(model, system + question, 6)]]
    assert len(warm_rows) == len(cold_rows) == 6
    for step, (a, b) in enumerate(zip(cold_rows, warm_rows)):
        assert np.array_equal(a, b), f"step {step}: max |diff| {np.abs(a - b).max()}"


def test_without_inner_checkpoints_the_hits_stop_at_chunk_ends(monkeypatch):
    """The control of the test above: with the mixer's states inside a prefill chunk not given
    (``state_checkpoints()`` read as none), the boundary at 20 holds no checkpoint and the
    later requests hit at 16, a chunk's end, only; the tokens stay mlx-lm's."""
    model, prompts, want = _shared_prefix_case()
    engine = _engine(model, state_checkpoint_interval=1)
    monkeypatch.setattr(type(engine.cache), "state_checkpoints", lambda self: ())
    assert engine.generate(prompts[:1], max_new_tokens=NEW) == [[want[0]]]
    out = engine.generate(prompts[1:], max_new_tokens=NEW)
    assert [o[0] for o in out] == want[1:]
    assert engine.stats.prefix_hit_tokens == 3 * 16


def test_what_does_not_compose_is_refused_by_name():
    model, _, _ = _case()
    for bad in ("offload", "deterministic"):
        with pytest.raises(kvcache.UnsupportedFeatureError,
                           match=f"{bad}=True with the granitemoehybrid model's state layers"):
            _engine(model, **{bad: True})
    engine = _engine(model, max_total_tokens=256)
    cache, adapter = engine.cache, engine.adapter
    cache.add_sequence(0)
    with adapter.session(cache), adapter.step_context(cache), cache.forward([0], [5]):
        adapter.forward(cache, np.arange(1, 6, dtype=np.int64), np.arange(5, dtype=np.int64),
                        np.asarray([4], np.int64))
    with pytest.raises(kvcache.UnsupportedFeatureError, match="checkpoint"):
        cache.popn(0, 1)
    with pytest.raises(kvcache.UnsupportedFeatureError):
        cache.fork_sequence(0, 1, 3)
    assert cache.sequence_length(0) == 5


def test_what_is_not_understood_is_refused(monkeypatch):
    import mlx.nn as nn
    module = importlib.import_module("mlx_lm.models.granitemoehybrid")
    # a layer type the family's state layers do not know
    other = make_granite(seed=1)
    other.args.layer_types = ["mamba", "attention", "mamba", "hybrid", "attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 3 .*'hybrid'"):
        state_kinds(other)
    # a replaced mixer (a subclass computes what it likes)
    model = make_granite(seed=1)
    mixer = model.layers[2].mamba
    mixer.__class__ = type("GraniteMoeHybridMamba2Mixer", (type(mixer),), {})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 2 .*a subclass"):
        Engine(model, backend="metal", device="cpu", max_total_tokens=256)
    # not depthwise: a full convolution over the channels
    model = make_granite(seed=1)
    model.layers[3].mamba.conv1d = nn.Conv1d(192, 192, 4, bias=True)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 3 .*groups=1"):
        state_kinds(model)
    # a time-step limit that is not (low, high)
    model = make_granite(seed=1)
    model.layers[0].mamba.time_step_limit = (0.0,)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 0 .*time_step_limit"):
        cache_config(model)
    # another gated norm
    model = make_granite(seed=1)
    model.layers[0].mamba.norm = nn.RMSNorm(128)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 0 .*norm RMSNorm"):
        state_kinds(model)
    # groups that do not divide the heads
    with pytest.raises(kvcache.UnsupportedFeatureError, match="n_groups=3"):
        state_kinds(make_granite(seed=1, mamba_n_heads=4, mamba_n_groups=3))
    # a mamba layer that make_cache() gives another cache
    model = make_granite(seed=1)
    from mlx_lm.models.cache import KVCache
    object.__setattr__(model, "make_cache", lambda: [KVCache() for _ in model.layers])
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"make_cache\(\) gives layer 0 .*a KVCache"):
        state_kinds(model)
    # the module's SSM function replaced: not the one read
    model = make_granite(seed=1)
    monkeypatch.setattr(module, "ssm_update", lambda *a, **k: None)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="ssm_update"):
        state_kinds(model)
    monkeypatch.undo()
    # the mixer called with a mask array (padding)
    model, _, _ = _case()
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=64,
                                              max_batch_size=1), backend="metal", device="cpu")
    cache.add_sequence(0)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="mask"):
        with cache.forward([0], [3]):
            caches = layer_caches(model, cache)
            model.layers[0].mamba(mx.zeros((3, 1, 64)), mask=mx.ones((3, 1), mx.bool_),
                                  cache=caches[0])
    assert cache.sequence_length(0) == 0
