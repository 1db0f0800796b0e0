"""The conformance harness: drive a backend under test and the reference backend in lockstep.

``CachePair`` owns two ``PagedKVCache`` objects built from the same ``CacheConfig``: ``ref`` on
the reference backend (the oracle) and ``dut`` (device under test) on the backend being proved.
Every public call goes to both; results are compared:

* attention outputs and lse with per-dtype tolerances (``TOLERANCES``), NaN-sensitive: a NaN or
  an infinity in the backend's output where the reference has a finite value fails, and ``-inf``
  lse (a row that sees no key) must be ``-inf`` in both;
* ``query_positions``, ``sequence_length``, ``num_available_pages``, ``total_sequence_length``,
  ``num_sequences``, ``is_empty`` exactly; ``get_kv`` of every sequence with the dtype tolerance;
* errors: the same exception type from both, and neither cache changed (lengths, free pages and
  the stored KV bit for bit).

Poisoning. The public API returns fresh arrays, so the suite cannot pre-fill a kernel's output.
What it does instead:

* every page slot of the backend under test that holds no live token is overwritten with NaN
  (through the backend's own ``append_kv``) when the cache is built and after every call that
  may free or shrink something. A kernel that reads a slot it should not (wrong page index,
  missing length mask, a forked partial page that was not copied) then yields NaN and fails;
* outputs are compared NaN-sensitively against the reference, so an output row a kernel forgot to
  write (uninitialised memory, or zeros where a row has no key and needs ``lse = -inf``) fails.

A dense model of SPEC section 3 (``DenseModel``: per sequence, the list of its tokens' K/V, no
pages) additionally checks the *reference* outputs, so a core bug is reported as such instead of
being copied by every backend.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

import kvcache
from kvcache import CacheConfig, PagedKVCache, to_numpy


# ---------------------------------------------------------------------------- tolerances
@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    lse_atol: float


TOLERANCES = {
    # float32 storage: kernels accumulate in float32 vs the reference's float64.
    "float32": Tolerance(atol=1e-4, rtol=1e-4, lse_atol=1e-4),
    # 16-bit storage: the output is rounded once (half an ulp is ~1e-3 at |o| ~ 2 in fp16,
    # ~8e-3 in bf16) and rotated q/k are rounded once in "normal" RoPE mode.
    "float16": Tolerance(atol=2e-3, rtol=2e-3, lse_atol=4e-3),
    "bfloat16": Tolerance(atol=2e-2, rtol=2e-2, lse_atol=3e-2),
}


class Mismatch(AssertionError):
    """The backend under test disagrees with the reference."""


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> cache dtype -> float64 (round to nearest even), as ``from_numpy`` does."""
    from kvcache.reference import NP_DTYPES
    return np.asarray(x, np.float64).astype(NP_DTYPES[dtype]).astype(np.float64)


def assert_close(what: str, expected, actual, tol: Tolerance, *, lse: bool = False,
                 context: str = "", row_label=None) -> None:
    """NaN-sensitive comparison with a readable message (first bad element, count, max error)."""
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    if e.shape != a.shape:
        raise Mismatch(f"{what}: shape {a.shape}, reference {e.shape}{context}")
    atol = tol.lse_atol if lse else tol.atol
    rtol = 0.0 if lse else tol.rtol
    e_inf, a_inf = np.isinf(e), np.isinf(a)
    bad = np.isnan(a) | np.isnan(e)
    bad |= e_inf != a_inf
    bad |= e_inf & a_inf & (np.sign(e) != np.sign(a))
    finite = ~(np.isnan(a) | np.isnan(e) | e_inf | a_inf)
    diff = np.where(finite, np.abs(np.where(finite, a, 0) - np.where(finite, e, 0)), 0.0)
    bad |= finite & (diff > atol + rtol * np.abs(np.where(finite, e, 0)))
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    where = f"index {idx}"
    if row_label is not None and idx:
        where += f" ({row_label(idx[0])})"
    nan = int(np.isnan(a).sum())
    maxerr = float(diff.max()) if diff.size else 0.0
    raise Mismatch(
        f"{what}: {int(bad.sum())} of {bad.size} elements differ from the reference "
        f"(atol={atol}, rtol={rtol}); first at {where}: backend {float(a[idx])!r}, reference {float(e[idx])!r}; "
        f"max finite |diff| {maxerr:.3g}; NaNs in backend output: {nan}"
        f"{' (NaN: an unwritten output or a read of an unwritten/poisoned page slot)' if nan else ''}"
        f"{context}")


# ---------------------------------------------------------------------------- dense model
class _Seq:
    def __init__(self, num_layers, hkv, d):
        self.k = np.zeros((num_layers, 0, hkv, d))   # as the cache stores K (rotated in "normal")
        self.v = np.zeros((num_layers, 0, hkv, d))
        self.tree_parent: list = []                  # uncommitted tree (the last len() tokens)
        self.tree_depth: list = []
        self.window: Optional[tuple] = None          # (window, sink)

    def copy_prefix(self, n):
        s = _Seq(self.k.shape[0], self.k.shape[2], self.k.shape[3])
        s.k, s.v = self.k[:, :n].copy(), self.v[:, :n].copy()
        return s

    @property
    def committed(self):
        return self.k.shape[1] - len(self.tree_parent)


class DenseModel:
    """SPEC section 3 without pages: each sequence is the list of its tokens. Used to check the
    reference backend + core (not the backend under test) on every forward."""

    def __init__(self, config: CacheConfig):
        self.c = config
        self.seqs: dict = {}
        self.pending = None

    def _rope(self, x, pos):
        from kvcache.reference import rotate
        from kvcache.backend import RopeSpec
        return rotate(x, np.asarray(pos), RopeSpec(self.c.rope_theta, self.c.rope_scale))

    def add(self, sid):
        c = self.c
        self.seqs[sid] = _Seq(c.num_layers, c.num_kv_heads, c.head_dim)

    def remove(self, sid):
        del self.seqs[sid]

    def fork(self, parent, child, pos):
        p = self.seqs[parent]
        n = p.k.shape[1] if pos == -1 else pos
        self.seqs[child] = p.copy_prefix(n)

    def popn(self, sid, n):
        s = self.seqs[sid]
        keep = s.k.shape[1] - n
        s.k, s.v = s.k[:, :keep], s.v[:, :keep]

    def enable_window(self, sid, w, s):
        self.seqs[sid].window = (w, s)

    def clear(self):
        self.seqs.clear()

    def commit(self, sids, leaves):
        for sid, leaf in zip(sids, leaves):
            s = self.seqs[sid]
            base = s.committed
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = s.tree_parent[node]
            keep = [base + n for n in reversed(path)]
            idx = list(range(base)) + keep
            s.k, s.v = s.k[:, idx], s.v[:, idx]
            s.tree_parent, s.tree_depth = [], []

    def begin(self, sids, lens, tree):
        """Positions of the new tokens; records what each new token sees."""
        positions, plan = [], []
        t = 0
        for sid, n in zip(sids, lens):
            s = self.seqs[sid]
            before = s.k.shape[1]
            committed = s.committed
            if tree is None:
                pos = before + np.arange(n)
                plan.append((sid, before, None, committed))
            else:
                parents = [int(p) for p in tree[t:t + n]]
                first = len(s.tree_parent)
                for p in parents:
                    s.tree_parent.append(p)
                    s.tree_depth.append(0 if p < 0 else s.tree_depth[p] + 1)
                pos = committed + np.asarray(s.tree_depth[first:], np.int64)
                plan.append((sid, before, first, committed))
            positions.append(pos)
            t += n
        self.pending = (list(sids), list(lens), plan, np.concatenate(positions))
        return self.pending[3]

    def attention(self, layer, q, k, v, sm_scale):
        """q, k, v float64 (already rounded to the cache dtype). Returns o (rounded), lse."""
        from kvcache.reference import softmax_attend
        c = self.c
        sids, lens, plan, positions = self.pending
        mode = c.effective_rope_mode
        sm_scale = c.head_dim ** -0.5 if sm_scale is None else sm_scale
        o = np.zeros((q.shape[0], c.num_qo_heads, c.head_dim))
        lse = np.full((q.shape[0], c.num_qo_heads), -np.inf)
        t = 0
        for (sid, before, tree_first, committed), n in zip(plan, lens):
            s = self.seqs[sid]
            qi, ki, vi = q[t:t + n], k[t:t + n], v[t:t + n]
            pos = positions[t:t + n]
            if mode == "normal":
                qi = _round(self._rope(qi, pos), c.dtype)
                ki = _round(self._rope(ki, pos), c.dtype)
            keys = np.concatenate([s.k[layer, :before], ki])
            vals = np.concatenate([s.v[layer, :before], vi])
            total = before + n
            if tree_first is None:
                visible = np.zeros((n, total), bool)
                visible[:, :before] = True
                visible[:, before:] = np.tril(np.ones((n, n), bool))
            else:
                visible = np.zeros((n, total), bool)
                visible[:, :committed] = True
                for r in range(n):
                    node = tree_first + r
                    while node != -1:
                        visible[r, committed + node] = True
                        node = s.tree_parent[node]
            if mode == "inline":
                qi = self._rope(qi, pos)
                keys = self._rope(keys, np.arange(total))
            o[t:t + n], lse[t:t + n] = softmax_attend(qi, keys, vals, visible, sm_scale,
                                                      c.group_size)
            t += n
        self._new_kv = getattr(self, "_new_kv", {})
        self._new_kv[layer] = (k, v)
        return _round(o, c.dtype), lse

    def end(self):
        """Store the new tokens (K as the cache stores it) and slide windows."""
        c = self.c
        sids, lens, plan, positions = self.pending
        new = getattr(self, "_new_kv", {})
        t = 0
        for (sid, before, _, _), n in zip(plan, lens):
            s = self.seqs[sid]
            ks, vs = [], []
            for layer in range(c.num_layers):
                if layer in new:
                    kl, vl = new[layer][0][t:t + n], new[layer][1][t:t + n]
                    if c.effective_rope_mode == "normal":
                        kl = _round(self._rope(kl, positions[t:t + n]), c.dtype)
                else:   # a layer that ran no attention: its K/V were never written
                    kl = vl = np.full((n, c.num_kv_heads, c.head_dim), np.nan)
                ks.append(kl)
                vs.append(vl)
            s.k = np.concatenate([s.k, np.stack(ks)], axis=1)
            s.v = np.concatenate([s.v, np.stack(vs)], axis=1)
            if s.window is not None:
                w, sink = s.window
                length = s.k.shape[1]
                if length > w:   # exactly ``sink`` sinks and the last ``w - sink`` tokens
                    idx = list(range(sink)) + list(range(length - (w - sink), length))
                    s.k, s.v = s.k[:, idx], s.v[:, idx]
            t += n
        self.pending, self._new_kv = None, {}

    def abort(self):
        """Forget the pending forward (its tree tokens too)."""
        for sid, _, tree_first, _ in self.pending[2]:
            s = self.seqs[sid]
            if tree_first is not None:
                del s.tree_parent[tree_first:], s.tree_depth[tree_first:]
        self.pending, self._new_kv = None, {}

    def get_kv(self, sid, start, end):
        s = self.seqs[sid]
        return s.k[:, start:end], s.v[:, start:end]


# ---------------------------------------------------------------------------- the pair
def seed_for(text: str, base: int = 0) -> int:
    return (zlib.crc32(text.encode()) + base) & 0x7FFFFFFF


def make_config(*, dtype="float32", gqa=4, head_dim=64, page_size=16, num_layers=2,
                rope_mode="none", max_total_tokens=512, max_batch_size=16,
                prefill_chunk_size=512, support_sliding_window=False, num_kv_heads=None,
                rope_theta=10000.0, rope_scale=1.0, static_decode=False,
                static_decode_batch_sizes=()) -> CacheConfig:
    """A small config for the suite: GQA ratio ``gqa`` with 2 KV heads (1 for ratio 8)."""
    hkv = num_kv_heads or (1 if gqa >= 8 else 2)
    return CacheConfig(num_layers=num_layers, num_qo_heads=hkv * gqa, num_kv_heads=hkv,
                       head_dim=head_dim, page_size=page_size, max_batch_size=max_batch_size,
                       max_total_tokens=max_total_tokens, prefill_chunk_size=prefill_chunk_size,
                       dtype=dtype, rope_mode=rope_mode, rope_theta=rope_theta,
                       rope_scale=rope_scale, support_sliding_window=support_sliding_window,
                       static_decode=static_decode, static_decode_batch_sizes=static_decode_batch_sizes)


_CALLS = {
    "add_sequence": "add", "remove_sequence": "remove", "fork_sequence": "fork", "popn": "popn",
    "enable_sliding_window": "enable_window", "clear": "clear",
    "commit_accepted_token_tree_nodes": "commit",
}


class CachePair:
    """The backend under test (``dut``) and the reference (``ref``) driven in lockstep."""

    def __init__(self, config: CacheConfig, backend: str, device: Optional[str] = None, *,
                 seed: int = 0, poison: str = "nan", model: bool = True):
        self.config = config
        self.tol = TOLERANCES[config.dtype]
        self.rng = np.random.default_rng(seed)
        # graph mode is the backend's (the reference runs the same forwards eagerly)
        ref_config = dataclasses.replace(config, static_decode=False) if config.static_decode else config
        self.ref = PagedKVCache(ref_config, backend="reference")
        self.dut = PagedKVCache(config, backend=backend, device=device)
        self.model = DenseModel(config) if model else None
        self.poison_value = {"nan": np.nan, "large": 3.0e4 if config.dtype == "float16" else 1.0e6,
                             "none": None}[poison]
        self.seqs: list = []
        self.history: list[str] = []
        self.in_forward = False
        self._with = None
        self.poison()

    # ------------------------------------------------------------------ helpers
    def context(self) -> str:
        c = self.config
        hist = "; ".join(self.history[-12:])
        more = f"... ({len(self.history) - 12} earlier) " if len(self.history) > 12 else ""
        return (f"\n  backend {self.dut.backend.name!r}, config dtype={c.dtype} "
                f"heads={c.num_qo_heads}/{c.num_kv_heads} head_dim={c.head_dim} "
                f"page_size={c.page_size} rope={c.rope_mode} sliding={c.support_sliding_window}"
                f"\n  after: {more}{hist}")

    def _note(self, text):
        self.history.append(text)

    def poison(self) -> None:
        """Write the poison value into every slot of the backend under test that holds no live
        token (through the backend's own append_kv, so it works for any array library)."""
        if self.poison_value is None:
            return
        c, cache = self.config, self.dut
        pt = cache.state.pt
        live = [pt.position_slots(s, 0, pt.length(s)) for s in pt.seqs.values()]
        used = np.concatenate(live) if live else np.zeros(0, np.int32)
        free = np.setdiff1d(np.arange(pt.num_pages * c.page_size, dtype=np.int64), used)
        if not len(free):
            return
        b = cache.backend
        fill = np.full((len(free), c.num_kv_heads, c.head_dim), self.poison_value)
        k = b.from_numpy(fill)
        slots = b.aux_to_device(free.astype(np.int32))
        for layer in range(c.num_layers):
            b.append_kv(cache.pages[layer], k, k, slots)

    def both(self, method: str, *args, **kwargs):
        """Call ``method`` on both caches; same exception type or both succeed."""
        self._note(f"{method}{args if len(args) != 1 else '(' + repr(args[0]) + ')'}")
        outcome = []
        for cache in (self.ref, self.dut):
            try:
                outcome.append((True, getattr(cache, method)(*args, **kwargs)))
            except Exception as exc:  # noqa: BLE001 - compared below
                outcome.append((False, exc))
        (ok_r, r), (ok_d, d) = outcome
        if ok_r != ok_d or (not ok_r and type(r) is not type(d)):
            what_r = "returned" if ok_r else f"raised {type(r).__name__}: {r}"
            what_d = "returned" if ok_d else f"raised {type(d).__name__}: {d}"
            raise Mismatch(f"{method}: reference {what_r}; backend {what_d}{self.context()}")
        if not ok_r:
            raise r
        if self.model is not None and method in _CALLS:
            getattr(self.model, _CALLS[method])(*args, **kwargs)
        return r, d

    # ------------------------------------------------------------------ sequence ops
    def add(self, *sids):
        for sid in sids:
            self.both("add_sequence", sid)
            self.seqs.append(sid)
        self.check()

    def remove(self, sid):
        self.both("remove_sequence", sid)
        self.seqs.remove(sid)
        self.check()

    def fork(self, parent, child, fork_pos=-1):
        self.both("fork_sequence", parent, child, fork_pos)
        self.seqs.append(child)
        self.check()

    def popn(self, sid, n):
        self.both("popn", sid, n)
        self.check()

    def enable_sliding_window(self, sid, window, sink):
        self.both("enable_sliding_window", sid, window, sink)
        self.check()

    def clear(self):
        self.both("clear")
        self.seqs.clear()
        self.check()

    def commit(self, sids, leaves):
        self.both("commit_accepted_token_tree_nodes", list(sids), list(leaves))
        self.check()

    # ------------------------------------------------------------------ forward
    def random(self, *shape):
        return self.rng.standard_normal(shape)

    def begin(self, sids, lens, tree=None, *, via_with=False):
        """begin_forward on both caches (``via_with``: by entering ``cache.forward(...)``, so
        that ``abort(how="raise")`` can leave the with block by an exception)."""
        if via_with:
            self._with = self.both("forward", list(sids), list(lens), tree)
            for manager in self._with:
                manager.__enter__()
        else:
            self.both("begin_forward", list(sids), list(lens), tree)
        self.in_forward = True
        self.sids, self.lens = list(sids), list(lens)
        self.expected_positions = None
        if self.model is not None:
            self.expected_positions = self.model.begin(sids, lens, tree)

    def row_label(self, t: int) -> str:
        for sid, n in zip(self.sids, self.lens):
            if t < n:
                return f"sequence {sid}, new token {t}"
            t -= n
        return "?"

    def check_positions(self):
        r, d = self.both("query_positions")
        r, d = to_numpy(r), to_numpy(d)
        bucket = self.dut.static_bucket
        if bucket is not None:      # graph mode: the bucket's rows, padding at position 0
            if len(d) != bucket or d[len(r):].any():
                raise Mismatch(f"graph mode: query_positions {d.tolist()} should be the {len(r)} "
                               f"positions padded with zeros to the bucket's {bucket}{self.context()}")
            d = d[:len(r)]
        if not np.array_equal(r, d):
            raise Mismatch(f"query_positions: backend {d.tolist()}, reference {r.tolist()}{self.context()}")
        if self.expected_positions is not None and not np.array_equal(r, self.expected_positions):
            raise Mismatch(f"CORE BUG: query_positions {r.tolist()} disagree with SPEC "
                           f"{self.expected_positions.tolist()}{self.context()}")

    def attend(self, layer, *, fused=False, sm_scale=None, return_lse=True, inputs=None):
        """Random q/k/v for ``layer`` through both caches; compares o and lse; returns them."""
        c = self.config
        total = sum(self.lens)
        if inputs is None:
            q = self.random(total, c.num_qo_heads, c.head_dim)
            k = self.random(total, c.num_kv_heads, c.head_dim)
            v = self.random(total, c.num_kv_heads, c.head_dim)
        else:
            q, k, v = inputs
        self._note(f"attention(layer {layer}{', fused' if fused else ''})")
        outs = []
        for cache in (self.ref, self.dut):
            try:
                if fused and cache is self.dut:
                    qkv = cache.from_numpy(np.concatenate([q, k, v], axis=1))
                    res = cache.attention_with_fused_qkv(layer, qkv, sm_scale, return_lse=return_lse) \
                        if return_lse else cache.attention_with_fused_qkv(layer, qkv, sm_scale)
                else:
                    args = (layer, cache.from_numpy(q), cache.from_numpy(k), cache.from_numpy(v), sm_scale)
                    res = cache.attention(*args, return_lse=return_lse) if return_lse else cache.attention(*args)
                outs.append((True, res))
            except Exception as exc:  # noqa: BLE001
                outs.append((False, exc))
        (ok_r, r), (ok_d, d) = outs
        if not ok_r or not ok_d:
            if ok_r != ok_d or type(r) is not type(d):
                raise Mismatch(f"attention: reference {'ok' if ok_r else repr(r)}, backend "
                               f"{'ok' if ok_d else repr(d)}{self.context()}") from (d if not ok_d else None)
            raise r
        if return_lse:
            (o_r, lse_r), (o_d, lse_d) = r, d
        else:
            if isinstance(d, tuple):
                raise Mismatch(f"attention(return_lse=False) returned a tuple{self.context()}")
            o_r, o_d, lse_r, lse_d = r, d, None, None
        if self.dut.backend.dtype_name(o_d) != c.dtype:
            raise Mismatch(f"attention output dtype {self.dut.backend.dtype_name(o_d)}, expected "
                           f"{c.dtype}{self.context()}")
        o_r, o_d = to_numpy(o_r), to_numpy(o_d)
        ctx = self.context()
        assert_close(f"attention output (layer {layer})", o_r, o_d, self.tol, context=ctx,
                     row_label=self.row_label)
        if return_lse:
            lse_r, lse_d = to_numpy(lse_r), to_numpy(lse_d)
            if lse_d.dtype != np.float32:
                raise Mismatch(f"lse dtype {lse_d.dtype}, expected float32{ctx}")
            assert_close(f"lse (layer {layer})", lse_r, lse_d, self.tol, lse=True, context=ctx,
                         row_label=self.row_label)
        if self.model is not None:
            qd, kd, vd = (_round(x, c.dtype) for x in (q, k, v))
            o_m, lse_m = self.model.attention(layer, qd, kd, vd, sm_scale)
            try:
                assert_close(f"reference attention output (layer {layer}) vs the dense SPEC model",
                             o_m, o_r, self.tol, row_label=self.row_label)
                if return_lse:
                    assert_close(f"reference lse (layer {layer}) vs the dense SPEC model", lse_m,
                                 lse_r, self.tol, lse=True, row_label=self.row_label)
            except Mismatch as exc:
                raise Mismatch(f"CORE BUG (not the backend under test): {exc}{ctx}") from None
        return o_d, lse_d

    def end(self):
        self.both("end_forward")
        self.in_forward = False
        if self.model is not None:
            self.model.end()
        self.check()

    def abort(self, how="abort"):
        """Undo the open forward on both caches: ``abort_forward()``, or (``how="raise"``, after
        ``begin(via_with=True)``) an exception raised inside the ``with cache.forward`` block."""
        if how == "raise":
            self._note("exception inside with cache.forward")
            for manager in self._with:
                error = RuntimeError("the model failed")
                if manager.__exit__(RuntimeError, error, None):
                    raise Mismatch(f"cache.forward swallowed an exception{self.context()}")
        else:
            self.both("abort_forward")
        self._with = None
        self.in_forward = False
        if self.model is not None:
            self.model.abort()
        self.check()

    def aborted(self, sids, lens, tree=None, *, layers=1, how="abort"):
        """A forward that runs attention on its first ``layers`` layers and is then undone
        ``how`` (see ``abort``); both caches must be exactly as before it, bit for bit."""
        before = [self.raw_snapshot(cache) for cache in (self.ref, self.dut)]
        self.begin(sids, lens, tree, via_with=how == "raise")
        for layer in range(layers):
            self.attend(layer)
        self.abort(how)
        for cache, snap in zip((self.ref, self.dut), before):
            after = self.raw_snapshot(cache)
            for key in ("num_available_pages", "total_sequence_length", "num_sequences",
                        "is_empty", "lengths"):
                if after[key] != snap[key]:
                    raise Mismatch(f"an aborted forward changed {key} of the {cache.backend.name} "
                                   f"cache: {snap[key]} -> {after[key]}{self.context()}")
            for s in self.seqs:
                for name, x, y in zip("KV", snap["kv"][s], after["kv"][s]):
                    if not np.array_equal(x, y, equal_nan=True):
                        raise Mismatch(f"an aborted forward changed the stored {name} of sequence "
                                       f"{s} in the {cache.backend.name} cache{self.context()}")

    def forward(self, sids, lens, tree=None, *, fused=False, sm_scale=None, positions="first",
                layers=None):
        """One complete forward: begin, attention on every layer, end; compares everything."""
        self.begin(sids, lens, tree)
        if positions == "first":
            self.check_positions()
        for layer in (range(self.config.num_layers) if layers is None else layers):
            self.attend(layer, fused=fused, sm_scale=sm_scale)
        if positions == "after":
            self.check_positions()
        self.end()

    def prefill(self, sid, n, **kw):
        self.forward([sid], [n], **kw)

    def decode(self, sids, steps=1, **kw):
        for _ in range(steps):
            self.forward(list(sids), [1] * len(sids), **kw)

    # ------------------------------------------------------------------ state
    def snapshot(self, cache) -> dict:
        return {"num_available_pages": cache.num_available_pages,
                "total_sequence_length": cache.total_sequence_length,
                "num_sequences": cache.num_sequences, "is_empty": cache.is_empty,
                "lengths": {s: cache.sequence_length(s) for s in self.seqs},
                "kv": {s: tuple(to_numpy(x) for x in cache.get_kv(s)) for s in self.seqs}}

    def check(self) -> None:
        """Compare the whole observable state of both caches (and with the model); re-poison."""
        if self.in_forward:
            return
        r, d = self.snapshot(self.ref), self.snapshot(self.dut)
        ctx = self.context()
        for key in ("num_available_pages", "total_sequence_length", "num_sequences", "is_empty",
                    "lengths"):
            if r[key] != d[key]:
                raise Mismatch(f"{key}: backend {d[key]}, reference {r[key]}{ctx}")
        for s in self.seqs:
            for name, er, ed in zip("kv", r["kv"][s], d["kv"][s]):
                assert_close(f"get_kv({s}) {name.upper()}", er, ed, self.tol, context=ctx)
        if self.model is not None:
            for s in self.seqs:
                m = self.model.get_kv(s, 0, None)
                if m[0].shape[1] != r["lengths"][s]:
                    raise Mismatch(f"CORE BUG: sequence {s} has length {r['lengths'][s]}, the "
                                   f"SPEC model {m[0].shape[1]}{ctx}")
                for name, em, er in zip("kv", m, r["kv"][s]):
                    if np.isnan(em).any():   # a layer skipped by the test: unspecified content
                        continue
                    try:
                        assert_close(f"reference get_kv({s}) {name.upper()} vs the dense SPEC model",
                                     em, er, self.tol)
                    except Mismatch as exc:
                        raise Mismatch(f"CORE BUG (not the backend under test): {exc}{ctx}") from None
        for cache in (self.ref, self.dut):
            check = getattr(cache.state.pt, "check_invariants", None)
            if check is not None:
                try:
                    check()
                except AssertionError as exc:
                    raise Mismatch(f"CORE BUG: page accounting broken: {exc}{ctx}") from None
        self.poison()

    def raw_snapshot(self, cache) -> dict:
        s = self.snapshot(cache)
        s["lengths"] = dict(s["lengths"])
        return s

    def expect_error(self, exc_type, method, *args, **kwargs):
        """Both caches raise ``exc_type`` (the same concrete type) and neither changes."""
        in_fwd = self.in_forward
        before = None if in_fwd else (self.raw_snapshot(self.ref), self.raw_snapshot(self.dut))
        free_before = (self.ref.num_available_pages, self.dut.num_available_pages)
        try:
            self.both(method, *args, **kwargs)
        except exc_type as exc:
            self.history[-1] += f" -> {type(exc).__name__}"
            caught = exc
        except Exception as exc:  # noqa: BLE001
            raise Mismatch(f"{method}{args}: expected {exc_type.__name__}, both raised "
                           f"{type(exc).__name__}: {exc}{self.context()}") from None
        else:
            raise Mismatch(f"{method}{args}: expected {exc_type.__name__}, both returned"
                           f"{self.context()}")
        if not isinstance(caught, kvcache.KVCacheError):
            raise Mismatch(f"{method}: {type(caught).__name__} is not a kvcache.KVCacheError")
        if (self.ref.num_available_pages, self.dut.num_available_pages) != free_before:
            raise Mismatch(f"{method} raised {type(caught).__name__} but changed the free page count "
                           f"{free_before} -> {(self.ref.num_available_pages, self.dut.num_available_pages)}"
                           f"{self.context()}")
        if before is not None:
            for cache, snap in zip((self.ref, self.dut), before):
                after = self.raw_snapshot(cache)
                for key in ("num_available_pages", "total_sequence_length", "num_sequences",
                            "is_empty", "lengths"):
                    if after[key] != snap[key]:
                        raise Mismatch(f"{method} raised {type(caught).__name__} but changed "
                                       f"{key} of the {cache.backend.name} cache: {snap[key]} -> "
                                       f"{after[key]}{self.context()}")
                for s in self.seqs:
                    for x, y in zip(snap["kv"][s], after["kv"][s]):
                        if not np.array_equal(x, y, equal_nan=True):
                            raise Mismatch(f"{method} raised {type(caught).__name__} but changed "
                                           f"the stored KV of sequence {s} in the "
                                           f"{cache.backend.name} cache{self.context()}")
        return caught


# ---------------------------------------------------------------------------- run-ahead driver
class RunAhead:
    """Drive a ``CachePair`` the way a serving loop does: the backend under test gets every call
    queued with no host read in between, outputs are kept and compared only in ``finish()``.

    Inputs come from pools of random rows made on the device before the first call (a forward
    slices them at random offsets), because turning host arrays into device arrays may wait for
    the device. ``ballast()`` queues a long prefill on a second cache of the same backend and
    device, whose outputs are dropped at once: the device is then busy long after the host has
    moved on, and the allocator holds freed blocks that queued kernels still write, which is
    where buffer reuse races show. Everything the reference does is checked the same way at the
    end: per forward and layer the output and lse, and ``get_kv`` of every sequence.
    """

    POOL_ROWS = 1024

    def __init__(self, pair: CachePair, ballast_tokens: int = 64):
        self.pair = pair
        pair.model = None                   # the reference is the judge of the run
        c = pair.config
        self.forwards = 0
        self.outputs: list = []             # (label, layer, ref (o, lse), dut (o, lse))
        rows = self.POOL_ROWS
        pools = [pair.random(rows, h, c.head_dim) for h in (c.num_qo_heads, c.num_kv_heads,
                                                           c.num_kv_heads)]
        self.pools = {cache: [cache.from_numpy(x) for x in pools] for cache in (pair.ref, pair.dut)}
        self.ballast_cache = None
        self.ballast_tokens = ballast_tokens
        if ballast_tokens:
            b = CacheConfig(num_layers=4, num_qo_heads=16, num_kv_heads=4, head_dim=c.head_dim,
                            page_size=c.page_size, max_batch_size=1, max_total_tokens=ballast_tokens,
                            prefill_chunk_size=ballast_tokens, dtype=c.dtype, rope_mode="none")
            self.ballast_cache = PagedKVCache(b, backend=pair.dut.backend.name,
                                              device=pair.dut.backend.device)
            rng = np.random.default_rng(1)
            self.ballast_inputs = [self.ballast_cache.from_numpy(rng.standard_normal((ballast_tokens, h, b.head_dim)))
                                   for h in (b.num_qo_heads, b.num_kv_heads)]

    # ------------------------------------------------------------------ calls
    def call(self, method: str, *args):
        """A sequence operation on both caches (both must succeed; nothing is read back)."""
        self.pair._note(f"{method}{args}")
        for cache in (self.pair.ref, self.pair.dut):
            getattr(cache, method)(*args)

    def add(self, *sids):
        for sid in sids:
            self.call("add_sequence", sid)
            self.pair.seqs.append(sid)

    def remove(self, sid):
        self.call("remove_sequence", sid)
        self.pair.seqs.remove(sid)

    def fork(self, parent, child, fork_pos=-1):
        self.call("fork_sequence", parent, child, fork_pos)
        self.pair.seqs.append(child)

    def forward(self, sids, lens, tree=None):
        """begin, attention on every layer (outputs kept on the device), end."""
        pair, c = self.pair, self.pair.config
        total = sum(lens)
        label = f"forward {self.forwards} {list(sids)} {list(lens)}{' tree' if tree else ''}"
        pair._note(label)
        self.forwards += 1
        starts = [int(pair.rng.integers(0, self.POOL_ROWS - total + 1)) for _ in range(3 * c.num_layers)]
        kept = {}
        for cache in (pair.ref, pair.dut):
            pools = self.pools[cache]
            cache.begin_forward(list(sids), list(lens), tree)
            outs = []
            for layer in range(c.num_layers):
                q, k, v = (pool[s:s + total] for pool, s in zip(pools, starts[3 * layer:3 * layer + 3]))
                outs.append(cache.attention(layer, q, k, v, return_lse=True))
            cache.end_forward()
            kept[cache] = outs
        for layer in range(c.num_layers):
            self.outputs.append((label, layer, kept[pair.ref][layer], kept[pair.dut][layer]))

    def decode(self, sids, steps=1):
        for _ in range(steps):
            self.forward(sids, [1] * len(sids))

    def ballast(self):
        """Queue a long prefill on the ballast cache and drop its outputs."""
        if self.ballast_cache is None:
            return
        b, (q, kv) = self.ballast_cache, self.ballast_inputs
        b.clear()
        b.add_sequence(0)
        with b.forward([0], [self.ballast_tokens]):
            for layer in range(b.config.num_layers):
                b.attention(layer, q, kv, kv)

    # ------------------------------------------------------------------ the only reads
    def finish(self) -> None:
        pair = self.pair
        for label, layer, (o_r, l_r), (o_d, l_d) in self.outputs:
            ctx = f"\n  {label}, layer {layer} (outputs read after {self.forwards} queued forwards)"
            assert_close("run-ahead attention output", to_numpy(o_r), to_numpy(o_d), pair.tol, context=ctx)
            assert_close("run-ahead lse", to_numpy(l_r), to_numpy(l_d), pair.tol, lse=True, context=ctx)
        pair.check()
