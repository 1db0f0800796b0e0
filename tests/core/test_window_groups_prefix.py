"""The prefix cache in a cache with window groups (``CacheConfig(prefix_cache=True,
layer_kinds=...)``, docs/hybrid.md "Prefix caching with window groups"): a hit restores exactly
the window pages a cold run holds and attends alike bit for bit; window pages only the index
holds are reclaimed when a group runs short, and the boundaries that needed them miss with the
reason counted; eviction, sliding, forks and popn neither free a page twice nor leak one."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import CacheConfig, PagedKVCache, Window

PS = 4


def config(**kw):
    base = dict(num_layers=3, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=PS,
                max_batch_size=2, max_total_tokens=256, prefill_chunk_size=16, dtype="float32",
                rope_mode="none", prefix_cache=True, layer_kinds={0: Window(5), 2: Window(9)})
    base.update(kw)
    return CacheConfig(**base)


def rows(cache, tokens, start, n):
    """q, k, v of each layer for positions ``start .. start + n`` of ``tokens``: a function of
    the token and its position only, so that any run computes the same K/V for a prefix."""
    c = cache.config
    out = []
    for layer in range(c.num_layers):
        per = [np.random.default_rng([tokens[p], p, layer]).standard_normal(
            (c.num_qo_heads + 2 * c.num_kv_heads, c.head_dim)) for p in range(start, start + n)]
        a = np.stack(per).astype(np.float32)
        q, k, v = np.split(a, [c.num_qo_heads, c.num_qo_heads + c.num_kv_heads], axis=1)
        out.append((q, k, v))
    return out


def run(cache, seqs):
    """One forward of ``[(sid, tokens, start, n)]``; returns each layer's output (numpy)."""
    ids = [s for s, _, _, _ in seqs]
    lens = [n for _, _, _, n in seqs]
    parts = [rows(cache, t, start, n) for _, t, start, n in seqs]
    outs = []
    with cache.forward(ids, lens):
        for layer in range(cache.config.num_layers):
            q, k, v = (cache.from_numpy(np.concatenate([p[layer][i] for p in parts]))
                       for i in range(3))
            outs.append(kvcache.to_numpy(cache.attention(layer, q, k, v)).copy())
    return outs


def check(cache):
    cache.state.pt.check_invariants()
    cache.manager.prefix.check()


def windows_of(cache, sid):
    groups = cache.state.pt.groups
    return {g.spec.name: (g.first[sid], list(g.live[sid])) for g in groups.groups}


def test_config_accepts_the_prefix_cache_with_window_groups():
    cfg = config()
    assert cfg.prefix_cache and cfg.layer_kinds


@pytest.mark.parametrize("m_pages", [1, 3, 5])
def test_a_hit_restores_the_cold_runs_window_pages_and_attends_alike(m_pages):
    """Cold: the prefix of ``m`` tokens in one forward, then the rest. Warm: a sequence
    attached at ``m`` runs the rest. Same window pages (contents), same outputs bit for bit."""
    m = m_pages * PS
    prompt = list(range(100, 100 + m + 7))
    cold = PagedKVCache(config(prefix_cache=False, prefill_chunk_size=32), backend="reference")
    cold.add_sequence(0)
    run(cold, [(0, prompt, 0, m)])
    cold_out = run(cold, [(0, prompt, m, 7)])

    warm = PagedKVCache(config(prefill_chunk_size=32), backend="reference")
    assert warm.add_sequence(1, prompt[:m + 1]) == 0
    run(warm, [(1, prompt, 0, m + 1)])      # computes the prefix (and one token past it)
    warm.remove_sequence(1)                 # its pages stay cached, window ones included
    check(warm)
    assert warm.match_prefix(prompt) == m
    assert warm.add_sequence(2, prompt) == m
    # the window pages a cold run of length m holds: from the one holding m - w on
    held = warm.window_pages(2)
    assert held == cold_pages_after(m)
    for layer in (0, 2):
        k, v = (kvcache.to_numpy(a) for a in warm.get_kv(2, held[f"window={ {0: 5, 2: 9}[layer]}"][0],
                                                         m, layer=layer))
        want = rows(warm, prompt, held[f"window={ {0: 5, 2: 9}[layer]}"][0], k.shape[0])
        np.testing.assert_array_equal(k, want[layer][1])
        np.testing.assert_array_equal(v, want[layer][2])
    warm_out = run(warm, [(2, prompt, m, 7)])
    for a, b in zip(cold_out, warm_out):
        np.testing.assert_array_equal(a, b)
    check(warm)


def cold_pages_after(m):
    out = {}
    for w in (5, 9):
        first = max(0, m - w) // PS
        out[f"window={w}"] = (first * PS, -(-m // PS) - first)
    return out


def expected_match(cache, prompt):
    """The deepest boundary of ``prompt``'s cached chain at which every window group's nodes
    hold the pages from the one holding ``P - w`` to ``P`` (docs/hybrid.md), from the index's
    nodes (``Node.wp``), in tokens."""
    raw = np.asarray(prompt, np.int64).tobytes()
    chain = {}
    for filed in cache.manager.prefix.nodes.values():
        for node in filed:
            if raw.startswith(node.src[:node.depth * PS * 8]):
                chain[node.depth] = node
    windows = [kind.size for kind, _ in cache.config.window_groups]
    best = 0
    for d in range(1, (len(prompt) - 1) // PS + 1):
        if d not in chain:
            break
        if all(chain[j].wp is not None and chain[j].wp[g] >= 0
               for g, w in enumerate(windows) for j in range(max(0, d * PS - w) // PS + 1, d + 1)):
            best = d * PS
    return best


def test_a_hit_shortens_to_where_the_window_pages_are_held_and_counts_the_miss():
    """Prompts sharing the first 16 tokens of an older one hit there (those nodes are used
    again) and run on through a one-sequence cache: the window pools run short and reclaim the
    older prompt's least recently used window pages, the deeper ones (its full pages stay
    cached): its match ends at the deepest boundary whose window pages are all held, and the
    tokens lost count as window misses."""
    cache = PagedKVCache(config(max_batch_size=1, prefill_chunk_size=16, max_total_tokens=1024),
                         backend="reference")
    prompt = list(range(40))
    cache.add_sequence(0, prompt[:33])
    for start in range(0, 32, 16):
        run(cache, [(0, prompt, start, 16)])
    run(cache, [(0, prompt, 32, 1)])
    cache.remove_sequence(0)
    check(cache)
    assert cache.match_prefix(prompt) == expected_match(cache, prompt) == 32
    sid = 1
    while cache.match_prefix(prompt) == 32:
        other = prompt[:16] + [500 + 40 * sid + j for j in range(5)]
        assert cache.add_sequence(sid, other) == 16
        run(cache, [(sid, other, 16, 5)])
        cache.remove_sequence(sid)
        check(cache)
        sid += 1
    got = cache.match_prefix(prompt)
    assert got == expected_match(cache, prompt) == 16
    assert cache.prefix_miss_tokens_by_reason == {"window": 0}       # match changes nothing
    assert cache.add_sequence(sid, prompt) == got
    assert cache.prefix_miss_tokens_by_reason == {"window": 32 - got}
    check(cache)
    for start in range(got, 40, 16):                # recomputed: the nodes hold pages again
        run(cache, [(sid, prompt, start, min(16, 40 - start))])
    check(cache)
    cache.remove_sequence(sid)
    assert cache.match_prefix(prompt + [1]) == 40
    check(cache)


def test_window_pages_only_the_index_holds_are_reclaimed_when_a_group_runs_short():
    cache = PagedKVCache(config(max_batch_size=1, prefill_chunk_size=8, max_total_tokens=1024),
                         backend="reference")
    totals = cache.num_total_pages_by_group
    start = cache.num_available_pages_by_group
    sid = 0
    for i in range(12):     # distinct prompts: the index holds far more window pages than a pool
        prompt = [1000 * i + j for j in range(17)]
        cache.add_sequence(sid, prompt)
        for s in range(0, 16, 8):
            run(cache, [(sid, prompt, s, 8)])
        cache.remove_sequence(sid)
        sid += 1
        check(cache)
        avail = cache.num_available_pages_by_group
        # what the index holds counts as available
        assert all(avail[g] == totals[g] for g in totals if g != "full")
    # the least recently used prompts lost their window pages first: the newest still hits
    newest = [1000 * 11 + j for j in range(17)]
    assert cache.match_prefix(newest) == 16
    assert cache.match_prefix([j for j in range(17)]) < 16
    cache.clear_prefix_cache()
    check(cache)
    assert cache.num_available_pages_by_group == start
    groups = cache.state.pt.groups
    assert all(len(g.free) == g.num_pages for g in groups.groups)


def test_eviction_sliding_forks_and_popn_free_every_page_once():
    cache = PagedKVCache(config(max_batch_size=2, max_total_tokens=128), backend="reference")
    groups = cache.state.pt.groups
    totals = {g.spec.name: g.num_pages for g in groups.groups}
    base = list(range(50, 90))
    cache.add_sequence(0, base[:25])
    run(cache, [(0, base, 0, 16)])
    run(cache, [(0, base, 16, 9)])
    cache.fork_sequence(0, 1, 25)           # shares the window pages, copies a partial page
    cache.fork_sequence(0, 2, 25)
    run(cache, [(1, base, 25, 3), (2, list(range(50, 75)) + [7, 8], 25, 2)])
    check(cache)
    cache.popn(1, 2)                         # within the window
    check(cache)
    cache.remove_sequence(0)
    check(cache)
    # a new sequence on the cached prefix, then more forwards sliding its window
    other = base[:20] + list(range(900, 930))
    assert cache.add_sequence(3, other) == 20
    for s in range(20, 48, 7):
        run(cache, [(3, other, s, 7)])
        check(cache)
    # the full pool runs short: eviction takes the cached nodes with their window pages
    cache.remove_sequence(3)
    cached = cache.num_cached_pages
    cache.add_sequence(4)
    while cache.can_append([4], [16]):
        run(cache, [(4, list(range(3000, 3400)), cache.sequence_length(4), 16)])
        check(cache)
    assert cache.num_cached_pages < cached
    for sid in (1, 2, 4):
        cache.remove_sequence(sid)
        check(cache)
    cache.clear_prefix_cache()
    check(cache)
    assert cache.num_cached_pages == 0
    assert cache.num_available_pages == cache.num_total_pages
    assert {g.spec.name: len(g.free) for g in groups.groups} == totals
    assert not any(g.cref.any() or g.ref.any() for g in groups.groups)


def test_a_popn_below_a_window_is_refused_before_anything_changes():
    cache = PagedKVCache(config(), backend="reference")
    prompt = list(range(30))
    cache.add_sequence(0, prompt)
    run(cache, [(0, prompt, 0, 16)])
    run(cache, [(0, prompt, 16, 14)])
    seqs = set(cache.state.pt.seqs)
    count = cache.manager.prefix.count
    with pytest.raises(kvcache.UnsupportedFeatureError, match="popn 20 on sequence 0"):
        cache.popn(0, 20)
    assert set(cache.state.pt.seqs) == seqs and cache.manager.prefix.count == count
    check(cache)
