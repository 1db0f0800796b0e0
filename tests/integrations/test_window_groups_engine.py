"""Window groups served end to end (issue 56, increment 2): transformers models whose layers
slide (Gemma-3-style sliding and full layers; Mistral-style, every layer sliding) on a cache
whose windowed layers keep only the pages their windows still see, generating greedily through
the Engine (queued requests sharing batches, chunked prefill) and through the adapter in a loop
of one's own, token for token equal to transformers' own ``generate``; the windowed groups'
pages are freed while they run (a cache that kept every page fails the page checks). And what
is refused: a window that is not understood, options that do not compose."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import backend_or_skip, hf_greedy, make_model, model_needs_or_skip, own_loop_greedy
from engine_cases import assert_warm_prefix_equals_cold

import kvcache  # noqa: E402
from kvcache.integrations.transformers import (Engine, TransformersAdapter,  # noqa: E402
                                               cache_config, layer_kinds)

PAGE = 4
WINDOW = 8                  # transformers' sliding_window: Window(7), two pages and a bit
NEW = 12
# (model family, overrides): sliding and full layers by layer_types; every layer sliding
CASES = {
    "gemma3_text": dict(sliding_window=WINDOW, num_hidden_layers=3,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "mistral": dict(sliding_window=WINDOW),
}
LENGTHS = (3, 29, 17, 40)


def _prompts(seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, n).tolist() for n in LENGTHS]


_CASES: dict = {}


def _case(family):
    """(model, prompts, transformers' greedy tokens), once per family."""
    if family not in _CASES:
        model = make_model(family, seed=56, **CASES[family])
        prompts = _prompts()
        _CASES[family] = (model, prompts, [hf_greedy(model, p, NEW) for p in prompts])
    return _CASES[family]


def _check_held(cache, windows):
    """Every sequence's window groups hold only the pages its later queries can see."""
    for sid in cache.sequence_ids:
        length = cache.sequence_length(sid)
        for name, (first, pages) in cache.window_pages(sid).items():
            w = windows[name]
            assert first == max(0, length - w) // PAGE * PAGE, (sid, length, name, first)
            assert pages == -(-length // PAGE) - first // PAGE <= -(-w // PAGE) + 1


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_engine_greedy_equals_generate_and_frees_window_pages(family, backend, monkeypatch):
    model, prompts, want = _case(family)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    model_needs_or_skip(name, model)
    engine = Engine(model, backend=name, device=device, page_size=PAGE, max_total_tokens=1024,
                    prefill_chunk_size=16, max_batch_size=4)
    kinds = dict(engine.config.layer_kinds)
    assert kinds == layer_kinds(model) and engine.window_groups_off is None
    assert set(kinds.values()) == {kvcache.Window(WINDOW - 1)}
    assert not engine.graphs and engine.host_tier is None
    windows = {f"window={k.size}": k.size for k in kinds.values()}
    ids = [engine.add_request(p, kvcache.integrations.SamplingParams(max_tokens=NEW))
           for p in prompts]
    got: dict = {rid: [] for rid in ids}
    shared, slid = 0, 0
    while engine.has_unfinished():
        outs = engine.step()
        shared = max(shared, engine.cache.num_sequences)
        _check_held(engine.cache, windows)
        slid += sum(first > 0 for sid in engine.cache.sequence_ids
                    for first, _ in engine.cache.window_pages(sid).values())
        for out in outs:
            got[out.request_id].extend(out.new_token_ids)
    for i, rid in enumerate(ids):
        assert got[rid] == want[i], f"{family} on {name}: prompt {i} ({len(prompts[i])} tokens)"
    assert shared == len(prompts)           # the requests shared the cache and its batches
    assert slid > 0                          # pages slid out of the windows and were freed
    assert engine.cache.is_empty
    assert engine.cache.num_available_pages_by_group == engine.cache.num_total_pages_by_group


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_adapter_loop_greedy_equals_generate(backend, monkeypatch):
    """The adapter's forward in a loop of one's own (``cache_config(model,
    window_groups=True)``): every prompt prefilled in chunks of 16 together, then decoded
    together, the tokens transformers' own."""
    family = "gemma3_text"
    model, prompts, want = _case(family)
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    adapter = TransformersAdapter(model)
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=512, max_batch_size=4,
                       prefill_chunk_size=64, window_groups=True)
    assert dict(cfg.layer_kinds) == {0: kvcache.Window(7), 1: kvcache.Window(7)}
    cache = kvcache.PagedKVCache(cfg, backend=name, device=device)
    out = own_loop_greedy(adapter, cache, prompts, NEW,
                          each_step=lambda c: _check_held(c, {"window=7": 7}))
    seqs = list(range(len(prompts)))
    for i in seqs:
        assert out[i][:NEW] == want[i], f"prompt {i}"
        assert cache.window_pages(i)["window=7"][0] > 0


def test_window_groups_default_on_with_the_prefix_cache_and_refusals(tmp_path):
    model, _, _ = _case("gemma3_text")
    kw = dict(backend="reference", page_size=PAGE, max_total_tokens=512)
    # the defaults: the prefix cache and window groups, both on
    engine = Engine(model, **kw)
    assert dict(engine.config.layer_kinds) == layer_kinds(model) and engine.config.prefix_cache
    assert engine.window_groups_off is None
    assert Engine(model, window_groups=True, **kw).config.prefix_cache
    assert Engine(model, window_groups=False, prefix_cache=False, **kw).config.layer_kinds == ()
    # a prefix file is loaded through imports (not composed yet): every page kept, or refused
    path = tmp_path / "none.kvp"
    with pytest.raises(kvcache.UnsupportedFeatureError, match="prefix_file=None"):
        Engine(model, window_groups=True, prefix_file=path, **kw)
    # asked for, with what does not compose: refused, naming it
    for bad, says in ((dict(deterministic=True), "deterministic=True"),
                      (dict(offload=True), "offload=True")):
        with pytest.raises(kvcache.UnsupportedFeatureError, match=says):
            Engine(model, window_groups=True, **{**kw, **bad})
    with pytest.raises(kvcache.UnsupportedFeatureError, match="no sliding-window layer"):
        Engine(make_model("llama"), window_groups=True, prefix_cache=False, **kw)


def test_graphs_on_by_default_keep_every_page_unless_window_groups_are_asked(monkeypatch):
    """Where graphs are on by default (a GPU; stood in for by the engine's graph rule), the
    default keeps the graphs and every page, naming why; ``window_groups=True`` makes the
    other trade: graphs left at None go off."""
    model, _, _ = _case("gemma3_text")
    name, device = backend_or_skip("cuda", monkeypatch, cache_config(model).head_dim)
    kw = dict(backend=name, device=device, page_size=PAGE, max_total_tokens=512)
    monkeypatch.setattr(Engine, "_want_graphs", lambda self, graphs, backend, device:
                        graphs is not False)
    engine = Engine(model, **kw)
    assert engine.config.layer_kinds == () and engine.graphs
    assert "graphs (on by default here)" in engine.window_groups_off
    asked = Engine(model, window_groups=True, **kw)
    assert dict(asked.config.layer_kinds) == layer_kinds(model) and not asked.graphs


def test_a_window_not_understood_is_refused_or_kept_whole():
    model = make_model("gemma3_text", seed=1, **CASES["gemma3_text"])
    kw = dict(backend="reference", page_size=PAGE, max_total_tokens=512, prefix_cache=False)
    model.model.layers[1].self_attn.sliding_window = 5          # not what the config says
    with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 1 .*sliding_window=5"):
        layer_kinds(model)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="window_groups=True: layer 1"):
        Engine(model, window_groups=True, **kw)
    engine = Engine(model, **kw)                               # None: every page kept
    assert engine.config.layer_kinds == () and "layer 1" in engine.window_groups_off
    # a layer type window groups do not know
    other = make_model("gemma3_text", seed=1, **CASES["gemma3_text"])
    other.config.layer_types = ["sliding_attention", "chunked_attention", "full_attention"]
    with pytest.raises(kvcache.UnsupportedFeatureError, match="'chunked_attention'"):
        layer_kinds(other)


def test_a_layer_attending_with_another_window_than_its_group_changes_nothing():
    """A cache whose window group says Window(5) for a layer that attends over 8 positions:
    the layer's first attention call refuses, and the forward changes nothing."""
    model, prompts, _ = _case("gemma3_text")
    cfg = cache_config(model, page_size=PAGE, max_total_tokens=256, max_batch_size=2,
                       prefill_chunk_size=64)
    import dataclasses
    cfg = dataclasses.replace(cfg, layer_kinds={0: kvcache.Window(5), 1: kvcache.Window(7)})
    cache = kvcache.PagedKVCache(cfg, backend="reference")
    adapter = TransformersAdapter(model)
    cache.add_sequence(0)
    before = cache.num_available_pages_by_group
    with adapter.session(cache), adapter.step_context(cache):
        with pytest.raises(kvcache.UnsupportedFeatureError, match="layer 0 .*Window\\(5\\)"):
            with cache.forward([0], [len(prompts[1])]):
                adapter.forward(cache, np.asarray(prompts[1], np.int64),
                                np.arange(len(prompts[1]), dtype=np.int64),
                                np.asarray([len(prompts[1]) - 1], np.int64))
    assert cache.sequence_length(0) == 0 and cache.num_available_pages_by_group == before


def test_preemption_and_forks_in_a_small_cache_with_window_groups():
    """Four requests in a cache of 48 tokens: the scheduler preempts (every group's pages come
    back, the preempted request recomputes), and n=2 samples fork inside a page; the greedy
    tokens are transformers' own."""
    model, _, _ = _case("gemma3_text")
    engine = Engine(model, backend="reference", page_size=PAGE, max_total_tokens=48,
                    prefill_chunk_size=16, max_batch_size=4, prefix_cache=False)
    assert engine.config.layer_kinds
    prompts = [list(range(i, i + 18)) for i in range(1, 5)]
    out = engine.generate(prompts, max_new_tokens=NEW)
    assert engine.stats.preemptions > 0
    for i, p in enumerate(prompts):
        assert out[i][0] == hf_greedy(model, p, NEW), f"prompt {i}"
    two = engine.generate([prompts[0][:6]], kvcache.integrations.SamplingParams(
        max_tokens=NEW, n=2))
    assert two[0][0] == two[0][1] == hf_greedy(model, prompts[0][:6], NEW)
    assert engine.stats.forks >= 2 and engine.cache.is_empty
    assert engine.cache.num_available_pages_by_group == engine.cache.num_total_pages_by_group


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_shared_prefixes_hit_the_prefix_cache_with_window_groups(backend, monkeypatch):
    """Requests sharing a 22-token prefix (longer than the window: its first pages slide out
    of the windowed layers) through the Engine's default, prefix cache and window groups both
    on: later requests start from the cached prefix, the window pages of its boundary included,
    and the greedy tokens are transformers' own; a second call hits across calls."""
    model, _, _ = _case("gemma3_text")
    name, device = backend_or_skip(backend, monkeypatch, cache_config(model).head_dim)
    model_needs_or_skip(name, model)
    rng = np.random.default_rng(5)
    shared = rng.integers(1, 512, 22).tolist()
    prompts = [shared + rng.integers(1, 512, n).tolist() for n in (5, 9, 2, 13)]
    want = [hf_greedy(model, p, NEW) for p in prompts]
    engine = Engine(model, backend=name, device=device, page_size=PAGE, max_total_tokens=1024,
                    prefill_chunk_size=16, max_batch_size=4)
    assert engine.config.prefix_cache and engine.config.layer_kinds
    out = engine.generate(prompts, max_new_tokens=NEW)
    for i in range(len(prompts)):
        assert out[i][0] == want[i], f"prompt {i}"
    hits = engine.stats.prefix_hit_tokens
    assert hits >= 3 * 20, hits              # three requests from the shared pages
    out = engine.generate(prompts[:2], max_new_tokens=NEW)     # cached across calls
    assert [o[0] for o in out] == want[:2]
    assert engine.stats.prefix_hit_tokens >= hits + 2 * 20
    # (the window pools hold max_batch_size sequences' windows and a chunk: the oldest
    # prompts' window pages may be reclaimed, a miss the stats name, not a wrong token)
    assert engine.cache.num_available_pages_by_group == engine.cache.num_total_pages_by_group
    engine.cache.clear_prefix_cache()
    assert engine.cache.num_cached_pages == 0


def test_a_window_miss_is_counted_in_the_stats():
    """A window pool too small to keep a prefix's window pages: the next request that shares
    the prefix starts from fewer tokens (or none), the stats say why, and the tokens are
    still transformers' own."""
    model, _, _ = _case("gemma3_text")
    rng = np.random.default_rng(6)
    shared = rng.integers(1, 512, 22).tolist()
    first = shared + rng.integers(1, 512, 3).tolist()
    others = [rng.integers(1, 512, 30).tolist() for _ in range(3)]
    second = shared + rng.integers(1, 512, 4).tolist()
    engine = Engine(model, backend="reference", page_size=PAGE, max_total_tokens=1024,
                    prefill_chunk_size=16, max_batch_size=1)
    for p in [first] + others + [second]:
        assert engine.generate([p], max_new_tokens=2)[0][0] == hf_greedy(model, p, 2)
    # every prompt's window pages stay cached until the small window pool runs short
    assert engine.stats.prefix_miss_tokens_by_reason.get("window", 0) > 0


def test_a_warm_prefix_gives_the_cold_runs_logits_bit_for_bit_with_window_groups():
    """docs/prefix-caching.md's condition (the cold prompt's first chunk ends at the page
    boundary the warm one starts from): with window groups on, the warm request reads the
    cached full pages and the window pages of that boundary, and every logits row equals the
    cold run's bit for bit."""
    model, _, _ = _case("gemma3_text")
    rng = np.random.default_rng(3)
    system = rng.integers(1, 512, 4 * PAGE).tolist()      # past the window of 7
    question, other = rng.integers(1, 512, 7).tolist(), rng.integers(1, 512, 9).tolist()
    kw = dict(backend="reference", page_size=PAGE, max_total_tokens=1024,
              prefill_chunk_size=4 * PAGE, overlap=False)
    cold, _ = assert_warm_prefix_equals_cold(lambda: Engine(model, **kw), system, question,
                                             other, 4 * PAGE)
    assert cold.config.layer_kinds and cold.config.prefix_cache
