"""Window groups (``CacheConfig(layer_kinds={layer: Window(w)})``, capability
``window_groups``, docs/hybrid.md): a windowed layer's K/V live in a pool of its own and each
sequence keeps only the pages its later queries can see, read through one ``DepthAux`` entry
per sequence whose keys start at its first live page (``k_rope_offset`` that page's first
position) with the layer's ``window_left``.

The judge is the same cache without groups on the reference backend, given the same calls and
each windowed layer's window as ``window_left``: every output and lse must match it (the
dtype's tolerance), and the K/V a group still holds must read back (``get_kv(layer=)``) as
there. The page counts are checked against the rule (per group, a sequence of length ``L``
holds the pages from the one holding ``max(0, L - w)`` on) with host reads only, so the
queued test reads no device output until every forward is queued."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import pytest

import kvcache
from kvcache import PagedKVCache, Window, to_numpy

from .base import Conformance
from .harness import make_config
from .tolerance import TOLERANCES, Mismatch, assert_close

NUM_LAYERS = 3          # layers 0 and 2 windowed (two groups), layer 1 full attention


class GroupTwin:
    """The backend under test with window groups (``dut``) and the reference without them
    (``ref``), driven in lockstep; outputs are kept and compared in ``finish`` (``eager``:
    after every forward as well)."""

    POOL_ROWS = 1024

    def __init__(self, backend: str, device: Optional[str], dtype: str, page_size: int, *,
                 windows: Optional[dict] = None, eager: bool = False, seed: int = 0, **config):
        ps = page_size
        self.windows = windows if windows is not None else {0: 2 * ps + 3, 2: max(1, ps // 2)}
        kw = dict(dtype=dtype, page_size=page_size, num_layers=NUM_LAYERS, max_total_tokens=1024,
                  max_batch_size=4, prefill_chunk_size=256)
        kw.update(config)
        plain = make_config(**kw)
        self.config = dataclasses.replace(plain, layer_kinds={
            layer: Window(w) for layer, w in self.windows.items()})
        self.ref = PagedKVCache(plain, backend="reference")
        self.dut = PagedKVCache(self.config, backend=backend, device=device)
        self.tol = TOLERANCES[dtype]
        self.eager = eager
        self.rng = np.random.default_rng(seed)
        c = plain
        pools = [self.rng.standard_normal((self.POOL_ROWS, h, d)) for h, d in
                 ((c.num_qo_heads, c.head_dim), (c.num_kv_heads, c.head_dim),
                  (c.num_kv_heads, c.head_dim_v))]
        self.pools = {id(cache): [cache.from_numpy(x) for x in pools]
                      for cache in (self.ref, self.dut)}
        self.lengths: dict = {}
        self.first: dict = {}           # (sid, layer) -> first page the group still holds
        self.kept: list = []
        self.history: list = []
        self.poison()

    # ------------------------------------------------------------------ helpers
    def context(self) -> str:
        return (f"\n  backend {self.dut.backend.name!r}, dtype {self.config.dtype}, page size "
                f"{self.config.page_size}, windows {self.windows}\n  after: "
                f"{'; '.join(self.history[-10:])}")

    def both(self, method: str, *args, **kwargs):
        self.history.append(f"{method}{args}")
        out = [getattr(cache, method)(*args, **kwargs) for cache in (self.ref, self.dut)]
        return out

    def lowest_fork(self, sid) -> int:
        """The lowest fork position of ``sid`` whose window keys every group still holds."""
        ps = self.config.page_size
        return min(self.lengths[sid], max(self.first[sid, layer] * ps + w
                                          for layer, w in self.windows.items()))

    def first_kept(self, layer: int, length: int) -> int:
        return max(0, length - self.windows[layer]) // self.config.page_size

    def poison(self) -> None:
        """NaN into every slot of the backend under test that holds no token: free pages of
        every pool, and the rows past each sequence's end in its last pages (queued device
        writes, no read)."""
        c, cache = self.config, self.dut
        b, ps, pt = cache.backend, c.page_size, cache.state.pt
        lengths = {sid: pt.length(seq) for sid, seq in pt.seqs.items()}
        live = [pt.position_slots(seq, 0, lengths[sid]) for sid, seq in pt.seqs.items()]
        used = np.concatenate(live) if live else np.zeros(0, np.int64)
        full_free = np.setdiff1d(np.arange(c.num_pages * ps), used)
        todo = [(c.full_layers, full_free)]
        for g, group in enumerate(pt.groups.groups):
            held = []
            for sid, pages in group.live.items():
                first = group.first[sid] * ps
                pos = np.arange(first, first + len(pages) * ps)
                slots = np.asarray(pages, np.int64).repeat(ps) * ps + pos % ps
                held.append(slots[pos < lengths[sid]])
            held_slots = np.concatenate(held) if held else np.zeros(0, np.int64)
            todo.append((c.window_groups[g][1],
                         np.setdiff1d(np.arange(group.num_pages * ps), held_slots)))
        for layers, free in todo:
            if not len(free) or not layers:
                continue
            k = b.from_numpy(np.full((len(free), c.num_kv_heads, c.head_dim), np.nan))
            v = b.from_numpy(np.full((len(free), c.num_kv_heads, c.head_dim_v), np.nan))
            slots = b.aux_to_device(free.astype(np.int32))
            for layer in layers:
                b.append_kv(cache.pages[layer], k, v, slots)

    def check_pages(self) -> None:
        """Per group and sequence, the pages held are the rule's (host reads only)."""
        ps = self.config.page_size
        for sid, length in self.lengths.items():
            held = self.dut.window_pages(sid)
            for layer, w in self.windows.items():
                first = self.first[sid, layer]
                got = held[f"window={w}"]
                want = (first * ps, -(-length // ps) - first)
                if got != want:
                    raise Mismatch(f"sequence {sid} (length {length}) holds {got} (first "
                                   f"position, pages) of window group window={w}, the rule "
                                   f"says {want}{self.context()}")
                if want[1] > -(-w // ps) + 1:
                    raise Mismatch(f"sequence {sid} holds {want[1]} pages of window={w}, more "
                                   f"than ceil(w / page_size) + 1{self.context()}")

    # ------------------------------------------------------------------ sequence ops
    def add(self, *sids):
        for sid in sids:
            self.both("add_sequence", sid)
            self.lengths[sid] = 0
            for layer in self.windows:
                self.first[sid, layer] = 0
        self.after()

    def remove(self, sid):
        self.both("remove_sequence", sid)
        del self.lengths[sid]
        self.after()

    def fork(self, parent, child, pos=-1):
        self.both("fork_sequence", parent, child, pos)
        n = self.lengths[parent] if pos == -1 else pos
        self.lengths[child] = n
        for layer in self.windows:
            self.first[child, layer] = self.first_kept(layer, n)
        self.after()

    def popn(self, sid, n):
        self.both("popn", sid, n)
        self.lengths[sid] -= n
        self.after()

    def after(self):
        self.check_pages()
        if self.eager:
            self.poison()

    # ------------------------------------------------------------------ forwards
    def inputs(self, total: int):
        starts = [int(self.rng.integers(0, self.POOL_ROWS - total + 1)) for _ in range(3)]
        return lambda cache: tuple(pool[s:s + total]
                                   for pool, s in zip(self.pools[id(cache)], starts))

    def begin(self, sids, lens):
        self.both("begin_forward", list(sids), list(lens))

    def attend(self, layer: int, window_left: int = -1):
        """Layer ``layer`` on both caches: ``window_left`` goes to the backend under test (-1:
        a windowed layer's group window); the reference gets the window it then uses."""
        total = sum(len_ for len_ in self._lens)
        inputs = self.inputs(total)
        used = window_left
        if layer in self.windows and window_left == -1:
            used = self.windows[layer]
        kw_ref = {"window_left": used} if used >= 0 else {}
        kw_dut = {"window_left": window_left} if window_left >= 0 else {}
        r = self.ref.attention(layer, *inputs(self.ref), return_lse=True, **kw_ref)
        d = self.dut.attention(layer, *inputs(self.dut), return_lse=True, **kw_dut)
        label = f"forward {self._sids} {self._lens}, layer {layer} (window_left {window_left})"
        self.kept.append((label, r, d))
        if self.eager:
            self.compare(*self.kept[-1])

    def forward(self, sids, lens, window_left=None):
        """A whole forward; ``window_left``: per layer (a dict) what the backend under test
        gets (default -1 everywhere: the windowed layers take their group's)."""
        self._sids, self._lens = list(sids), list(lens)
        self.begin(sids, lens)
        for layer in range(NUM_LAYERS):
            self.attend(layer, (window_left or {}).get(layer, -1))
        self.both("end_forward")
        for sid, n in zip(sids, lens):
            self.lengths[sid] += n
            for layer in self.windows:
                self.first[sid, layer] = max(self.first[sid, layer],
                                             self.first_kept(layer, self.lengths[sid]))
        self.after()

    def decode(self, sids, steps: int, **kw):
        for _ in range(steps):
            self.forward(sids, [1] * len(sids), **kw)

    def compare(self, label, ref, dut):
        (o_r, l_r), (o_d, l_d) = ref, dut
        ctx = f"\n  {label}{self.context()}"
        assert_close("window-group attention output", to_numpy(o_r), to_numpy(o_d), self.tol,
                     context=ctx)
        assert_close("window-group lse", to_numpy(l_r), to_numpy(l_d), self.tol, lse=True,
                     context=ctx)

    def finish(self):
        """Compare every kept output (read only now), then each sequence's K/V still held."""
        for item in self.kept:
            self.compare(*item)
        ps = self.config.page_size
        for sid, length in self.lengths.items():
            for layer in range(NUM_LAYERS):
                start = self.first[sid, layer] * ps if layer in self.windows else 0
                if start >= length:
                    continue
                for name, r, d in zip("KV", self.ref.get_kv(sid, start, length, layer=layer),
                                      self.dut.get_kv(sid, start, length, layer=layer)):
                    assert_close(f"get_kv({sid}, {start}, {length}, layer={layer}) {name}",
                                 to_numpy(r), to_numpy(d), self.tol, context=self.context())
        for cache in (self.ref, self.dut):
            try:
                cache.state.pt.check_invariants()
            except AssertionError as exc:
                raise Mismatch(f"CORE BUG: page accounting broken: {exc}{self.context()}") from None


class TestWindowGroups(Conformance):
    """Window groups: a windowed layer's pages in a pool of its own, freed as they slide out
    of every window; outputs equal the same cache without groups."""

    @pytest.fixture
    def twin(self, variant, kvcache_backend, kvcache_device, kvcache_backend_class):
        from .plugin import skip_unless
        caps = kvcache_backend_class.capabilities
        dtype, page_size = variant
        if dtype not in caps.dtypes:
            pytest.skip(kvcache.Capabilities.reason("dtypes") + f" [{dtype}]")
        from kvcache.reference import ReferenceBackend
        if dtype not in ReferenceBackend.capabilities.dtypes:
            pytest.skip(f"the reference backend cannot store {dtype} here")
        skip_unless(caps, "window_groups")
        skip_unless(caps, "window_left")

        def make(**kw):
            if kw.get("rope_mode", "none") == "inline":
                skip_unless(caps, "inline_rope")
            return GroupTwin(kvcache_backend, kvcache_device, dtype, page_size, **kw)
        return make

    @pytest.mark.parametrize("rope_mode", ["none", "inline"])
    def test_queued_forwards(self, twin, rope_mode):
        """Prefill chunks, decode steps across pages, forks mid-page and at page ends, popn
        inside the window, removes and adds (freed pages handed out again), per-layer windows
        (the group's, an explicit one, a smaller one): every output read only at the end.
        Inline RoPE rotates a windowed entry's key ``j`` at ``k_rope_offset + j``: the first
        live page's position must be exact."""
        t = twin(rope_mode=rope_mode)
        ps = t.config.page_size
        w0 = t.windows[0]
        t.add(0, 1)
        t.forward([0, 1], [3 * ps + 5, 7])
        t.forward([1, 0], [2 * ps + 1, 2])
        t.decode([0, 1], steps=ps + 3)
        t.fork(0, 2, max(t.lengths[0] - 1, t.lowest_fork(0)))     # inside the last page
        end = -(-t.lowest_fork(1) // ps) * ps                         # at a page end
        t.fork(1, 3, end if end <= t.lengths[1] else -1)
        t.decode([2, 3, 0], steps=3, window_left={0: w0, 2: 0})
        t.forward([3, 2], [ps + 2, 5], window_left={0: max(0, w0 - 3), 1: 4})
        allowed = t.lengths[2] - (t.first[2, 0] * ps + w0)
        allowed = min(allowed, t.lengths[2] - (t.first[2, 2] * ps + t.windows[2]))
        if allowed > 0:
            t.popn(2, allowed)                             # as far as the windows allow
        t.remove(0)
        t.add(4)
        t.forward([4, 2, 1], [4 * ps + 3, 1, ps])
        t.decode([4, 1, 2, 3], steps=ps + 1)
        t.remove(1)
        t.add(5)
        t.forward([5, 4], [ps - 1 if ps > 1 else 1, 2 * ps])
        t.decode([5, 4, 3], steps=4)
        t.finish()

    def test_abort(self, twin):
        """An aborted forward (abort_forward after some layers, an exception inside ``with
        cache.forward``) takes back its pages and frees none: pages, counts and K/V as before,
        and the forwards after it match."""
        t = twin(eager=True)
        ps = t.config.page_size
        t.add(0, 1)
        t.forward([0, 1], [3 * ps + 2, ps + 1])
        t.decode([0, 1], steps=2)
        for how in ("abort", "raise"):
            before = (t.dut.num_available_pages_by_group,
                      {s: t.dut.window_pages(s) for s in t.lengths},
                      {(s, layer): [to_numpy(x).copy() for x in t.dut.get_kv(
                          s, t.first[s, layer] * ps, None, layer=layer)]
                       for s in t.lengths for layer in t.windows})
            if how == "abort":
                t.dut.begin_forward([0, 1], [2 * ps + 3, ps])
                t.dut.attention(0, *t.inputs(3 * ps + 3)(t.dut))
                t.dut.abort_forward()
            else:
                with pytest.raises(RuntimeError):
                    with t.dut.forward([1, 0], [ps, 1]):
                        for layer in range(NUM_LAYERS):
                            t.dut.attention(layer, *t.inputs(ps + 1)(t.dut))
                        raise RuntimeError("the model failed")
            after = (t.dut.num_available_pages_by_group,
                     {s: t.dut.window_pages(s) for s in t.lengths})
            if after != before[:2]:
                raise Mismatch(f"an aborted forward ({how}) changed the groups' pages: "
                               f"{before[:2]} -> {after}{t.context()}")
            for (s, layer), kv in before[2].items():
                now = t.dut.get_kv(s, t.first[s, layer] * ps, None, layer=layer)
                for name, x, y in zip("KV", kv, now):
                    if not np.array_equal(x, to_numpy(y), equal_nan=True):
                        raise Mismatch(f"an aborted forward ({how}) changed {name} of "
                                       f"sequence {s}, layer {layer}{t.context()}")
            t.poison()
        t.decode([1, 0], steps=ps + 2)
        t.forward([0, 1], [ps + 1, 2])
        t.finish()

    def test_freed_pages(self, twin):
        """Pages slide out and come back: a long decode holds at most ceil(w / page_size) + 1
        pages per group, the freed ones are free (counted), and a group that runs out refuses
        the forward with CacheFullError naming it, with nothing changed (``can_append`` and
        ``pages_needed(by_group=True)`` say so first)."""
        t = twin(max_batch_size=2, prefill_chunk_size=64)
        ps = t.config.page_size
        n = min(2 * ps, 64)             # each sequence's prompt
        totals = t.dut.num_total_pages_by_group
        t.add(0)
        t.forward([0], [32])
        for _ in range(3 * ps + 2):
            t.forward([0], [1])
            free = t.dut.num_available_pages_by_group
            for layer, w in t.windows.items():
                name = f"window={w}"
                held = t.dut.window_pages(0)[name][1]
                if free[name] != totals[name] - held:
                    raise Mismatch(f"{name}: {free[name]} free of {totals[name]} with "
                                   f"{held} held by the only sequence{t.context()}")
        # fill the pools with sequences that each keep their window
        name = f"window={max(t.windows.values())}"
        sid = 1
        while True:
            t.add(sid)
            if not t.dut.can_append([sid], [n]):
                break
            t.forward([sid], [n])
            sid += 1
            if sid > 200:
                raise Mismatch(f"{name}: never ran out{t.context()}")
        need = t.dut.pages_needed([sid], [n], by_group=True)
        free = t.dut.num_available_pages_by_group
        short = [g for g in need if need[g] > free[g]]
        assert short, (need, free)
        before = (free, t.dut.window_pages(0), t.dut.sequence_length(sid))
        named = [g for g in short if g != "full"]        # the groups are counted first
        with pytest.raises(kvcache.CacheFullError, match=f"'{named[0]}'" if named else "free"):
            t.dut.begin_forward([sid], [n])
        if (t.dut.num_available_pages_by_group, t.dut.window_pages(0),
                t.dut.sequence_length(sid)) != before:
            raise Mismatch(f"a refused forward changed the cache{t.context()}")
        t.finish()

    def test_refusals(self, twin):
        """What window groups do not compose with yet is refused by name, nothing changed:
        a whole-sequence export, ``get_kv`` of every layer, a ``popn`` or a fork below the
        window, a ``window_left`` above a group's window, token trees."""
        t = twin(eager=True)
        ps = t.config.page_size
        t.add(0)
        t.forward([0], [2 * ps + 2 * t.windows[0]])
        before = (t.dut.num_available_pages_by_group, t.dut.window_pages(0))
        with pytest.raises(kvcache.UnsupportedFeatureError, match="window groups"):
            t.dut.export_sequence(0)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="pass layer"):
            t.dut.get_kv(0)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="below the window"):
            t.dut.popn(0, t.lengths[0])
        with pytest.raises(kvcache.InvalidArgumentError, match="window group"):
            t.dut.fork_sequence(0, 9, 1)
        with pytest.raises(kvcache.UnsupportedFeatureError, match="token trees"):
            t.dut.begin_forward([0], [1], [-1])
        t.dut.begin_forward([0], [1])
        with pytest.raises(kvcache.InvalidArgumentError, match="layer 0"):
            t.dut.attention(0, *t.inputs(1)(t.dut), window_left=t.windows[0] + 1)
        t.dut.abort_forward()
        if (t.dut.num_available_pages_by_group, t.dut.window_pages(0)) != before:
            raise Mismatch(f"a refused call changed the groups' pages{t.context()}")
        t.forward([0], [2])
        t.finish()
