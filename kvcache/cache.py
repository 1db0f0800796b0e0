"""``PagedKVCache``: the public API, a facade over three parts that each own one concern:

- ``KVManager`` (``kv_manager.py``): sequences, the prefix index and the page questions, on the
  host (what a scheduler talks to);
- ``ForwardRun`` (``forward_run.py``): one open forward, returned by ``begin_forward``: its
  plan, index arrays and per-layer ``attention`` / ``append_kv``;
- ``Payloads`` (``payloads.py``): K/V as data (``get_kv``, exports, imports);

with the fp8 scales in ``KVScales`` (``kv_scales.py``). The facade takes the thread lock of
each call (one thread uses a cache at a time), refuses calls that may not run inside a
forward, runs the device side of host decisions (page copies, tree compaction) and owns the
forward's lifecycle (begin, end, abort, clear)."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Optional, Union

import numpy as np

from .backend import Capabilities
from . import files, layer_groups, prefix_files
from .cache_calls import busy_error, doc_of, exclusive, part_call, part_view, run_call
from .config import DTYPES, CacheConfig
from .core.aux import MergedAuxManager, PlainAuxManager
from .core.groups import group_specs
from .core.imports import ImportReservation
from .core.plan import ForwardAux, ForwardPlan
from .core.planner import Planner
from .core.static import static_capacity
from .core.slots import ZEROS, StateSlots
from .core.state import CacheState
from .errors import CacheFullError, ForwardStateError, InvalidArgumentError, UnsupportedFeatureError
from .forward_run import ForwardRun, layer_arg
from .kv_manager import KVManager
from .kv_scales import KVScales
from .payloads import Payloads, copy_pages
from .plugins import open_backend
from .state_slots import StateArrays
from .transfer import SequencePayload

# A backend-native array (numpy.ndarray, torch.Tensor, mlx.core.array): the core never looks inside.
Array = Any

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
    forwards), ``state`` (the core's sequences and page table), ``manager`` (the
    ``KVManager``: sequences and pages on the host), ``payloads`` (``Payloads``), ``scales``
    (``KVScales`` of fp8 pages, else None), ``state_arrays`` (``StateArrays``: the state
    layers' arrays, ``CacheConfig.layer_kinds`` with ``State``), ``rope`` (the ``RopeSpec``),
    ``aux_manager``
    (moves a forward's index arrays to the device), ``copy_stream`` (the backend's copy
    stream, or None).
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
            self._require(not config.batch_invariant or caps.batch_invariant, "batch_invariant",
                          "batch_invariant=True", cls)
            # a windowed layer's pages start at its first live page: the window masks the rest
            for capability in ("window_groups", "window_left"):
                self._require(not config.window_groups or getattr(caps, capability), capability,
                              "window groups (CacheConfig.layer_kinds)", cls)
            self._require(not config.state_layers or caps.state_slots, "state_slots",
                          f"state layers {list(config.state_layers)} (CacheConfig.layer_kinds)",
                          cls)
            self._require(not config.batch_invariant or caps.tree_attention, "tree_attention",
                          "batch_invariant=True", cls)
            self._require(config.effective_rope_mode == "none" or config.rope_spec().default_frequencies
                          or caps.rope_frequencies, "rope_frequencies",
                          "rope_inv_freq / rope_rotary_dim with RoPE on", cls)
            self.config = config
            self.backend = cls(config, device)
            self.capabilities: Capabilities = caps
            slots = (StateSlots(config.num_state_slots, tuple(config.state_layers),
                                config.num_state_checkpoints,
                                config.state_checkpoint_interval * config.page_size)
                     if config.state_layers else None)
            self.state = CacheState(config.num_pages, config.page_size,
                                    config.support_sliding_window, group_specs(config), slots)
            self.pages = self._allocate_pages(config)
            self.state_arrays = StateArrays(self.backend, config)
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
        self.rope = config.rope_spec()
        self.manager = KVManager(config, self.state, self.planner)
        self.scales = KVScales(config, self.backend) if config.kv_format.scaled else None
        self.payloads = Payloads(config, self.backend, self.pages, self.state, self.manager,
                                 self.scales)
        self._run: Optional[ForwardRun] = None
        self._lock = threading.Lock()      # held by the thread using the cache (see exclusive)
        self._owner: Optional[threading.Thread] = None  # that thread

    def __getstate__(self):             # copies start unowned, with a lock of their own
        return dict(self.__dict__, _lock=None, _owner=None)

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _allocate_pages(self, config):
        """The page arrays, refused up front (CacheFullError, nothing allocated) when they
        exceed the memory the backend says its device has."""
        need, capacity = config.kv_bytes + config.state_bytes, self.backend.memory_capacity()
        layers = (f"{config.num_layers} layers x {config.num_pages} pages" if not config.layer_kinds
                  else layer_groups.describe(config))
        what = (f"{layers} of {config.page_size} tokens in {config.dtype}: {need} bytes "
                f"({need / 2**30:,.1f} GiB)")
        if capacity is not None and need > capacity:
            raise CacheFullError(
                f"the cache's page arrays need {what}, but the {self.backend.name!r} backend's "
                f"device holds {capacity} bytes ({capacity / 2**30:,.1f} GiB); lower "
                f"max_total_tokens or num_layers")
        try:
            return layer_groups.allocate(self.backend, config)
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
    def from_numpy(self, array: Any, dtype: Optional[str] = None) -> Array:
        """A native array on the cache's device: floats in ``dtype`` (a ``DTYPES`` name; None:
        the cache dtype), ints as int32."""
        try:
            host = np.asarray(array)
        except Exception as e:
            raise InvalidArgumentError(f"from_numpy needs a numeric array, got {type(array).__name__}: {e}") from None
        if host.dtype.kind in "OUSMmc":
            raise InvalidArgumentError(
                f"from_numpy needs a real numeric array, got dtype {host.dtype} from {type(array).__name__}")
        if dtype is not None and dtype not in DTYPES:
            raise InvalidArgumentError(f"from_numpy: dtype={dtype!r:.40} must be None or one "
                                       f"of {DTYPES}")
        return self.backend.from_numpy(host, dtype)

    def _no_forward(self, what: str) -> None:
        if self._run is not None:
            raise ForwardStateError(
                f"{what} is not allowed between begin_forward and end_forward "
                f"(forward over sequences {self._run.plan.seq_ids} is open)")

    def _checked_run(self, what: str) -> ForwardRun:
        """The open forward, if the calling thread holds it (an identity compare: attention
        takes no lock)."""
        if self._owner is not threading.current_thread():
            if self._owner is not None:
                raise busy_error(self, what)
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        run = self._run
        if run is None:
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        return run

    def _copy_pages(self, copies) -> None:
        if self.config.layer_kinds:
            layer_groups.copy_pages(self.backend, self.config, self.pages, copies)
        else:
            copy_pages(self.backend, self.pages, copies)

    def _compact(self, src: np.ndarray, dst: np.ndarray) -> None:
        b = self.backend
        b.compact_kv(self.pages, b.aux_to_device(src), b.aux_to_device(dst))

    # ------------------------------------------------------------------ sequences (KVManager)
    match_prefix = part_call("manager", KVManager.match_prefix)
    prefix_admission = part_call("manager", KVManager.prefix_admission)
    extend_tokens = part_call("manager", KVManager.extend_tokens, between_forwards=True)
    clear_prefix_cache = part_call("manager", KVManager.clear_prefix_cache, between_forwards=True)
    remove_sequence = part_call("manager", KVManager.remove_sequence, between_forwards=True)
    enable_sliding_window = part_call("manager", KVManager.enable_sliding_window,
                                      between_forwards=True)
    sequence_length = part_call("manager", KVManager.sequence_length)
    pages_needed = part_call("manager", KVManager.pages_needed)
    append_room = part_call("manager", KVManager.append_room)
    can_append = part_call("manager", KVManager.can_append)
    num_cached_pages = part_view("manager", KVManager.num_cached_pages)
    prefix_miss_tokens_by_reason = part_view("manager", KVManager.prefix_miss_tokens_by_reason)
    num_available_pages = part_view("manager", KVManager.num_available_pages)
    num_total_pages = part_view("manager", KVManager.num_total_pages, locked=False)
    num_available_pages_by_group = part_view("manager", KVManager.num_available_pages_by_group)
    num_appendable_pages = part_view("manager", KVManager.num_appendable_pages)
    num_total_pages_by_group = part_view("manager", KVManager.num_total_pages_by_group)
    window_pages = part_call("manager", KVManager.window_pages)
    total_sequence_length = part_view("manager", KVManager.total_sequence_length)
    num_sequences = part_view("manager", KVManager.num_sequences)
    sequence_ids = part_view("manager", KVManager.sequence_ids)
    is_empty = part_view("manager", KVManager.is_empty)

    num_available_state_slots = part_view("manager", KVManager.num_available_state_slots)

    @exclusive
    @doc_of(KVManager.add_sequence)
    def add_sequence(self, seq_id: int, tokens: Optional[Sequence[int]] = None, *,
                     extra_key: Any = None) -> int:
        self._no_forward("add_sequence")
        start = self.manager.add_sequence(seq_id, tokens, extra_key=extra_key)
        slots = self.state.slots
        if slots is not None:   # a new sequence's state: zeros, or a cached prefix's checkpoint
            sid = self.state.seq(seq_id).seq_id
            ck = slots.restore.pop(sid, None)
            self._restore_slot(ZEROS if ck is None else ck, slots.slot[sid])
        return start

    def _restore_slot(self, ck: int, slot: int) -> None:
        """State slot ``slot`` takes checkpoint row ``ck`` (``ZEROS``: zeros)."""
        if ck == ZEROS:
            self.state_arrays.zero(slot)
        else:
            self.state_arrays.restore(ck, slot)

    @exclusive
    @doc_of(KVManager.fork_sequence)
    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        self._no_forward("fork_sequence")
        self._copy_pages(self.manager.fork_sequence(parent_id, child_id, fork_pos))
        slots = self.state.slots
        if slots is not None:           # the child starts from the parent's state
            self.state_arrays.copy(slots.slot[self.state.seq(parent_id).seq_id],
                                   slots.slot[self.state.seq(child_id).seq_id])

    @exclusive
    @doc_of(KVManager.popn)
    def popn(self, seq_id: int, n: int) -> None:
        self._no_forward("popn")
        self._copy_pages(self.manager.popn(seq_id, n))
        slots = self.state.slots
        if slots is not None:           # popped back to known states: the slot takes them
            ck = slots.restore.pop(self.state.seq(seq_id).seq_id, None)
            if ck is not None:
                self._restore_slot(ck, slots.slot[self.state.seq(seq_id).seq_id])

    @exclusive
    @doc_of(KVManager.commit_accepted_token_tree_nodes)
    def commit_accepted_token_tree_nodes(self, seq_ids: Sequence[int],
                                         leaf_indices: Sequence[int]) -> None:
        self._no_forward("commit_accepted_token_tree_nodes")
        self.manager.commit_accepted_token_tree_nodes(seq_ids, leaf_indices, self._compact)

    @exclusive
    def clear(self) -> None:
        """Drop every sequence and free every page (also ends an open forward, even one left
        open by a thread that has died). fp8 pages: the scales forwards calibrated and imports
        adopted are forgotten (the next forward calibrates again); those ``set_kv_scales``
        gave stay."""
        self._close(committed=False)
        self.manager.clear()
        if self.scales is not None:
            self.scales.forget()

    # ------------------------------------------------------------------ fp8 scales
    @exclusive
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
        if self.scales is None:
            raise InvalidArgumentError(
                f"set_kv_scales: the cache stores kv_dtype={self.config.kv_dtype!r}; scales are "
                f"for 'float8_e4m3' pages")
        layer_id = layer_arg(layer_id, self.config.num_layers, "set_kv_scales: layer_id")
        self.scales.set(layer_id, k_scale, v_scale)

    @exclusive
    def kv_scales(self, layer_id: int) -> Optional[tuple]:
        """``(k_scale, v_scale)`` of layer ``layer_id``, each a tuple of ``num_kv_heads``
        floats, or None while not set (and for pages that are not fp8). Raises
        InvalidArgumentError for a layer outside [0, num_layers)."""
        layer_id = layer_arg(layer_id, self.config.num_layers, "kv_scales: layer_id")
        return None if self.scales is None else self.scales.get(layer_id)

    # ------------------------------------------------------------------ payloads
    @exclusive
    @doc_of(Payloads.get_kv)
    def get_kv(self, seq_id: int, start: int = 0, end: Optional[int] = None,
               layer: Optional[int] = None) -> tuple[Array, Array]:
        if layer is None:
            self._no_forward("get_kv")
        if self.config.layer_kinds:
            return layer_groups.get_kv(self, seq_id, start, end, layer)
        return self.payloads.get_kv(seq_id, start, end, layer, self._run)

    @exclusive
    @doc_of(Payloads.export_sequences)
    def export_sequences(self, seq_ids: Sequence[int], starts: Optional[Sequence[int]] = None,
                         *, layers: Optional[range] = None
                         ) -> tuple[list[SequencePayload], Array, Array]:
        layer_groups.refuse(self.config, "export_sequences")
        return self.payloads.export_sequences(seq_ids, starts, layers=layers, run=self._run)

    @exclusive
    @doc_of(files.save_sequences)
    def save_sequences(self, path, seq_ids: Sequence[int], tokens: Optional[Sequence] = None,
                       fingerprint: Optional[dict] = None) -> None:
        self._no_forward("save_sequences")
        layer_groups.refuse(self.config, "save_sequences")
        files.save_sequences(self, path, seq_ids, tokens, fingerprint)

    @exclusive
    @doc_of(files.load_sequences)
    def load_sequences(self, path, seq_ids: Optional[Sequence[int]] = None,
                       fingerprint: Optional[dict] = None, convert_dtype: bool = False) -> list:
        self._no_forward("load_sequences")
        layer_groups.refuse(self.config, "load_sequences")
        return files.load_sequences(self, path, seq_ids, fingerprint, convert_dtype)

    @exclusive
    @doc_of(prefix_files.save)
    def save_prefix_cache(self, path, fingerprint: Optional[dict] = None,
                          prefixes: Optional[Sequence] = None, extra_key: Any = None) -> int:
        self._no_forward("save_prefix_cache")
        return prefix_files.save(self, path, fingerprint, prefixes, extra_key)

    @exclusive
    @doc_of(prefix_files.load)
    def load_prefix_cache(self, path, fingerprint: Optional[dict] = None,
                          convert_dtype: bool = False) -> int:
        self._no_forward("load_prefix_cache")
        return prefix_files.load(self, path, fingerprint, convert_dtype)

    @property
    def prefix_cache(self) -> prefix_files.PrefixCache:
        """The automatic prefix cache (``CacheConfig(prefix_cache=True)``) as the SPEC names
        it: ``cache.prefix_cache.save(path)`` / ``.load(path)`` (``save_prefix_cache`` /
        ``load_prefix_cache``, which raise InvalidArgumentError when the cache has none)."""
        return prefix_files.PrefixCache(self)

    export_sequence = part_call("payloads", Payloads.export_sequence, between_forwards=True,
                                whole_sequences=True)
    import_sequence = part_call("payloads", Payloads.import_sequence, between_forwards=True,
                                whole_sequences=True)
    reserve_import = part_call("payloads", Payloads.reserve_import, between_forwards=True,
                               whole_sequences=True)
    write_import = part_call("payloads", Payloads.write_import, between_forwards=True,
                             whole_sequences=True)
    commit_import = part_call("payloads", Payloads.commit_import, between_forwards=True,
                              whole_sequences=True)
    cancel_import = part_call("payloads", Payloads.cancel_import, between_forwards=True,
                              whole_sequences=True)

    # ------------------------------------------------------------------ forward
    @exclusive
    def begin_forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                      token_tree_parent_ptr: Optional[Sequence[int]] = None) -> ForwardRun:
        """Open a forward appending ``append_lengths[i]`` tokens to sequence ``seq_ids[i]``;
        returns its ``ForwardRun`` (the cache's ``attention`` / ``append_kv`` calls go to it).

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
            self.planner.static_mixed = self.scales is None or self.scales.all_calibrated()
        plan = self.manager.with_room(
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
        self._run = run = ForwardRun(self, plan, aux)
        return run

    @property
    @exclusive
    def static_bucket(self) -> Optional[int]:
        """The batch bucket of the open forward when it is a static-shape decode step, its
        token bucket when it is a static-shape mixed step (``CacheConfig.static_mixed``;
        ``open_plan.static_mixed`` tells which): its q/k/v may have this many rows, padded rows
        give zeros. None for an eager forward."""
        return None if self._run is None else self._run.plan.static_bucket

    @property
    @exclusive
    def open_plan(self) -> Optional[ForwardPlan]:
        """The open forward's plan (a frozen ``ForwardPlan``: read it, never change it), or
        None between forwards. A repeated decode step reuses the arrays of the plan two steps
        before it: copy what you keep longer than the next step."""
        return None if self._run is None else self._run.plan

    @property
    @exclusive
    def layers_run(self) -> frozenset[int]:
        """The layers that have run attention in the open forward (empty between forwards)."""
        return frozenset() if self._run is None else frozenset(self._run.layers_done)

    attention = run_call(ForwardRun.attention)
    get_state = run_call(ForwardRun.get_state)
    set_state = run_call(ForwardRun.set_state)
    state_checkpoints = run_call(ForwardRun.state_checkpoints)
    set_state_checkpoints = run_call(ForwardRun.set_state_checkpoints)
    append_kv = run_call(ForwardRun.append_kv)
    attention_with_fused_qkv = run_call(ForwardRun.attention_with_fused_qkv)
    query_positions = run_call(ForwardRun.query_positions)
    forward_aux = run_call(ForwardRun.forward_aux)
    rerun_layers = run_call(ForwardRun.rerun_layers)
    mark_layers_run = run_call(ForwardRun.mark_layers_run)
    watch_forward = run_call(ForwardRun.watch_forward)

    @exclusive
    def end_forward(self) -> None:
        """Commit the open forward; every layer must have run attention (else ForwardStateError,
        and the forward stays open to finish or abort)."""
        run = self._checked_run("end_forward")
        missing = run.missing_layers()
        if missing:
            raise ForwardStateError(
                f"end_forward: layers {missing} of {self.config.num_layers} have not run "
                f"attention in the forward over sequences {run.plan.seq_ids}; run them, or call "
                f"abort_forward")
        unwritten = run.missing_states()
        if unwritten:
            raise ForwardStateError(
                f"end_forward: the states {', '.join(unwritten)} have not been written (set_state) in the "
                f"forward over sequences {run.plan.seq_ids}: each state layer writes every "
                f"state of the forward's sequences once it has read them; write them, or call "
                f"abort_forward")
        run.commit_states()
        self._close(committed=True)
        self.manager.forward_committed(run.plan)
        if self.config.num_state_checkpoints:
            run.commit_checkpoints()

    @exclusive
    def abort_forward(self) -> None:
        """Undo the open forward: the cache returns to its state before begin_forward.

        Also the recovery from a forward left open by a thread that has died (it holds the
        cache for good, and every other call from another thread raises ForwardStateError
        saying so): any thread may abort that forward. A live thread's forward is only its
        own to abort."""
        run = self._checked_run("abort_forward")
        self.planner.rollback(run.plan.undo)
        if self.scales is not None:     # scales it calibrated are forgotten with it
            self.scales.rollback()
        self._close(committed=False)

    def _close(self, committed: bool) -> None:
        run, self._run = self._run, None
        if self.scales is not None:
            self.scales.undo = {}
        if run is not None:
            run.close(committed)

    @contextlib.contextmanager
    def forward(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                token_tree_parent_ptr: Optional[Sequence[int]] = None) -> Iterator[PagedKVCache]:
        """``with cache.forward(seq_ids, append_lengths): ...`` runs begin_forward (same
        arguments, ``token_tree_parent_ptr`` included) / end_forward around the block, which
        gets the cache; an exception inside the block aborts the forward instead (nothing of it
        is kept), and so does a block that leaves a layer unrun (ForwardStateError)."""
        run = self.begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)
        try:
            yield self
        except BaseException:
            if self._run is run:
                self.abort_forward()
            raise
        if self._run is run:
            try:
                self.end_forward()
            except ForwardStateError as exc:     # layers missing: the block cannot finish them
                self.abort_forward()
                raise ForwardStateError(
                    f"{exc} (the with block ended, so the forward was aborted)") from None
