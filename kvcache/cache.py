"""``PagedKVCache``: the public API. Validates, then drives the core (sequences, pages, index
arrays) and the backend (memory, streams, kernels)."""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np

from .backend import Capabilities
from .config import DTYPES, CacheConfig
from .core.aux import MergedAuxManager, PlainAuxManager
from .core.plan import ForwardAux, ForwardPlan
from .core.planner import Planner
from .core.prefix import Ghost, PrefixIndex, Prompt
from .arrays import to_host
from .core.imports import ImportReservation, ImportSpec, pages_needed as import_pages
from .core.static import static_capacity
from .core.state import CacheState, as_int
from .core.validate import bool_arg, float_arg, int_arg, int_values, seq_id_arg, seq_id_list
from .kv_quant import AFFINE_BITS, affine_row_bytes
from .errors import (CacheFullError, ForwardStateError, InvalidArgumentError, KVCacheError,
                     SequenceExistsError, UnsupportedFeatureError)
from .plugins import open_backend
from .transfer import SequencePayload, payload_fields

# A backend-native array (numpy.ndarray, torch.Tensor, mlx.core.array): the core never looks inside.
Array = Any

_current_thread = threading.current_thread

# calls that may take over a forward left open by a thread that has died (see _exclusive)
_RECOVERS = frozenset({"abort_forward", "clear"})
FP8_CALIBRATION_FORWARDS = 8
"""Eager forwards that may calibrate an fp8 head in all (the first one that writes the layer
included): a head that only ever held zeros or NaN / inf by then keeps the provisional scale
(``kv_quant.FP8_PROVISIONAL_SCALE``), and the layer's forwards stop reading K/V back."""


def _exclusive(method):
    """A public call that runs only while no other thread uses the cache: the calling thread
    takes the cache's lock without waiting (else ForwardStateError naming the holder) and gives
    it back on return, except that a forward keeps it from begin_forward to end / abort.

    The owner is a ``Thread`` object, not a thread id: ids are reused, so a new thread must not
    pass for a dead one. A forward left open by a thread that has died can be taken over by
    ``abort_forward`` or ``clear`` from any thread (the only recovery: the dead thread cannot
    finish it); every other call raises ForwardStateError saying so."""
    what = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        me = _current_thread()
        if self._owner is me:                   # inside its own forward (or call)
            took = False
        elif self._lock.acquire(False):
            self._owner, took = me, True
        elif what in _RECOVERS and self._plan is not None and self._owner_died():
            self._owner, took = me, True        # the lock is held for the dead thread: take it
        else:
            raise self._busy(what)
        held = self._plan is not None
        try:
            return method(self, *args, **kwargs)
        finally:
            if self._plan is None and (took or held):
                self._owner = None
                self._lock.release()
    return call


class PagedKVCache:
    """A paged KV cache for ``config.num_layers`` attention layers on one backend's device.

    ``config``: a ``CacheConfig``; ``backend``: a registered backend name, or "auto" for the
    highest-priority available one; ``device``: the backend's device name (None: its default).
    Sequences are added, forked, popped and removed between forwards; a forward
    (``begin_forward`` .. ``attention`` per layer .. ``end_forward``) appends tokens to a batch
    of sequences and attends over their history. A cache is used by one thread at a time.

    Shapes, with ``T`` the new tokens of the open forward and ``B`` its sequences: ``q``
    ``(T, num_qo_heads, head_dim)``, ``k`` ``(T, num_kv_heads, head_dim)``, ``v`` and the
    output ``o`` ``(T, num_kv_heads | num_qo_heads, head_dim_v)``, ``lse`` ``(T, num_qo_heads)``
    float32; arrays are the backend's own (``from_numpy`` makes them).

    Attributes (read them, never assign): ``config`` (the ``CacheConfig``), ``backend`` (the
    ``Backend`` instance), ``capabilities`` (its ``Capabilities``), ``pages`` (one page array
    per layer, of shape ``backend.page_shape(config.num_pages)``), ``planner`` (plans
    forwards), ``state`` (the core's sequences and page table), ``aux_manager`` (moves a
    forward's index arrays to the device), ``copy_stream`` (the backend's copy stream, or
    None).
    """

    def __init__(self, config: CacheConfig, backend: str = "auto", device: Optional[str] = None) -> None:
        if not isinstance(config, CacheConfig):
            raise InvalidArgumentError(f"config must be a kvcache.CacheConfig, got {type(config).__name__}")

        def start(cls):
            """Check ``cls`` against the configuration, construct it and allocate the pages
            (``open_backend``: with backend='auto' a plugin failing here is skipped)."""
            caps = cls.capabilities
            self._require(config.dtype in caps.dtypes, "dtypes", f"dtype {config.dtype!r}", cls)
            self._require(config.kv_dtype in caps.kv_dtypes, "kv_dtypes",
                          f"kv_dtype {config.kv_dtype!r}", cls)
            self._require(config.head_dim in caps.head_dims, "head_dims", f"head_dim {config.head_dim}", cls)
            self._require(config.head_dim_v == config.head_dim or config.head_dim_v in caps.head_dims_v,
                          "head_dims_v", f"head_dim_v {config.head_dim_v} (head_dim {config.head_dim})", cls)
            self._require(not config.support_sliding_window or caps.sliding_window, "sliding_window",
                          "support_sliding_window=True", cls)
            self._require(config.effective_rope_mode != "inline" or caps.inline_rope, "inline_rope",
                          "inline RoPE (rope_mode='inline', or sliding windows with RoPE)", cls)
            self._require(not config.static_decode or caps.static_decode, "static_decode", "static_decode=True", cls)
            # a static-shape mixed step is one paged pass whose new tokens are chain trees
            self._require(not config.static_mixed or caps.tree_attention, "tree_attention",
                          "static_mixed=True", cls)
            self._require(config.effective_rope_mode == "none" or config.rope_spec().default_frequencies
                          or caps.rope_frequencies, "rope_frequencies",
                          "rope_inv_freq / rope_rotary_dim with RoPE on", cls)
            self.config = config
            self.backend = cls(config, device)
            self.capabilities: Capabilities = caps
            self.state = CacheState(config.num_pages, config.page_size, config.support_sliding_window)
            self.pages = self._allocate_pages(config)
            return cls

        cls = open_backend(backend, device, start)
        caps = self.capabilities
        self.copy_stream = self.backend.create_stream() if caps.copy_stream else None
        self._require(not config.static_decode or caps.merged_aux, "merged_aux", "static_decode=True", cls)
        self.aux_manager: Union[MergedAuxManager, PlainAuxManager]
        if caps.merged_aux:
            self.aux_manager = MergedAuxManager(
                self.backend, self.copy_stream,
                static_capacity=functools.partial(static_capacity, config)
                if config.static_decode else None)
        else:
            self.aux_manager = PlainAuxManager(self.backend)
        self.planner = Planner(self.state, config, caps)
        """Plans forwards; ``planner.begin`` plans and reserves without opening a forward
        (benchmarks and tests of the host work use it)."""
        self._prefix = PrefixIndex(self.state) if config.prefix_cache else None
        # fp8 pages: per layer, None (not set yet) or (host (2, Hkv) float32, backend array)
        self._kv_scales: Optional[list] = (
            [None] * config.num_layers if config.kv_dtype == "float8_e4m3" else None)
        # fp8 pages: per layer, None or (bool (2, Hkv): the heads (K's, V's) no forward could
        # calibrate yet, stored with kv_quant.FP8_PROVISIONAL_SCALE; eager forwards left to try)
        self._kv_pending: Optional[list] = (
            [None] * config.num_layers if self._kv_scales is not None else None)
        self._kv_pinned: set = set()        # layers set_kv_scales gave scales (clear() keeps them)
        self._scale_undo: dict = {}         # layer -> (scales, pending) before the open forward
        self._rope = config.rope_spec()
        self._plan: Optional[ForwardPlan] = None
        self._aux: Optional[ForwardAux] = None
        self._layers_done: set = set()
        self._watchers: list = []          # of the open forward (watch_forward)
        self._forward_exports: dict = {}   # (ids, starts) -> [headers, slots, device slots]
        self._lock = threading.Lock()      # held by the thread using the cache (see _exclusive)
        self._owner: Optional[threading.Thread] = None  # that thread

    # ------------------------------------------------------------------ threads
    def _owner_died(self) -> bool:
        """The lock's holder is a thread that has ended (it left its forward open)."""
        owner = self._owner
        return owner is not None and not owner.is_alive()

    def _busy(self, what: str) -> ForwardStateError:
        """The error for a call from a thread while another one uses the cache."""
        owner, plan = self._owner, self._plan
        doing = (f"holds an open forward over sequences {plan.seq_ids}" if plan is not None
                 else "is inside a call")
        who = (f"thread {owner.name!r} (id {owner.ident})" if owner is not None
               else "another thread")
        me = threading.current_thread()
        if plan is not None and self._owner_died():
            return ForwardStateError(
                f"{what} from thread {me.name!r} (id {me.ident}) while {who}, which has died, "
                f"{doing}: call abort_forward() or clear() from any thread to recover")
        return ForwardStateError(
            f"{what} from thread {me.name!r} (id {me.ident}) while {who} {doing}: a cache is "
            f"used by one thread at a time")

    def __getstate__(self):             # copies start unowned, with a lock of their own
        return dict(self.__dict__, _lock=None, _owner=None)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _allocate_pages(self, config):
        """The page arrays, refused up front (CacheFullError, nothing allocated) when they
        exceed the memory the backend says its device has."""
        need, capacity = config.kv_bytes, self.backend.memory_capacity()
        what = (f"{config.num_layers} layers x {config.num_pages} pages of {config.page_size} "
                f"tokens in {config.dtype}: {need} bytes ({need / 2**30:,.1f} GiB)")
        if capacity is not None and need > capacity:
            raise CacheFullError(
                f"the cache's page arrays need {what}, but the {self.backend.name!r} backend's "
                f"device holds {capacity} bytes ({capacity / 2**30:,.1f} GiB); lower "
                f"max_total_tokens or num_layers")
        try:
            return self.backend.allocate_pages(config.num_pages)
        except MemoryError as e:
            raise CacheFullError(f"allocating the cache's page arrays ({what}) failed: {e}") from None

    @staticmethod
    def _require(ok, capability, what, cls):
        if not ok:
            raise UnsupportedFeatureError(
                f"backend {cls.name!r} does not support {what}: {Capabilities.reason(capability)}")

    def __repr__(self) -> str:
        c, pt = self.config, self.state.pt     # unguarded: a repr from any thread never raises
        return (f"PagedKVCache(backend={self.backend.name!r}, layers={c.num_layers}, "
                f"pages={c.num_pages}x{c.page_size}, sequences={len(pt.seqs)}, "
                f"free_pages={pt.num_free})")

    # ------------------------------------------------------------------ arrays
    def from_numpy(self, array: Any) -> Array:
        """A native array on the cache's device: floats in the cache dtype, ints as int32."""
        try:
            host = np.asarray(array)
        except Exception as e:
            raise InvalidArgumentError(f"from_numpy needs a numeric array, got {type(array).__name__}: {e}") from None
        if host.dtype.kind in "OUSMmc":
            raise InvalidArgumentError(
                f"from_numpy needs a real numeric array, got dtype {host.dtype} from {type(array).__name__}")
        return self.backend.from_numpy(host)

    # ------------------------------------------------------------------ sequences
    def _no_forward(self, what: str) -> None:
        if self._plan is not None:
            raise ForwardStateError(
                f"{what} is not allowed between begin_forward and end_forward "
                f"(forward over sequences {self._plan.seq_ids} is open)")

    @_exclusive
    def add_sequence(self, seq_id: int, tokens: Optional[Sequence[int]] = None, *,
                     extra_key: Any = None) -> int:
        """Add sequence ``seq_id`` (an int in the int64 range, numpy ints too); returns its
        length: 0, or with the prefix cache the cached prefix it starts from.

        ``tokens``: the token ids of the sequence's positions as far as known (e.g. the
        prompt), ints >= 0. With ``CacheConfig(prefix_cache=True)`` the sequence starts holding
        the longest cached prefix of ``tokens`` in whole pages, at most ``len(tokens) - 1``
        tokens (the last one is left for the model to compute: its logits are the next pick),
        shared with the sequences that hold it; the ids are recorded, and each full page whose
        KV the sequence then computes joins the index. Without the prefix cache they are
        checked and ignored. ``extra_key``: any hashable value that must also match (e.g. a
        LoRA adapter id); None: none. A new sequence without a cached prefix takes no page
        until a forward appends to it.
        Raises SequenceExistsError if the id is in the cache, InvalidArgumentError for an id
        that is not such an int (a bool or a float neither), bad token ids or an unhashable
        ``extra_key``, ForwardStateError inside a forward; nothing changes then."""
        self._no_forward("add_sequence")
        if tokens is None:
            if extra_key is not None:
                raise InvalidArgumentError(
                    f"add_sequence({seq_id!r:.40}): extra_key is matched with tokens; pass tokens too")
            self.state.add_sequence(seq_id)
            return 0
        sid = seq_id_arg(seq_id)
        ids = _token_ids(tokens, f"add_sequence: sequence {sid}: tokens")
        if extra_key is not None:
            _hashable(extra_key, f"add_sequence: sequence {sid}: extra_key")
        if sid in self.state.pt.seqs:
            raise SequenceExistsError(f"sequence {sid} is already in the cache")
        if self._prefix is None:
            self.state.add_sequence(sid)
            return 0
        return self._prefix.attach(sid, ids, extra_key)

    @_exclusive
    def match_prefix(self, tokens: Sequence[int], extra_key: Any = None) -> int:
        """The length ``add_sequence(seq_id, tokens, extra_key=extra_key)`` would start from
        now: the longest cached prefix of ``tokens`` in whole pages, at most ``len(tokens) -
        1`` (0 without ``CacheConfig(prefix_cache=True)``). Changes nothing (not even the
        least-recently-used order). Raises InvalidArgumentError for bad ids or key."""
        ids = _token_ids(tokens, "match_prefix: tokens")
        if extra_key is not None:
            _hashable(extra_key, "match_prefix: extra_key")
        if self._prefix is None:
            return 0
        node = self._prefix.find(ids, extra_key)
        return 0 if node is None else node.depth * self.config.page_size

    @_exclusive
    def prefix_admission(self, tokens: Sequence[int], extra_key: Any = None) -> tuple[int, int]:
        """``(start, pages)``: the length ``add_sequence(seq_id, tokens, extra_key=extra_key)``
        would start from now (``match_prefix``), and how many of ``num_available_pages`` that
        takes (cached pages the new sequence would hold; pages other sequences hold already
        are not available anyway). A scheduler admits a request with it: its first chunk then
        needs ``pages_needed`` after those. ``(0, 0)`` without the prefix cache. Changes
        nothing."""
        ids = _token_ids(tokens, "prefix_admission: tokens")
        if extra_key is not None:
            _hashable(extra_key, "prefix_admission: extra_key")
        if self._prefix is None:
            return 0, 0
        node = self._prefix.find(ids, extra_key)
        return (0 if node is None else node.depth * self.config.page_size), self._prefix.pinned(node)

    @_exclusive
    def extend_tokens(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Record the token ids of sequence ``seq_id``'s next positions, after the ones already
        recorded (``add_sequence``'s ``tokens``, earlier calls): e.g. the tokens a request
        generated, before removing it, so that a next turn of the conversation finds them
        cached. Full pages whose ids and KV are both there join the index (at once, and after
        each forward). Ids of positions a sequence pops (``popn``) are forgotten; a sequence
        with a sliding window or an uncommitted token tree is indexed only once committed
        and unwindowed (never, for a window). No-op without ``CacheConfig(prefix_cache=True)``
        (the ids are still checked). Raises SequenceNotFoundError, InvalidArgumentError for bad
        ids, ForwardStateError inside a forward; nothing changes then."""
        self._no_forward("extend_tokens")
        seq = self.state.seq(seq_id)
        ids = _token_ids(tokens, f"extend_tokens: sequence {seq.seq_id}: tokens")
        if self._prefix is not None and len(ids):
            self._prefix.extend(seq, ids)

    @property
    @_exclusive
    def num_cached_pages(self) -> int:
        """Pages that only the prefix cache holds (no sequence reads them): part of
        ``num_available_pages``, evicted least recently used when a call needs pages. 0
        without ``CacheConfig(prefix_cache=True)``."""
        return 0 if self._prefix is None else self._prefix.evictable()

    @_exclusive
    def clear_prefix_cache(self) -> int:
        """Evict every cached page that no sequence reads (e.g. after the model's weights
        changed: cached KV would be stale) and forget it; returns the pages freed, all of
        ``num_cached_pages``. Sequences keep their pages. Raises ForwardStateError inside a
        forward."""
        self._no_forward("clear_prefix_cache")
        return 0 if self._prefix is None else self._prefix.clear()

    def _with_room(self, call, shortfall):
        """``call()``; when it raises CacheFullError and evicting cached pages covers the
        ``shortfall()`` (pages missing), evict them and call again. The call changed nothing
        when it raised, so a refusal that eviction cannot fix leaves the index as it was."""
        try:
            return call()
        except CacheFullError:
            prefix = self._prefix
            if prefix is None:
                raise
            short = shortfall()
            cached = prefix.evictable()
            if short <= 0 or cached < short:
                raise
            # a few pages more than this call lacks: the next calls then find free pages
            # instead of failing and planning again (a 32nd of the cache, at most 64 pages)
            prefix.evict(max(short, min(cached, 64, self.state.pt.num_pages // 32)))
        return call()

    @_exclusive
    def remove_sequence(self, seq_id: int) -> None:
        """Drop sequence ``seq_id`` and free the pages only it holds (pages shared with a fork
        stay with the other sequences). Raises SequenceNotFoundError for an id not in the cache,
        ForwardStateError inside a forward; nothing changes then."""
        self._no_forward("remove_sequence")
        seq = self.state.seq(seq_id)
        if self._prefix is not None and self._prefix.retire(seq):
            return                  # its indexed pages stay cached, held by a ghost
        self.state.remove_sequence(seq_id)

    @_exclusive
    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        """Add sequence ``child_id`` holding the first ``fork_pos`` tokens of ``parent_id``
        (-1: all of them). Whole pages are shared, not copied; a partial last page is copied.
        Raises SequenceNotFoundError / SequenceExistsError for the ids, InvalidArgumentError
        for ``fork_pos`` outside [0, length] (or beyond a windowed parent's sinks),
        ForwardStateError inside a forward or on an uncommitted token tree, CacheFullError
        when a partial page must be copied and no page is free; nothing changes then."""
        self._no_forward("fork_sequence")
        copies = self._with_room(lambda: self.state.fork_sequence(parent_id, child_id, fork_pos),
                                 lambda: 1 - self.state.pt.num_free)
        self._copy_pages(copies)
        if self._prefix is not None:
            child = self.state.seq(child_id)
            self._prefix.forked(self.state.seq(parent_id), child, self.state.length(child_id))

    @_exclusive
    def popn(self, seq_id: int, n: int) -> None:
        """Remove the last ``n`` tokens of sequence ``seq_id`` (``0 <= n <= length``; sinks of
        a sliding window included): pages left empty are freed; when the new end lies in a
        page shared with a fork, that partial page is copied first, so the other sequence keeps
        its tokens. Raises SequenceNotFoundError, InvalidArgumentError for ``n`` outside
        [0, length], ForwardStateError inside a forward or on an uncommitted token tree,
        CacheFullError when a partial page must be copied and no page is free; nothing changes
        then."""
        self._no_forward("popn")
        if self._prefix is not None:                # the pages it pops stay cached
            try:
                seq, count = self.state.check_popn(seq_id, n)
            except CacheFullError:              # eviction may make room: popn says
                seq, count = self.state.seq(seq_id), int(n)
            self._prefix.detach(seq, (int(self.state.pt.s_len[seq.slot]) - count) // self.config.page_size)
        copies = self._with_room(lambda: self.state.popn(seq_id, n),
                                 lambda: 1 - self.state.pt.num_free)
        self._copy_pages(copies)
        if self._prefix is not None:
            self._prefix.truncated(self.state.seq(seq_id))

    def _copy_pages(self, copies) -> None:
        for c in copies:
            self.backend.copy_page_prefix(self.pages, c.src_page, c.dst_page, c.length)

    @_exclusive
    def enable_sliding_window(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Give sequence ``seq_id`` a sliding window (eviction): after each forward it keeps its
        first ``sink_size`` tokens (the attention sinks) and its last ``window_size -
        sink_size``; whole pages between the two are freed, and RoPE is applied inside attention
        at the positions within the kept tokens. Needs ``CacheConfig(support_sliding_window=True)``.

        ``window_size``: an int > 0, the tokens kept; ``sink_size``: an int in
        [0, window_size). Pages shared with another sequence never slide out, so ``sink_size``
        must cover the prefix the sequence shares with a fork. Raises SequenceNotFoundError,
        InvalidArgumentError (a cache without sliding-window support, bad sizes, a window
        already set, a shared prefix longer than ``sink_size``), ForwardStateError inside a
        forward or on an uncommitted token tree; nothing changes then."""
        self._no_forward("enable_sliding_window")
        self.state.enable_sliding_window(seq_id, window_size, sink_size)
        if self._prefix is not None:            # its pages will slide: their entries go
            seq = self.state.seq(seq_id)
            if seq.prefix is not None:
                self._prefix.release(seq.prefix)

    @_exclusive
    def clear(self) -> None:
        """Drop every sequence and free every page (also ends an open forward, even one left
        open by a thread that has died). fp8 pages: the scales forwards calibrated and imports
        adopted are forgotten (the next forward calibrates again); those ``set_kv_scales``
        gave stay."""
        self._close(committed=False)
        self.state.clear()
        if self._kv_scales is not None:
            for layer in range(self.config.num_layers):
                if layer not in self._kv_pinned:
                    self._kv_scales[layer] = None
                self._kv_pending[layer] = None          # type: ignore[index]
        if self._prefix is not None:
            self._prefix = PrefixIndex(self.state)

    @_exclusive
    def commit_accepted_token_tree_nodes(self, seq_ids: Sequence[int],
                                         leaf_indices: Sequence[int]) -> None:
        """Accept one path of each sequence's uncommitted token tree (speculative decoding):
        the accepted nodes' K/V rows move right after the committed history (one
        ``Backend.compact_kv`` launch), every other tree token is dropped, and the sequences
        are committed (they can be forked, popped, exported and windowed again).

        ``seq_ids``: B distinct ids of sequences in the cache; ``leaf_indices``: B ints, the
        accepted leaf of each as an index into that sequence's uncommitted tree (all tree
        tokens appended since its last commit, in ``token_tree_parent_ptr`` order): the path
        from the root to that node is kept; -1 keeps none of the tree. Raises
        SequenceNotFoundError, InvalidArgumentError (lengths differ, a sequence listed twice,
        a leaf outside [-1, tree size)), ForwardStateError inside a forward; nothing changes
        then."""
        self._no_forward("commit_accepted_token_tree_nodes")
        items = self.state.check_commit(seq_ids, leaf_indices)
        src, dst = self.state.commit_plan(items)
        bases = [self.state.pt.length(seq) - len(seq.tree_parent) for seq, _ in items]
        if len(src):
            self.backend.compact_kv(self.pages, self.backend.aux_to_device(src),
                                    self.backend.aux_to_device(dst))
        self.state.commit(items)
        if self._prefix is not None:
            for (seq, _), base in zip(items, bases):    # ids recorded past the tree's
                self._prefix.truncated(seq, base)           # root are not the accepted ones
                self._prefix.index(seq)

    # ------------------------------------------------------------------ queries
    @property
    @_exclusive
    def num_available_pages(self) -> int:
        """Free pages now (of ``num_total_pages``), counting the cached pages that eviction
        frees when needed (``num_cached_pages``); ``begin_forward`` raises CacheFullError when a
        forward needs more (``pages_needed``)."""
        free = int(self.state.pt.num_free)
        return free if self._prefix is None else free + self._prefix.evictable()

    @property
    def num_total_pages(self) -> int:
        """Pages per layer, ``config.num_pages``: the capacity in tokens is about
        ``num_total_pages * page_size`` (one page is spare; see ``CacheConfig.num_pages``)."""
        return int(self.state.pt.num_pages)

    @property
    @_exclusive
    def total_sequence_length(self) -> int:
        """The tokens of every sequence added up (a token shared by forks counts once per
        sequence; a sliding window counts the tokens it keeps)."""
        pt = self.state.pt
        return int(sum(int(pt.s_len[s.slot]) for k, s in pt.seqs.items() if not isinstance(k, Ghost)))

    @_exclusive
    def sequence_length(self, seq_id: int) -> int:
        """The tokens sequence ``seq_id`` holds (committed ones and its uncommitted token tree;
        with a sliding window, the tokens it keeps). Raises SequenceNotFoundError."""
        return self.state.length(seq_id)

    @property
    @_exclusive
    def num_sequences(self) -> int:
        """The number of sequences in the cache."""
        return len(self._sequence_ids())

    @property
    @_exclusive
    def sequence_ids(self) -> list[int]:
        """The ids of the sequences in the cache (a new list; no particular order)."""
        return self._sequence_ids()

    def _sequence_ids(self) -> list:
        seqs = self.state.pt.seqs
        if self._prefix is None:
            return list(seqs)
        return [k for k in seqs if not isinstance(k, Ghost)]

    @property
    @_exclusive
    def is_empty(self) -> bool:
        """Whether the cache holds no sequence and every page is free (or only cached: see
        ``num_cached_pages``)."""
        return not self._sequence_ids() and self.num_available_pages == self.state.pt.num_pages

    @_exclusive
    def pages_needed(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                     token_tree_parent_ptr: Optional[Sequence[int]] = None, *,
                     net: bool = False) -> int:
        """The free pages that ``begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)``
        would take now: a scheduler's "is there room" question (vLLM's ``allocate_slots``),
        answered by the code ``begin_forward`` reserves with, so the two cannot disagree.

        ``seq_ids``: B distinct ids of sequences in the cache (1 <= B <= max_batch_size);
        ``append_lengths``: B ints >= 1, the new tokens of each, summing to at most
        ``prefill_chunk_size``; ``token_tree_parent_ptr``: None, or one int per new token, as
        for ``begin_forward`` (a tree does not change the count, only what is valid).
        Each sequence counts the pages its new tokens need beyond the room left in its last
        page (a partial last page is filled first; a page shared with a fork never is: the
        fork already copied the partial page, so a sequence's last page is its own).
        ``net``: False (default) counts every page taken off the free list, the number
        ``begin_forward`` compares with ``num_available_pages`` (CacheFullError above it);
        a sliding window frees the pages that slide out only after every new page is taken, so
        they do not make room for the same forward. True: that count minus the pages the
        forward's sliding windows free, i.e. how far ``num_available_pages`` drops from now to
        after the forward (negative when windows free more than the forward takes); the two
        counts differ only for sequences with a sliding window.
        Validates like ``begin_forward`` (SequenceNotFoundError, InvalidArgumentError,
        ForwardStateError for an uncommitted tree, naming the sequence, value and limit) but
        never raises CacheFullError, and changes nothing. Inside an open forward it counts
        against the pages that forward leaves (``end_forward`` changes no page)."""
        net = bool_arg(net, "net")
        taken, freed = self.planner.pages_needed(seq_ids, append_lengths, token_tree_parent_ptr)
        return taken - freed if net else taken

    @_exclusive
    def append_room(self, seq_id: int, pages: int, limit: int) -> int:
        """The most new tokens, at most ``limit``, that ``seq_id`` can append in one forward of
        its own taking at most ``pages`` free pages: the inverse of ``pages_needed`` (the room
        in its own last page first, then whole pages; a sliding window counted as
        ``pages_needed`` counts it), so a scheduler sizes a prompt chunk without page maths.

        ``seq_id``: a sequence in the cache; ``pages``: an int (below 1: the room in its last
        page only); ``limit``: an int in [1, prefill_chunk_size]. Raises what ``pages_needed``
        raises for ``([seq_id], [limit])``; changes nothing."""
        pages = int_arg(pages, "pages")
        return self.planner.append_room(seq_id, pages, limit)

    @_exclusive
    def can_append(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                   token_tree_parent_ptr: Optional[Sequence[int]] = None) -> bool:
        """Whether ``begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)`` has the
        pages it needs now: ``pages_needed(...) <= num_available_pages`` (False exactly when
        it would raise CacheFullError). Same arguments and input errors as ``pages_needed``;
        changes nothing."""
        return self.pages_needed(seq_ids, append_lengths,
                                 token_tree_parent_ptr) <= self.num_available_pages

    @property
    def _packed(self) -> bool:
        """Whether pages move as packed rows (int8 / int4: ``Backend.gather_kv_packed``)."""
        return self.config.kv_dtype in AFFINE_BITS

    def _stored_rows(self, slots: np.ndarray, layers: Optional[range] = None,
                     dev: Optional[Array] = None) -> tuple[Array, Array]:
        """(k, v) of ``layers`` (None: every layer) at ``slots`` as a payload carries them:
        packed rows for int8 / int4 pages, else the values (fp8: read back with the layer
        scales). ``dev``: ``slots`` on the device already."""
        b = self.backend
        layers = range(self.config.num_layers) if layers is None else layers
        pages = self.pages[layers.start:layers.stop]
        dev = b.aux_to_device(slots) if dev is None else dev
        if self._packed:
            return b.gather_kv_packed(pages, dev)
        return b.gather_kv(pages, dev, **self._gather_kw(layers))

    def _layer_range(self, layers, what: str) -> range:
        """``layers`` (None: all, or a ``range`` of consecutive layers, step 1, non-empty)
        checked against the cache's layer count."""
        n = self.config.num_layers
        if layers is None:
            return range(n)
        if not isinstance(layers, range) or layers.step != 1 or not 0 <= layers.start < layers.stop <= n:
            raise InvalidArgumentError(
                f"{what}: layers={layers!r} must be None or a range of consecutive layers "
                f"within [0, {n}) (e.g. range(0, {n}))")
        return layers

    @_exclusive
    def set_kv_scales(self, layer_id: int, k_scale, v_scale) -> None:
        """The fp8 scales of layer ``layer_id`` (``kv_dtype="float8_e4m3"``): ``k_scale`` and
        ``v_scale`` each one float > 0 or ``num_kv_heads`` of them (a stored code times its
        head's scale is the value read back; e.g. a checkpoint's ``k_scale`` / ``v_scale``).
        Without them the first forward that writes a layer calibrates its scales
        (``kvcache.kv_quant.calibrate_fp8``, from finite values; a head that forward leaves
        uncalibrated, all zeros or NaN / inf, is calibrated by a later one). A layer's scales
        are set once, before a calibrated or imported scale binds its stored codes (they would
        change meaning); scales set here survive ``clear()``, calibrated and imported ones do
        not. Each scale is checked as the float32 it is stored as: within
        ``kv_quant.FP8_SCALE_LIMITS`` (1e-50 would be 0, 1e39 inf). Raises
        InvalidArgumentError for another ``kv_dtype``, a bad layer or scale, or a layer whose
        scales are set; ForwardStateError inside a forward; nothing changes then."""
        self._no_forward("set_kv_scales")
        c = self.config
        if self._kv_scales is None:
            raise InvalidArgumentError(
                f"set_kv_scales: the cache stores kv_dtype={c.kv_dtype!r}; scales are for "
                f"'float8_e4m3' pages")
        layer_id = self._layer(layer_id, "set_kv_scales: layer_id")
        if self._fixed_scales(layer_id) is not None:
            raise InvalidArgumentError(
                f"set_kv_scales: layer {layer_id} has its scales already (set, imported or "
                f"calibrated when it was first written); its stored codes depend on them")
        from .kv_quant import FP8_SCALE_LIMITS
        lo, hi = FP8_SCALE_LIMITS
        rows = []
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            vals = value.tolist() if hasattr(value, "tolist") else value
            one = not isinstance(vals, (list, tuple))
            vals = [vals] * c.num_kv_heads if one else list(vals)
            if len(vals) != c.num_kv_heads:
                raise InvalidArgumentError(
                    f"set_kv_scales: {name} has {len(vals)} values, expected 1 or num_kv_heads="
                    f"{c.num_kv_heads}")
            row = []
            for head, x in enumerate(vals):
                what = f"set_kv_scales: {name}" + ("" if one else f"[{head}]")
                f = float_arg(x, what, positive=True)
                with np.errstate(over="ignore", under="ignore"):
                    f32 = float(np.float32(f))
                if not lo <= f32 <= hi:
                    raise InvalidArgumentError(
                        f"{what}={f!r} is {f32!r} as the float32 it is stored as; a scale must "
                        f"be in [{lo!r}, {hi!r}] after that cast (a normal float32 whose "
                        f"saturated code, 448 x scale, is finite)")
                row.append(f32)
            rows.append(row)
        self._put_scales(layer_id, np.asarray(rows, np.float32))
        self._kv_pending[layer_id] = None               # type: ignore[index]
        self._kv_pinned.add(layer_id)

    @_exclusive
    def kv_scales(self, layer_id: int) -> Optional[tuple]:
        """``(k_scale, v_scale)`` of layer ``layer_id``, each a tuple of ``num_kv_heads``
        floats, or None while not set (and for pages that are not fp8). Raises
        InvalidArgumentError for a layer outside [0, num_layers)."""
        layer_id = self._layer(layer_id, "kv_scales: layer_id")
        if self._kv_scales is None:
            return None
        entry = self._kv_scales[layer_id]
        return None if entry is None else (tuple(entry[0][0].tolist()), tuple(entry[0][1].tolist()))

    def _put_scales(self, layer: int, host) -> None:
        self._kv_scales[layer] = (host, self.backend.from_numpy(host, "float32"))   # type: ignore[index]

    def _fixed_scales(self, layer: int) -> Optional[np.ndarray]:
        """Layer ``layer``'s host (2, Hkv) fp8 scales once some bind its stored codes; None
        while none do (never set, or every head still waiting for a forward to calibrate it:
        what such a head holds reads the same at any scale)."""
        entry = self._kv_scales[layer]                      # type: ignore[index]
        pending = self._kv_pending[layer]                   # type: ignore[index]
        if entry is None or (pending is not None and pending[0].all()):
            return None
        return entry[0]

    def _scale_kw(self, plan: ForwardPlan, layer: int, k, v, positions) -> dict:
        """The ``kv_scale`` keyword of layer ``layer``'s kernels ({} unless fp8 pages),
        calibrating the layer's scales from this forward's ``k`` / ``v`` as they are stored
        (K rotated at ``positions`` where the cache applies RoPE as it writes: a rotation can
        raise a coordinate up to sqrt(2) times) when none are set, or those of its heads no
        forward could calibrate yet."""
        if self._kv_scales is None:
            return {}
        pending = self._kv_pending[layer]                   # type: ignore[index]
        if self._kv_scales[layer] is None or pending is not None:
            if plan.static_bucket is None:
                self._calibrate(layer, k, v, positions)
            elif self._kv_scales[layer] is None:
                raise ForwardStateError(
                    f"layer {layer} has no fp8 scales, and a static-shape decode step (which "
                    f"may be captured) cannot calibrate them: set_kv_scales, or run an eager "
                    f"forward first (forward over sequences {plan.seq_ids})")
            else:
                # a captured step cannot look at its values: the heads still uncalibrated keep
                # the provisional scale for good (not undone by an abort either: a capture may
                # hold this scale array, which a later calibration would replace)
                self._kv_pending[layer] = None              # type: ignore[index]
        return {"kv_scale": self._kv_scales[layer][1]}     # type: ignore[index]

    def _calibrate(self, layer: int, k, v, positions) -> None:
        """Calibrate layer ``layer``'s fp8 scales, or its heads still uncalibrated, from this
        forward's ``k`` / ``v`` (``kv_quant.fp8_calibration``: finite values only, outliers
        clipped). A head left uncalibrated (all zeros, NaN, inf) keeps the provisional scale
        and is tried again by the next eager forwards that write the layer, up to
        ``FP8_CALIBRATION_FORWARDS`` in all, then keeps it for good (each try reads the
        layer's K/V back to the host). ``abort_forward`` undoes it."""
        from .kv_quant import fp8_calibration
        b = self.backend
        if self.config.effective_rope_mode == "normal":
            k = b.rope(k, positions, self._rope)
        (ks, k_ok), (vs, v_ok) = fp8_calibration(b.to_numpy(k)), fp8_calibration(b.to_numpy(v))
        new, ok = np.stack([ks, vs]), np.stack([k_ok, v_ok])
        entry, pending = self._kv_scales[layer], self._kv_pending[layer]    # type: ignore[index]
        self._scale_undo.setdefault(layer, (entry, pending))
        host: Optional[np.ndarray]
        if entry is None:
            host, waiting, left = new, ~ok, FP8_CALIBRATION_FORWARDS
        else:
            waiting, left = pending                     # type: ignore[misc]
            take = waiting & ok
            host = np.where(take, new, entry[0]).astype(np.float32) if take.any() else None
            waiting = waiting & ~ok
        if host is not None:
            self._put_scales(layer, host)
        left -= 1
        pending = (waiting, left) if waiting.any() and left > 0 else None
        self._kv_pending[layer] = pending               # type: ignore[index]

    def _gather_kw(self, layers) -> dict:
        """``gather_kv``'s ``kv_scale`` keyword for ``layers`` ({} unless fp8 pages): per layer
        its scales (1.0 for a layer never written: nothing stored to read)."""
        if self._kv_scales is None:
            return {}
        ones = None
        out = []
        for layer in layers:
            entry = self._kv_scales[layer]
            if entry is None:
                if ones is None:
                    ones = self.backend.from_numpy(
                        np.ones((2, self.config.num_kv_heads), np.float32), "float32")
                out.append(ones)
            else:
                out.append(entry[1])
        return {"kv_scale": out}

    @_exclusive
    def get_kv(self, seq_id: int, start: int = 0, end: Optional[int] = None,
               layer: Optional[int] = None) -> tuple[Array, Array]:
        """The K/V of tokens ``start .. end-1`` (None: to the end) of sequence ``seq_id``, K as
        stored: ``(k, v)`` each ``(num_layers, end-start, num_kv_heads, head_dim)`` (v:
        ``head_dim_v``), or with ``layer`` that layer's only, ``(end-start, num_kv_heads,
        head_dim)``.

        With ``layer`` it may also be called inside a forward (by the thread that opened it), for
        a model that computes its attention itself (see ``append_kv``): the tokens from before
        the forward are there, and the forward's own once the layer has run. Raises
        SequenceNotFoundError, InvalidArgumentError for a range outside [0, length] or a layer
        outside [0, num_layers), ForwardStateError inside a forward without ``layer``, for a
        range reaching the forward's tokens before the layer has written them, or in a forward
        over a sliding-window sequence (its new tokens may take the slots of old ones)."""
        if layer is None:
            self._no_forward("get_kv")
        seq = self.state.seq(seq_id)
        length = self.state.pt.length(seq)
        start = as_int(start, "start")
        end = length if end is None else as_int(end, "end")
        if not 0 <= start <= end <= length:
            raise InvalidArgumentError(
                f"get_kv range [{start}, {end}) of sequence {seq.seq_id} must lie in [0, {length}]")
        pages, layers = self.pages, range(self.config.num_layers)
        if layer is not None:
            layer = self._layer(layer, "get_kv layer")
            pages, layers = [self.pages[layer]], range(layer, layer + 1)
            if self._plan is not None:
                self._check_in_forward_read(self._plan, seq, layer, end, length)
        slots = self.state.pt.position_slots(seq, start, end)
        k, v = self.backend.gather_kv(pages, self.backend.aux_to_device(slots),
                                      **self._gather_kw(layers))
        return (k, v) if layer is None else (k[0], v[0])

    def _check_in_forward_read(self, plan: ForwardPlan, seq, layer: int, end: int,
                               length: int) -> None:
        """ForwardStateError unless tokens ``.. end-1`` of ``seq`` hold layer ``layer``'s K/V
        during the open forward ``plan``."""
        if plan.write_after:
            raise ForwardStateError(
                f"get_kv(layer={layer}) inside a forward over sliding-window sequences "
                f"({plan.seq_ids}): a new token may take the slot of an old one")
        written = length
        if seq.seq_id in plan.seq_ids and layer not in self._layers_done:
            written -= int(plan.append_lengths[plan.seq_ids.index(seq.seq_id)])
        if end > written:
            raise ForwardStateError(
                f"get_kv range up to {end} of sequence {seq.seq_id} reaches this forward's new "
                f"tokens (from {written}), which layer {layer} has not written yet (attention "
                f"or append_kv first)")

    # ------------------------------------------------------------------ export / import
    @_exclusive
    def export_sequence(self, seq_id: int, start: int = 0, end: Optional[int] = None) -> SequencePayload:
        """The K/V of tokens ``start .. end-1`` (None: to the end) of sequence ``seq_id`` as
        stored, with what another cache needs to take them (``kvcache.SequencePayload``: the
        arrays are this backend's, each (num_layers, end-start, num_kv_heads, head_dim); the
        copy is queued on the device, ``payload.to_numpy()`` waits for it). Raises
        SequenceNotFoundError, InvalidArgumentError for a range outside [0, length],
        ForwardStateError inside a forward or for an uncommitted token tree; changes nothing."""
        self._no_forward("export_sequence")
        header, slots = self._export_range(seq_id, start, end)
        k, v = self._stored_rows(slots)
        return dataclasses.replace(header, k=k, v=v)

    @_exclusive
    def export_sequences(self, seq_ids: Sequence[int], starts: Optional[Sequence[int]] = None,
                         *, layers: Optional[range] = None
                         ) -> tuple[list[SequencePayload], Array, Array]:
        """Several sequences' tails in one gather: ``(headers, k, v)`` with ``headers[i]`` the
        header-only payload of ``seq_ids[i]`` from ``starts[i]`` (None: 0) to its end, and
        ``k``, ``v`` (num_layers, total tokens, num_kv_heads, head_dim) holding their tokens
        one sequence after another (``kvcache.distributed`` sends them as they are). From fp8
        pages, as ``export_sequence``: ``k`` and ``v`` hold the values read back (``code *
        scale``) in the compute dtype, and each header the layer scales (``kv_scales``).
        ``layers``: a ``range`` of consecutive layers to gather (None: all); ``k`` and ``v``
        then hold ``len(layers)`` layers (a transfer sends a large batch a few layers at a
        time, gathering the next while the last is on the wire). Inside an open forward (its
        own thread) the sequences are as they will be after it, and ``layers`` must be layers
        the forward has written (``layers_run``): a transfer sends each layer while the next
        computes (ForwardStateError otherwise, and for sliding-window forwards, whose new
        tokens may take old tokens' slots). Errors as ``export_sequence``; a sequence listed
        twice is refused. ``layers=range(i, i)`` (empty): the headers alone, ``k`` and ``v``
        None (inside a forward too: what a transfer announces before the layers are written)."""
        headers_only = (isinstance(layers, range) and len(layers) == 0 and layers.step == 1
                        and 0 <= layers.start <= self.config.num_layers)
        layers = range(0, 0) if headers_only else self._layer_range(layers, "export_sequences")
        plan = self._plan
        if plan is not None:
            unwritten = sorted(set(layers) - self._layers_done)
            if plan.write_after or unwritten:
                raise ForwardStateError(
                    f"export_sequences inside the forward over sequences {plan.seq_ids}: "
                    + ("a sliding-window forward's new tokens may take old tokens' slots"
                       if plan.write_after else f"layers {unwritten} are not written yet "
                       f"(attention or append_kv first)"))
        seq_ids = seq_id_list(seq_ids, "seq_ids")
        starts = [0] * len(seq_ids) if starts is None else int_values(starts, "starts")
        if len(starts) != len(seq_ids):
            raise InvalidArgumentError(
                f"export_sequences got {len(seq_ids)} seq_ids but {len(starts)} starts")
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidArgumentError(f"export_sequences: seq_ids {seq_ids} repeat a sequence")
        key = (tuple(seq_ids), tuple(starts))
        known = self._forward_exports.get(key) if plan is not None else None
        if known is None:
            parts = [self._export_range(sid, st, None) for sid, st in zip(seq_ids, starts)]
            slots = (np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int32))
            known = [[p[0] for p in parts], slots, None]
            # a transfer inside the forward asks again for each layer (not with fp8 pages:
            # the headers carry scales this forward may still calibrate)
            if plan is not None and self._kv_scales is None:
                self._forward_exports[key] = known
        headers, slots, dev = known
        if headers_only:
            return list(headers), None, None
        if dev is None:
            dev = known[2] = self.backend.aux_to_device(slots)
        k, v = self._stored_rows(slots, layers, dev)
        return list(headers), k, v

    def _payloads_supported(self, what: str) -> None:
        c = self.config
        if c.head_dim_v != c.head_dim:
            raise UnsupportedFeatureError(
                f"{what}: sequence payloads carry K and V with one head dim, but this cache has "
                f"head_dim={c.head_dim} and head_dim_v={c.head_dim_v} (not supported yet)")

    def _export_range(self, seq_id, start, end) -> tuple[SequencePayload, np.ndarray]:
        """(header-only payload, slots) of an export, validated."""
        seq = self.state.seq(seq_id)
        self._payloads_supported(f"export of sequence {seq.seq_id}")
        if not seq.committed:
            raise ForwardStateError(
                f"sequence {seq.seq_id} has {len(seq.tree_parent)} uncommitted token-tree tokens; "
                f"call commit_accepted_token_tree_nodes before exporting it")
        length = self.state.pt.length(seq)
        start = as_int(start, "start")
        end = length if end is None else as_int(end, "end")
        if not 0 <= start <= end <= length:
            raise InvalidArgumentError(
                f"export range [{start}, {end}) of sequence {seq.seq_id} must lie in "
                f"[0, {length}]")
        windowed = seq.window != -1
        header = SequencePayload(
            None, None, start=start, num_tokens=end - start, source_length=length,
            window_size=seq.window if windowed else -1,
            sink_size=seq.sink_request if windowed else 0,
            backend=self.backend.name, device=self.backend.device,
            kv_scales=self._payload_scales(), **payload_fields(self.config))
        return header, self.state.pt.position_slots(seq, start, end)

    def _payload_scales(self) -> Optional[tuple]:
        """A payload's ``kv_scales``: per layer ((K's), (V's)) or None (fp8 pages only)."""
        if self._kv_scales is None:
            return None
        return tuple(self.kv_scales(layer) for layer in range(self.config.num_layers))

    @_exclusive
    def import_sequence(self, seq_id: int, payload: SequencePayload, *,
                        parent_id: Optional[int] = None, fork_pos: Optional[int] = None,
                        convert_dtype: bool = False) -> None:
        """Add sequence ``seq_id`` holding ``payload``'s tokens (from ``export_sequence`` of
        any cache and backend; the page size may differ).

        Without ``parent_id`` the payload must start at token 0. With ``parent_id`` the new
        sequence forks from that sequence at ``fork_pos`` (default ``payload.start``; it must
        lie in ``[payload.start, payload.end]``): it shares the parent's first ``fork_pos``
        tokens (their pages, as ``fork_sequence``) and gets the payload's tokens from
        ``fork_pos`` on. The caller vouches that the parent's first ``fork_pos`` tokens are the
        source's; a payload with a sliding window shares only its sink tokens.
        ``convert_dtype``: accept a payload stored in another dtype (rounded to this cache's).
        An fp8 cache takes fp8 payloads: it adopts their scales for layers that have none and
        stores their values again (the source's codes); a layer with other scales refuses
        unless ``convert_dtype`` (docs/quantized-kv.md). A sliding window in the payload is
        enabled on the new sequence.
        Raises SequenceExistsError / SequenceNotFoundError for the ids, InvalidArgumentError
        for a payload this cache would store or read otherwise (layers, KV heads, head_dim,
        RoPE mode or settings, dtype) or a bad ``fork_pos``, UnsupportedFeatureError for an
        unknown format version, CacheFullError when the free pages do not suffice,
        ForwardStateError inside a forward; nothing changes then."""
        self._no_forward("import_sequence")
        convert_dtype = bool_arg(convert_dtype, "convert_dtype")
        spec = self._import_spec(seq_id, payload, parent_id, fork_pos, convert_dtype)
        if payload.k is None or payload.v is None:
            raise InvalidArgumentError(
                f"import of sequence {spec.seq_id}: the payload has no arrays (a header-only "
                f"payload can only be reserved: reserve_import)")
        adopt = self._import_scales(spec.seq_id, payload, convert_dtype)
        k, v, packed = self._native_kv(spec.seq_id, payload)
        res = self._reserve_import([spec])
        res.scales = dict(adopt)        # adopted by the commit only: a failure leaves none
        try:
            self._write_import(res, k, v, packed)
            self._commit_import(res)
        except BaseException:
            self.state.cancel_import(res)
            raise

    def _import_spec(self, seq_id, payload, parent_id, fork_pos, convert_dtype) -> ImportSpec:
        """The checked ``ImportSpec`` of importing ``payload`` as ``seq_id``."""
        seq_id = seq_id_arg(seq_id)
        if not isinstance(payload, SequencePayload):
            raise InvalidArgumentError(
                f"import of sequence {seq_id}: payload must be a kvcache.SequencePayload "
                f"(from export_sequence), got {type(payload).__name__}")
        self._payloads_supported(f"import of sequence {seq_id}")
        payload.check_fits(self.config, seq_id, convert_dtype)
        start, end = payload.start, payload.end
        if parent_id is None:
            if start != 0 or fork_pos not in (None, 0):
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: the payload starts at token {start} and "
                    f"fork_pos={fork_pos!r}; tokens before the payload's come from a parent: pass "
                    f"parent_id (and fork_pos in [{start}, {end}])")
            fork_pos = 0
        else:
            parent_id = seq_id_arg(parent_id, "parent_id")
            fork_pos = start if fork_pos is None else as_int(fork_pos, "fork_pos")
            if not start <= fork_pos <= end:
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: fork_pos {fork_pos} must lie in the payload's "
                    f"tokens [{start}, {end}] (the positions after the shared prefix)")
        return ImportSpec(seq_id, end - fork_pos, payload.window_size, payload.sink_size,
                          parent_id, fork_pos, skip=fork_pos - start)

    def _import_scales(self, seq_id: int, payload: SequencePayload, convert: bool,
                       pending: Optional[dict] = None) -> list:
        """The (layer, host (2, Hkv) float32 scales) an fp8 import adopts: the payload's, for
        each layer whose scales are not set yet. ``pending``: layer -> (seq_id, host scales)
        that earlier items of the same reservation adopt; they count as this cache's (one
        reservation adopts one set of scales per layer, as successive ``import_sequence``
        calls would). Raises InvalidArgumentError for a layer whose scales differ from the
        payload's (its codes would change) unless ``convert`` (then stored again with the
        scales the layer has: rounded twice), and for a payload with tokens and no scales for
        a layer that has none either. Checks only; changes nothing."""
        if self._kv_scales is None or payload.kv_scales is None:
            return []
        pending = {} if pending is None else pending
        adopt = []
        for layer, theirs in enumerate(payload.kv_scales):
            fixed = self._fixed_scales(layer)
            owner, mine = (None, fixed) if fixed is not None else pending.get(layer, (None, None))
            if theirs is None:
                if mine is None and self._kv_scales[layer] is None and payload.num_tokens:
                    raise InvalidArgumentError(
                        f"import of sequence {seq_id}: the payload has no fp8 scales for layer "
                        f"{layer} and this cache has none either: its values cannot be stored")
                continue
            host = np.asarray(theirs, np.float32)
            if mine is None:
                adopt.append((layer, host))
            elif not np.array_equal(mine, host) and not convert:
                where = "" if owner is None else (
                    f" (adopted from sequence {owner}, earlier in this reservation)")
                raise InvalidArgumentError(
                    f"import of sequence {seq_id}: layer {layer}'s fp8 scales are "
                    f"{_scales_text(mine)}{where}, the payload's {theirs}; pass "
                    f"convert_dtype=True to store its values again with those scales (rounded "
                    f"twice)")
        return adopt

    def _reserved_scales(self, res: ImportReservation, what: str) -> list:
        """The (layer, host scales) of ``res.scales`` that this cache still lacks, each checked
        against the layer's scales now: a forward may have calibrated the layer since the
        reservation, or ``set_kv_scales`` or another import set it. InvalidArgumentError when
        they differ from the reservation's (its values are stored with the payloads' scales:
        the codes would mean something else); equal scales need no adopting. Changes
        nothing."""
        out = []
        for layer, host in sorted(res.scales.items()):
            fixed = self._fixed_scales(layer)
            if fixed is None:
                out.append((layer, host))
            elif not np.array_equal(fixed, host):
                raise InvalidArgumentError(
                    f"{what} of sequences {res.seq_ids}: layer {layer} got the fp8 scales "
                    f"{_scales_text(fixed)} after the import was reserved (a forward "
                    f"calibrated them, or set_kv_scales or another import set them), but the "
                    f"reservation stores its values with the payloads' {_scales_text(host)}: "
                    f"cancel_import, then import again (convert_dtype=True stores them with "
                    f"the cache's scales)")
        return out

    def _native_kv(self, seq_id: int, payload: SequencePayload) -> tuple[Array, Array, bool]:
        """``(k, v, packed)``: the payload's K and V as this backend's arrays, either packed
        rows of this cache's int8 / int4 format (``packed``: stored unchanged) or values in
        the dtype ``append_kv`` takes (the storage dtype; the compute dtype for quantized
        pages, which it quantizes)."""
        b, c = self.backend, self.config
        src = payload.array_dtype
        packed = (self._packed and payload.kv_dtype == c.kv_dtype and payload.dtype == c.dtype
                  and payload.kv_quant_group == c.kv_quant_group)
        kv = "uint8" if packed else c.dtype if c.kv_quantized else c.kv_dtype
        k, v = payload.k, payload.v
        if (payload.backend == b.name and payload.device == b.device and src == kv
                and b.is_native(k) and b.is_native(v)):
            return k, v, packed
        try:
            if payload.affine and not packed:       # converted: the values the rows read back
                hk, hv = payload.values()
            else:
                hk, hv = to_host(k, src), to_host(v, src)
            return b.from_numpy(hk, kv), b.from_numpy(hv, kv), packed
        except KVCacheError:
            raise
        except Exception as e:
            raise InvalidArgumentError(
                f"import of sequence {seq_id}: cannot read the payload's arrays "
                f"({type(k).__name__}): {e}") from None

    def _write_import(self, res: ImportReservation, k: Array, v: Array,
                      packed: bool = False, layers: Optional[range] = None) -> None:
        """Write ``k`` / ``v`` (the layers ``layers``, None: all) at ``res.slots``: ``packed``
        rows of this cache's int8 / int4 format unchanged, else values in the dtype
        ``append_kv`` takes, which fp8 pages quantize with each layer's scales: the cache's,
        or those ``res`` adopts (checked first: ``_reserved_scales``)."""
        self._reserved_scales(res, "write_import")
        if res.num_tokens == 0:
            return
        b = self.backend
        layers = range(self.config.num_layers) if layers is None else layers
        slots = b.aux_to_device(res.slots)
        if packed:
            for i, layer in enumerate(layers):
                b.append_kv_packed(self.pages[layer], k[i], v[i], slots)
            return
        if not self.config.kv_quantized:
            # rows stored as they come: one call for every layer (one launch where the backend
            # can; launches per layer were most of a small transfer's time)
            b.append_kv_layers([self.pages[layer] for layer in layers], k, v, slots)
            return
        ones = None
        for i, layer in enumerate(layers):
            pages = self.pages[layer]
            quant = {}
            if self._kv_scales is not None:
                entry = self._kv_scales[layer]
                if layer in res.scales:     # adopted (checked: the layer has none or these)
                    scale = b.from_numpy(res.scales[layer], "float32")
                elif entry is not None:
                    scale = entry[1]
                    # heads not calibrated yet get values stored with their provisional scale:
                    # they keep it (a cancelled reservation does not undo this; it only ends
                    # the wait for a forward to calibrate them)
                    self._kv_pending[layer] = None          # type: ignore[index]
                else:           # no item holds tokens with this layer's values (checked)
                    if ones is None:
                        ones = b.from_numpy(np.ones((2, self.config.num_kv_heads), np.float32),
                                            "float32")
                    scale = ones
                quant = {"kv_scale": scale}
            b.append_kv(pages, k[i], v[i], slots, **quant)

    def _commit_import(self, res: ImportReservation) -> None:
        """Commit ``res`` (checked first, its adopted scales too) and then, only then, adopt
        its fp8 scales."""
        b = self.backend
        adopt = [(layer, host, b.from_numpy(host, "float32"))
                 for layer, host in self._reserved_scales(res, "commit_import")]
        copies = self.state.commit_import(res)          # validates, then changes the tables
        for layer, host, device in adopt:
            self._kv_scales[layer] = (host, device)     # type: ignore[index]
            self._kv_pending[layer] = None              # type: ignore[index]
        self._copy_pages(copies)

    @_exclusive
    def reserve_import(self, items: Sequence[tuple], convert_dtype: bool = False) -> ImportReservation:
        """The first phase of an import whose K/V arrives later (``kvcache.distributed``).

        ``items``: ``(seq_id, payload, parent_id, fork_pos)`` tuples as ``import_sequence``
        takes them (``payload`` may be header-only; an item may fork from an earlier item);
        ``convert_dtype`` as for ``import_sequence``. Checks everything ``import_sequence``
        checks and takes the pages; the sequences appear at ``commit_import`` after
        ``write_import``, or ``cancel_import`` gives the pages back. Between the two the pages
        count as used (forwards may run, but none may be open at a reserve or commit).

        An fp8 cache checks the payloads' scales as ``import_sequence`` does (a layer whose
        scales differ is refused unless ``convert_dtype``; a layer with no scales on either
        side refused for a payload with tokens) and adopts them for the layers that have none,
        all or nothing: the reservation holds the adopted scales (``reservation.scales``, the
        cache's to read: layer -> (2, Hkv) float32), ``write_import`` stores the values with
        them, and only ``commit_import`` makes them the cache's. ``cancel_import``, a refused
        write or commit, or a cleared cache leave the cache's scales as they were. Items
        adopting different scales for one layer are refused unless ``convert_dtype`` (then the
        first item's are adopted and the later items' values stored with them, rounded twice,
        as successive ``import_sequence`` calls would). The affine formats (int8 / int4) raise
        UnsupportedFeatureError: they do not move yet."""
        self._no_forward("reserve_import")
        convert_dtype = bool_arg(convert_dtype, "convert_dtype")
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InvalidArgumentError(
                f"reserve_import: items must be a list of (seq_id, payload, parent_id, fork_pos) "
                f"tuples, got {type(items).__name__}")
        for i, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) != 4:
                raise InvalidArgumentError(
                    f"reserve_import: item {i} must be a (seq_id, payload, parent_id, fork_pos) "
                    f"tuple, got {item!r:.80}")
        specs = [self._import_spec(sid, p, parent, pos, convert_dtype)
                 for sid, p, parent, pos in items]
        pending: dict = {}              # layer -> (seq_id, host scales) the items adopt
        for spec, item in zip(specs, items):
            for layer, host in self._import_scales(spec.seq_id, item[1], convert_dtype, pending):
                pending[layer] = (spec.seq_id, host)
        res = self._reserve_import(specs)
        res.scales = {layer: host for layer, (_, host) in pending.items()}
        return res

    def _reserve_import(self, specs) -> ImportReservation:
        ps = self.config.page_size
        return self._with_room(lambda: self.state.reserve_import(specs),
                               lambda: sum(import_pages(s, ps) for s in specs) - self.state.pt.num_free)

    @_exclusive
    def write_import(self, reservation: ImportReservation, k: Array, v: Array, *,
                     layers: Optional[range] = None) -> None:
        """Write a reservation's K/V: ``k``, ``v`` this backend's arrays of shape (num_layers,
        ``reservation.num_tokens``, num_kv_heads, head_dim), the items' payload tokens in order
        (queued on the device like any append), in the storage dtype; for fp8 pages in the
        compute dtype instead: the values (as ``export_sequences`` gives them), which are
        quantized with each layer's scales (the cache's, or those the reservation adopts).
        ``layers``: a ``range`` of consecutive layers that ``k`` and ``v`` hold (None: all;
        their first axis is then ``len(layers)``): a transfer writes each message's layers as
        it arrives. Raises InvalidArgumentError for other arrays, or when a layer whose scales
        the reservation adopts got other scales since (a forward calibrated them: cancel and
        import again); ForwardStateError inside a forward or for a closed reservation."""
        self._no_forward("write_import")
        self.state.check_reservation(reservation, "write_import")
        layers = self._layer_range(layers, "write_import")
        b, c = self.backend, self.config
        want = (len(layers), reservation.num_tokens, c.num_kv_heads, c.head_dim)
        dtype = c.dtype if c.kv_quantized else c.kv_dtype
        what = (f"{dtype} (the compute dtype: the values, which this {c.kv_dtype} cache "
                f"quantizes with the layer scales)" if c.kv_quantized else dtype)
        if self._packed:
            want = want[:3] + (affine_row_bytes(c.head_dim, AFFINE_BITS[c.kv_dtype],
                                                c.kv_quant_group, c.dtype),)
            dtype, what = "uint8", f"uint8 (packed {c.kv_dtype} rows, as export_sequences gives)"
        for name, a in (("k", k), ("v", v)):
            if not b.is_native(a) or b.shape_of(a) != want or b.dtype_name(a) != dtype:
                got = (f"{b.dtype_name(a)} {b.shape_of(a)}" if b.is_native(a)
                       else type(a).__name__)
                raise InvalidArgumentError(
                    f"write_import of sequences {reservation.seq_ids}: {name} must be a {b.name} "
                    f"array {want} in {what}, got {got}")
        self._write_import(reservation, k, v, self._packed, layers)

    @_exclusive
    def commit_import(self, reservation: ImportReservation) -> None:
        """Make a reservation's sequences appear (their K/V written by then), and adopt the
        fp8 scales the reservation holds for layers that have none. Checks again that the
        ids are free, the parents there and the adopted scales still agree with the cache's
        (InvalidArgumentError when a forward calibrated a layer since); on error nothing
        changes and the reservation stays open."""
        self._no_forward("commit_import")
        self.state.check_reservation(reservation, "commit_import")
        self._commit_import(reservation)

    @_exclusive
    def cancel_import(self, reservation: ImportReservation) -> None:
        """Give a reservation's pages back (no-op when already committed or cancelled); the fp8
        scales it would have adopted go with it (the cache never held them)."""
        self._no_forward("cancel_import")
        self.state.cancel_import(reservation)

    def query_positions(self) -> Array:
        """RoPE position of each new token of the open forward (device int32 array).

        The array belongs to the forward: it holds these positions until the next
        ``begin_forward`` and may be overwritten after (on merged-aux backends, cuda and rocm,
        it is a view into the forward's index buffer, which a later forward refills). Copy
        it (``kvcache.to_numpy``, ``.clone()``) to keep it longer."""
        self._open("query_positions")
        return self._device_aux().tokens.q_positions

    # ------------------------------------------------------------------ forward
    @_exclusive
    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                      token_tree_parent_ptr: Optional[Sequence[int]] = None) -> None:
        """Open a forward appending ``append_lengths[i]`` tokens to sequence ``seq_ids[i]``.

        ``seq_ids``: B distinct ids of sequences in the cache (1 <= B <= max_batch_size);
        ``append_lengths``: B ints >= 1 summing to at most ``prefill_chunk_size`` (T tokens);
        ``token_tree_parent_ptr``: None, or T ints: each new token's parent among its
        sequence's uncommitted tree nodes (-1: a root), for speculative decoding.
        The new tokens' pages are reserved now; each layer's ``attention`` then takes the
        forward's q/k/v rows in this order. Raises a typed error and changes nothing on bad
        input or when the pages do not suffice (CacheFullError)."""
        self._no_forward("begin_forward")
        if self.config.static_mixed:
            # a captured step cannot calibrate fp8 scales: mixed steps run eagerly until set
            self.planner.static_mixed = self._kv_scales is None or all(
                entry is not None and pending is None     # every head calibrated
                for entry, pending in zip(self._kv_scales,
                                          self._kv_pending))  # type: ignore[arg-type]
        plan = self._with_room(
            lambda: self.planner.begin(seq_ids, append_lengths, token_tree_parent_ptr),
            lambda: self.planner.pages_needed(seq_ids, append_lengths, token_tree_parent_ptr)[0]
            - self.state.pt.num_free)
        aux = None
        if plan.static_bucket is not None:
            # a replayed capture runs no Python, so the copy cannot wait for attention
            try:
                manager = self.aux_manager
                assert isinstance(manager, MergedAuxManager)   # static_decode requires merged_aux
                aux = manager.upload_static(plan)
            except BaseException:
                self.planner.rollback(plan.undo)
                raise
        self._plan, self._aux, self._layers_done = plan, aux, set()

    @property
    @_exclusive
    def static_bucket(self) -> Optional[int]:
        """The batch bucket of the open forward when it is a static-shape decode step, its
        token bucket when it is a static-shape mixed step (``CacheConfig.static_mixed``;
        ``open_plan.static_mixed`` tells which): its q/k/v may have this many rows, padded rows
        give zeros. None for an eager forward."""
        return None if self._plan is None else self._plan.static_bucket

    @property
    @_exclusive
    def open_plan(self) -> Optional[ForwardPlan]:
        """The open forward's plan (a frozen ``ForwardPlan``: read it, never change it), or
        None between forwards. A repeated decode step reuses the arrays of the plan two steps
        before it: copy what you keep longer than the next step."""
        return self._plan

    @property
    @_exclusive
    def layers_run(self) -> frozenset[int]:
        """The layers that have run attention in the open forward (empty between forwards)."""
        return frozenset(self._layers_done)

    @_exclusive
    def rerun_layers(self, layers: Optional[Sequence[int]] = None) -> None:
        """Let ``layers`` (None: every layer) of the open forward run attention again: capture
        helpers run one step's layers several times (warm-up, capture). Appending the same
        K/V again writes the same rows, so the repeated runs leave the cache as one run."""
        self._open("rerun_layers")
        self._layers_done = set() if layers is None else self._layers_done - set(
            self._layer_list(layers, "rerun_layers"))

    @_exclusive
    def mark_layers_run(self, layers: Sequence[int]) -> None:
        """Record that ``layers`` ran attention in the open forward without ``attention``
        being called: a replayed capture of a step ran them."""
        self._open("mark_layers_run")
        self._written(sorted(set(self._layer_list(layers, "mark_layers_run")) - self._layers_done))

    def _written(self, layers: list) -> None:
        self._layers_done.update(layers)
        for watcher in list(self._watchers):
            for layer in layers:
                watcher.layer_written(layer)

    @_exclusive
    def watch_forward(self, watcher) -> None:
        """Tell ``watcher`` about the open forward as it runs: ``watcher.layer_written(layer)``
        after each layer's K/V is written (queued on the device; an ``attention``,
        ``append_kv`` or ``mark_layers_run`` call), ``watcher.forward_closed(committed)`` when
        it ends (True) or is aborted (False); then the watcher is dropped. What a watcher
        raises propagates from that call (after the layer counts as run; after the forward
        closed). ``kvcache.distributed.send_sequence`` inside a forward watches it to send
        each layer while the next computes. ForwardStateError outside a forward."""
        self._open("watch_forward")
        self._watchers.append(watcher)

    def _layer_list(self, layers, what: str) -> list:
        n = self.config.num_layers
        if isinstance(layers, (set, frozenset)):         # e.g. ``layers_run``: order is moot
            layers = list(layers)
        out = int_values(layers, f"{what}: layers")      # None, a string, floats: typed errors
        bad = [layer for layer in out if not 0 <= layer < n]
        if bad:
            raise InvalidArgumentError(f"{what}: layers {bad} are not in [0, {n})")
        return out

    @_exclusive
    def forward_aux(self) -> ForwardAux:
        """The open forward's index arrays on the device (``ForwardAux``, read-only), copying
        them now if no call has yet."""
        self._open("forward_aux")
        return self._device_aux()

    @_exclusive
    def end_forward(self) -> None:
        """Commit the open forward; every layer must have run attention (else ForwardStateError,
        and the forward stays open to finish or abort)."""
        plan = self._open("end_forward")
        n = self.config.num_layers
        if len(self._layers_done) != n:
            missing = sorted(set(range(n)) - self._layers_done)
            raise ForwardStateError(
                f"end_forward: layers {missing} of {n} have not run attention in the forward over "
                f"sequences {plan.seq_ids}; run them, or call abort_forward")
        self._close(committed=True)
        if self._prefix is not None:        # full pages whose ids are recorded join the index
            seqs, ps = self.state.pt.seqs, self.config.page_size
            for sid in plan.seq_ids:
                seq = seqs[int(sid)]
                t = seq.prefix              # most decode steps complete no recorded page
                if t is not None and len(t.tokens) >= (len(t.chain) + 1) * ps:
                    self._prefix.index(seq)

    @_exclusive
    def abort_forward(self) -> None:
        """Undo the open forward: the cache returns to its state before begin_forward.

        Also the recovery from a forward left open by a thread that has died (it holds the
        cache for good, and every other call from another thread raises ForwardStateError
        saying so): any thread may abort that forward. A live thread's forward is only its
        own to abort."""
        plan = self._open("abort_forward")
        self.planner.rollback(plan.undo)
        if self._kv_scales is not None:     # scales it calibrated are forgotten with it
            for layer, (entry, pending) in self._scale_undo.items():
                self._kv_scales[layer] = entry
                self._kv_pending[layer] = pending       # type: ignore[index]
        self._close(committed=False)

    def _close(self, committed: bool) -> None:
        if self._aux is not None:       # the next copy into that aux buffer waits for its readers
            self.aux_manager.release()
        self._plan, self._aux = None, None
        self._layers_done = set()
        self._scale_undo = {}
        self._forward_exports = {}
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher.forward_closed(committed)

    @contextlib.contextmanager
    def forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                token_tree_parent_ptr: Optional[Sequence[int]] = None) -> Iterator[PagedKVCache]:
        """``with cache.forward(seq_ids, append_lengths): ...`` runs begin_forward (same
        arguments, ``token_tree_parent_ptr`` included) / end_forward around the block, which
        gets the cache; an exception inside the block aborts the forward instead (nothing of it
        is kept), and so does a block that leaves a layer unrun (ForwardStateError)."""
        self.begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)
        plan = self._plan
        try:
            yield self
        except BaseException:
            if self._plan is plan:
                self.abort_forward()
            raise
        if self._plan is plan:
            try:
                self.end_forward()
            except ForwardStateError as exc:     # layers missing: the block cannot finish them
                self.abort_forward()
                raise ForwardStateError(
                    f"{exc} (the with block ended, so the forward was aborted)") from None

    def _open(self, what: str) -> ForwardPlan:
        """The open forward, if the calling thread holds it (an identity compare: attention
        takes no lock)."""
        if self._owner is not _current_thread():
            if self._owner is not None:
                raise self._busy(what)
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        plan = self._plan
        if plan is None:
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        return plan

    def _device_aux(self) -> ForwardAux:
        """Upload this forward's index arrays on first use (lazy; see core.aux)."""
        if self._aux is None:
            plan = self._plan
            if plan is None:     # callers open the forward first; this keeps the types honest
                raise ForwardStateError("no open forward: call begin_forward first")
            self._aux = self.aux_manager.upload(plan)
        return self._aux

    def _check_input(self, name, array, heads, total, dim=None):
        """InvalidArgumentError unless ``array`` is a native array of shape ``(total, heads,
        dim)`` (or the static-shape bucket's rows) in the cache dtype."""
        b, c = self.backend, self.config
        dim = c.head_dim if dim is None else dim
        if not b.is_native(array):
            raise InvalidArgumentError(
                f"{name} must be a {b.name} backend array (use cache.from_numpy), got {type(array).__name__}")
        shape = b.shape_of(array)
        plan = self._plan
        assert plan is not None         # called inside a forward only (after ``_open``)
        bucket = plan.static_bucket
        if shape != (total, heads, dim) and (bucket is None or shape != (bucket, heads, dim)):
            padded = f" (or {bucket} rows: the static-shape bucket)" if bucket is not None else ""
            raise InvalidArgumentError(
                f"{name} has shape {shape}, expected ({total}, {heads}, {dim}){padded} "
                f"for {total} new tokens of sequences {plan.seq_ids}")
        if b.dtype_name(array) != c.dtype:
            raise InvalidArgumentError(f"{name} has dtype {b.dtype_name(array)}, the cache stores {c.dtype}")

    def attention(self, layer_id: int, q: Array, k: Array, v: Array,
                  sm_scale: Optional[float] = None, return_lse: bool = False,
                  window_left: int = -1, logit_softcap: Optional[float] = None,
                  sinks: Optional[Array] = None) -> Union[Array, tuple[Array, Array]]:
        """Write layer ``layer_id``'s new K/V into the cache and attend: each new token's query
        over its sequence's history and the new tokens before it (its tree ancestors in a
        token tree, the window and sinks of a sliding window).

        ``q``: (T, num_qo_heads, head_dim), ``k``: (T, num_kv_heads, head_dim), ``v``: (T,
        num_kv_heads, head_dim_v), backend arrays in the cache dtype, rows in ``begin_forward``
        order (a static-shape step may pass ``static_bucket`` rows; padded rows give zeros);
        ``sm_scale``: logit scale (default ``head_dim ** -0.5``); ``window_left``: -1 (every
        key), or ``w >= 0``: a query at position ``p`` sees only keys at positions ``p - w ..
        p`` (FlashInfer's ``window_left``; capability ``window_left``; not with a token tree;
        a per-call value, so sliding and full layers mix in one forward); any ``w >=
        num_pages * page_size`` (no sequence is that long: every key is in the window) is
        taken as -1, on every backend. Positions are the
        cache's (``query_positions``). ``logit_softcap``: None, or ``c > 0``: each score
        ``s = q . k * sm_scale`` becomes ``c * tanh(s / c)`` before the softmax (capability
        ``logit_softcap``). ``sinks``: None, or a backend array of ``num_qo_heads`` logits
        (float) that join each query head's softmax denominator and carry no value (learned
        attention sinks; capability ``attention_sinks``); the lse includes them.
        Returns ``o`` (T, num_qo_heads, head_dim_v), with ``return_lse`` also ``lse``
        (T, num_qo_heads) float32. Each layer runs once per forward."""
        plan = self._open("attention")
        c = self.config
        layer_id = as_int(layer_id, "layer_id")
        return_lse = bool_arg(return_lse, "return_lse")
        scale = c.head_dim ** -0.5 if sm_scale is None else float_arg(sm_scale, "sm_scale")
        window_left = self._window_left(plan, window_left)
        softcap = self._softcap(plan, logit_softcap)
        self._layer_to_run(layer_id)
        total = plan.total_tokens
        self._check_input("q", q, c.num_qo_heads, total)
        rows = self.backend.shape_of(q)[0]
        self._check_input("k", k, c.num_kv_heads, rows)
        self._check_input("v", v, c.num_kv_heads, rows, c.head_dim_v)
        self._check_sinks(plan, sinks)
        aux = self._device_aux()
        o, lse = self._attend(plan, aux, layer_id, q, k, v, scale, window_left,
                              softcap, sinks)
        self._written([layer_id])               # a layer that raised has not run
        return (o, lse) if return_lse else o

    def _window_left(self, plan: ForwardPlan, window_left) -> int:
        """The validated ``window_left`` of an attention call: -1 (no window) or an int in
        ``[0, num_pages * page_size)``. No sequence holds more tokens than the cache has slots,
        so a window of that many positions or more sees every key: it is -1, decided here
        once, so no backend sees a value beyond int32 (2**31, 2**64-1: overflow, or a wrong
        window) and one without the capability runs it."""
        if type(window_left) is int and window_left == -1:     # the default: nothing to check
            return -1
        try:
            window_left = int_arg(window_left, "window_left", lo=-1, limit="-1: no window")
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc} (forward over sequences {plan.seq_ids})") from None
        if window_left >= self.config.num_pages * self.config.page_size:
            return -1
        if window_left >= 0:
            self._need(plan, "window_left", f"window_left={window_left}")
            # a static-shape mixed step's trees are chains (causal): positions order its keys
            if plan.tokens.self_tree is not None or any(
                    d.tree is not None and not d.tree.chains for d in plan.depths):
                raise UnsupportedFeatureError(
                    f"window_left={window_left} with a token tree (forward over sequences "
                    f"{plan.seq_ids}): tree attention has no per-query window")
        return window_left

    def _softcap(self, plan: ForwardPlan, logit_softcap) -> float:
        """The validated soft cap of an attention call: 0.0 (off) or a finite float > 0."""
        if logit_softcap is None:
            return 0.0
        try:
            cap = float_arg(logit_softcap, "logit_softcap", positive=True)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{exc} (forward over sequences {plan.seq_ids})") from None
        self._need(plan, "logit_softcap", f"logit_softcap={cap}")
        return cap

    def _need(self, plan: ForwardPlan, capability: str, what: str) -> None:
        """UnsupportedFeatureError naming ``what``, the forward and the capability, unless the
        backend declares ``capability``."""
        if not getattr(self.capabilities, capability):
            raise UnsupportedFeatureError(
                f"backend {self.backend.name!r} does not support {what} (forward over sequences "
                f"{plan.seq_ids}): {Capabilities.reason(capability)}")

    def _check_sinks(self, plan: ForwardPlan, sinks) -> None:
        if sinks is None:
            return
        b, heads = self.backend, self.config.num_qo_heads
        self._need(plan, "attention_sinks", "attention sinks")
        if not b.is_native(sinks):
            raise InvalidArgumentError(
                f"sinks must be a {b.name} backend array of {heads} logits (use cache.from_numpy), "
                f"got {type(sinks).__name__}")
        if b.shape_of(sinks) != (heads,) or b.dtype_name(sinks) not in DTYPES:
            raise InvalidArgumentError(
                f"sinks has shape {b.shape_of(sinks)} and dtype {b.dtype_name(sinks)}, expected "
                f"({heads},) (one logit per query head) of one of {DTYPES}")

    def _layer(self, layer_id, what: str) -> int:
        """``layer_id`` as an int in [0, num_layers); InvalidArgumentError naming ``what``."""
        layer_id = as_int(layer_id, what)
        if not 0 <= layer_id < self.config.num_layers:
            raise InvalidArgumentError(f"{what} {layer_id} must be in [0, {self.config.num_layers})")
        return layer_id

    def _layer_to_run(self, layer_id) -> int:
        """``layer_id`` as an int in [0, num_layers) that has not run in this forward (typed
        errors otherwise): the layer an ``attention`` or ``append_kv`` call runs."""
        layer_id = self._layer(layer_id, "layer_id")
        if layer_id in self._layers_done:
            raise ForwardStateError(f"layer {layer_id} already ran attention in this forward")
        return layer_id

    @staticmethod
    def _write_rows(plan: ForwardPlan, aux: ForwardAux, rows: int):
        """(positions, slots) of the ``rows`` input rows: a static-shape step's arrays cut to
        unpadded inputs (run eagerly)."""
        positions, slots = aux.tokens.q_positions, aux.tokens.append_slots
        if plan.static_bucket is not None and rows != plan.static_bucket:
            positions, slots = positions[:rows], slots[:rows]
        return positions, slots

    def append_kv(self, layer_id: int, k: Array, v: Array) -> None:
        """Write layer ``layer_id``'s new K/V into the cache without attending: for a model
        that computes its attention itself over ``get_kv(seq_id, layer=layer_id)`` (e.g. its own
        soft-capped or latent attention). It counts as the layer's run in this forward.

        ``k``: (T, num_kv_heads, head_dim), ``v``: (T, num_kv_heads, head_dim_v), backend arrays
        in the cache dtype, rows in ``begin_forward`` order (or ``static_bucket`` rows). With
        ``rope_mode="normal"`` K is rotated at its position on the way in, as in
        ``attention``. Raises InvalidArgumentError for shapes, dtypes or the layer,
        ForwardStateError outside a forward or for a layer that already ran."""
        plan = self._open("append_kv")
        c = self.config
        layer_id = self._layer_to_run(layer_id)
        self._check_input("k", k, c.num_kv_heads, plan.total_tokens)
        rows = self.backend.shape_of(k)[0]
        self._check_input("v", v, c.num_kv_heads, rows, c.head_dim_v)
        positions, slots = self._write_rows(plan, self._device_aux(), rows)
        quant = self._scale_kw(plan, layer_id, k, v, positions)
        if self.config.effective_rope_mode == "normal":
            self.backend.append_kv(self.pages[layer_id], k, v, slots, positions, self._rope, **quant)
        else:
            self.backend.append_kv(self.pages[layer_id], k, v, slots, **quant)
        self._written([layer_id])

    def attention_with_fused_qkv(self, layer_id: int, qkv: Array, sm_scale: Optional[float] = None,
                                 return_lse: bool = False, window_left: int = -1,
                                 logit_softcap: Optional[float] = None,
                                 sinks: Optional[Array] = None) -> Union[Array, tuple[Array, Array]]:
        """``attention`` with q, k, v packed in ``qkv`` (T, num_qo_heads + 2*num_kv_heads,
        head_dim), in that order along the heads; ``layer_id``, ``sm_scale``, ``return_lse``,
        ``window_left``, ``logit_softcap`` and ``sinks`` as there, and so is the result.
        Needs ``head_dim_v == head_dim`` (else InvalidArgumentError)."""
        plan = self._open("attention_with_fused_qkv")
        c = self.config
        if c.head_dim_v != c.head_dim:
            raise InvalidArgumentError(
                f"attention_with_fused_qkv packs q, k and v with one head dim, but the cache has "
                f"head_dim={c.head_dim} and head_dim_v={c.head_dim_v}; call attention(q, k, v)")
        self._check_input("qkv", qkv, c.num_qo_heads + 2 * c.num_kv_heads, plan.total_tokens)
        q, k, v = self.backend.split_qkv(qkv)
        return self.attention(layer_id, q, k, v, sm_scale, return_lse, window_left,
                              logit_softcap, sinks)

    def _attend(self, plan: ForwardPlan, aux: ForwardAux, layer: int, q, k, v, scale,
                window_left=-1, softcap=0.0, sinks=None):
        b, mode = self.backend, self.config.effective_rope_mode
        pages = self.pages[layer]
        inline = self._rope if mode == "inline" else None
        tokens = aux.tokens
        positions, slots = self._write_rows(plan, aux, b.shape_of(q)[0])
        # quantized pages: every kernel reads K/V as stored, the forward's own rows included
        quant = self._scale_kw(plan, layer, k, v, positions)
        if not plan.write_after:
            if mode == "normal":
                q, k = b.rope_append(pages, q, k, v, slots, positions, self._rope, **quant)
            else:
                b.append_kv(pages, k, v, slots, **quant)
        o = lse = None
        # optional keywords only when used: a backend without the capability never sees them;
        # the sinks go to the first call only (partials merge by lse: the sink counts once)
        extra: dict = {"window_left": window_left} if window_left >= 0 else {}
        if softcap:
            extra["logit_softcap"] = softcap
        if not plan.paged_only:
            o, lse = b.ragged_attention(q, k, v, tokens.qo_indptr, scale,
                                        num_seqs=len(plan.seq_ids), max_len=plan.max_append,
                                        tree=tokens.self_tree, rope=inline, q_positions=positions,
                                        k_rope_offset=tokens.k_rope_offset, **quant,
                                        **extra, **({"sinks": sinks} if sinks is not None else {}))
        for depth in aux.depths:
            if depth.num_pages == 0 and plan.static_bucket is None:
                continue
            first = o is None and sinks is not None
            o_d, lse_d = b.paged_attention(q, pages, depth, scale, rope=inline, q_positions=positions,
                                           **quant, **extra, **({"sinks": sinks} if first else {}))
            if o is None:
                o, lse = o_d, lse_d
            else:
                o, lse = b.merge_attention(o, lse, o_d, lse_d)
        if plan.write_after:
            b.append_kv(pages, k, v, slots, **quant)
        return o, lse


_SIGN = 7 if sys.byteorder == "little" else 0     # the byte of an int64 that holds its sign bit


def _token_ids(tokens, what: str) -> Prompt:
    """``tokens`` (a list or tuple of ints, a 1-D integer array or an ``array('q')``) as a
    ``Prompt``: a copy of the ids, checked (ints >= 0). The common cases are converted and
    checked at C speed: the index's host cost is a few microseconds per 1,000 tokens, and a
    Python loop here would be ten times it; anything else, or a bad id, goes through
    ``int_values`` (the precise error)."""
    buf = None
    if isinstance(tokens, array.array) and tokens.typecode == "q":     # int64 already
        buf = tokens.tobytes()
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        # uint64 past 2**63 wraps negative: refused below
        buf = tokens.astype(np.int64, copy=False).tobytes()
    elif isinstance(tokens, (list, tuple)) and list(map(type, tokens)).count(int) == len(tokens):
        try:        # exact ints only (checked above): fromiter is the fastest conversion
            buf = np.fromiter(tokens, np.int64, len(tokens)).tobytes()
        except OverflowError:
            pass
    # no negative int64: no sign byte >= 0x80 (one C pass over a byte string, no numpy call)
    if buf is not None and buf[_SIGN::8].isascii():
        return Prompt(buf)
    return Prompt(np.array(int_values(tokens, what, 0, 2**63 - 1), np.int64).tobytes())


def _hashable(value, what: str) -> None:
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be hashable, got {type(value).__name__}") from None


def _scales_text(host) -> str:
    """A layer's (2, Hkv) fp8 scales as ``kv_scales`` shows them: ((K's), (V's))."""
    return str((tuple(host[0].tolist()), tuple(host[1].tolist())))
