"""State checkpoints: the prefix cache with ``State`` layers (docs/hybrid.md, increment 6) on
the reference backend. A toy recurrence stands in for a model's state layers, and its judge is
a plain function of the token list: every state a sequence reads, cold or restored from a
checkpoint after a prefix hit, must equal the judge's state after its tokens, bit for bit. Also:
where a hit ends (the deepest boundary with a checkpoint), the miss reasons, checkpoints given
for boundaries inside a forward or only at its end, the interval, the least recently used
checkpoint dropped for room (the deepest of a forward kept first), eviction freeing them, and
the refusals with the prefix cache on, each leaving the cache as it was."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import CacheConfig, PagedKVCache, State, to_numpy

PS = 4
KINDS = {1: State({"conv": (2,), "ssm": (3,)}), 3: State({"ssm": (3,)})}


def config(**kw):
    base = dict(num_layers=4, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=PS,
                max_batch_size=4, max_total_tokens=256, prefill_chunk_size=64,
                dtype="float32", rope_mode="none", layer_kinds=KINDS, prefix_cache=True)
    base.update(kw)
    return CacheConfig(**base)


def cache_of(**kw):
    return PagedKVCache(config(**kw), backend="reference")


# ---------------------------------------------------------------------------- the toy model
def _emb(token: int, layer: int, width: int) -> np.ndarray:
    return np.float32(np.sin(np.arange(1, width + 1, dtype=np.float32) * (token + 1) * (layer + 1)))


def advance(layer: int, name: str, state: np.ndarray, token: int) -> np.ndarray:
    """One token of the toy recurrence: ``conv`` keeps the last two inputs, ``ssm`` decays."""
    if name == "conv":
        return np.array([state[1], np.float32(token % 13) / np.float32(7)], np.float32)
    return (state * np.float32(0.75) + _emb(token, layer, state.shape[0])).astype(np.float32)


def judge(tokens) -> dict:
    """The states after ``tokens`` from zeros: the plain token-list model."""
    out = {}
    for layer, kind in KINDS.items():
        for name, shape in kind.shapes:
            s = np.zeros(shape, np.float32)
            for t in tokens:
                s = advance(layer, name, s, t)
            out[layer, name] = s
    return out


def forward(cache, batch: dict, seen: dict, give_inner: bool = True) -> None:
    """One forward appending ``batch[sid]`` (token lists) to each sequence; ``seen[sid]``: its
    tokens so far (updated). Every state read must be the judge's; the states at the boundaries
    ``state_checkpoints()`` lists are given when ``give_inner``."""
    ids = list(batch)
    lens = [len(batch[s]) for s in ids]
    rng = np.random.default_rng(len(ids))
    c = cache.config
    with cache.forward(ids, lens):
        for layer in (0, 2):
            q, k, v = (cache.from_numpy(rng.standard_normal((sum(lens), h, c.head_dim)))
                       for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            cache.attention(layer, q, k, v)
        inner = cache.state_checkpoints()
        starts = [len(seen[s]) for s in ids]
        for (row, n) in inner:
            assert 0 < n < lens[row] and (starts[row] + n) % c.page_size == 0
        for layer, kind in KINDS.items():
            for name in kind.names:
                old = to_numpy(cache.get_state(layer, name))
                new, at = old.copy(), {}
                for row, sid in enumerate(ids):
                    want = judge(seen[sid])[layer, name]
                    assert np.array_equal(old[row], want), (sid, layer, name, len(seen[sid]))
                    s = old[row]
                    for j, t in enumerate(batch[sid]):
                        s = advance(layer, name, s, t)
                        at[row, j + 1] = s
                    new[row] = s
                cache.set_state(layer, name, cache.from_numpy(new))
                if give_inner and inner:
                    cache.set_state_checkpoints(
                        layer, name, cache.from_numpy(np.stack([at[w] for w in inner])))
    for sid in ids:
        seen[sid] = seen[sid] + list(batch[sid])
    if cache.manager.prefix is not None:
        cache.manager.prefix.check()
    cache.state.slots.check_invariants(cache.sequence_ids)


def states_of(cache, sid) -> dict:
    """``sid``'s states, read in a forward that is aborted."""
    cache.begin_forward([sid], [1])
    out = {(layer, name): to_numpy(cache.get_state(layer, name))[0].copy()
           for layer, kind in KINDS.items() for name in kind.names}
    cache.abort_forward()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


PROMPT = [int(t) for t in np.random.default_rng(1).integers(1, 50, 30)]


# ---------------------------------------------------------------------------- hits
def test_a_hit_restores_the_states_at_the_boundary():
    cache = cache_of()
    seen = {1: []}
    assert cache.add_sequence(1, PROMPT) == 0
    forward(cache, {1: PROMPT}, seen)               # boundaries 4 .. 28, given inside
    cache.remove_sequence(1)
    other = PROMPT[:22] + [99, 98, 97]
    assert cache.match_prefix(other) == 20
    assert cache.add_sequence(2, other) == 20       # 5 whole pages
    seen[2] = other[:20]
    assert same(states_of(cache, 2), judge(other[:20]))
    forward(cache, {2: other[20:]}, seen)
    assert same(states_of(cache, 2), judge(other))
    assert cache.prefix_miss_tokens_by_reason == {"checkpoint": 0}
    # the same prompt again: the deepest boundary, 28 (29 tokens would leave none to compute)
    assert cache.add_sequence(3, PROMPT) == 28
    assert same(states_of(cache, 3), judge(PROMPT[:28]))


def test_without_inner_states_only_a_forwards_end_is_a_checkpoint():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT}, seen, give_inner=False)    # ends at 30: no boundary
    cache.remove_sequence(1)
    assert cache.match_prefix(PROMPT[:22] + [99]) == 0
    assert cache.add_sequence(2, PROMPT[:22] + [99]) == 0
    assert cache.prefix_miss_tokens_by_reason == {"checkpoint": 20}
    cache.remove_sequence(2)
    # chunks of 8: the states at 8, 16 and 24 are the forwards' ends
    seen[3] = []
    cache.add_sequence(3, PROMPT)
    for i in range(0, 30, 8):
        forward(cache, {3: PROMPT[i:i + 8]}, seen, give_inner=False)
    cache.remove_sequence(3)
    assert cache.add_sequence(4, PROMPT[:22] + [99]) == 16
    assert same(states_of(cache, 4), judge(PROMPT[:16]))
    # 20 (seq 2), 28 (seq 3: the same prompt, no checkpoint yet), 4 (seq 4: 20 -> 16)
    assert cache.prefix_miss_tokens_by_reason == {"checkpoint": 20 + 28 + 4}


def test_the_interval_spaces_the_checkpoints():
    cache = cache_of(state_checkpoint_interval=3)
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT[:5]}, seen)
    assert cache.open_plan is None
    cache.begin_forward([1], [25])
    assert cache.state_checkpoints() == ((0, 7), (0, 19))        # positions 12 and 24
    cache.abort_forward()
    forward(cache, {1: PROMPT[5:]}, seen)
    cache.remove_sequence(1)
    assert cache.add_sequence(2, PROMPT[:23] + [99]) == 12
    assert same(states_of(cache, 2), judge(PROMPT[:12]))


def test_decode_steps_keep_the_boundaries_they_end_at():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT[:14])               # the ids of every position recorded
    forward(cache, {1: PROMPT[:3]}, seen)
    for t in PROMPT[3:13]:
        forward(cache, {1: [t]}, seen)
    cache.remove_sequence(1)
    assert cache.add_sequence(2, PROMPT[:13] + [99]) == 12
    assert same(states_of(cache, 2), judge(PROMPT[:12]))


def test_a_boundary_past_the_recorded_ids_is_no_checkpoint():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT[:6])
    cache.begin_forward([1], [10])
    assert cache.state_checkpoints() == ((0, 4),)   # 8 is past the 6 recorded ids
    cache.abort_forward()


def test_room_drops_the_least_recently_used_checkpoint_deepest_kept_first():
    cache = cache_of(max_state_checkpoints=2)
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT}, seen)               # 7 boundaries, 2 rows: 28 and 24 kept
    cache.remove_sequence(1)
    assert cache.match_prefix(PROMPT[:22] + [99]) == 0
    assert cache.match_prefix(PROMPT[:26] + [99]) == 24
    assert cache.add_sequence(2, PROMPT) == 28
    other = [7] * 13
    seen[3] = []
    cache.add_sequence(3, other)
    forward(cache, {3: other}, seen)                # 4, 8, 12: the rows of 24 (then 28) go
    held = sorted(n.depth * PS for n in cache.manager.prefix.ckpts.held.values())
    assert held == [8, 12]
    assert cache.match_prefix(PROMPT) == 0
    assert cache.match_prefix(other + [1]) == 12


def test_evicting_a_node_frees_its_checkpoint():
    cache = cache_of(max_total_tokens=32)
    assert cache.num_total_pages == 9
    seen = {1: [], 2: []}
    cache.add_sequence(1, PROMPT[:21])
    forward(cache, {1: PROMPT[:21]}, seen)
    cache.remove_sequence(1)
    assert len(cache.manager.prefix.ckpts.held) == 5
    other = [5] * 34
    cache.add_sequence(2, other)
    forward(cache, {2: other}, seen)                # needs the cached pages: evicted
    assert cache.match_prefix(PROMPT[:21]) == 0
    assert len(cache.manager.prefix.ckpts.held) == 8      # other's 4 .. 32 alone


def test_forks_keep_the_parents_state_and_popn_is_refused_with_nothing_changed():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT[:10]}, seen)
    cache.fork_sequence(1, 2)
    assert same(states_of(cache, 2), judge(PROMPT[:10]))
    before = (cache.num_available_pages, cache.num_cached_pages, cache.sequence_length(1),
              cache.manager.prefix.count, len(cache.state.pt.seqs))
    with pytest.raises(kvcache.UnsupportedFeatureError, match="no checkpoint of position 9"):
        cache.popn(1, 1)                # not a page boundary
    assert before == (cache.num_available_pages, cache.num_cached_pages,
                      cache.sequence_length(1), cache.manager.prefix.count,
                      len(cache.state.pt.seqs))
    cache.manager.prefix.check()


def test_set_state_checkpoints_checks_its_values():
    cache = cache_of()
    cache.add_sequence(1, PROMPT)
    cache.begin_forward([1], [10])
    with pytest.raises(kvcache.InvalidArgumentError, match=r"expected \(2, 3\)"):
        cache.set_state_checkpoints(1, "ssm", cache.from_numpy(np.zeros((1, 3), np.float32)))
    with pytest.raises(kvcache.InvalidArgumentError, match="not a state layer"):
        cache.set_state_checkpoints(0, "ssm", cache.from_numpy(np.zeros((2, 3), np.float32)))
    cache.abort_forward()
    with pytest.raises(kvcache.ForwardStateError):
        cache.state_checkpoints()


def test_an_aborted_forward_keeps_no_checkpoint():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    with pytest.raises(RuntimeError):
        with cache.forward([1], [12]):
            raise RuntimeError("the model failed")
    assert not cache.manager.prefix.ckpts.held
    forward(cache, {1: PROMPT[:12]}, seen)
    assert len(cache.manager.prefix.ckpts.held) == 3


def test_clear_forgets_the_checkpoints():
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT}, seen)
    cache.clear()
    assert cache.add_sequence(2, PROMPT) == 0 and not cache.manager.prefix.ckpts.held
    assert same(states_of(cache, 2), judge([]))


# ---------------------------------------------------------------------------- the judge
@pytest.mark.parametrize("seed", range(6))
def test_random_programs_read_the_judges_states(seed):
    """Prompts drawn from a few shared stems, added (hits), prefilled in random chunks beside
    each other, given inner checkpoints or not, popped back (to a page boundary or anywhere:
    refused where no checkpoint holds the states there), removed; small page and checkpoint
    pools. Every state read equals the judge's, and the index and slots stay whole."""
    rng = np.random.default_rng(seed)
    cache = cache_of(max_total_tokens=96, max_state_checkpoints=5, max_batch_size=3,
                     state_checkpoint_interval=int(rng.integers(1, 3)))
    stems = [[int(t) for t in rng.integers(1, 40, 24)] for _ in range(3)]
    seen: dict = {}
    want: dict = {}
    hits = popped = 0
    for sid in range(40):
        while len(seen) >= 3 or (seen and rng.random() < 0.6):
            live = list(seen)
            done = [s for s in live if len(seen[s]) == len(want[s])]
            if done and rng.random() < 0.7:
                s = done[int(rng.integers(len(done)))]
                cache.remove_sequence(s)
                del seen[s], want[s]
                continue
            if live and rng.random() < 0.25:     # popn back: allowed where the states are known
                s = live[int(rng.integers(len(live)))]
                at = int(rng.integers(0, len(seen[s]) + 1))
                if rng.random() < 0.5:
                    at = at // PS * PS            # half the time a page boundary
                n = len(seen[s]) - at
                try:
                    cache.popn(s, n)
                except kvcache.UnsupportedFeatureError:
                    assert cache.sequence_length(s) == len(seen[s])
                    continue
                popped += n > 0
                seen[s] = seen[s][:len(seen[s]) - n]   # the next forward reads its states
                assert cache.sequence_length(s) == len(seen[s])
                continue
            batch = {}
            for s in live:
                left = len(want[s]) - len(seen[s])
                if left:
                    batch[s] = want[s][len(seen[s]):len(seen[s]) + int(rng.integers(1, left + 1))]
            if not batch:
                continue
            try:
                forward(cache, batch, seen, give_inner=bool(rng.random() < 0.7))
            except kvcache.CacheFullError:
                s = max(seen, key=lambda s: len(seen[s]))
                cache.remove_sequence(s)
                del seen[s], want[s]
        stem = stems[int(rng.integers(3))]
        prompt = stem[:int(rng.integers(1, 25))] + [int(t) for t in rng.integers(1, 40, int(rng.integers(1, 8)))]
        try:
            start = cache.add_sequence(sid, prompt)
        except kvcache.CacheFullError:
            continue
        hits += start > 0
        seen[sid], want[sid] = prompt[:start], prompt
        try:
            assert same(states_of(cache, sid), judge(prompt[:start]))
        except kvcache.CacheFullError:
            pass            # no page for the read's token: its first forward checks it
        cache.manager.prefix.check()
    assert hits > 3 and popped > 0


# ---------------------------------------------------------------------------- popn
@pytest.mark.parametrize("inner", [True, False], ids=["inner", "end-only"])
def test_popn_to_a_boundary_with_a_checkpoint_restores_its_states(inner):
    # boundaries 4 and 8 get checkpoints inside the forward (given), 12 at its end: popn back
    # to one of them takes its states, and the sequence goes on from there as the judge says
    cache = cache_of()
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT[:12]}, seen, give_inner=inner)
    forward(cache, {1: PROMPT[12:14]}, seen)
    cache.fork_sequence(1, 2)           # a fork keeps its own states
    for n, at in ((2, 12), (4, 8)):
        if at == 8 and not inner:
            with pytest.raises(kvcache.UnsupportedFeatureError,
                               match=r"popn\(1, 4\) .*no checkpoint of position 8 is held"):
                cache.popn(1, n)
            assert cache.sequence_length(1) == 12
            continue
        cache.popn(1, n)
        assert cache.sequence_length(1) == at
        assert same(states_of(cache, 1), judge(PROMPT[:at]))
        seen[1] = PROMPT[:at]
    assert same(states_of(cache, 2), judge(PROMPT[:14]))
    at = cache.sequence_length(1)
    forward(cache, {1: PROMPT[at:at + 5], 2: [7, 7]}, seen | {2: PROMPT[:14]})
    cache.manager.prefix.check()


@pytest.mark.parametrize("prefix", [True, False], ids=["prefix", "no-prefix"])
def test_popn_to_zero_takes_the_states_back_to_zeros(prefix):
    cache = cache_of(prefix_cache=prefix)
    seen = {1: []}
    cache.add_sequence(1, PROMPT)
    forward(cache, {1: PROMPT[:6]}, seen)
    if not prefix:                      # no checkpoint anywhere without the prefix cache
        with pytest.raises(kvcache.UnsupportedFeatureError, match="no checkpoint of position 4"):
            cache.popn(1, 2)
    cache.popn(1, 6)
    assert cache.sequence_length(1) == 0
    assert same(states_of(cache, 1), judge([]))
    forward(cache, {1: [5, 6, 7]}, {1: []})
