"""The twin driver: a backend under test and the reference backend driven in lockstep.

``CachePair`` owns two ``PagedKVCache`` objects built from the same ``CacheConfig``: ``ref`` on
the reference backend (the oracle) and ``dut`` (device under test) on the backend being proved.
Every public call goes to both; results are compared:

* attention outputs and lse with the per-dtype ``TOLERANCES``, strict about non-finite values
  both ways: NaN and +-inf must be exactly where the reference has them, and ``-inf`` lse (a row
  that sees no key) must be ``-inf`` in both;
* ``query_positions``, ``sequence_length``, ``sequence_ids``, ``num_available_pages``,
  ``total_sequence_length``, ``num_sequences``, ``is_empty`` exactly; ``get_kv`` of every
  sequence with the dtype tolerance;
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

The dense model (``DenseModel``: per sequence, the list of its tokens' K/V, no pages)
additionally checks the *reference* outputs, so a core bug is reported as such instead of being
copied by every backend.

``RunAhead`` is the same pair driven the way a serving loop drives a cache: nothing of the
backend under test is read until ``finish()``.
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Optional

import numpy as np

import kvcache
from kvcache import CacheConfig, PagedKVCache, to_numpy

from .model import DenseModel
from .tolerance import TOLERANCES, Mismatch, assert_close, round_to


def seed_for(text: str, base: int = 0) -> int:
    """A stable 31-bit seed from ``text`` (a test name) plus ``base``."""
    return (zlib.crc32(text.encode()) + base) & 0x7FFFFFFF


def make_config(*, dtype="float32", gqa=4, head_dim=64, page_size=16, num_layers=2,
                rope_mode="none", max_total_tokens=512, max_batch_size=16,
                prefill_chunk_size=512, support_sliding_window=False, num_kv_heads=None,
                rope_theta=10000.0, rope_scale=1.0, static_decode=False,
                static_decode_batch_sizes=(), rope_inv_freq=(), rope_rotary_dim=0,
                head_dim_v=None, prefix_cache=False, kv_dtype="auto",
                kv_quant_group=64, static_mixed=False, batch_invariant=False) -> CacheConfig:
    """A small config for the suite: GQA ratio ``gqa`` with 2 KV heads (1 for ratio 8)."""
    hkv = num_kv_heads or (1 if gqa >= 8 else 2)
    return CacheConfig(num_layers=num_layers, num_qo_heads=hkv * gqa, num_kv_heads=hkv,
                       head_dim=head_dim, page_size=page_size, max_batch_size=max_batch_size,
                       max_total_tokens=max_total_tokens, prefill_chunk_size=prefill_chunk_size,
                       dtype=dtype, rope_mode=rope_mode, rope_theta=rope_theta,
                       rope_scale=rope_scale, rope_inv_freq=rope_inv_freq,
                       rope_rotary_dim=rope_rotary_dim, support_sliding_window=support_sliding_window,
                       static_decode=static_decode, static_decode_batch_sizes=static_decode_batch_sizes,
                       head_dim_v=head_dim_v, prefix_cache=prefix_cache, kv_dtype=kv_dtype,
                       kv_quant_group=kv_quant_group, static_mixed=static_mixed,
                       batch_invariant=batch_invariant)


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
        ref_config = (dataclasses.replace(config, static_decode=False, static_mixed=False)
                      if config.static_decode else config)
        self.ref = PagedKVCache(ref_config, backend="reference")
        self.dut = PagedKVCache(config, backend=backend, device=device)
        # quantized pages: the reference (kvcache.kv_quant's rule) is the judge, not the dense
        # full-precision model
        self.model = DenseModel(config) if model and not config.kv_format.quantized else None
        self.poison_value = {"nan": np.nan, "large": 3.0e4 if config.dtype == "float16" else 1.0e6,
                             "none": None}[poison]
        self.seqs: list = []
        self.history: list[str] = []
        self.in_forward = False
        self.forwards = 0
        self.sids: list = []            # the open (or last) forward's sequences, lengths, tree
        self.lens: list = []
        self.tree = None
        self._with: Optional[tuple] = None    # the entered cache.forward(...) managers
        self.poison()

    # ------------------------------------------------------------------ helpers
    def context(self) -> str:
        """The config and the last calls, appended to every mismatch message."""
        c = self.config
        hist = "; ".join(self.history[-12:])
        more = f"... ({len(self.history) - 12} earlier) " if len(self.history) > 12 else ""
        return (f"\n  backend {self.dut.backend.name!r}, config dtype={c.dtype} "
                f"heads={c.num_qo_heads}/{c.num_kv_heads} head_dim={c.head_dim}/{c.head_dim_v} "
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
        k = b.from_numpy(np.full((len(free), c.num_kv_heads, c.head_dim), self.poison_value))
        v = b.from_numpy(np.full((len(free), c.num_kv_heads, c.head_dim_v), self.poison_value))
        slots = b.aux_to_device(free.astype(np.int32))
        for layer in range(c.num_layers):
            b.append_kv(cache.pages[layer], k, v, slots)

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
        """``add_sequence`` of each id on both caches."""
        for sid in sids:
            self.both("add_sequence", sid)
            self.seqs.append(sid)
        self.check()

    def remove(self, sid):
        """``remove_sequence`` on both caches."""
        self.both("remove_sequence", sid)
        self.seqs.remove(sid)
        self.check()

    def fork(self, parent, child, fork_pos=-1):
        """``fork_sequence`` on both caches."""
        self.both("fork_sequence", parent, child, fork_pos)
        self.seqs.append(child)
        self.check()

    def popn(self, sid, n):
        """``popn`` on both caches."""
        self.both("popn", sid, n)
        self.check()

    def enable_sliding_window(self, sid, window, sink):
        """``enable_sliding_window`` on both caches."""
        self.both("enable_sliding_window", sid, window, sink)
        self.check()

    def clear(self):
        """``clear`` on both caches."""
        self.both("clear")
        self.seqs.clear()
        self.check()

    def commit(self, sids, leaves):
        """``commit_accepted_token_tree_nodes`` on both caches."""
        self.both("commit_accepted_token_tree_nodes", list(sids), list(leaves))
        self.check()

    # ------------------------------------------------------------------ forward
    def random(self, *shape):
        """Standard-normal float64 host array of ``shape`` from the pair's seeded generator."""
        return self.rng.standard_normal(shape)

    def begin(self, sids, lens, tree=None, *, via_with=False):
        """begin_forward on both caches (``via_with``: by entering ``cache.forward(...)``, so
        that ``abort(how="raise")`` can leave the with block by an exception)."""
        if via_with:
            managers = self._with = self.both("forward", list(sids), list(lens), tree)
            for manager in managers:
                manager.__enter__()
        else:
            self.both("begin_forward", list(sids), list(lens), tree)
        self.in_forward = True
        self.forwards += 1
        self.sids, self.lens, self.tree = list(sids), list(lens), tree
        self.expected_positions = None
        if self.model is not None:
            self.expected_positions = self.model.begin(sids, lens, tree)

    def row_label(self, t: int) -> str:
        """Which sequence and new token row ``t`` of the open forward is."""
        for sid, n in zip(self.sids, self.lens):
            if t < n:
                return f"sequence {sid}, new token {t}"
            t -= n
        return "?"

    def check_positions(self):
        """``query_positions`` of both caches (and the dense model) agree."""
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
            raise Mismatch(f"CORE BUG: query_positions {r.tolist()} disagree with the dense model "
                           f"{self.expected_positions.tolist()}{self.context()}")

    def layer_inputs(self, layer: int):
        """The q, k, v of ``layer`` in the open forward: random host arrays (float64) of
        ``(T, num_qo_heads, D)``, ``(T, num_kv_heads, D)`` and ``(T, num_kv_heads, Dv)``, T the
        forward's tokens."""
        c, total = self.config, sum(self.lens)
        return (self.random(total, c.num_qo_heads, c.head_dim),
                self.random(total, c.num_kv_heads, c.head_dim),
                self.random(total, c.num_kv_heads, c.head_dim_v))

    def attend(self, layer, *, fused=False, sm_scale=None, return_lse=True, inputs=None,
               window_left=-1, logit_softcap=None, sinks=None):
        """q/k/v for ``layer`` (``inputs``: host arrays, or a function ``cache -> (q, k, v)`` of
        native arrays; default ``layer_inputs``) through both caches; compares o and lse (and
        the reference with the dense model); ``window_left`` (when >= 0), ``logit_softcap`` and
        ``sinks`` (host logits, one per query head) are passed on; returns the backend's
        (o, lse) as host arrays."""
        c = self.config
        win: dict = {"window_left": window_left} if window_left >= 0 else {}
        if logit_softcap is not None:
            win["logit_softcap"] = logit_softcap
        if sinks is not None:
            sinks = np.asarray(sinks, np.float64)
            self._note(f"sinks {np.round(sinks, 2).tolist()}")
        if inputs is None:
            inputs = self.layer_inputs(layer)
        if callable(inputs):
            native = inputs
            # the values as the reference holds them: what the fused call and the dense model use
            host = tuple(to_numpy(x) for x in native(self.ref))
        else:
            host = tuple(inputs)

            def native(cache):
                return tuple(cache.from_numpy(x) for x in host)
        self._note(f"attention(layer {layer}{', fused' if fused else ''})")
        results: list = []
        errors: list[Optional[Exception]] = []
        for cache in (self.ref, self.dut):
            if sinks is not None:
                win["sinks"] = cache.from_numpy(sinks)          # in the cache dtype
            try:
                if fused and cache is self.dut:
                    qkv = cache.from_numpy(np.concatenate(host, axis=1))
                    res = cache.attention_with_fused_qkv(layer, qkv, sm_scale, return_lse=return_lse,
                                                         **win) \
                        if return_lse else cache.attention_with_fused_qkv(layer, qkv, sm_scale, **win)
                else:
                    q, k, v = native(cache)
                    res = cache.attention(layer, q, k, v, sm_scale, return_lse=return_lse, **win) \
                        if return_lse else cache.attention(layer, q, k, v, sm_scale, **win)
                results.append(res)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001
                results.append(None)
                errors.append(exc)
        (r, d), (err_r, err_d) = results, errors
        if err_r is not None or err_d is not None:
            if err_r is None or err_d is None or type(err_r) is not type(err_d):
                raise Mismatch(f"attention: reference {'ok' if err_r is None else repr(err_r)}, "
                               f"backend {'ok' if err_d is None else repr(err_d)}"
                               f"{self.context()}") from err_d
            raise err_r
        if return_lse:
            (o_r, lse_r), (o_d, lse_d) = r, d
        else:
            if isinstance(d, tuple):
                raise Mismatch(f"attention(return_lse=False) returned a tuple{self.context()}")
            o_r, o_d, lse_r, lse_d = r, d, None, None
        if self.dut.backend.dtype_name(o_d) != c.dtype:
            raise Mismatch(f"attention output dtype {self.dut.backend.dtype_name(o_d)}, expected "
                           f"{c.dtype}{self.context()}")
        compared = self.compare_attention(layer, (o_r, lse_r), (o_d, lse_d))
        if compared is None:
            return None
        (o_r, lse_r), (o_d, lse_d) = compared
        if self.model is not None:
            qd, kd, vd = (round_to(x, c.dtype) for x in host)
            o_m, lse_m = self.model.attention(
                layer, qd, kd, vd, sm_scale, window_left, logit_softcap or 0.0,
                None if sinks is None else round_to(sinks, c.dtype))
            try:
                assert_close(f"reference attention output (layer {layer}) vs the dense model",
                             o_m, o_r, self.tol, row_label=self.row_label)
                if return_lse:
                    assert_close(f"reference lse (layer {layer}) vs the dense model", lse_m,
                                 lse_r, self.tol, lse=True, row_label=self.row_label)
            except Mismatch as exc:
                raise Mismatch(f"CORE BUG (not the backend under test): {exc}{self.context()}") from None
        return o_d, lse_d

    def compare_attention(self, layer: int, ref, dut):
        """Compare one layer's ``(o, lse)`` of both caches (lse None without ``return_lse``);
        returns both as host arrays, ``((o_r, lse_r), (o_d, lse_d))``."""
        (o_r, lse_r), (o_d, lse_d) = ref, dut
        o_r, o_d = to_numpy(o_r), to_numpy(o_d)
        ctx = self.context()
        assert_close(f"attention output (layer {layer})", o_r, o_d, self.tol, context=ctx,
                     row_label=self.row_label)
        if lse_r is not None:
            lse_r, lse_d = to_numpy(lse_r), to_numpy(lse_d)
            if lse_d.dtype != np.float32:
                raise Mismatch(f"lse dtype {lse_d.dtype}, expected float32{ctx}")
            assert_close(f"lse (layer {layer})", lse_r, lse_d, self.tol, lse=True, context=ctx,
                         row_label=self.row_label)
        return (o_r, lse_r), (o_d, lse_d)

    def end(self):
        """``end_forward`` on both caches, then ``check``."""
        self.both("end_forward")
        self.in_forward = False
        if self.model is not None:
            self.model.end()
        self.check()

    def abort(self, how="abort"):
        """Undo the open forward on both caches: ``abort_forward()``, or (``how="raise"``, after
        ``begin(via_with=True)``) an exception raised inside the ``with cache.forward`` block."""
        if how == "raise":
            if self._with is None:
                raise RuntimeError('abort(how="raise") needs a forward opened with '
                                   'begin(via_with=True)')
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
                layers=None, window_left=-1, logit_softcap=None, sinks=None):
        """One complete forward: begin, attention on every layer, end; compares everything.
        ``window_left``, ``logit_softcap`` and ``sinks`` are passed to every layer, or per layer
        where given as a function of the layer index."""
        def at(value, layer):
            return value(layer) if callable(value) else value

        self.begin(sids, lens, tree)
        if positions == "first":
            self.check_positions()
        for layer in (range(self.config.num_layers) if layers is None else layers):
            self.attend(layer, fused=fused, sm_scale=sm_scale, window_left=at(window_left, layer),
                        logit_softcap=at(logit_softcap, layer), sinks=at(sinks, layer))
        if positions == "after":
            self.check_positions()
        self.end()

    def prefill(self, sid, n, **kw):
        """One forward of ``n`` new tokens of sequence ``sid``."""
        self.forward([sid], [n], **kw)

    def decode(self, sids, steps=1, **kw):
        """``steps`` forwards of one new token for each of ``sids``."""
        for _ in range(steps):
            self.forward(list(sids), [1] * len(sids), **kw)

    # ------------------------------------------------------------------ state
    def snapshot(self, cache) -> dict:
        """Everything observable of ``cache``: counters, ids, lengths and ``get_kv`` (host arrays)."""
        return {"num_available_pages": cache.num_available_pages,
                "total_sequence_length": cache.total_sequence_length,
                "num_sequences": cache.num_sequences, "is_empty": cache.is_empty,
                "sequence_ids": sorted(cache.sequence_ids),
                "lengths": {s: cache.sequence_length(s) for s in self.seqs},
                "kv": {s: tuple(to_numpy(x) for x in cache.get_kv(s)) for s in self.seqs}}

    def check(self) -> None:
        """Compare the whole observable state of both caches (and with the model); re-poison."""
        if self.in_forward:
            return
        r, d = self.snapshot(self.ref), self.snapshot(self.dut)
        ctx = self.context()
        for key in ("num_available_pages", "total_sequence_length", "num_sequences", "is_empty",
                    "sequence_ids", "lengths"):
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
                                   f"dense model {m[0].shape[1]}{ctx}")
                for name, em, er in zip("kv", m, r["kv"][s]):
                    if np.isnan(em).any():   # a layer skipped by the test: unspecified content
                        continue
                    try:
                        assert_close(f"reference get_kv({s}) {name.upper()} vs the dense model",
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
        """``snapshot`` with its own copy of the lengths (for before/after comparisons)."""
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


class RunAhead(CachePair):
    """A ``CachePair`` driven the way a serving loop drives a cache: the backend under test gets
    every call queued with no host read in between; outputs are kept and compared only in
    ``finish()`` (so ``check``, ``check_positions`` and the dense model are off until then).

    Inputs come from pools of random rows made on the device before the first call (a forward
    slices them at random offsets), because turning host arrays into device arrays may wait for
    the device. ``ballast()`` queues a long prefill on a second cache of the same backend and
    device, whose outputs are dropped at once: the device is then busy long after the host has
    moved on, and the allocator holds freed blocks that queued kernels still write, which is
    where buffer reuse races show. ``ballast_tokens`` None: 64 on a CPU device (nothing runs
    ahead there), 4096 elsewhere. Everything the reference does is checked the same way at the
    end: per forward and layer the output and lse, and ``get_kv`` of every sequence.
    """

    POOL_ROWS = 1024

    def __init__(self, config: CacheConfig, backend: str, device: Optional[str] = None, *,
                 seed: int = 0, poison: str = "nan", ballast_tokens: Optional[int] = None):
        super().__init__(config, backend, device, seed=seed, poison=poison, model=False)
        c = config
        self.kept: list = []                # (label, layer, ref (o, lse), dut (o, lse))
        pools = [self.random(self.POOL_ROWS, h, d) for h, d in
                 ((c.num_qo_heads, c.head_dim), (c.num_kv_heads, c.head_dim),
                  (c.num_kv_heads, c.head_dim_v))]
        self.pools = {cache: [cache.from_numpy(x) for x in pools] for cache in (self.ref, self.dut)}
        if ballast_tokens is None:
            ballast_tokens = 64 if str(self.dut.backend.device).startswith("cpu") else 4096
        self.ballast_cache = None
        self.ballast_tokens = ballast_tokens
        if ballast_tokens:
            b = CacheConfig(num_layers=4, num_qo_heads=16, num_kv_heads=4, head_dim=c.head_dim,
                            page_size=c.page_size, max_batch_size=1, max_total_tokens=ballast_tokens,
                            prefill_chunk_size=ballast_tokens, dtype=c.dtype, rope_mode="none")
            self.ballast_cache = PagedKVCache(b, backend=self.dut.backend.name,
                                              device=self.dut.backend.device)
            rng = np.random.default_rng(1)
            self.ballast_inputs = [self.ballast_cache.from_numpy(rng.standard_normal((ballast_tokens, h, b.head_dim)))
                                   for h in (b.num_qo_heads, b.num_kv_heads)]

    # ------------------------------------------------------------------ no reads before finish
    def check(self) -> None:
        """Nothing: reading the backend under test would wait for the device."""

    def check_positions(self) -> None:
        """Nothing (see ``check``)."""

    def layer_inputs(self, layer: int):
        """Rows of the device-side pools at random offsets (no host-to-device copy)."""
        total = sum(self.lens)
        starts = [int(self.rng.integers(0, self.POOL_ROWS - total + 1)) for _ in range(3)]
        return lambda cache: tuple(pool[s:s + total] for pool, s in zip(self.pools[cache], starts))

    def compare_attention(self, layer: int, ref, dut):
        """Keep both outputs on the device for ``finish``."""
        label = f"forward {self.forwards - 1} {self.sids} {self.lens}{' tree' if self.tree else ''}"
        self.kept.append((label, layer, ref, dut))
        return None

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
        """Compare every kept output, then the whole state of both caches."""
        for label, layer, (o_r, l_r), (o_d, l_d) in self.kept:
            ctx = f"\n  {label}, layer {layer} (outputs read after {self.forwards} queued forwards)"
            assert_close("run-ahead attention output", to_numpy(o_r), to_numpy(o_d), self.tol, context=ctx)
            assert_close("run-ahead lse", to_numpy(l_r), to_numpy(l_d), self.tol, lse=True, context=ctx)
        CachePair.check(self)
