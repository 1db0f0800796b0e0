"""What the hybrid-model integration tests share (models with state layers: LFM2's short
convolutions through transformers and mlx-lm, Bamba / Granite-4.0-H's Mamba-2 mixers,
Qwen3-Next's gated DeltaNet): the small workload, the model built once per family with the
library's own greedy tokens, and the test bodies that are the same for every family (the
Engine's queued greedy requests, preemption and forks, prefix hits through state
checkpoints). Neutral to the model library, as ``engine_cases``: each test file passes its
own model factory, Engine and the library's greedy generation."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import own_loop_greedy   # at import: in a whole run `conftest` is another dir's later
from kvcache import PagedKVCache, UnsupportedFeatureError
from kvcache.integrations import SamplingParams

PAGE = 4
NEW = 10
CHUNK = 8                       # prompts of 19 and 37 tokens span 3 and 5 chunks
LENGTHS = (1, 2, 5, 19, 37)
VOCAB = 128
ENGINE = dict(page_size=PAGE, max_total_tokens=512, prefill_chunk_size=CHUNK, max_batch_size=4)
"""The Engine options of the tests (each adds its backend and device)."""
SHARED = 22                     # the shared prefix: five pages, the hit its first 20 tokens


def prompts(seed: int = 7) -> list:
    """One random prompt of each of ``LENGTHS`` tokens (ids in ``[1, VOCAB)``)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in LENGTHS]


def once_per_family(make, greedy):
    """``case(*family)``: ``(model, prompts(), the library's greedy tokens per prompt)``, built
    once per ``family`` (the arguments of ``make``, which builds the model; none: its
    default). ``greedy(model, prompt)``: the library's own ``NEW`` greedy tokens."""
    built: dict = {}

    def case(*family):
        if family not in built:
            model = make(*family)
            ps = prompts()
            built[family] = (model, ps, [greedy(model, p) for p in ps])
        return built[family]
    return case


def assert_engine_greedy(engine, prompts: list, want: list, label: str = "",
                         shared: int = 4) -> None:
    """Every prompt queued on ``engine`` at once (greedy, ``NEW`` tokens each) and stepped to the
    end: each request's tokens are ``want``'s (``label`` begins the message), ``shared``
    sequences were in the cache at once, some forward mixed prefill and decode tokens, and the
    cache ends empty with every state slot back."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=NEW)) for p in prompts]
    got: dict = {rid: [] for rid in ids}
    most, mixed = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        most = max(most, engine.cache.num_sequences)
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
        mixed += engine.stats.prefill_tokens > 0 and engine.stats.decode_tokens > 0
    for i, rid in enumerate(ids):
        assert got[rid] == want[i], f"{label}prompt {i} ({len(prompts[i])} tokens)"
    assert most == shared and mixed
    assert engine.cache.is_empty
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def assert_adapter_loop_greedy(adapter, cache_config, model, prompts: list, want: list,
                               label: str = "", chunk: int = CHUNK, **backend):
    """``adapter``'s forward in a loop of one's own (``conftest.own_loop_greedy``) on a cache of
    ``cache_config(model)`` (its state layers come with it; ``backend``: the cache's backend
    and device): every prompt prefilled in chunks of ``chunk`` together, then decoded
    together; each prompt's ``NEW`` tokens are ``want``'s (``label`` begins the message).
    Returns the cache."""
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=512, max_batch_size=len(prompts),
                       prefill_chunk_size=64)
    cache = PagedKVCache(cfg, **backend)
    out = own_loop_greedy(adapter, cache, prompts, NEW, chunk=chunk)
    for i in range(len(prompts)):
        assert out[i][:NEW] == want[i], f"{label}prompt {i}"
    return cache


def assert_preemption_and_forks(engine_of, greedy) -> None:
    """Four requests of 18 tokens in a cache of 48 tokens: the scheduler preempts (the state
    slot comes back, the preempted request recomputes from fresh states); then ``n = 3``
    samples of one prompt, one sequence per forward, fork at the prompt's end (the children's
    slots take copies of the states); the tokens are the library's. ``engine_of(**options)``:
    an Engine of the test's model, ``options`` over ``ENGINE``; ``greedy(prompt)``: the
    library's ``NEW`` greedy tokens."""
    engine = engine_of(max_total_tokens=48)
    prompts = [list(range(i, i + 18)) for i in range(1, 5)]
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
    for i, p in enumerate(prompts):
        assert out[i][0] == greedy(p), f"prompt {i}"
    small = engine_of(max_total_tokens=256, max_batch_size=1)
    three = small.generate([prompts[0][:11]], SamplingParams(max_tokens=NEW, n=3))
    assert three[0] == [greedy(prompts[0][:11])] * 3
    assert small.stats.forks >= 3 and small.cache.is_empty
    assert small.cache.num_available_state_slots == 2


def shared_prefix_prompts(seed: int = 5) -> list:
    """Four prompts behind one ``SHARED``-token prefix, with 5, 9, 2 and 13 tokens of their
    own."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(1, VOCAB, SHARED).tolist()
    return [shared + rng.integers(1, VOCAB, n).tolist() for n in (5, 9, 2, 13)]


def assert_prefix_hits(engine, prompts: list, want: list) -> None:
    """``shared_prefix_prompts`` through ``engine`` (prefix cache on, a state checkpoint at
    every page boundary): the first alone (no hit), then the others in one call, each starting
    from the 20 cached tokens (the boundary at 20 lies inside the first's prefill chunk 16..24:
    its state layers give that checkpoint) with no miss; the greedy tokens are ``want``'s and
    every state slot comes back."""
    assert engine.generate(prompts[:1], max_new_tokens=NEW) == [[want[0]]]
    assert engine.stats.prefix_hit_tokens == 0
    out = engine.generate(prompts[1:], max_new_tokens=NEW)
    assert [o[0] for o in out] == want[1:]
    assert engine.stats.prefix_hit_tokens == 3 * 20
    assert engine.stats.prefix_miss_tokens_by_reason == {}      # no miss
    assert engine.cache.num_available_state_slots == engine.config.num_state_slots


def assert_warm_prefix_bits(engine_of) -> None:
    """docs/prefix-caching.md's condition on fresh ``engine_of()`` Engines (chunks of
    ``4 * PAGE`` tokens: the cold prompt's first chunk ends at the page boundary the warm one
    starts from): the warm request restores that boundary's state beside the cached pages, and
    every logits row equals the cold run's bit for bit (``engine_cases``'
    ``assert_warm_prefix_equals_cold`` on a random system prompt of four pages)."""
    from engine_cases import assert_warm_prefix_equals_cold
    rng = np.random.default_rng(3)
    system = rng.integers(1, VOCAB, 4 * PAGE).tolist()
    question, other = rng.integers(1, VOCAB, 7).tolist(), rng.integers(1, VOCAB, 9).tolist()
    assert_warm_prefix_equals_cold(engine_of, system, question, other, 4 * PAGE)


def assert_state_edits_refused(engine, fork: bool = True) -> None:
    """What the cache refuses for state layers, on a fresh ``engine``: after one forward of 5
    tokens, ``popn`` (no checkpoint to go back to), a fork below the length (``fork``: the
    families whose cache checks it) and an export; the sequence keeps its 5 tokens."""
    cache, adapter = engine.cache, engine.adapter
    cache.add_sequence(0)
    with adapter.session(cache), adapter.step_context(cache), cache.forward([0], [5]):
        adapter.forward(cache, np.arange(1, 6, dtype=np.int64), np.arange(5, dtype=np.int64),
                        np.asarray([4], np.int64))
    with pytest.raises(UnsupportedFeatureError, match="checkpoint"):
        cache.popn(0, 1)
    if fork:
        with pytest.raises(UnsupportedFeatureError):
            cache.fork_sequence(0, 1, 3)
    with pytest.raises(UnsupportedFeatureError):
        cache.export_sequence(0)
    assert cache.sequence_length(0) == 5


def assert_refused(make_engine, cache_config, model, match: str) -> None:
    """``model`` refused (``UnsupportedFeatureError`` matching ``match``) by an Engine
    (``make_engine(model)``) and by ``cache_config(model)`` alike."""
    with pytest.raises(UnsupportedFeatureError, match=match):
        make_engine(model)
    with pytest.raises(UnsupportedFeatureError, match=match):
        cache_config(model)


def full_conv(module, attr: str) -> int:
    """Replaces ``module``'s depthwise conv ``attr`` (a ``Conv1d``) by a full one (groups 1)
    of the same channels, taps and padding: what the cache's convolution does not compute (a
    conv changed after the model was built). Returns its channels."""
    conv = getattr(module, attr)
    setattr(module, attr, type(conv)(conv.in_channels, conv.out_channels, conv.kernel_size[0],
                                     padding=conv.padding))
    return conv.in_channels


class KeywordDropped:
    """A context in which every module of ``modules`` (torch modules) loses its ``kvcache=``
    keyword on the way in, as under a decoder layer that does not pass its keywords down."""

    def __init__(self, modules):
        self.modules = list(modules)
        self.hooks: list = []

    @staticmethod
    def _drop(module, args, kwargs):
        kwargs.pop("kvcache", None)
        return args, kwargs

    def __enter__(self):
        self.hooks = [m.register_forward_pre_hook(self._drop, with_kwargs=True)
                      for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def forgetting(forward, zeroed: str):
    """A state layer's cache forward (``forward(module, cache, hidden_states)``) that reads its
    state ``zeroed`` as zeros at every forward (a sequence that forgets it)."""
    def run(module, cache, hidden_states):
        get = cache.get_state

        def zeros(layer, name):
            value = get(layer, name)
            return value * 0 if name == zeroed else value
        cache.get_state = zeros
        try:
            return forward(module, cache, hidden_states)
        finally:
            del cache.get_state
    return run


def assert_state_slots_wait(engine_of, prompts: list, want: list, monkeypatch) -> None:
    """One state slot per batch row (``STATE_SLOTS_PER_ROW = 1``, patched before
    ``engine_of(**options)`` builds an Engine of 3 rows) and ``n = 5`` samples of each of the
    two ``prompts``: the samples' prefixes and samples need more slots than the cache has; the
    scheduler admits no more sequences to a forward than there are free slots (before the fix
    an admission failed, preempted the sequence admitted just before it and the same forward
    was planned again, forever), and the tokens are ``want``'s (the library's)."""
    import kvcache.integrations.engine as engine_module
    monkeypatch.setattr(engine_module, "STATE_SLOTS_PER_ROW", 1)
    eng = engine_of(max_batch_size=3)
    assert eng.config.num_state_slots == 3
    out = eng.generate(prompts, SamplingParams(max_tokens=NEW, n=5))
    assert out == [[w] * 5 for w in want]
    assert eng.stats.forks >= 8
    assert eng.cache.num_available_state_slots == 3
