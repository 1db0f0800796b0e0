"""What the transformers hybrid-family tests share (LFM2, Bamba / Granite-4.0-H, Qwen3-Next,
Nemotron-H, Falcon-H1): the tests that are the same for every family are written once, in
``family_tests``, and taken into each file's namespace (the same ids), bound to the family's
``Family`` (its model, what its state layers are called and hold, what it refuses, the
tolerances); each file keeps its own configuration checks and its own tests. The mlx-lm files
do the same with ``mlx_hybrid_cases``. Imports at module top level only (in a whole run
`conftest` is another dir's later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from conftest import (assert_state_engine_refusals, backend_or_skip, chunked_logits, hf_greedy,
                      torch, transformers)
from hybrid_cases import (ENGINE, NEW, PAGE, KeywordDropped, assert_adapter_loop_greedy,
                          assert_engine_greedy, assert_preemption_and_forks, assert_prefix_hits,
                          assert_refused, assert_state_edits_refused, assert_warm_prefix_bits,
                          forgetting, shared_prefix_prompts)

import kvcache
from kvcache.integrations.transformers import (Engine, TransformersAdapter, cache_config,
                                               route_state_layers, state_kinds, stateful_layers)
from kvcache.integrations.transformers import states as states_module

BACKENDS = ("reference", "cuda")
slow = pytest.mark.slow


def engine(model, **options):
    """An Engine of ``model`` on the reference backend, ``options`` over the tests' ``ENGINE``."""
    return Engine(model, **{**ENGINE, "backend": "reference", **options})


def refused(model, match: str) -> None:
    """``model`` refused, matching ``match``, by an Engine and by ``cache_config`` alike."""
    assert_refused(lambda m: Engine(m, backend="reference", max_total_tokens=256), cache_config,
                   model, match)


def assert_a_subclass_refused(model, layer: int, attr: str) -> None:
    """``model``'s layer ``layer``'s state module ``attr`` replaced by a subclass of the same
    name (a subclass computes what it likes): refused by name, as ``refused``."""
    module = getattr(model.model.layers[layer], attr)
    name = type(module).__name__
    module.__class__ = type(name, (type(module),), {})
    refused(model, rf"layers\.{layer}\.{attr} \({name}\) is not transformers' {name}")


def assert_state_layers(model, kinds: dict, full_layers: tuple, routed) -> object:
    """``model``'s state layers are ``kinds`` (cache layer -> ``kvcache.State``), its cache
    config (3 rows) has them beside the attention layers ``full_layers``, and the decoder
    layers ``routed`` are the ones routed (they still run transformers' own forward without
    the cache). Returns the config, for the family's own checks."""
    assert state_kinds(model) == kinds
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=3)
    assert dict(cfg.layer_kinds) == kinds and cfg.full_layers == full_layers
    assert route_state_layers(model) == list(routed)
    assert [i for i, _, _ in stateful_layers(model)] == list(routed)
    return cfg


@dataclass(frozen=True)
class Family:
    """What a transformers hybrid family's shared tests take; a test whose field is ``None``
    (or false) is not taken (the family has its own, or none)."""

    name: str                   # ``config.model_type``, as the refusals name it
    case: Callable              # ``case()``: (model, prompts, transformers' greedy tokens)
    make: Callable              # ``make()``: the case's model built afresh (routed anew)
    cache_layers: int           # the cache's layers (pages and states)
    slow: bool = False          # all but the Engine's reference row with overlap: ``slow``
    adapter_chunk: int = 8      # the adapter loop's prefill chunks
    states: tuple = ()          # a layer's states, each read as zeros in turn (none: no test)
    forward: str = ""           # the ``states`` function the state layers call
    every_long_prompt_wrong: bool = False    # each long prompt's tokens wrong, not just some
    uneven_atol: float | None = None         # the chunked prompt's logits against one forward
    own_chunks_atol: float | None = None     # ... and against transformers' own chunked run
    layer_modules: str = ""     # the ``states`` function naming the routed modules
    outside_prompt: int = 2     # the prompt generated outside the Engine afterwards
    prefix_model: Callable | None = None     # the prefix-hit test's model
    own_interval_over_one: bool = False      # the Engine's own checkpoint interval is > 1
    warm_prefix: bool = False
    compose: bool = False       # the refusals of what does not compose
    rope_refused: bool = True   # ... ``rope='cache'`` among them


def family_tests(family: Family) -> dict:
    """The tests every transformers hybrid family file runs, by name, bound to ``family``, for
    the file to take into its namespace (``globals().update``: pytest collects them there,
    under the file's own ids): the Engine and the adapter's own loop against transformers' own
    ``generate`` on the reference backend and cuda's CPU mode, preemption and forks, and (as
    ``family`` has them) a prompt in uneven chunks, each state carrying, a decoder layer that
    drops the cache's keyword, prefix hits through state checkpoints, a warm prefix bit for bit
    and what does not compose."""
    case, tests = family.case, {}

    def mark(test):
        return slow(test) if family.slow else test

    def take(test):
        tests[test.__name__] = test
        return test

    # CI keeps the slow families' Engine row on the reference backend with the host ahead
    sample = (lambda v: pytest.param(v, marks=slow)) if family.slow else (lambda v: v)

    @take
    @pytest.mark.parametrize("overlap", [True, sample(False)])
    @pytest.mark.parametrize("backend", ["reference", sample("cuda")])
    def test_engine_greedy_equals_generate(backend, overlap, monkeypatch):
        """Five queued requests of 1 to 37 tokens, at most 4 per forward, prompts in chunks of
        8: prefill chunks and decode tokens of several sequences share forwards, each
        sequence's state layers run from its own states, and the attention layers read their
        pages; the tokens are transformers' own."""
        model, prompts, want = case()
        name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
        eng = engine(model, backend=name, device=device, overlap=overlap)
        assert dict(eng.config.layer_kinds) == state_kinds(model)
        assert eng.config.num_layers == family.cache_layers
        assert eng.config.num_state_slots == 8          # 2 * max_batch_size
        # the prefix cache stays on (state checkpoints); nothing else was on here
        assert eng.config.prefix_cache and not eng.graphs and eng.host_tier is None
        assert eng.state_layers_off is None
        assert_engine_greedy(eng, prompts, want, f"{name}: ")

    @take
    @mark
    @pytest.mark.parametrize("backend", BACKENDS)
    def test_adapter_loop_greedy_equals_generate(backend, monkeypatch):
        """The adapter's forward in a loop of one's own (``cache_config(model)``: the state
        layers come with it): every prompt prefilled in chunks together, then decoded
        together."""
        model, prompts, want = case()
        name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
        adapter = TransformersAdapter(model)
        assert adapter.state_layers() == state_kinds(model)
        assert_adapter_loop_greedy(adapter, cache_config, model, prompts, want, f"{name}: ",
                                   chunk=family.adapter_chunk, backend=name, device=device)

    @take
    @mark
    def test_preemption_and_forks_recompute_the_state():
        """Four requests in a cache of 48 tokens: the scheduler preempts (the state slot comes
        back, the preempted request recomputes from fresh states), and ``n = 3`` samples fork
        at the prompt's end (the children's slots take copies of the states); the tokens are
        transformers'."""
        model, _, _ = case()
        assert_preemption_and_forks(lambda **kw: engine(model, **kw),
                                    lambda prompt: hf_greedy(model, prompt, NEW))

    if family.uneven_atol is not None:
        @take
        @mark
        def test_a_prompt_in_uneven_chunks_gives_the_whole_prompts_logits():
            """A 37-token prompt prefilled in chunks of 1, 8, 1, 5, 8, 3 and 11 tokens (a new
            sequence's one token, one-token chunks with a past that take the recurrent step,
            chunks continuing from a state): every position's logits are those of one forward
            over the whole prompt without a cache (and, where the family's chunked rule rounds
            from chunk to chunk, those of transformers' own run in the same chunks), within
            float32 rounding."""
            model, _, _ = case()
            prompt = np.random.default_rng(1).integers(1, 128, 37)
            chunks = (1, 8, 1, 5, 8, 3, 11)
            with torch.no_grad():
                whole = model(torch.from_numpy(prompt)[None]).logits[0].numpy()
            got = chunked_logits(model, prompt, chunks, PAGE)
            if family.own_chunks_atol is not None:
                np.testing.assert_allclose(got, own_chunked_logits(model, prompt, chunks),
                                           atol=family.own_chunks_atol, rtol=0)
            np.testing.assert_allclose(got, whole, atol=family.uneven_atol, rtol=0)

    if family.states:
        @take
        @mark
        @pytest.mark.parametrize("zeroed", list(family.states))
        def test_each_state_carries(zeroed, monkeypatch):
            """The same Engine with one of the states read as zeros at every forward (a
            sequence that forgets it) gets the long prompts' tokens wrong: every state carries
            from forward to forward."""
            _, prompts, want = case()
            monkeypatch.setattr(states_module, family.forward,
                                forgetting(getattr(states_module, family.forward), zeroed))
            model = family.make()     # routed afresh: its wrappers call the patched function
            out = engine(model).generate(prompts, max_new_tokens=NEW)
            assert [o[0] for o in out][3:] != want[3:]
            if family.every_long_prompt_wrong:
                assert all(o[0] != w for o, w in zip(out[3:], want[3:]))

    if family.layer_modules:
        @take
        @mark
        def test_a_decoder_layer_that_does_not_pass_the_cache_down_still_reaches_the_states():
            """Each state layer's module loses ``kvcache=`` on its way in (as a release whose
            decoder layer does not pass its keywords down): the adapter's ``serving`` still
            routes it and the tokens equal ``generate``; outside the Engine the module is
            transformers' own again."""
            model, prompts, greedy = case()
            modules = getattr(states_module, family.layer_modules)(model).values()
            with KeywordDropped(m for _, m in modules):
                out = engine(model, max_batch_size=3).generate(prompts, max_new_tokens=NEW)
                assert [o[0] for o in out] == greedy
            at = family.outside_prompt
            assert hf_greedy(model, prompts[at], NEW) == greedy[at]

    if family.prefix_model is not None:
        @take
        @mark
        @pytest.mark.parametrize("backend", BACKENDS)
        def test_shared_prefixes_hit_through_state_checkpoints(backend, monkeypatch):
            """Requests sharing a 22-token prefix through the Engine, checkpoints every page
            (``state_checkpoint_interval=1``): the first request's prefill chunk 16..24 gives
            the states at 20 (inside the chunk), so the later requests start from 20 cached
            tokens with every state restored beside the pages; the greedy tokens are
            transformers' own."""
            model = family.prefix_model()
            name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
            prompts = shared_prefix_prompts()
            want = [hf_greedy(model, p, NEW) for p in prompts]
            eng = engine(model, backend=name, device=device, state_checkpoint_interval=1)
            assert eng.config.prefix_cache and eng.config.state_checkpoint_interval == 1
            assert_prefix_hits(eng, prompts, want)
            if family.own_interval_over_one:
                # the Engine's own interval: a checkpoint costs more than a page's KV
                assert engine(model).config.state_checkpoint_interval > 1

    if family.warm_prefix:
        @take
        @mark
        def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit():
            """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the
            page boundary the warm one starts from): the warm request restores that boundary's
            states beside the cached pages, and every logits row equals the cold run's bit for
            bit."""
            model, _, _ = case()
            assert_warm_prefix_bits(lambda: engine(model, prefill_chunk_size=4 * PAGE,
                                                   overlap=False, state_checkpoint_interval=1))

    if family.compose:
        @take
        @mark
        def test_what_does_not_compose_is_refused_by_name():
            model, _, _ = case()
            kw = assert_state_engine_refusals(model, family.name)
            if family.rope_refused:
                with pytest.raises(kvcache.UnsupportedFeatureError,
                                   match=f"rope='cache' with the {family.name}"):
                    Engine(model, rope="cache", **kw)
            assert_state_edits_refused(Engine(model, **kw), fork=False)

    return tests


def own_chunked_logits(model, prompt: np.ndarray, chunks) -> np.ndarray:
    """transformers' own logits for every position of ``prompt`` run in ``chunks`` (their
    sizes, in order) on its own cache."""
    with torch.no_grad():
        own = transformers.DynamicCache(config=model.config)
        rows, at = [], 0
        for n in chunks:
            rows.append(model(torch.from_numpy(prompt[at:at + n])[None], cache=own,
                              use_cache=True, position_ids=torch.arange(at, at + n)[None]
                              ).logits[0].numpy())
            at += n
    return np.concatenate(rows)
