"""Window groups (``CacheConfig(layer_kinds={layer: Window(w)})``, docs/hybrid.md increment 1):
the config's checks and refusals, the pools' sizes as allocated, the page queries per group
against what ``begin_forward`` takes, the refusals of what does not compose yet, and the memory
row of ``kvcache bench --memory``. The model-based test is test_window_groups_stateful.py; the
conformance class ``TestWindowGroups`` proves the backends."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcache
from kvcache import CacheConfig, PagedKVCache, Window

PS = 4


def config(**kw):
    base = dict(num_layers=3, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=PS,
                max_batch_size=2, max_total_tokens=256, prefill_chunk_size=16, dtype="float32",
                rope_mode="none", layer_kinds={0: Window(5), 2: Window(9)})
    base.update(kw)
    return CacheConfig(**base)


def run(cache, ids, lens, rng=np.random.default_rng(0)):
    T, c = sum(lens), cache.config
    with cache.forward(ids, lens):
        for layer in range(c.num_layers):
            q, k, v = (cache.from_numpy(rng.standard_normal((T, h, c.head_dim)))
                       for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            cache.attention(layer, q, k, v)


# ---------------------------------------------------------------------------- the config
@pytest.mark.parametrize("kinds, match", [
    ({3: Window(4)}, r"layer=3 must be in \[0, 2\] \(num_layers=3\)"),
    ({-1: Window(4)}, r"layer=-1 must be in"),
    ({True: Window(4)}, r"layer must be an int, got True"),
    ({1.0: Window(4)}, r"layer must be an int"),
    ({0: 4}, r"layer_kinds\[0\]=4 is not a kvcache.Window"),
    ({0: None}, r"layer_kinds\[0\]=None is not a kvcache.Window"),
    ([(0, Window(4)), (0, Window(5))], r"gives layer 0 twice"),
    ([(0, Window(4), 1)], r"pairs"),
    (7, r"must be a mapping"),
    ("ab", r"must be a mapping"),
    ([5], r"pairs, got the item 5"),
])
def test_bad_layer_kinds_name_the_layer_value_and_limit(kinds, match):
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        config(layer_kinds=kinds)


@pytest.mark.parametrize("size", [-1, 1.0, True, None, 2**31])
def test_bad_window_sizes(size):
    with pytest.raises(kvcache.InvalidArgumentError, match="Window.size"):
        Window(size)


@pytest.mark.parametrize("feature, extra", [
    ("support_sliding_window", {}), ("batch_invariant", {}),
    ("static_decode", {}), ("static_mixed", {"static_decode": True})])
def test_features_not_composed_yet_are_refused_by_name(feature, extra):
    name = feature if not extra else "static_decode"     # the first one named
    with pytest.raises(kvcache.UnsupportedFeatureError, match=f"CacheConfig.{name}=True"):
        config(**{feature: True}, **extra)


def test_config_reads_back_sorted_pairs_and_groups():
    c = config(layer_kinds={2: Window(9), 0: Window(5), 1: Window(5)}, num_layers=4)
    assert c.layer_kinds == ((0, Window(5)), (1, Window(5)), (2, Window(9)))
    assert c.window_groups == ((Window(5), (0, 1)), (Window(9), (2,)))
    assert c.full_layers == (3,)
    assert [c.layer_group(layer) for layer in range(4)] == [0, 0, 1, -1]
    assert dataclasses.replace(c, max_batch_size=3).layer_kinds == c.layer_kinds   # pairs in
    assert hash(c) == hash(config(layer_kinds=c.layer_kinds, num_layers=4))
    # sizing rule: max_batch_size * (ceil(w / ps) + 2) + ceil(chunk / ps), at most num_pages
    assert c.window_group_pages(0) == 2 * (2 + 2) + 4
    assert c.window_group_pages(1) == 2 * (3 + 2) + 4
    assert config(max_total_tokens=16).window_group_pages(1) == config(max_total_tokens=16).num_pages


def test_page_arrays_as_allocated_and_kv_bytes():
    cache = PagedKVCache(config(), backend="reference")
    c = cache.config
    assert [p.shape[0] for p in cache.pages] == [c.window_group_pages(0), c.num_pages,
                                                 c.window_group_pages(1)]
    assert sum(p.nbytes for p in cache.pages) == c.kv_bytes
    assert cache.num_total_pages_by_group == {"full": c.num_pages, "window=5": 12,
                                              "window=9": 14}
    plain = dataclasses.replace(c, layer_kinds=())
    assert plain.kv_bytes == plain.num_pages * plain.page_size * plain.token_kv_bytes


def test_a_backend_without_the_capability_refuses(monkeypatch):
    from kvcache.reference import ReferenceBackend
    monkeypatch.setattr(ReferenceBackend, "capabilities",
                        dataclasses.replace(ReferenceBackend.capabilities, window_groups=False))
    with pytest.raises(kvcache.UnsupportedFeatureError, match="window_groups"):
        PagedKVCache(config(), backend="reference")


# ---------------------------------------------------------------------------- page queries
def test_page_queries_per_group_match_what_begin_forward_takes():
    cache = PagedKVCache(config(), backend="reference")
    rng = np.random.default_rng(1)
    for sid in range(3):
        cache.add_sequence(sid)
    for step in range(40):
        ids = sorted(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist())
        lens = [int(rng.integers(1, 8)) for _ in ids]
        need = cache.pages_needed(ids, lens, by_group=True)
        free = cache.num_available_pages_by_group
        assert need["full"] == cache.pages_needed(ids, lens)
        if not cache.can_append(ids, lens):
            with pytest.raises(kvcache.CacheFullError):
                cache.begin_forward(ids, lens)
            assert cache.num_available_pages_by_group == free
            cache.remove_sequence(ids[0])
            cache.add_sequence(ids[0])
            continue
        cache.begin_forward(ids, lens)
        taken = {g: free[g] - n for g, n in cache.num_available_pages_by_group.items()}
        assert taken == need, (step, taken, need)
        cache.abort_forward()
        assert cache.num_available_pages_by_group == free
        run(cache, ids, lens)
        cache.state.pt.check_invariants()


def test_append_room_is_the_most_one_forward_can_take():
    cache = PagedKVCache(config(max_batch_size=1, prefill_chunk_size=16), backend="reference")
    cache.add_sequence(0)
    run(cache, [0], [14])
    free = cache.num_available_pages_by_group
    for pages in range(0, 6):
        n = cache.append_room(0, pages, 16)
        assert cache.pages_needed([0], [n]) <= max(pages, 0)
        # the window groups bound it by their own free pages
        assert all(cache.pages_needed([0], [n], by_group=True)[g] <= free[g] for g in free)


def test_a_group_that_runs_out_names_itself_and_changes_nothing():
    cache = PagedKVCache(config(max_batch_size=1, prefill_chunk_size=8), backend="reference")
    totals = cache.num_total_pages_by_group
    sid = 0
    while True:
        cache.add_sequence(sid)
        if not cache.can_append([sid], [8]):
            break
        run(cache, [sid], [8])
        sid += 1
    before = cache.num_available_pages_by_group
    need = cache.pages_needed([sid], [8], by_group=True)
    short = [g for g in ("window=5", "window=9") if need[g] > before[g]]
    assert short and need["full"] <= before["full"], (need, before)
    with pytest.raises(kvcache.CacheFullError, match=f"window group '{short[0]}'") as exc:
        cache.begin_forward([sid], [8])
    assert f"but {before[short[0]]} of its {totals[short[0]]} are free" in str(exc.value)
    assert cache.num_available_pages_by_group == before
    assert cache.sequence_length(sid) == 0


def test_pages_are_freed_at_commit_not_by_the_forward_that_slides_them():
    cache = PagedKVCache(config(), backend="reference")
    cache.add_sequence(0)
    run(cache, [0], [16])
    assert cache.window_pages(0) == {"window=5": (8, 2), "window=9": (4, 3)}
    free = cache.num_available_pages_by_group
    cache.begin_forward([0], [4])          # one new page each; none freed yet
    assert cache.window_pages(0) == {"window=5": (8, 3), "window=9": (4, 4)}
    cache.abort_forward()
    assert cache.num_available_pages_by_group == free
    run(cache, [0], [4])                   # length 20: w=5 keeps from 15, w=9 from 11
    assert cache.window_pages(0) == {"window=5": (12, 2), "window=9": (8, 3)}
    after = cache.num_available_pages_by_group
    assert after == dict(free, full=free["full"] - 1)     # one page taken, one freed per group


# ---------------------------------------------------------------------------- refusals
def test_whole_sequence_calls_are_refused(tmp_path):
    cache = PagedKVCache(config(), backend="reference")
    cache.add_sequence(0)
    run(cache, [0], [12])
    refused = [lambda: cache.export_sequence(0), lambda: cache.export_sequences([0]),
               lambda: cache.save_sequences(tmp_path / "x.kv", [0]),
               lambda: cache.load_sequences(tmp_path / "x.kv"),
               lambda: kvcache.HostTier(cache).offload(0),
               lambda: cache.get_kv(0),
               lambda: cache.enable_sliding_window(0, 8, 0),
               lambda: cache.begin_forward([0], [2], [-1, 0]),
               lambda: cache.popn(0, 12)]
    for call in refused:
        with pytest.raises(kvcache.UnsupportedFeatureError):
            call()
    assert not (tmp_path / "x.kv").exists()
    assert cache.sequence_length(0) == 12 and cache.sequence_ids == [0]


def test_window_left_of_a_windowed_layer():
    cache = PagedKVCache(config(), backend="reference")
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    x = [cache.from_numpy(np.ones((3, h, 8))) for h in (4, 2, 2)]
    with pytest.raises(kvcache.InvalidArgumentError, match="window_left=6 for layer 0"):
        cache.attention(0, *x, window_left=6)
    with pytest.raises(kvcache.InvalidArgumentError, match="window_left"):
        cache.attention(0, *x, window_left=2.0)
    cache.attention(0, *x, window_left=5)
    cache.attention(1, *x, window_left=100)       # a full layer: any window
    cache.attention(2, *x, window_left=-1)        # the group's
    cache.end_forward()


def test_get_kv_of_a_windowed_layer_starts_at_its_first_live_position():
    cache = PagedKVCache(config(), backend="reference")
    cache.add_sequence(0)
    run(cache, [0], [16])
    k, v = cache.get_kv(0, 8, None, layer=0)
    assert k.shape == (8, 2, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="from position 8 on"):
        cache.get_kv(0, 7, None, layer=0)
    assert cache.get_kv(0, 0, None, layer=1)[0].shape == (16, 2, 8)


# ---------------------------------------------------------------------------- the memory row
def test_memory_row_meets_its_target():
    from kvcache.bench.memory import TARGET, memory_rows
    rows = memory_rows(context=32768, window=1024, local=5, sequences=(1,))
    assert rows[0]["ratio"] >= TARGET
    assert rows[0]["grouped_pages"]["window=1024"] < rows[0]["plain_pages"]["full"]


def test_memory_of_another_mix_is_printed_against_its_ceiling(capsys):
    # gpt-oss's 1:1 mix keeps every page of half its layers: at most 2x, so the 5:1 mix's
    # 3x is not its verdict; the row says how close it comes to its own ceiling
    from kvcache.bench.memory import memory_rows, print_memory
    rows = memory_rows(context=32768, window=128, local=1, sequences=(1,))
    assert 1.5 < rows[0]["ratio"] < 2
    print_memory(rows)
    out = capsys.readouterr().out
    assert "MISSED" not in out and f"{rows[0]['ratio'] / 2:.0%} of this mix's 2x ceiling" in out


def test_appendable_pages_are_the_most_constrained_groups():
    """``num_appendable_pages`` (the scheduler's page budget): the fewest free pages of any
    group; a forward takes as many new pages from every group (``pages_needed(by_group=True)``
    counts them alike), so ``can_append`` is exactly ``pages_needed <= num_appendable_pages``.
    Five sequences in pools sized for two (max_batch_size): the window groups run short
    before the full pool does."""
    cache = PagedKVCache(config(max_total_tokens=512), backend="reference")
    # empty: every page free, and the window pools far smaller than the full one
    assert cache.num_appendable_pages == min(cache.num_total_pages_by_group.values()) < 129
    seen_short = False
    for sid in range(5):
        cache.add_sequence(sid)
        for n in (7, 6, 3):
            by_group = cache.pages_needed([sid], [n], by_group=True)
            if not cache.can_append([sid], [n]):
                break
            run(cache, [sid], [n])
            assert len(set(by_group.values())) == 1, by_group
        free = cache.num_available_pages_by_group
        assert cache.num_appendable_pages == min(free.values())
        seen_short |= min(free.values()) < free["full"]
        for s in cache.sequence_ids:
            for n in (1, 3, 4, 9, 16):
                need = cache.pages_needed([s], [n])
                assert cache.pages_needed([s], [n], by_group=True) == dict.fromkeys(free, need)
                assert cache.can_append([s], [n]) == (need <= cache.num_appendable_pages)
                room = cache.append_room(s, cache.num_appendable_pages, n)
                assert cache.can_append([s], [room]) if room else True
    assert seen_short
