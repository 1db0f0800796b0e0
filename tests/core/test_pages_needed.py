"""``pages_needed`` / ``can_append`` against ``begin_forward``: seeded random programs (add, fork
at any position, popn, sliding windows, forwards of random lengths with repeated decode batches,
removes, bad requests) on a small reference cache. Before every forward the query must predict
exactly what the forward does: ``pages_needed(net=True)`` is the drop in
``num_available_pages`` that begin_forward + attention + end_forward cause, ``can_append`` is
False exactly when begin_forward raises CacheFullError (which leaves everything unchanged), a
bad request raises the same typed error from both, and the query changes nothing (not even the
plan epoch or the decode batch a repeated step reuses)."""

import numpy as np
import pytest

import kvcache
from kvcache import CacheFullError, ForwardStateError, KVCacheError
from kvcache.core.planner import Planner

PS = 4
LIMITS = dict(max_batch_size=4, prefill_chunk_size=12)


def make_cache(sliding: bool, max_total_tokens: int = 40):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=PS, max_total_tokens=max_total_tokens, dtype="float32",
                              rope_mode="none", support_sliding_window=sliding, **LIMITS)
    return kvcache.PagedKVCache(cfg, backend="reference")


def state_of(cache):
    """Free pages, plan epoch and sequence lengths (a refused begin_forward keeps them)."""
    return (cache.num_available_pages, cache.state.epoch,
            {s: cache.sequence_length(s) for s in cache.sequence_ids})


def snapshot(cache):
    """``state_of`` plus the decode batch a repeated step would reuse (a query keeps it too;
    a refused begin_forward may drop it)."""
    return state_of(cache) + (cache.planner.decode_reuse,)


def run_layers(cache, rng, total):
    c = cache.config
    for layer in range(c.num_layers):
        q = rng.standard_normal((total, c.num_qo_heads, c.head_dim))
        k, v = (rng.standard_normal((total, c.num_kv_heads, c.head_dim)) for _ in range(2))
        cache.attention(layer, *(cache.from_numpy(x) for x in (q, k, v)))


def outcome(call):
    try:
        call()
    except KVCacheError as e:
        return type(e), str(e)
    return None


class Program:
    """One random program; ``stats`` counts what the checks saw."""

    def __init__(self, seed: int, sliding: bool):
        self.rng = np.random.default_rng(seed)
        self.cache = make_cache(sliding, max_total_tokens=int(self.rng.choice([24, 40, 64])))
        self.sliding = sliding
        self.next_id = 0
        self.decode_batch = None
        self.stats = dict(forwards=0, full=0, boundary=0, slid=0, bad=0, room=0)

    def ids(self):
        return self.cache.sequence_ids

    def pick(self):
        return int(self.rng.choice(self.ids()))

    # ------------------------------------------------------------------ structure
    def add(self):
        self.cache.add_sequence(self.next_id)
        self.next_id += 1

    def fork(self):
        parent = self.pick()
        n = self.cache.sequence_length(parent)
        pos = -1 if self.rng.random() < 0.3 else int(self.rng.integers(0, n + 1))
        try:
            self.cache.fork_sequence(parent, self.next_id, pos)
        except (kvcache.InvalidArgumentError, CacheFullError):
            return      # a windowed parent past its sinks, or no page for the partial copy
        self.next_id += 1

    def popn(self):
        sid = self.pick()
        n = int(self.rng.integers(0, self.cache.sequence_length(sid) + 1))
        try:
            self.cache.popn(sid, n)
        except CacheFullError:
            pass

    def window(self):
        w = int(self.rng.integers(2, 14))
        s = int(self.rng.integers(0, w))
        try:
            self.cache.enable_sliding_window(self.pick(), w, s)
        except kvcache.InvalidArgumentError:
            pass        # already windowed, or shares more than its sinks

    def remove(self):
        self.cache.remove_sequence(self.pick())

    # ------------------------------------------------------------------ forwards
    def batch(self):
        if self.decode_batch and self.rng.random() < 0.6 and all(
                s in self.ids() for s in self.decode_batch):
            return self.decode_batch, [1] * len(self.decode_batch)   # the reused decode plan
        ids = list(self.ids())
        self.rng.shuffle(ids)
        ids = [int(s) for s in ids[:int(self.rng.integers(1, min(len(ids), 4) + 1))]]
        if self.rng.random() < 0.5:
            lens = [1] * len(ids)
            self.decode_batch = ids
        else:
            budget = LIMITS["prefill_chunk_size"]
            lens = [int(self.rng.integers(1, max(2, budget // len(ids)) + 1)) for _ in ids]
        return ids, lens

    def bad_batch(self):
        ids, lens = self.batch()
        kind = int(self.rng.integers(0, 6))
        if kind == 0:
            return ids + [10_000], lens + [1]                 # unknown sequence
        if kind == 1:
            return ids, [0] + lens[1:]                        # a length below 1
        if kind == 2:
            return ids + ids[:1], lens + lens[:1]             # a sequence twice
        if kind == 3:
            return ids, lens + [1]                            # lengths do not match ids
        if kind == 4:
            return ids[:1], [LIMITS["prefill_chunk_size"] + 1]  # over the chunk
        return [], []                                          # no sequence

    def forward(self):
        cache = self.cache
        if self.rng.random() < 0.1:
            ids, lens = self.bad_batch()
            before = state_of(cache)
            want = outcome(lambda: cache.begin_forward(ids, lens))
            assert want is not None and want[0] is not CacheFullError
            assert state_of(cache) == before
            before = snapshot(cache)
            assert outcome(lambda: cache.pages_needed(ids, lens)) == want
            assert outcome(lambda: cache.can_append(ids, lens)) == want
            assert snapshot(cache) == before
            self.stats["bad"] += 1
            return
        ids, lens = self.batch()
        before = snapshot(cache)
        free = before[0]
        taken = cache.pages_needed(ids, lens)
        net = cache.pages_needed(ids, lens, net=True)
        room = cache.can_append(ids, lens)
        assert snapshot(cache) == before, "the query changed the cache"
        # append_room is pages_needed's inverse: the most tokens within a page budget
        sid = ids[int(self.rng.integers(len(ids)))]
        pages = int(self.rng.integers(-1, free + 2))
        limit = int(self.rng.integers(1, LIMITS["prefill_chunk_size"] + 1))
        brute = max(n for n in range(limit + 1)
                    if n == 0 or cache.pages_needed([sid], [n]) <= max(pages, 0))
        assert cache.append_room(sid, pages, limit) == brute
        assert snapshot(cache) == before, "append_room changed the cache"
        self.stats["room"] += brute < limit
        assert room == (taken <= free)
        assert net <= taken
        windowed = self.sliding and any(
            cache.state.seq(s).window != -1 for s in ids)
        if not windowed:
            assert net == taken
        self.stats["boundary"] += taken - free in (0, 1)
        try:
            cache.begin_forward(ids, lens)
        except CacheFullError:
            assert not room, f"can_append said yes, begin_forward refused {ids} {lens}"
            assert state_of(cache) == before[:3]
            cache.state.pt.check_invariants()
            self.stats["full"] += 1
            return
        assert room, f"can_append said no, begin_forward took {ids} {lens} ({taken} > {free})"
        # the drop happens in begin_forward (end_forward changes no page): ask inside too
        assert cache.num_available_pages == free - net
        run_layers(cache, self.rng, sum(lens))
        cache.end_forward()
        assert cache.num_available_pages == free - net
        cache.state.pt.check_invariants()
        self.stats["forwards"] += 1
        self.stats["slid"] += net < taken

    def step(self):
        ops = [(self.add, 2), (self.forward, 6)]
        if self.ids():
            ops += [(self.fork, 2), (self.popn, 1), (self.remove, 1)]
            if self.sliding:
                ops.append((self.window, 1))
        if not self.ids():
            ops = [(self.add, 1)]
        elif len(self.ids()) >= 6:
            ops = [op for op in ops if op[0] not in (self.add, self.fork)]
        fns, weights = zip(*ops)
        p = np.asarray(weights, float)
        fn = fns[int(self.rng.choice(len(fns), p=p / p.sum()))]
        if fn is self.forward and not self.ids():
            return
        fn()


@pytest.mark.parametrize("fast_path", [True, False], ids=["fast_path", "general"])
@pytest.mark.parametrize("sliding", [False, True], ids=["plain", "sliding"])
def test_pages_needed_predicts_begin_forward(sliding, fast_path, monkeypatch):
    monkeypatch.setattr(Planner, "fast_path", fast_path)
    totals = dict(forwards=0, full=0, boundary=0, slid=0, bad=0, room=0)
    for seed in range(30):
        prog = Program(seed, sliding)
        for _ in range(80):
            prog.step()
        for k, v in prog.stats.items():
            totals[k] += v
    # the programs reach what the test is for: full caches, the exact boundary, slides
    assert totals["forwards"] > 500 and totals["full"] > 30 and totals["boundary"] > 30
    assert totals["bad"] > 20 and totals["room"] > 30          # append_room short of its limit
    if sliding:
        assert totals["slid"] > 20


def test_counts_partial_pages_and_forks():
    cache = make_cache(False)
    cache.add_sequence(0)
    assert cache.pages_needed([0], [1]) == 1
    with cache.forward([0], [5]):
        run_layers(cache, np.random.default_rng(0), 5)
    assert cache.pages_needed([0], [3]) == 0          # 5 tokens: 3 rows left in page 2
    assert cache.pages_needed([0], [4]) == 1
    cache.fork_sequence(0, 1, 3)                      # the partial page is copied at the fork
    assert cache.pages_needed([0, 1], [3, 1]) == 0
    assert cache.pages_needed([0, 1], [4, 2]) == 2
    assert cache.pages_needed([0, 1], [4, 2], net=True) == 2


def test_sliding_window_frees_after_taking():
    cache = make_cache(True)
    cache.add_sequence(0)
    cache.enable_sliding_window(0, 8, 0)
    rng = np.random.default_rng(0)
    with cache.forward([0], [8]):
        run_layers(cache, rng, 8)
    free = cache.num_available_pages
    # 8 more tokens: 2 new pages taken, then the window slides 2 pages out
    assert cache.pages_needed([0], [8]) == 2
    assert cache.pages_needed([0], [8], net=True) == 0
    with cache.forward([0], [8]):
        run_layers(cache, rng, 8)
    assert cache.num_available_pages == free


def test_open_forward_and_token_trees():
    cache = make_cache(False)
    cache.add_sequence(0)
    rng = np.random.default_rng(0)
    cache.begin_forward([0], [3], [-1, 0, 0])
    run_layers(cache, rng, 3)
    inside = cache.pages_needed([0], [2], [-1, 3])    # counts against the open forward's pages
    cache.end_forward()
    assert cache.pages_needed([0], [2], [-1, 3]) == inside == 1
    # an uncommitted tree refuses a forward without one, typed, from both
    want = outcome(lambda: cache.begin_forward([0], [1]))
    assert want[0] is ForwardStateError
    assert outcome(lambda: cache.pages_needed([0], [1])) == want
    assert outcome(lambda: cache.can_append([0], [1])) == want
    with pytest.raises(kvcache.InvalidArgumentError, match="net"):
        cache.pages_needed([0], [1], [-1], net=1)
