"""What the mlx-lm hybrid-family tests share (LFM2, Granite-4.0-H / Nemotron-H, Qwen3-Next):
the test bodies that need mlx (``hybrid_cases`` stays neutral to the model library). The tests
every family file runs are written once, in ``family_tests``, and taken into each file's
namespace (the same ids); the bodies the files' own tests share take the family's model (or
its ``case``: model, prompts, mlx-lm's greedy tokens) and what is the family's own: the state
layers found, prefix hits through state checkpoints, and what is refused (an edited model, a
replaced function or class, another cache, a mask). Imports at module top level only (in a
whole run `conftest` is another dir's later)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from mlx_lm_cases import metal_cpu_or_skip, mlx_greedy, mlx_logits, mx
from engine_cases import assert_warm_prefix_equals_cold
from hybrid_cases import (ENGINE, NEW, PAGE, assert_adapter_loop_greedy, assert_engine_greedy,
                          assert_preemption_and_forks, assert_prefix_hits,
                          assert_state_edits_refused, shared_prefix_prompts)

import kvcache  # noqa: E402
from kvcache.integrations.mlx_lm import (Engine, MlxLmAdapter, cache_config,  # noqa: E402
                                         layer_caches, route_state_layers, sliding_windows,
                                         state_kinds)
from kvcache.integrations.mlx_lm import states as states_module  # noqa: E402


def engine(model, **options):
    """An Engine of ``model`` on the metal backend (MLX's CPU device), ``options`` over the
    tests' ``ENGINE``; skips where the backend lacks the model's head_dim."""
    metal_cpu_or_skip(cache_config(model).head_dim)
    return Engine(model, **{**ENGINE, "backend": "metal", "device": "cpu", **options})


def assert_state_layers(case, kinds: dict, full_layers: tuple, routed: int = 3):
    """``case``'s model has the state layers ``kinds`` (and no sliding window), its cache
    config those beside the attention layers ``full_layers`` of 4 query and 2 KV heads of 16;
    the layers routed are the state layers, and the routed class still runs mlx-lm's own
    layer with mlx-lm's own cache (prompt ``routed``'s tokens are mlx-lm's). Returns the
    config (3 rows)."""
    model, prompts, want = case
    assert state_kinds(model) == kinds
    assert sliding_windows(model) == {}
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == kinds and cfg.full_layers == full_layers
    assert (cfg.num_qo_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert route_state_layers(model) == sorted(kinds)
    assert mlx_greedy(model, prompts[routed], NEW) == want[routed]
    return cfg


def assert_generate_equals_mlx_lm(case) -> None:
    """``case``'s prompts through ``Engine.generate``: the layer kinds are the model's state
    layers and the tokens mlx-lm's."""
    model, prompts, want = case
    eng = engine(model)
    assert dict(eng.config.layer_kinds) == state_kinds(model)
    assert eng.generate(prompts, max_new_tokens=NEW) == [[w] for w in want]


def shared_prefix_case(model) -> tuple:
    """``(hybrid_cases.shared_prefix_prompts(), mlx-lm's greedy tokens of each)``."""
    prompts = shared_prefix_prompts()
    return prompts, [mlx_greedy(model, p, NEW) for p in prompts]


def assert_prefix_hits_at_every_page(model):
    """``shared_prefix_case`` through an Engine of ``model`` with a state checkpoint at every
    page (``hybrid_cases.assert_prefix_hits``: the later requests start from 20 cached tokens,
    the checkpoint inside the first's prefill chunk 16..24), then the first prompt again, warm:
    the cold run's tokens. Returns the Engine."""
    prompts, want = shared_prefix_case(model)
    eng = engine(model, state_checkpoint_interval=1)
    assert eng.config.prefix_cache and eng.config.state_checkpoint_interval == 1
    assert_prefix_hits(eng, prompts, want)
    # the first prompt again, warm (its deeper checkpoints may have gone to the later
    # requests: 8 rows): the cold run's tokens
    again = eng.generate(prompts[:1], max_new_tokens=NEW)
    assert again == [[want[0]]] and eng.stats.prefix_hit_tokens >= 3 * 20 + 20
    return eng


def assert_edit_refused(model, path: str, value, match: str, check=state_kinds) -> None:
    """``model`` with what ``path`` names (attributes and list indices from the model, dotted:
    ``"layers.3.conv.conv"``) set to ``value``, something other than what was read:
    ``check(model)`` refuses it, matching ``match``."""
    *parents, last = path.split(".")
    owner = model
    for p in parents:
        owner = owner[int(p)] if p.isdigit() else getattr(owner, p)
    setattr(owner, last, value)
    with pytest.raises(kvcache.UnsupportedFeatureError, match=match):
        check(model)


def assert_a_replaced_function_refused(model, name: str) -> None:
    """The function ``name`` of ``model``'s mlx-lm module (what its state layers call, read as
    mlx-lm's own) replaced: refused, naming it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module(type(model).__module__), name,
                      lambda *a, **k: None)
        with pytest.raises(kvcache.UnsupportedFeatureError, match=name):
            state_kinds(model)


def assert_a_subclass_refused(model, layer: int, attr: str, name: str, build=None) -> None:
    """``model``'s layer ``layer``'s module ``attr`` replaced by a subclass named ``name`` (a
    subclass computes what it likes): refused by ``build(model)`` (an Engine by default),
    naming the layer."""
    module = getattr(model.layers[layer], attr)
    module.__class__ = type(name, (type(module),), {})
    build = build or (lambda m: Engine(m, backend="metal", device="cpu", max_total_tokens=256))
    with pytest.raises(kvcache.UnsupportedFeatureError, match=f"layer {layer} .*a subclass"):
        build(model)


def assert_residual_blocks_refused(make, mixer: str) -> None:
    """A model of Mamba ``ResidualBlock`` layers (``make(seed=2)``, a fresh one each time) with
    its layer 1 mixer replaced by a subclass named ``mixer``, its layer 2 block by a subclass
    (the block decides how the mixer is called), or its layer 2 conv by one that is not
    depthwise: each refused, naming the layer."""
    import mlx.nn as nn
    assert_a_subclass_refused(make(seed=2), 1, "mixer", mixer)
    model = make(seed=2)
    model.layers[2].__class__ = type("ResidualBlock", (type(model.layers[2]),), {})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 2 .*a subclass"):
        state_kinds(model)
    assert_edit_refused(make(seed=2), "layers.2.mixer.conv1d",
                        nn.Conv1d(128, 128, 4, bias=True), "layer 2 .*groups=1")


def assert_another_make_cache_refused(model) -> None:
    """``model``'s ``make_cache()`` giving a ``KVCache`` at every layer: refused, naming the
    first state layer (0)."""
    from mlx_lm.models.cache import KVCache
    object.__setattr__(model, "make_cache", lambda: [KVCache() for _ in model.layers])
    with pytest.raises(kvcache.UnsupportedFeatureError,
                       match=r"make_cache\(\) gives layer 0 .*a KVCache"):
        state_kinds(model)


def assert_a_mask_refused(model, attr: str, slot=lambda caches: caches[0]) -> None:
    """Layer 0's state module ``attr`` called with a mask array (padding) inside a forward of 3
    tokens (its cache ``slot(layer_caches(...))``: the first entry; a Falcon-H1's first pair's
    mixer cache): refused, and the sequence gains no token."""
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=64,
                                              max_batch_size=1), backend="metal", device="cpu")
    cache.add_sequence(0)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="mask"):
        with cache.forward([0], [3]):
            caches = layer_caches(model, cache)
            getattr(model.layers[0], attr)(mx.zeros((3, 1, model.args.hidden_size)),
                                           mask=mx.ones((3, 1), mx.bool_), cache=slot(caches))
    assert cache.sequence_length(0) == 0


def family_tests(case, family: str, pair: tuple, states: tuple = ()) -> dict:
    """The tests every mlx-lm hybrid family file runs, by name, bound to the file's ``case``
    (its once-per-family ``(model, prompts, mlx-lm's greedy tokens)``; none: the family's
    default model), for the file to take into its namespace (``globals().update``: pytest
    collects them there, under the file's own ids): the Engine, the adapter's own loop and the
    model's own call with ``layer_caches`` (the prompts ``pair`` in one forward) against
    mlx-lm's own generation, preemption and forks, and what does not compose (``family``:
    ``args.model_type``, as the refusals name it). With ``states`` (the names of a layer's
    states: the families whose states recur, Mamba-2 mixers and gated DeltaNet) also a
    chunked prompt's logits against one forward, each state carrying, an aborted forward,
    prefix hits stopping at chunk ends without inner checkpoints and a warm prefix's logits
    bit for bit."""

    @pytest.mark.parametrize("overlap", [False, True])
    def test_engine_greedy_equals_mlx_lm(overlap):
        """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of
        8: prefill chunks and decode tokens of several sequences share forwards, each
        sequence's state layers run from its own states, and the tokens are mlx-lm's own."""
        model, prompts, want = case()
        eng = engine(model, overlap=overlap)
        assert dict(eng.config.layer_kinds) == state_kinds(model)
        assert eng.config.num_state_slots == 8          # 2 * max_batch_size
        # the prefix cache stays on (state checkpoints); nothing else was on here
        assert eng.config.prefix_cache and eng.host_tier is None
        assert eng.state_layers_off is None
        assert_engine_greedy(eng, prompts, want)

    def test_adapter_loop_greedy_equals_mlx_lm():
        """The adapter's forward in a loop of one's own (``cache_config(model)``: the state
        layers come with it): every prompt prefilled in chunks of 8 together, then decoded
        together; every state slot comes back."""
        model, prompts, want = case()
        metal_cpu_or_skip(cache_config(model).head_dim)
        adapter = MlxLmAdapter(model)
        assert adapter.state_layers() == state_kinds(model)
        cache = assert_adapter_loop_greedy(adapter, cache_config, model, prompts, want,
                                           backend="metal", device="cpu")
        for i in range(len(prompts)):
            cache.remove_sequence(i)
        assert cache.num_available_state_slots == cache.config.num_state_slots

    def test_layer_caches_loop_greedy_equals_mlx_lm():
        """The model's own call with ``layer_caches`` (no adapter): two prompts prefilled in
        one forward, then decoded together."""
        assert_layer_caches_loop_greedy(*case(), pair)

    def test_preemption_and_forks_recompute_the_state():
        """Four requests in a cache of 48 tokens: the scheduler preempts (the state slot comes
        back, the preempted request recomputes from fresh states), and ``n = 3`` samples fork
        at the prompt's end (the child's slot takes a copy of the states); the tokens are
        mlx-lm's."""
        model = case()[0]
        assert_preemption_and_forks(lambda **kw: engine(model, **kw),
                                    lambda prompt: mlx_greedy(model, prompt, NEW))

    def test_what_does_not_compose_is_refused_by_name(tmp_path):
        model = case()[0]
        for bad in ("offload", "deterministic"):
            with pytest.raises(kvcache.UnsupportedFeatureError,
                               match=f"{bad}=True with the {family} model's state layers"):
                engine(model, **{bad: True})
        with pytest.raises(kvcache.UnsupportedFeatureError, match="prefix_file=None"):
            engine(model, prefix_file=tmp_path / "none.kvp")
        with pytest.raises(kvcache.UnsupportedFeatureError, match="no sliding-window layer"):
            engine(model, window_groups=True)
        # what the cache refuses for state layers: popn, a fork below the length, exports
        assert_state_edits_refused(engine(model, max_total_tokens=256))

    tests = dict(locals())          # the tests above (by name), with the arguments
    if not states:
        return {name: t for name, t in tests.items() if name.startswith("test_")}

    def test_odd_chunks_give_the_logits_of_one_forward():
        """A 37-token prompt in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a one-token chunk
        with a past takes mlx-lm's decode step): every position's logits are those of mlx-lm's
        forward over the whole prompt without a cache, within float32 rounding."""
        model, prompts, _ = case()
        assert_odd_chunks_equal_one_forward(model, prompts[4])

    @pytest.mark.parametrize("zeroed", list(states))
    def test_each_state_carries(zeroed, monkeypatch):
        """The Engine with one of the states read as zeros at every forward gets the long
        prompts' tokens wrong: every state carries from chunk to chunk and step to step."""
        model, prompts, want = case()
        read_state_as_zeros(monkeypatch, zeroed)
        out = engine(model).generate(prompts, max_new_tokens=NEW)
        assert out[3][0] != want[3] and out[4][0] != want[4]

    def test_an_aborted_forward_keeps_the_states():
        """A forward that raises after the model ran (its states staged) is aborted: the
        sequence keeps its states and length, and the prompt's rest sent again, then decoded,
        gives mlx-lm's tokens (states advanced over the aborted tokens would not)."""
        model, prompts, want = case()
        metal_cpu_or_skip(cache_config(model).head_dim)
        prompt = prompts[4]
        adapter = MlxLmAdapter(model)
        cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=128,
                                                  max_batch_size=1), backend="metal",
                                     device="cpu")
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

    def test_without_inner_checkpoints_the_hits_stop_at_chunk_ends(monkeypatch):
        """The control of the file's prefix-hit test: with the states inside a prefill chunk
        not given (``state_checkpoints()`` read as none), the boundary at 20 holds no
        checkpoint and the later requests hit at 16, a chunk's end, only (so that test fails:
        48 hit tokens, not 60); the tokens stay mlx-lm's."""
        model = case()[0]
        prompts, want = shared_prefix_case(model)
        eng = engine(model, state_checkpoint_interval=1)
        monkeypatch.setattr(type(eng.cache), "state_checkpoints", lambda self: ())
        assert eng.generate(prompts[:1], max_new_tokens=NEW) == [[want[0]]]
        out = eng.generate(prompts[1:], max_new_tokens=NEW)
        assert [o[0] for o in out] == want[1:]
        assert eng.stats.prefix_hit_tokens == 3 * 16

    def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
        """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
        boundary the warm one starts from): the warm request restores that boundary's states
        beside the cached pages, every logits row equals the cold run's bit for bit, and the
        tokens (cold, and the cold Engine's own warm run) are mlx-lm's."""
        model = case()[0]
        rng = np.random.default_rng(3)
        system = rng.integers(1, 128, 4 * PAGE).tolist()
        question, other = rng.integers(1, 128, 7).tolist(), rng.integers(1, 128, 9).tolist()
        kw = dict(prefill_chunk_size=4 * PAGE, overlap=False, state_checkpoint_interval=1)
        want = [[mlx_greedy(model, system + question, 6)]]
        cold, _ = assert_warm_prefix_equals_cold(lambda: engine(model, **kw), system, question,
                                                 other, hit=4 * PAGE, expect=want)
        assert cold.generate([system + question], max_new_tokens=6) == want

    tests.update(locals())
    return {name: t for name, t in tests.items() if name.startswith("test_")}


def slow_except(tests: dict, *kept: str) -> dict:
    """``tests`` (``family_tests``' dict) with every test but those named ``kept`` marked
    ``slow`` (``make test-all`` runs them, ``make test`` the ones kept): for a family whose
    code paths the other families' files already run in CI."""
    return {name: t if name in kept else pytest.mark.slow(t) for name, t in tests.items()}


def assert_layer_caches_loop_greedy(model, prompts, want, pair):
    """The model's own call with ``layer_caches`` (no adapter): the prompts at indices ``pair``
    prefilled in one forward, then decoded together, equal to ``want``'s tokens."""
    metal_cpu_or_skip(cache_config(model).head_dim)
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=2)
    cache = kvcache.PagedKVCache(cfg, backend="metal", device="cpu")
    seqs = [prompts[i] for i in pair]
    toks = [list(p) for p in seqs]
    for s in (0, 1):
        cache.add_sequence(s)
    feed = [list(p) for p in seqs]
    for _ in range(NEW):
        flat = mx.array(np.concatenate(feed).astype(np.int32))
        with cache.forward([0, 1], [len(f) for f in feed]):
            logits = model(flat[:, None], cache=layer_caches(model, cache))
        ends = np.cumsum([len(f) for f in feed]) - 1
        picks = [int(mx.argmax(logits[int(e), -1])) for e in ends]
        feed = [[t] for t in picks]
        for s, t in enumerate(picks):
            toks[s].append(t)
    assert [t[len(p):] for t, p in zip(toks, seqs)] == [want[i] for i in pair]


def assert_odd_chunks_equal_one_forward(model, prompt):
    """``prompt`` through the adapter in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens: every
    position's logits are those of mlx-lm's forward over the whole prompt, within float32
    rounding."""
    metal_cpu_or_skip(cache_config(model).head_dim)
    adapter = MlxLmAdapter(model)
    cache = kvcache.PagedKVCache(cache_config(model, page_size=PAGE, max_total_tokens=128,
                                              max_batch_size=1), backend="metal", device="cpu")
    cache.add_sequence(0)
    rows, at = [], 0
    with adapter.session(cache):
        for n in (1, 8, 1, 5, 8, 3, 11):
            with adapter.step_context(cache), cache.forward([0], [n]):
                logits = adapter.forward(cache, np.asarray(prompt[at:at + n], np.int64),
                                         np.arange(at, at + n, dtype=np.int64),
                                         np.arange(n, dtype=np.int64))
            rows.append(adapter.to_numpy(logits))
            at += n
    assert at == len(prompt)
    got, want = np.concatenate(rows), mlx_logits(model, prompt)
    assert np.abs(got - want).max() < 1e-4, np.abs(got - want).max()


def read_state_as_zeros(monkeypatch, zeroed):
    """From here on, the state named ``zeroed`` is read as zeros at every forward."""
    original = states_module._states

    def zeros(forward, layer, name, shape, dtype):
        got = original(forward, layer, name, shape, dtype)
        return mx.zeros_like(got) if name == zeroed else got
    monkeypatch.setattr(states_module, "_states", zeros)


def random_model(module: str, model_type: str, kw: dict, seed: int,
                 conv: str = "conv1d.weight"):
    """A float32 mlx-lm model of ``mlx_lm.models.<module>``, ``model_type`` and ModelArgs
    ``kw``, its weights drawn by ``randomize_weights`` from ``seed``."""
    source = importlib.import_module(f"mlx_lm.models.{module}")
    args = source.ModelArgs.from_dict({"model_type": model_type, **kw})
    mx.random.seed(seed)
    return randomize_weights(source.Model(args), conv)


def randomize_weights(model, conv: str = "conv1d.weight"):
    """``model`` with random weights from mlx's current random state: matrices drawn with
    variance 1 / fan-in and every 1-D parameter moved off its initial value (weights named
    with ``conv`` kept), so that the greedy tokens vary."""
    from mlx.utils import tree_flatten
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if p.ndim == 1:
            updates.append((name, p + 0.3 * mx.random.normal(p.shape)))
        elif conv not in name:
            updates.append((name, mx.random.normal(p.shape) / np.sqrt(p.shape[-1])))
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())
    return model
