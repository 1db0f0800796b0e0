"""Automatic prefix caching, case by case (the stateful test, test_prefix_stateful.py, runs
random programs of the same operations against a token-list model)."""

import numpy as np
import pytest

import kvcache
from kvcache import CacheFullError, InvalidArgumentError, SequenceExistsError

PS = 4


def make(prefix_cache=True, tokens=64, **kw):
    config = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                                 page_size=PS, max_total_tokens=tokens, prefill_chunk_size=64,
                                 max_batch_size=8, dtype="float32", rope_mode="none",
                                 prefix_cache=prefix_cache, **kw)
    return kvcache.PagedKVCache(config, backend="reference")


def kv(tokens, start):
    """K/V rows of tokens at positions start..: a function of (token, position)."""
    rows = np.array([[t, start + i, 1, 0, 0, 0, 0, 0] for i, t in enumerate(tokens)], np.float32)
    return rows[:, None, :], -rows[:, None, :]


def run(cache, sid, tokens, start):
    q = np.ones((len(tokens), 2, 8), np.float32)
    k, v = kv(tokens, start)
    with cache.forward([sid], [len(tokens)]):
        return kvcache.to_numpy(cache.attention(0, q, k, v))


def stored(cache, sid):
    return kvcache.to_numpy(cache.get_kv(sid)[0])[0, :, 0, :2].astype(int).tolist()


def serve(cache, sid, prompt, new=()):
    """A request: add with its prompt, compute the rest, append ``new`` tokens, record them."""
    start = cache.add_sequence(sid, prompt)
    run(cache, sid, prompt[start:], start)
    if new:
        for i, t in enumerate(new):
            run(cache, sid, [t], len(prompt) + i)
        cache.extend_tokens(sid, list(new))
    return start


def test_a_repeated_prompt_starts_from_its_whole_pages_and_holds_the_right_rows():
    cache = make()
    prompt = list(range(10, 21))                   # 11 tokens: 2 full pages and 3
    assert serve(cache, 0, prompt) == 0
    assert cache.match_prefix(prompt) == 8 and cache.match_prefix(prompt[:9]) == 8
    assert cache.match_prefix(prompt[:8]) == 4      # at least one token is left to compute
    assert cache.add_sequence(1, prompt) == 8 and cache.sequence_length(1) == 8
    assert stored(cache, 1) == [[t, i] for i, t in enumerate(prompt[:8])]
    assert cache.match_prefix([10, 11, 12, 99, 14]) == 0 and cache.match_prefix([7] + prompt) == 0


def test_a_second_turn_finds_the_first_turns_prompt_and_answer():
    cache = make(tokens=128)
    turn1 = list(range(30, 39))                     # 9 tokens
    serve(cache, 0, turn1, new=[5, 6, 7, 8])        # 13 tokens hold KV (the last pick has none)
    cache.remove_sequence(0)
    turn2 = turn1 + [5, 6, 7, 8] + [40, 41, 42]
    assert cache.num_sequences == 0 and cache.is_empty
    assert cache.add_sequence(1, turn2) == 12       # 3 full pages: prompt and answer
    assert stored(cache, 1) == [[t, i] for i, t in enumerate(turn2[:12])]


def test_pages_of_removed_sequences_count_as_available_and_are_evicted_least_recent_first():
    cache = make(tokens=32)                        # 9 pages (one spare)
    total = cache.num_total_pages
    a, b = [1] * 9, [2] * 9
    serve(cache, 0, a)
    serve(cache, 1, b)
    cache.remove_sequence(0)
    cache.remove_sequence(1)
    assert cache.num_cached_pages == 4 and cache.num_available_pages == total
    assert cache.add_sequence(2, a) == 8             # a is used again: b is now the older
    cache.remove_sequence(2)
    big = list(range(100, 100 + 4 * (total - 3)))   # needs every page but 2, 1 of which is free
    serve(cache, 3, big[:-1])
    assert cache.match_prefix(a) == 8 and cache.match_prefix(b) < 8


def test_cache_full_only_when_eviction_cannot_make_room_and_then_nothing_changes():
    cache = make(tokens=32)
    total = cache.num_total_pages
    serve(cache, 0, [1] * 9)
    cache.remove_sequence(0)
    cache.add_sequence(1)
    run(cache, 1, list(range(4 * (total - 1))), 0)  # evicts the cached page it needs
    assert cache.match_prefix([1] * 9) == 4
    cache.remove_sequence(1)                         # no ids recorded: its pages are freed
    serve(cache, 2, [3] * 5)
    cache.remove_sequence(2)
    cached, avail = cache.num_cached_pages, cache.num_available_pages
    cache.add_sequence(4)
    with pytest.raises(CacheFullError):
        cache.begin_forward([4], [4 * (avail + 1)])
    assert (cache.num_cached_pages, cache.num_available_pages) == (cached, avail)
    assert cache.match_prefix([3] * 5) == 4          # the index is as it was
    with pytest.raises(InvalidArgumentError):        # a bad forward evicts nothing either
        cache.begin_forward([4], [0])
    assert cache.num_cached_pages == cached


def test_an_extra_key_separates_entries_and_bad_input_is_refused_with_nothing_changed():
    cache = make()
    prompt = list(range(9))
    start = cache.add_sequence(0, prompt, extra_key="lora-a")
    run(cache, 0, prompt[start:], start)
    assert cache.match_prefix(prompt, extra_key="lora-a") == 8
    assert cache.match_prefix(prompt) == 0 and cache.match_prefix(prompt, extra_key="lora-b") == 0
    for bad in ([1, -2], [1.5], "abc", [True]):
        with pytest.raises(InvalidArgumentError, match="tokens"):
            cache.add_sequence(5, bad)
    with pytest.raises(InvalidArgumentError, match="hashable"):
        cache.add_sequence(5, [1, 2], extra_key=[1])
    with pytest.raises(InvalidArgumentError, match="extra_key"):
        cache.add_sequence(5, extra_key="x")
    with pytest.raises(SequenceExistsError):
        cache.add_sequence(0, prompt)
    with pytest.raises(InvalidArgumentError):
        cache.extend_tokens(0, [3, -1])
    assert cache.sequence_ids == [0] and 5 not in cache.sequence_ids


def test_without_the_prefix_cache_tokens_are_checked_and_nothing_is_kept():
    cache = make(prefix_cache=False)
    prompt = list(range(9))
    assert serve(cache, 0, prompt) == 0
    cache.remove_sequence(0)
    assert cache.num_cached_pages == 0 and cache.match_prefix(prompt) == 0
    assert cache.add_sequence(1, prompt) == 0
    assert cache.clear_prefix_cache() == 0
    with pytest.raises(InvalidArgumentError):
        cache.add_sequence(2, [-1])


def test_popn_into_a_cached_prefix_keeps_the_cache_and_the_sequence_rows():
    cache = make()
    prompt = list(range(50, 61))
    serve(cache, 0, prompt)
    cache.popn(0, 6)                                 # back into the second cached page
    assert stored(cache, 0) == [[t, i] for i, t in enumerate(prompt[:5])]
    run(cache, 0, [7, 7, 7], 5)
    assert stored(cache, 0)[5:] == [[7, 5], [7, 6], [7, 7]]
    assert cache.match_prefix(prompt) == 8           # the cached pages were not written over
    assert cache.add_sequence(1, prompt) == 8
    assert stored(cache, 1) == [[t, i] for i, t in enumerate(prompt[:8])]


def test_forks_know_their_parents_tokens_and_windowed_sequences_are_not_indexed():
    cache = make(support_sliding_window=True)
    prompt = list(range(20, 29))
    serve(cache, 0, prompt)
    cache.fork_sequence(0, 1, 6)
    run(cache, 1, [1, 2, 3], 6)
    cache.extend_tokens(1, [1, 2, 3])
    cache.remove_sequence(1)
    assert cache.match_prefix(prompt[:6] + [1, 2, 3, 4]) == 8    # the child's own page
    with pytest.raises(InvalidArgumentError, match="shares its first"):
        cache.enable_sliding_window(0, 4, 1)         # its pages are shared with the cache
    cache.add_sequence(2, [9] * 9)
    cache.enable_sliding_window(2, 4, 1)             # before the first forward: fine
    run(cache, 2, [9] * 9, 0)
    cache.remove_sequence(2)
    assert cache.match_prefix([9] * 10) == 0         # its pages slid: never indexed


def test_an_imported_sequence_is_indexed_once_its_tokens_are_recorded():
    src, dst = make(), make()
    prompt = list(range(60, 69))
    serve(src, 0, prompt)
    dst.import_sequence(5, src.export_sequence(0))
    assert dst.match_prefix(prompt) == 0
    dst.extend_tokens(5, prompt)
    dst.remove_sequence(5)
    assert dst.add_sequence(6, prompt) == 8
    assert stored(dst, 6) == [[t, i] for i, t in enumerate(prompt[:8])]


def test_clear_drops_the_index():
    cache = make()
    serve(cache, 0, list(range(9)))
    cache.clear()
    assert cache.match_prefix(list(range(9))) == 0 and cache.num_cached_pages == 0
    assert cache.num_available_pages == cache.num_total_pages


def test_popn_into_a_page_shared_with_the_cache_keeps_the_recorded_ids():
    """popn that copies a partial page the cache shares replaces the sequence's record in the
    page table; the ids it recorded must go with it (they were lost: a later extend_tokens
    recorded ids from position 0, indexing the page of 1 2 3 4 under 0 0 0 0)."""
    cache = make()
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 7]
    serve(cache, 0, prompt)                         # pages 1 2 3 4 | 1 2 3 4 cached
    cache.popn(0, 2)                                # 7 tokens: into the shared second page
    cache.extend_tokens(0, [0, 0, 0, 0])            # ids of positions 7..10
    assert cache.match_prefix([0, 0, 0, 0, 5]) == 0
    assert cache.match_prefix([1, 2, 3, 4, 1, 2, 3, 4, 5]) == 8
    cache.remove_sequence(0)
    cached = cache.num_cached_pages
    assert cached == 2 and cache.clear_prefix_cache() == cached


def test_a_page_computed_twice_is_evicted_while_its_copy_is_in_use():
    """A sequence that computed a cached page again (added without its tokens) and went on
    past it holds a copy: the index entry then moves to the copy, and the first page can
    be evicted (it was stranded: counted as available, but never freed)."""
    cache = make(tokens=32)
    serve(cache, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9])    # pages 1-4 | 5-8
    cache.add_sequence(1)
    run(cache, 1, [1, 2, 3, 4, 6, 6, 6, 6, 9], 0)
    cache.extend_tokens(1, [1, 2, 3, 4, 6, 6, 6, 6, 9])   # 1-4 is indexed already (seq 0's)
    cache.remove_sequence(0)
    assert cache.num_cached_pages == 2
    assert cache.clear_prefix_cache() == 2          # both of sequence 0's pages
    assert cache.num_cached_pages == 0
    assert cache.match_prefix([1, 2, 3, 4, 6, 6, 6, 6, 0]) == 8   # served from sequence 1's
    assert cache.add_sequence(2, [1, 2, 3, 4, 6, 6, 6, 6, 0]) == 8
    assert stored(cache, 2) == [[t, i] for i, t in enumerate([1, 2, 3, 4, 6, 6, 6, 6])]
    cache.remove_sequence(1)
    cache.remove_sequence(2)
    cached = cache.num_cached_pages
    assert cached == 2 and cache.clear_prefix_cache() == cached
    assert cache.num_available_pages == cache.num_total_pages


def test_a_copy_of_a_cached_page_with_a_new_page_after_it_is_evicted_whole():
    """A fork that copied a partial page, completed it with the same ids as a cached page and
    went on: its new page's entry hangs under the cached page's entry, which must stay with
    the pages it was computed in (moving it to the copy stranded the copy once the new page
    was evicted: the entry still had a child elsewhere)."""
    cache = make(tokens=32)
    serve(cache, 0, [1, 2, 3, 4, 1, 2, 3, 4, 9])    # stays: it reads its cached pages
    cache.fork_sequence(0, 1, 3)                    # copies 1 2 3 into a page of its own
    run(cache, 1, [4, 6, 6, 6, 6, 9], 3)
    cache.extend_tokens(1, [4, 6, 6, 6, 6, 9])      # 1 2 3 4 (indexed) | 6 6 6 6 (new)
    cache.remove_sequence(1)
    cached = cache.num_cached_pages
    assert cached == 2 and cache.clear_prefix_cache() == cached
    assert cache.match_prefix([1, 2, 3, 4, 1, 2, 3, 4, 0]) == 8


def test_ids_are_taken_as_a_checked_copy():
    """``_token_ids`` copies and checks the ids (ints >= 0) at C speed, every time: an array
    changed in place since it was last asked about is checked again."""
    import array as _array
    from kvcache.kv_manager import token_ids as _token_ids
    ids = _array.array("q", [3, 4, 5])
    got = _token_ids(ids, "t")
    assert got.ids.tolist() == [3, 4, 5] and not got.ids.flags.writeable
    ids[0] = 9
    assert got.ids.tolist() == [3, 4, 5]                    # a copy: the caller's may change
    for bad in (_array.array("q", [3, -1]), np.array([3, -1]), np.array([2**63], np.uint64),
                [3, -1], [3, True], [3, 1.0], [np.int64(3), -1], (3, -1)):
        with pytest.raises(kvcache.InvalidArgumentError, match="-1|int|9223372036854775808"):
            _token_ids(bad, "t")
    assert _token_ids([np.int64(3), np.uint8(4)], "t").ids.tolist() == [3, 4]
    assert _token_ids(np.array([3, 4], np.int8), "t").ids.tolist() == [3, 4]
    assert _token_ids(np.arange(6)[::2], "t").ids.tolist() == [0, 2, 4]
    assert _token_ids([], "t").ids.tolist() == [] and _token_ids((), "t").ids.tolist() == []
    ids[1] = -1                                                  # changed: checked again
    with pytest.raises(kvcache.InvalidArgumentError, match="-1"):
        _token_ids(ids, "t")
    ids[1] = 7
    assert _token_ids(ids, "t").ids.tolist() == [9, 7, 5]


def test_a_changed_array_is_matched_by_its_new_ids():
    """The scheduler passes one array per waiting request, step after step: an array whose
    ids changed in place between calls is matched by the new ones."""
    import array as _array
    cache = make()
    serve(cache, 0, list(range(10, 21)))
    probe = _array.array("q", range(10, 21))
    arr = np.arange(10, 21)
    assert cache.match_prefix(probe) == 8 and cache.prefix_admission(probe) == (8, 0)
    assert cache.match_prefix(arr) == 8
    probe[5], arr[5] = 99, 99                       # page 2 differs now
    assert cache.match_prefix(probe) == 4 and cache.match_prefix(arr) == 4
    probe[0] = 98
    assert cache.match_prefix(probe) == 0 and cache.add_sequence(1, probe) == 0
    probe[0], probe[5] = 10, 15
    assert cache.add_sequence(2, probe) == 8
    assert stored(cache, 2) == [[t, i] for i, t in enumerate(range(10, 18))]


def test_extra_keys_with_one_python_hash_are_still_different_keys():
    """-1 and -2 hash alike in CPython, so the index files their pages under one key: pages
    computed under one are never handed to the other, and each key's own pages are found."""
    assert hash(-1) == hash(-2)
    cache = make()
    prompt = list(range(10, 21))
    cache.add_sequence(0, prompt, extra_key=-1)
    run(cache, 0, prompt, 0)
    assert cache.match_prefix(prompt, extra_key=-1) == 8
    assert cache.match_prefix(prompt, extra_key=-2) == 0
    assert cache.prefix_admission(prompt, extra_key=-2) == (0, 0)
    assert cache.add_sequence(1, prompt, extra_key=-2) == 0
    k, v = kv(prompt, 0)
    with cache.forward([1], [len(prompt)]):         # rows told apart from sequence 0's
        cache.attention(0, np.ones((len(prompt), 2, 8), np.float32), k + 100, v)
    cache.remove_sequence(0)
    cache.remove_sequence(1)
    assert cache.match_prefix(prompt, extra_key=-1) == 8
    assert cache.match_prefix(prompt, extra_key=-2) == 8
    assert cache.match_prefix(prompt, extra_key=-3) == 0 and cache.match_prefix(prompt) == 0
    assert cache.add_sequence(2, prompt, extra_key=-1) == 8
    assert cache.add_sequence(3, prompt, extra_key=-2) == 8
    assert stored(cache, 2) == [[t, i] for i, t in enumerate(prompt[:8])]
    assert stored(cache, 3) == [[t + 100, i + 100] for i, t in enumerate(prompt[:8])]


def test_one_page_at_one_depth_after_different_prefixes_is_told_apart():
    """The index files a node under its depth and its own page: pages alike at one depth
    after different first pages share that, and each prompt still gets its own pages, all of
    them."""
    cache = make()
    a = [1, 2, 3, 4] + [7, 7, 7, 7] + [9]
    b = [5, 6, 7, 8] + [7, 7, 7, 7] + [9]
    assert serve(cache, 0, a) == 0
    assert cache.match_prefix(b) == 0
    assert serve(cache, 1, b) == 0
    for sid in (0, 1):
        cache.remove_sequence(sid)
    assert cache.match_prefix(a) == 8 and cache.match_prefix(b) == 8
    assert cache.match_prefix([1, 2, 3, 4, 7, 7, 7, 0, 9]) == 4
    assert cache.match_prefix([0, 2, 3, 4, 7, 7, 7, 7, 9]) == 0
    c = [5, 6, 7, 8] + [8, 8, 8, 8] + [9]
    assert serve(cache, 2, c) == 4
    cache.remove_sequence(2)
    # page 2 of this one is filed (after c's first page), not after its own first page
    assert cache.match_prefix([1, 2, 3, 4, 8, 8, 8, 8, 9]) == 4
    assert cache.match_prefix([1, 2, 3, 4, 8, 8, 8, 8, 1, 1, 1, 1, 2]) == 4
    assert cache.add_sequence(3, b) == 8
    assert stored(cache, 3) == [[t, i] for i, t in enumerate(b[:8])]


def test_prompts_of_three_token_ids_share_keys_and_never_get_another_prefixs_pages():
    """Random prompts over ids {0, 1, 2} with pages of 4: many pages are alike at one depth
    after different prefixes. A match gives only pages whose tokens are the prompt's own, and
    the prompt just computed is found whole."""
    cache = make(tokens=128)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 3, int(rng.integers(5, 30))).tolist() for _ in range(40)]
    after: dict = {}                # (depth, page) -> the prefixes it follows, in these prompts
    for p in prompts:
        for d in range(1, (len(p) - 1) // PS + 1):
            after.setdefault((d, tuple(p[(d - 1) * PS:d * PS])), set()).add(tuple(p[:d * PS]))
    assert sum(len(prefixes) > 1 for prefixes in after.values()) > 10   # the case this is about
    for i, p in enumerate(prompts):
        got = cache.add_sequence(i, p)
        assert stored(cache, i) == [[t, j] for j, t in enumerate(p[:got])]
        for q in prompts[:i]:
            m = cache.match_prefix(q)
            assert m % PS == 0 and m < len(q)
        run(cache, i, p[got:], got)
        assert stored(cache, i) == [[t, j] for j, t in enumerate(p)]
        cache.remove_sequence(i)
        cache.state.pt.check_invariants()
        assert cache.match_prefix(p) == (len(p) - 1) // PS * PS
    hits = [cache.match_prefix(p) for p in prompts]
    for p, m in zip(prompts, hits):            # a hit is a prefix some prompt computed
        assert m == 0 or any(q[:m] == p[:m] and len(q) >= m for q in prompts)


def test_every_match_is_the_longest_whole_page_prefix_any_computed_prompt_shares():
    """Judged by brute force over the prompts computed (a cache large enough to evict none):
    random asks over ids {0, 1, 2}, some extending a computed prompt, in an order that moves
    the depth where one search ends (tried first by the next) above and below the next
    answer."""
    cache = make(tokens=4096)
    rng = np.random.default_rng(5)
    done = []
    for i in range(24):
        base = done[int(rng.integers(len(done)))] if done and rng.random() < 0.6 else []
        p = base[:int(rng.integers(0, len(base) + 1))] + rng.integers(0, 3, int(rng.integers(1, 20))).tolist()
        serve(cache, i, p)
        cache.remove_sequence(i)
        done.append(p)

    def want(q):
        best = 0
        for p in done:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, min(n // PS, len(p) // PS, (len(q) - 1) // PS))
        return best * PS

    asked = 0
    for _ in range(400):
        p = done[int(rng.integers(len(done)))]
        q = p[:int(rng.integers(0, len(p) + 1))] + rng.integers(0, 3, int(rng.integers(0, 12))).tolist()
        if not q:
            continue
        assert cache.match_prefix(q) == want(q), q
        asked += want(q) > 0
    assert asked > 100


def test_a_page_of_token_id_0_is_cached_like_any_other():
    """Id 0 is a token like any other (a padding id, or "!" in some vocabularies): a prompt
    with a page of zeros is cached whole, and told apart from the same prompt without it
    (the earlier index keyed a prefix by a weighted sum of its ids, to which zeros add
    nothing: such a page had its parent's key, and indexing stopped there)."""
    cache = make()
    prompt = [1, 2, 3, 4] + [0, 0, 0, 0] + [5, 6, 7, 8] + [9]
    assert serve(cache, 0, prompt) == 0
    cache.remove_sequence(0)
    assert cache.match_prefix(prompt) == 12
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4
    assert cache.add_sequence(1, [1, 2, 3, 4, 0, 0, 0, 0, 0]) == 8
    assert stored(cache, 1) == [[t, i] for i, t in enumerate(prompt[:8])]
