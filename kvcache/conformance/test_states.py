"""State slots (``CacheConfig(layer_kinds={layer: State(shapes)})``, capability
``state_slots``, docs/hybrid.md increment 4): each sequence holds one slot of every state array
of the state layers; a forward reads its sequences' states (``get_state``, in ``begin_forward``
order) and stages new ones (``set_state``) that the slots take at ``end_forward``.

The judge is a plain dict of states on the host, ``{(sequence, layer, name): array}``: a new
sequence's states are zeros, a committed forward's writes replace them, an aborted one's do not,
a fork copies the parent's; with the prefix cache, a sequence added at a cached prefix holds
the states first written for that prefix's boundary (its checkpoint, docs/hybrid.md). Every state written is a value of the cache dtype (rounded on the
host as ``from_numpy`` rounds), so a backend must give it back bit for bit. The queued test
reads no device array until every forward, fork and remove is queued (the run-ahead rule)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

import kvcache
from kvcache import PagedKVCache, State, to_numpy

from .base import Conformance
from .harness import make_config
from .tolerance import Mismatch, round_to

KINDS = {1: State({"conv": (3, 4), "ssm": (2, 2, 5)}), 2: State({"conv": (6,)})}
NUM_LAYERS = 3          # layer 0 full attention, layers 1 and 2 state layers


class StateTwin:
    """The backend under test and the judge (a dict of host states), driven in lockstep; every
    state read is kept and compared in ``finish``."""

    def __init__(self, backend: str, device: Optional[str], dtype: str, page_size: int,
                 slots: int = 4, seed: int = 0, prefix: bool = False):
        plain = make_config(dtype=dtype, page_size=page_size, num_layers=NUM_LAYERS,
                            max_total_tokens=512, max_batch_size=4, prefill_chunk_size=128)
        import dataclasses
        self.config = dataclasses.replace(plain, layer_kinds=KINDS, max_state_slots=slots,
                                          prefix_cache=prefix)
        self.tokens: dict = {}          # sid -> its token ids (the prefix cache's keys)
        self.checkpoints: dict = {}     # a prefix's ids -> {(layer, name): its states}
        self.dtype = dtype
        self.cache = PagedKVCache(self.config, backend=backend, device=device)
        self.rng = np.random.default_rng(seed)
        self.judge: dict = {}           # (sid, layer, name) -> the state (float64, rounded)
        self.lengths: dict = {}
        self.kept: list = []            # (label, expected, device array)
        self.history: list = []

    def context(self) -> str:
        return (f"\n  backend {self.cache.backend.name!r}, dtype {self.dtype}, page size "
                f"{self.config.page_size}\n  after: {'; '.join(self.history[-8:])}")

    def states(self):
        return [(layer, name, shape) for layer, kind in KINDS.items() for name, shape in kind.shapes]

    # ------------------------------------------------------------------ sequence ops
    def add(self, sid, tokens=None):
        """Add ``sid``; with ``tokens`` (the prefix cache) it starts at the longest cached
        prefix that holds a checkpoint, with those states."""
        self.history.append(f"add {sid}" + ("" if tokens is None else f" ({len(tokens)} ids)"))
        start = self.cache.add_sequence(sid, tokens)
        self.lengths[sid] = start
        self.tokens[sid] = list(tokens or ())
        saved = self.checkpoints.get(tuple(self.tokens[sid][:start])) if start else None
        if start and saved is None:
            raise Mismatch(f"CORE BUG: add_sequence started {sid} at {start} tokens, a "
                           f"boundary no checkpoint was written for{self.context()}")
        for layer, name, shape in self.states():
            self.judge[sid, layer, name] = (np.zeros(shape) if saved is None
                                            else saved[layer, name].copy())

    def remove(self, sid):
        self.history.append(f"remove {sid}")
        self.cache.remove_sequence(sid)
        del self.lengths[sid]
        for layer, name, _ in self.states():
            del self.judge[sid, layer, name]

    def fork(self, parent, child):
        self.history.append(f"fork {parent} -> {child}")
        self.cache.fork_sequence(parent, child)
        self.lengths[child] = self.lengths[parent]
        for layer, name, _ in self.states():
            self.judge[child, layer, name] = self.judge[parent, layer, name].copy()

    # ------------------------------------------------------------------ forwards
    def forward(self, sids, lens, commit: bool = True, read_back: bool = False):
        """A forward: attention on layer 0, then each state read (kept) and written anew
        (``read_back``: read again after the write, read-your-writes); aborted unless
        ``commit``."""
        c, cache = self.config, self.cache
        self.history.append(f"forward {list(sids)} {list(lens)}" + ("" if commit else " (aborted)"))
        total = sum(lens)
        cache.begin_forward(list(sids), list(lens))
        q, k, v = (cache.from_numpy(self.rng.standard_normal((total, h, c.head_dim)))
                   for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
        cache.attention(0, q, k, v)
        staged = {}
        inner = cache.state_checkpoints()
        given: dict = {}
        for layer, name, shape in self.states():
            label = f"get_state({layer}, {name!r}) of {list(sids)} ({self.history[-1]})"
            want = np.stack([self.judge[s, layer, name] for s in sids])
            self.kept.append((label, want, cache.get_state(layer, name)))
            new = round_to(self.rng.standard_normal((len(sids),) + shape), self.dtype)
            cache.set_state(layer, name, cache.from_numpy(new))
            staged[layer, name] = new
            if inner:
                at = round_to(self.rng.standard_normal((len(inner),) + shape), self.dtype)
                cache.set_state_checkpoints(layer, name, cache.from_numpy(at))
                given[layer, name] = at
            if read_back:
                self.kept.append((label + " after set_state", new, cache.get_state(layer, name)))
        if not commit:
            cache.abort_forward()
            return
        cache.end_forward()
        for (layer, name), new in staged.items():
            for i, s in enumerate(sids):
                self.judge[s, layer, name] = new[i]
        # the checkpoints: a boundary's first states stay (later ones for the same ids are
        # not written again)
        ps = self.config.page_size
        for j, (row, n) in enumerate(inner):
            key = tuple(self.tokens[sids[row]][:self.lengths[sids[row]] + n])
            self.checkpoints.setdefault(key, {w: v[j] for w, v in given.items()})
        for s, n in zip(sids, lens):
            self.lengths[s] += n
            end = self.lengths[s]
            if self.config.prefix_cache and end % ps == 0 and end <= len(self.tokens[s]):
                self.checkpoints.setdefault(tuple(self.tokens[s][:end]), {
                    (layer, name): self.judge[s, layer, name] for layer, name, _ in self.states()})

    def finish(self):
        """Compare every kept read, then every sequence's states now."""
        for sid in list(self.lengths):
            self.forward([sid], [1], commit=False)          # reads the states as they are now
        for label, want, got in self.kept:
            got = to_numpy(got).astype(np.float64)
            if got.shape != want.shape or not np.array_equal(got, want):
                bad = "shape " + str(got.shape) if got.shape != want.shape else \
                    f"{int((got != want).sum())} of {want.size} values differ"
                raise Mismatch(f"{label}: {bad} from the states written{self.context()}")
        slots = self.cache.state.slots
        if slots is None:
            raise Mismatch(f"CORE BUG: a cache with state layers has no slots{self.context()}")
        try:
            slots.check_invariants(self.cache.sequence_ids)
        except AssertionError as exc:
            raise Mismatch(f"CORE BUG: state slots broken: {exc}{self.context()}") from None


class TestStateSlots(Conformance):
    """State slots: per-sequence recurrent states read and written in a forward, zeros for a
    new sequence, copied on fork, restored by an abort, bit for bit."""

    @pytest.fixture
    def twin(self, variant, kvcache_backend, kvcache_device, kvcache_backend_class):
        from .plugin import skip_unless
        caps = kvcache_backend_class.capabilities
        dtype, page_size = variant
        if dtype not in caps.dtypes:
            pytest.skip(kvcache.Capabilities.reason("dtypes") + f" [{dtype}]")
        from kvcache.reference import ReferenceBackend
        if dtype not in ReferenceBackend.capabilities.dtypes:
            pytest.skip(f"numpy cannot hold {dtype} here (the judge rounds to it)")
        skip_unless(caps, "state_slots")
        return lambda **kw: StateTwin(kvcache_backend, kvcache_device, dtype, page_size, **kw)

    def test_queued_lifecycle(self, twin):
        """Adds, prefill chunks and decode steps in varying orders, forks (the child's states
        the parent's, then each its own), removes and adds that reuse a slot (zeros again),
        an aborted forward: every read kept and compared only at the end."""
        t = twin()
        t.add(0)
        t.add(1)
        t.forward([0, 1], [5, 3])
        t.forward([1, 0], [1, 1], read_back=True)
        t.fork(0, 2)
        t.forward([2, 0, 1], [1, 2, 1])
        t.forward([0, 2], [1, 1], commit=False)
        t.remove(1)
        t.add(3)                                    # 1's slot: zeros again
        t.forward([3, 2], [4, 1])
        t.fork(3, 4)
        for _ in range(3):
            t.forward([4, 3, 0, 2], [1, 1, 1, 1])
        t.remove(0)
        t.remove(4)
        t.add(5)
        t.forward([5, 2, 3], [2, 1, 1])
        t.finish()

    def test_abort(self, twin):
        """An aborted forward (abort_forward, or an exception inside ``with cache.forward``)
        leaves every state as it was, and the next forward reads them."""
        t = twin()
        t.add(0)
        t.add(1)
        t.forward([0, 1], [3, 3])
        t.forward([1, 0], [1, 1], commit=False)
        cache = t.cache
        with pytest.raises(RuntimeError):
            with cache.forward([0], [2]):
                for layer, name, shape in t.states():
                    cache.set_state(layer, name, cache.from_numpy(np.full((1,) + shape, 3.0)))
                raise RuntimeError("the model failed")
        t.forward([0, 1], [1, 1])
        t.finish()

    def test_prefix_hits_restore_checkpoints(self, twin):
        """With the prefix cache: a sequence's forwards keep its states at the page boundaries
        they pass (those inside a forward given by ``set_state_checkpoints``, one at a
        forward's end from ``set_state``), and sequences added later at a prefix of its ids
        start from that boundary's states, all queued and read at the end."""
        t = twin(prefix=True)
        ps = t.config.page_size
        # the scenario's unit: whole pages, at least 4 tokens (one-token pages put a boundary
        # at every token, and the forwards below need room on both sides of one)
        u = ps * -(-4 // ps)
        part = min(1, ps - 1)       # a matching partial page past the hit, where pages hold more
        ids = [int(x) for x in t.rng.integers(1, 1000, 3 * u + 3)]
        t.add(0, ids)
        t.forward([0], [u + 2])                     # the boundary at u inside
        t.forward([0], [u - 2])                     # ends at 2 u
        t.forward([0], [u + 3])                     # 3 u inside
        t.remove(0)
        # each new prompt parts from ids after its hit (token 0 is never an id of ids)
        t.add(1, ids[:2 * u + part] + [0])          # starts at 2 u (a forward's end)
        t.add(2, ids[:u + 3 * part] + [0])          # starts at u (inside a forward)
        t.add(3, ids[:3 * u + 3 * part] + [0])      # starts at 3 u
        if [t.lengths[s] for s in (1, 2, 3)] != [2 * u, u, 3 * u]:
            raise Mismatch(f"prefix hits at {[t.lengths[s] for s in (1, 2, 3)]}, expected "
                           f"{[2 * u, u, 3 * u]}{t.context()}")
        t.forward([1, 2, 3], [2, 1, 3])
        t.remove(2)
        t.forward([3, 1], [1, 1])
        t.finish()

    def test_a_state_dtype_of_its_own(self, twin):
        """``State(..., dtype="float32")`` beside the cache dtype's states: its arrays are
        float32 on the backend (``allocate_state``'s ``dtype``), values float32 can hold and
        the cache dtype cannot come back bit for bit after a fork, queued and read at the end."""
        import dataclasses
        t = twin()
        wide = {1: State({"ssm": (2, 3)}, dtype="float32"), 2: KINDS[2]}
        config = dataclasses.replace(t.config, layer_kinds=wide)
        cache = PagedKVCache(config, backend=t.cache.backend.name, device=t.cache.backend.device)
        fine = (1 + np.arange(12, dtype=np.float32).reshape(2, 2, 3) * np.float32(2.0 ** -20))
        cache.add_sequence(0)
        cache.add_sequence(1)
        cache.begin_forward([0, 1], [3, 2])
        c = cache.config
        q, k, v = (cache.from_numpy(t.rng.standard_normal((5, h, c.head_dim)))
                   for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
        cache.attention(0, q, k, v)
        cache.set_state(1, "ssm", cache.from_numpy(fine, "float32"))
        cache.set_state(2, "conv", cache.from_numpy(np.zeros((2, 6))))
        cache.end_forward()
        cache.fork_sequence(1, 2)
        cache.begin_forward([2, 0], [1, 1])
        got = cache.get_state(1, "ssm")
        cache.abort_forward()
        read = to_numpy(got)
        if read.dtype != np.float32 or not np.array_equal(read, fine[::-1]):
            raise Mismatch(f"a float32 state in a {t.dtype} cache read back "
                           f"{read.dtype} {read.ravel()[:4]}..., not the float32 values written"
                           f"{t.context()}")

    def test_refusals(self, twin):
        """Out of slots is CacheFullError naming the limit, and a slot comes back at remove;
        ``popn``, a fork below the length and token trees are refused (no checkpoint); each
        refusal changes nothing."""
        t = twin(slots=2)
        t.add(0)
        t.add(1)
        t.forward([0, 1], [4, 2])
        cache = t.cache
        before = (sorted(cache.sequence_ids), cache.num_available_pages,
                  cache.num_available_state_slots, cache.sequence_length(0))
        with pytest.raises(kvcache.CacheFullError, match="max_state_slots=2"):
            cache.add_sequence(2)
        with pytest.raises(kvcache.CacheFullError, match="max_state_slots=2"):
            cache.fork_sequence(0, 2)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="state layers"):
            cache.popn(0, 1)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="state layers"):
            cache.begin_forward([0], [2], [-1, 0])
        after = (sorted(cache.sequence_ids), cache.num_available_pages,
                 cache.num_available_state_slots, cache.sequence_length(0))
        if after != before:
            raise Mismatch(f"a refused call changed the cache: {before} -> {after}{t.context()}")
        t.remove(1)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="below the parent's length"):
            cache.fork_sequence(0, 2, 1)
        t.fork(0, 2)
        t.forward([2, 0], [1, 1])
        t.finish()
