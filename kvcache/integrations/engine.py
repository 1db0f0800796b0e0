"""``Engine``: continuous-batching generation over a ``PagedKVCache``, neutral to the model library.

Three parts, one loop (``kvcache.serving``): the ``Scheduler`` decides what each forward runs
(admission, chunked prefill, shared prefixes, ``n`` samples, preemption with the host tier; an
``AsyncScheduler`` keeps the host one step ahead of the device); the ``Runner`` runs a plan
through the model (a ``ModelAdapter``: the transformers and mlx-lm integrations each provide
one), the whole-step decode graphs and the sampler; the ``EngineCore`` joins them:
``add_request`` / ``step`` / ``abort`` / ``has_unfinished``, each step a ``schedule()`` and an
``update(plan, output)`` of the scheduler. ``generate``, ``stream`` and ``astream`` are thin
wrappers over it. The options are an ``EngineConfig`` (``kvcache.serving.config``).

Sampling follows ``SamplingParams`` per request: greedy (``temperature == 0``) is the first
argmax; otherwise the logits are filtered (top-k, top-p, min-p, as transformers' logits
processors) and drawn on their device with the request's seed (``kvcache.integrations.
sampling``), so a request's tokens do not depend on what else runs with it. A log-probability is
the model's (``log_softmax`` of the raw logits) at the chosen token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import itertools
import logging
import threading
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Optional, Sequence

from ..cache import PagedKVCache
from ..config import State, itemsize
from ..errors import InvalidArgumentError, UnsupportedFeatureError
from ..errors import pages as n_pages
from ..formats import FORMAT_TABLE
from ..serving import (AsyncScheduler, EngineConfig, EngineCore, EngineStats, RequestOutput,
                       SamplingParams, Scheduler)
from ..serving.progress import Progress
from ..serving.core import check_drawn
from ..host_tier import HostTier
from .adapter import ModelAdapter, PendingPicks
from .runner import Runner
from .sampling import sampling_params_for

if TYPE_CHECKING:  # pragma: no cover
    from .warm_up import WarmUp

__all__ = ["Engine", "EngineConfig", "EngineStats", "ModelAdapter", "PendingPicks",
           "RequestOutput", "SamplingParams"]

DEFAULT_TOKENS_PER_SEQUENCE = 512
"""``max_total_tokens`` where free device memory cannot be asked (a CPU, MLX):
``512 * max_batch_size``."""

STATE_SLOTS_PER_ROW = 2
"""``CacheConfig.max_state_slots`` of an engine over a model with state layers, per
``max_batch_size`` row (docs/hybrid.md, increment 5)."""


def checkpoints_for(config, states: dict, slots: int, interval: Optional[int] = None) -> dict:
    """The state checkpoints of an engine's cache (``CacheConfig`` fields; docs/hybrid.md,
    increment 8) over ``config`` with the state layers ``states`` and ``slots`` state slots:
    as many checkpoints as slots, and an interval (in pages) over which the attention layers'
    KV takes at least a checkpoint's bytes, so that checkpoints cost about what the pages they
    cover do (one page for LFM2's small conv states; hundreds for a Mamba-2 family's SSM
    states, whose hits then recompute up to that many pages); ``interval``: that one instead
    (``EngineConfig.state_checkpoint_interval``). Empty without state layers."""
    if not states:
        return {}
    state = sum(kind.elements() * itemsize(kind.storage(config.dtype))
                for kind in states.values())
    layers = max(1, config.num_layers - len(states))       # the layers with pages
    attention = max(1, config.token_kv_bytes // config.num_layers * layers * config.page_size)
    return dict(max_state_checkpoints=slots,
                state_checkpoint_interval=interval or max(1, -(-state // attention)))

_log = logging.getLogger(__name__)

_LIVE_ENGINES: "weakref.WeakSet[Engine]" = weakref.WeakSet()
"""The engines of this process, alive: a sizing error names what each holds."""
_NUMBERS = itertools.count(1)


def _weak_admit(engine: "Engine"):
    """``engine._admit`` for its core, through a weak reference: without that cycle, dropping
    an engine frees its cache's pages at once (the next engine's sizing sees them free)."""
    ref = weakref.ref(engine)

    def admit(*args, **kw):
        live = ref()
        assert live is not None, "an EngineCore outlived its Engine"
        return live._admit(*args, **kw)
    return admit


def _wants_logprobs(params: SamplingParams) -> bool:
    return params.logprobs is not None and params.logprobs is not False


def quant_group_for(config, kv_dtype) -> int:
    """The affine formats' group: 64 (mlx-lm's default), or 32 where the model's head dims are
    not multiples of 64 (CacheConfig refuses head dims that 32 does not divide either)."""
    fmt = FORMAT_TABLE.get(kv_dtype) if isinstance(kv_dtype, str) else None
    if fmt is not None and fmt.packed and (config.head_dim % 64 or config.head_dim_v % 64):
        return 32
    return config.kv_quant_group


class Engine:
    """Continuous-batching generation on one ``PagedKVCache`` for one model adapter.

    ``adapter``: the model (a ``ModelAdapter``). The options are ``EngineConfig``'s fields (its
    docstrings say what each does), given as keywords (``Engine(adapter, page_size=16,
    max_total_tokens=None, max_batch_size=64, ...)``) or as ``config=EngineConfig(...)``;
    keywords given beside ``config`` replace its fields. In short: ``backend`` / ``device``
    (None: the adapter's, the model's device) / ``dtype`` (None: the model's) as
    ``PagedKVCache``; ``page_size``, ``max_batch_size``, ``prefill_chunk_size`` and
    ``max_total_tokens`` (None: sized from the device memory free when the engine starts,
    ``memory_fraction`` of it; ``self.sizing`` says how); ``graphs`` / ``graph_batch_sizes`` /
    ``mixed_graphs`` / ``compile_step`` (whole-step graphs, their buckets, prefill steps
    captured too, the captured step compiled); ``offload`` / ``offload_tokens`` (the host tier
    preempted sequences are parked in); ``overlap`` (the host one step ahead of the device:
    an ``AsyncScheduler``); ``prefix_cache``; ``window_groups`` (sliding-window layers keep
    only the pages their windows see; ``self.window_groups_off`` says why not where they do
    not); ``kv_dtype`` (the pages' storage format);
    ``prefix_file`` (a saved prefix cache, e.g. a system prompt, loaded at start: its pages
    are hits for the requests that begin with them) and ``fingerprint_weights`` (the model
    fingerprint KV files carry hashes the weights too). KV files: ``save_prefix_cache``,
    ``load_prefix_cache`` and ``resume`` (a conversation saved by another engine, possibly on
    another backend), all checked against ``fingerprint``.
    ``self.engine_config`` holds them as given. A bad value raises ``InvalidArgumentError``
    naming the option; an option the backend or adapter cannot honour,
    ``UnsupportedFeatureError``.

    ``progress``: None (default) shows a progress display on a terminal during ``generate``;
    True / False force it.
    """

    def __init__(self, adapter: ModelAdapter, *, config: Optional[EngineConfig] = None,
                 **options):
        opts = EngineConfig.of(config, **options)
        self.engine_config = opts
        """The options this engine was built with (``EngineConfig``)."""
        self.adapter = adapter
        self._kv_dtype = opts.kv_dtype
        self.number = next(_NUMBERS)
        """This engine's number in its process (a sizing error names engines by it)."""
        backend = opts.backend
        device = opts.device if opts.device is not None else adapter.default_device()
        states, opts, self.state_layers_off = self._state_layers(opts, backend, device)
        """Why options were turned off for the model's state layers (LFM2's short
        convolutions: the prefix cache, graphs, offload; docs/hybrid.md), else None (no state
        layer, or nothing was on): ``self.config.layer_kinds`` holds the ``State`` layers."""
        kinds, self.window_groups_off = self._window_groups(opts, backend, device)
        """Why the model's sliding-window layers keep every page (``window_groups=None`` and
        something does not compose with window groups, or the adapter does not understand the
        model's windowing), else None (window groups on, turned off by ``window_groups=False``,
        or no windowed layer): ``self.config.layer_kinds`` says which."""
        if kinds:               # options left at None that do not compose: off
            opts = dataclasses.replace(
                opts, graphs=False if opts.graphs is None else opts.graphs,
                mixed_graphs=False if opts.mixed_graphs is None else opts.mixed_graphs,
                offload=False if opts.offload is None else opts.offload)
        self.graphs = self._want_graphs(opts.graphs, backend, device)
        sizes: dict = dict(dtype=opts.dtype, page_size=opts.page_size,
                           max_batch_size=opts.max_batch_size)
        max_total_tokens, prefill_chunk_size = opts.max_total_tokens, opts.prefill_chunk_size
        # a sequence the cache holds has a state slot: the batch's sequences and as many
        # again (samples' prefixes, decodes left out of a full batch, a recomputed head);
        # beyond that an admission preempts, as a full pool does
        slots = STATE_SLOTS_PER_ROW * int(opts.max_batch_size) if states else 0
        if max_total_tokens is None:
            max_total_tokens, self.sizing = self._size(
                backend, device, prefill_chunk_size, float(opts.memory_fraction), sizes,
                {**kinds, **states}, slots, opts.prefix_cache)
        else:
            self.sizing = "given"
        if prefill_chunk_size is None:
            prefill_chunk_size = min(8192, int(max_total_tokens))
        cfg = adapter.cache_config(max_total_tokens=max_total_tokens,
                                   prefill_chunk_size=prefill_chunk_size, **sizes)
        cfg = dataclasses.replace(cfg, prefix_cache=opts.prefix_cache, kv_dtype=opts.kv_dtype,
                                  kv_quant_group=quant_group_for(cfg, opts.kv_dtype),
                                  batch_invariant=opts.deterministic,
                                  layer_kinds={**kinds, **states}, max_state_slots=slots,
                                  **checkpoints_for(cfg, states, slots,
                                                    opts.state_checkpoint_interval))
        invariant_ops = self._invariant_ops(opts)
        if opts.mixed_graphs and not self.graphs:
            raise UnsupportedFeatureError(
                "mixed_graphs=True captures prefill steps beside the decode steps, and graphs "
                "are off; pass graphs=True (or None on a GPU) or mixed_graphs=False")
        self.mixed_graphs = bool(self.graphs and opts.mixed_graphs is not False)
        """Whether steps that prefill are captured too (``mixed_graphs``)."""
        if self.graphs:
            cfg = dataclasses.replace(cfg, static_decode=True,
                                      static_decode_batch_sizes=opts.graph_batch_sizes or (),
                                      static_mixed=self.mixed_graphs)
        self.cache = PagedKVCache(cfg, backend=backend, device=device)
        self.config = cfg
        adapter.check(self.cache)
        offload = opts.offload
        if offload is None:     # (payloads hold one head dim: no host tier for head_dim_v)
            offload = (not str(self.cache.backend.device or "cpu").startswith("cpu")
                       and cfg.head_dim_v == cfg.head_dim)
        self.host_tier: Optional[HostTier] = (
            HostTier(self.cache, cfg.max_total_tokens if opts.offload_tokens is None
                     else opts.offload_tokens)
            if offload else None)
        """Where preempted sequences are parked (None: offload is off, they are recomputed)."""
        self.overlap = opts.overlap
        self.stats = EngineStats()
        scheduler = AsyncScheduler if opts.overlap else Scheduler
        self.scheduler = scheduler(self.cache, self.host_tier, self.stats)
        self.compiled = self._want_compile(
            False if opts.deterministic and opts.compile_step is None else opts.compile_step,
            device)
        """Whether captured decode steps run the compiled model code (``compile_step``)."""
        self.runner = Runner(adapter, self.cache, self.stats, graphs=self.graphs,
                             compiled=self.compiled, invariant_ops=invariant_ops)
        self.decode_graphs = self.runner.decode_graphs
        self.core = EngineCore(self.scheduler, self.runner, _weak_admit(self))
        self.progress: Optional[bool] = None
        self._eos = frozenset(int(t) for t in adapter.eos_token_ids())
        self._lock = threading.RLock()
        self._streams: dict = {}            # request_id -> asyncio.Queue (astream)
        self._driver: Optional[asyncio.Task] = None
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._fingerprint: Optional[dict] = None
        _LIVE_ENGINES.add(self)
        self.prefix_loaded = 0
        """Pages the ``prefix_file`` put in the prefix cache at start (0: none)."""
        if opts.prefix_file is not None:
            self.prefix_loaded = self.load_prefix_cache(opts.prefix_file)

    # ------------------------------------------------------------------ construction
    def _state_layers(self, opts: EngineConfig, backend: str, device) -> tuple:
        """``(state layers, opts, why off)``: the adapter's ``state_layers`` (always built: the
        model cannot run without them), the options with what does not compose with state
        layers turned off (graphs, mixed graphs, offload left at None; the prefix cache stays:
        its hits restore state checkpoints), and why (None: no state layer, or nothing was
        on). Raises
        ``UnsupportedFeatureError`` naming the option for one asked for that does not compose
        (``graphs``, ``mixed_graphs``, ``offload``, ``deterministic``, a ``prefix_file``) and
        for a backend without ``state_slots``."""
        states = dict(self.adapter.state_layers())
        if not states:
            return {}, opts, None
        what = (f"the {self.adapter.family or 'model'} model's state layers {sorted(states)} "
                f"(recurrent state: no page)")
        from ..plugins import resolve_backend
        cls = resolve_backend(backend, device)
        if not cls.capabilities.state_slots:
            raise UnsupportedFeatureError(
                f"{what} need the backend capability 'state_slots', and backend {cls.name!r} "
                f"does not declare it; pick a backend that does (reference, cuda, metal)")
        # asked for by name: refused (docs/hybrid.md "Refused" for state layers)
        for name, on, why in (
                ("deterministic", opts.deterministic, "the batch-invariant mode"),
                ("graphs", opts.graphs, "captured steps"),
                ("mixed_graphs", opts.mixed_graphs, "captured steps"),
                ("offload", opts.offload, "the host tier (a state has no payload)")):
            if on:
                raise UnsupportedFeatureError(
                    f"{name}=True with {what}: {why} does not compose with state layers yet "
                    f"(docs/hybrid.md); pass {name}=False")
        if opts.prefix_file is not None:
            raise UnsupportedFeatureError(
                f"prefix_file with {what}: prefix files do not carry state checkpoints yet "
                f"(docs/hybrid.md); pass prefix_file=None")
        off = []
        if opts.graphs is None and self._want_graphs(None, backend, device):
            off.append("graphs (on by default here)")
        if opts.offload is None and not str(device or "cpu").startswith("cpu"):
            off.append("offload (on by default here; preempted sequences are recomputed)")
        opts = dataclasses.replace(opts, graphs=False, mixed_graphs=False, offload=False)
        if not off:
            return states, opts, None
        reason = f"{', '.join(off)} off for {what}: not composed with state layers yet (docs/hybrid.md)"
        _log.info("%s", reason)
        return states, opts, reason

    def _window_groups(self, opts: EngineConfig, backend: str, device) -> tuple:
        """``(layer_kinds, why off)`` by ``opts.window_groups`` (``EngineConfig``): the
        adapter's ``layer_kinds`` when window groups are on, else ``{}`` and the reason (None
        when the model has no windowed layer or they were turned off by ``False``). True with
        an option that does not compose raises ``UnsupportedFeatureError`` naming it."""
        if opts.window_groups is False:
            return {}, None
        asked = opts.window_groups is True
        try:
            kinds = dict(self.adapter.layer_kinds())
        except UnsupportedFeatureError as exc:
            if asked:
                raise UnsupportedFeatureError(f"window_groups=True: {exc}") from None
            return self._groups_off(f"{exc}")
        if not kinds:
            if asked:
                raise UnsupportedFeatureError(
                    f"window_groups=True: the {self.adapter.family or 'model'} model has no "
                    f"sliding-window layer; pass window_groups=None or False")
            return {}, None
        from ..plugins import resolve_backend
        cls = resolve_backend(backend, device)
        why, fixes = [], []
        if not cls.capabilities.window_groups:
            why.append(f"backend {cls.name!r} does not declare 'window_groups'")
        # not composed with window groups yet (docs/hybrid.md); each of these needs every page
        # (a prefix_file is loaded through imports, refused with window groups)
        for name, on in (("deterministic", opts.deterministic), ("graphs", opts.graphs),
                         ("mixed_graphs", opts.mixed_graphs), ("offload", opts.offload)):
            if on:
                why.append(f"{name}=True")
                fixes.append(f"{name}=False")
        # graphs on by default (a GPU): the step's speed wins over the windows' memory unless
        # window groups are asked for (window_groups=True turns the default graphs off)
        if (not asked and opts.graphs is None
                and self._want_graphs(None, backend, device)):
            why.append("graphs (on by default here)")
        if opts.prefix_file is not None:
            why.append("a prefix_file")
            fixes.append("prefix_file=None")
        if not why:
            return kinds, None
        reason = (f"{' and '.join(why)} with the sliding-window layers {sorted(kinds)}: not "
                  f"composed with window groups yet (docs/hybrid.md)")
        if asked:
            raise UnsupportedFeatureError(
                f"window_groups=True: {reason}; pass " + " ".join(fixes)
                + " or window_groups=None")
        return self._groups_off(reason)

    @staticmethod
    def _groups_off(reason: str) -> tuple:
        _log.info("window groups off, every page of the sliding-window layers kept: %s", reason)
        return {}, reason

    def _want_graphs(self, graphs: Optional[bool], backend: str, device: Optional[str]) -> bool:
        if graphs is False:
            return False
        from ..plugins import resolve_backend
        cls = resolve_backend(backend, device)
        fits = self.adapter.graphs_by_default(device)
        if graphs is None:
            return bool(fits) and cls.capabilities.static_decode
        if fits is None:
            raise UnsupportedFeatureError(
                f"graphs=True: the {self.adapter.family or type(self.adapter).__name__} adapter "
                f"cannot capture its model's decode steps; pass graphs=False")
        if not cls.capabilities.static_decode:
            raise UnsupportedFeatureError(
                f"graphs=True: backend {cls.name!r} does not declare 'static_decode' "
                f"(static-shape decode steps a graph can replay); pass graphs=False")
        return True

    def _invariant_ops(self, opts):
        """The adapter's batch-invariant ops for ``deterministic=True`` (None when off); an
        ``UnsupportedFeatureError`` where the adapter has none or ``compile_step`` is asked
        (the compiled step would fuse the ops the invariant mode runs in row blocks)."""
        if not opts.deterministic:
            return None
        ops = self.adapter.batch_invariant_ops()
        if ops is None:
            raise UnsupportedFeatureError(
                f"deterministic=True: the {self.adapter.family or type(self.adapter).__name__} "
                f"adapter has no batch-invariant model ops (ModelAdapter.batch_invariant_ops); "
                f"pass deterministic=False")
        if opts.compile_step:
            raise UnsupportedFeatureError(
                "deterministic=True with compile_step=True: the compiled step would fuse the "
                "model ops that deterministic mode runs in fixed row blocks; pass one of them")
        return ops

    def _want_compile(self, compile_step: Optional[bool], device) -> bool:
        if compile_step is False:
            return False
        why = self.adapter.compiles(device) if self.graphs else \
            "it compiles the captured decode step, and graphs are off"
        if compile_step is None:
            return why is None
        if why is not None:
            raise UnsupportedFeatureError(f"compile_step=True: {why}; pass compile_step=False")
        return True

    def _size(self, backend, device, chunk, fraction: float, sizes: dict,
              kinds: Optional[dict] = None, slots: int = 0, prefix_cache: bool = False) -> tuple:
        """``(max_total_tokens, how)`` from the device's free memory (see the class doc); with
        window groups or state layers (``kinds``; ``slots``: ``max_state_slots``) their pools
        and state arrays (with ``prefix_cache``, their checkpoints too) are counted out first
        and the tokens are the full-attention layers' (neither grows with the tokens)."""
        adapter = self.adapter
        batch = int(sizes["max_batch_size"])
        gc.collect()        # what a reference cycle still holds (a dropped model's, say)
        info = adapter.device_memory(device)
        if info is None:
            return DEFAULT_TOKENS_PER_SEQUENCE * batch, "default"
        free, total = info
        chunk = 8192 if chunk is None else int(chunk)
        ps = int(sizes["page_size"])
        probe_tokens = chunk + ps * (batch + 1)
        config = adapter.cache_config(max_total_tokens=probe_tokens, prefill_chunk_size=chunk, **sizes)
        config = dataclasses.replace(config, kv_dtype=self._kv_dtype,   # bytes per token count it
                                     kv_quant_group=quant_group_for(config, self._kv_dtype))
        probe = PagedKVCache(config, backend=backend, device=device)
        rows = min(batch, chunk)
        lens = [chunk // rows + (1 if i < chunk % rows else 0) for i in range(rows)]

        def largest_step():                 # a full prefill chunk with the most logit rows
            import numpy as np
            for i in range(rows):
                probe.add_sequence(i)
            positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
            with adapter.session(probe), adapter.step_context(probe), \
                    probe.forward(list(range(rows)), lens):
                logits = adapter.forward(probe, np.zeros(chunk, np.int64), positions,
                                         np.cumsum(lens).astype(np.int64) - 1)
            adapter.to_numpy(logits)
        peak = adapter.peak_memory(device, largest_step)
        del probe
        # this engine's share: a fraction of what was free when it started (the model, other
        # engines and other processes already counted out), less one largest step
        room, per_token = fraction * free - peak, config.token_kv_bytes
        if kinds:
            grouped = dataclasses.replace(config, layer_kinds=kinds, max_total_tokens=2**30,
                                          max_state_slots=slots, prefix_cache=prefix_cache,
                                          **checkpoints_for(config, {
                                              k: v for k, v in kinds.items()
                                              if isinstance(v, State)}, slots))
            layer_bytes = config.token_kv_bytes // config.num_layers
            room -= grouped.state_bytes
            if grouped.full_layers:     # (every layer windowed: sized as without groups)
                room -= sum(grouped.window_group_pages(g) * ps * layer_bytes * len(layers)
                            for g, (_, layers) in enumerate(grouped.window_groups))
                per_token = layer_bytes * len(grouped.full_layers)
        tokens = int(room // per_token) // ps * ps
        if tokens < 2 * ps:
            raise InvalidArgumentError(
                f"memory_fraction={fraction}: {free / 2**30:.2f} GiB free of {total / 2**30:.2f} "
                f"GiB on {device or adapter.default_device()} when this engine started, a largest "
                f"step takes {peak / 2**30:.2f} GiB: no room for a cache ({config.token_kv_bytes} "
                f"bytes per token). {self._holders(device, free, total)}; free them (del an "
                f"engine you no longer use), raise memory_fraction or pass max_total_tokens")
        return tokens, f"{fraction:g} of {free / 2**30:.1f} GiB free: {tokens} tokens"

    def _holders(self, device, free: int, total: int) -> str:
        """Who holds the device memory that is not free: this process's other engines (each by
        its KV pages), its other tensors, and the rest (other processes, CUDA contexts)."""
        gib = 2 ** 30
        here = str(device or self.adapter.default_device())
        engines = sorted((e for e in list(_LIVE_ENGINES)
                          if e is not self and str(e.cache.backend.device) == here),
                         key=lambda e: e.number)
        held = [f"engine {e.number} ({e.adapter.family or type(e.adapter).__name__}, "
                f"{e.cache.config.max_total_tokens} tokens): {e.cache.config.kv_bytes / gib:.2f} "
                f"GiB of KV pages" for e in engines]
        parts = [f"held on {here}: " + ("; ".join(held) if held else "no other engine of this process")]
        mine = self.adapter.process_memory(device)
        if mine is not None:
            others = sum(e.cache.config.kv_bytes for e in engines)
            parts.append(f"this process's other tensors (the model among them) "
                         f"{max(mine - others, 0) / gib:.2f} GiB")
            parts.append(f"other processes and memory outside the allocator (CUDA context, "
                         f"NCCL) {max(total - free - mine, 0) / gib:.2f} GiB")
        return ", ".join(parts)

    # ------------------------------------------------------------------ the online API
    def warm_up(self) -> "WarmUp":
        """Pay the first-use costs before serving: one throwaway forward of every kind of step
        the engine's whole-step graphs hold (each decode batch bucket; with ``mixed_graphs``
        each prefill token bucket, alone and over a shared prefix), so kernels compile and
        graphs are captured now rather than on the first requests that meet each shape; without
        graphs, one prefill and one decode step; then a fork inside a page, a round trip through
        the host tier (when offload is on) and the pickers once. Leaves no page, sequence or
        prefix-cache entry behind and counts nothing in ``stats``. Returns a ``WarmUp``
        (seconds, forwards, captures, the steps run and those the free pages could not hold).
        Raises ``InvalidArgumentError`` while requests are unfinished."""
        from .warm_up import warm_up
        with self._lock:
            return warm_up(self)

    def add_request(self, prompt: Sequence[int], params: Optional[SamplingParams] = None, *,
                    hold_kv: bool = False, kv_seq_id: Optional[int] = None,
                    drawn: int = 0) -> int:
        """Queue a request: ``prompt`` token ids, ``params`` a ``SamplingParams`` (None: its
        defaults, greedy 32 tokens). Returns its id. A bad prompt or one that cannot fit the
        cache even alone raises ``InvalidArgumentError`` and queues nothing. ``hold_kv`` /
        ``kv_seq_id``: disaggregated prefill and decode; ``drawn``: the sample's picks before
        this request, where its draws count from (``EngineCore.add_request``)."""
        with self._lock:
            return self.core.add_request(prompt, params, hold_kv=hold_kv, kv_seq_id=kv_seq_id,
                                         drawn=drawn)

    def new_seq_id(self) -> int:
        """A cache sequence id the engine never uses itself (to import a sequence under)."""
        with self._lock:
            return self.core.new_seq_id()

    def release(self, request_id: int) -> bool:
        """Remove the sequence a finished ``hold_kv`` request keeps in the cache."""
        with self._lock:
            return self.core.release(request_id)

    def step(self) -> list:
        """Run one forward; returns a ``RequestOutput`` per sample that got tokens or ended."""
        with self._lock:
            return self.core.step()

    def abort(self, request_id: int) -> None:
        """End a request now: its pages are free when this returns; the next ``step`` reports
        it (``finish_reason="abort"``)."""
        with self._lock:
            self.core.abort(request_id)

    def has_unfinished(self) -> bool:
        """``step`` has more to run or report (a request waits or runs, a step's picks are
        unread, an abort is unreported): drive the engine with ``while
        engine.has_unfinished(): engine.step()``."""
        return self.core.has_unfinished()

    def _admit(self, prompt, params, what: str = "prompt"):
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(
                f"params must be a kvcache.integrations.SamplingParams or None, got {params!r:.80}")
        prompt = self._check_prompt(prompt, what, params.max_tokens)
        stops = frozenset(params.stop_token_ids or ()) | (frozenset() if params.ignore_eos else self._eos)
        return prompt, params, stops

    def _check_prompt(self, prompt, what: str, max_tokens: int) -> list:
        vocab = int(self.adapter.vocab_size)
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise InvalidArgumentError(f"{what} must be a non-empty list of integer token ids, "
                                       f"got {prompt!r:.80}")
        tokens = list(prompt)
        # plain ints in range (the common case) are checked at C speed; the loop finds the
        # offender otherwise (a 2,000-token prompt took 2 ms in it)
        fast = bool(tokens) and set(map(type, tokens)) == {int} and min(tokens) >= 0 \
            and max(tokens) < vocab
        for k, t in enumerate(() if fast else tokens):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise InvalidArgumentError(f"{what} must be a non-empty list of integer token "
                                           f"ids, got {prompt!r:.80}")
            if not 0 <= int(t) < vocab:
                raise InvalidArgumentError(f"{what}: token {int(t)} at index {k} is outside the "
                                           f"model's vocabulary [0, {vocab})")
        if not tokens:
            raise InvalidArgumentError(f"{what} must be a non-empty list of integer token ids, got []")
        cfg = self.config
        length = len(tokens) + max_tokens
        # what one sequence of the request holds at most: its prompt and every new token but
        # the last (never run); the scheduler can always shrink to that one sequence
        need = -(-(length - 1) // cfg.page_size)
        total = self.cache.num_total_pages
        pages = total - 1       # CacheConfig.num_pages keeps one page spare beyond the capacity
        if need > pages:
            raise InvalidArgumentError(
                f"{what}: {len(tokens)} tokens + max_tokens={max_tokens} hold up to {length - 1} "
                f"tokens in the cache, {n_pages(need, 'page')} of {cfg.page_size}, more than the cache "
                f"holds even for this request alone ({n_pages(pages, 'page')}: its {n_pages(total, 'page')}, "
                f"cache.num_total_pages, less the 1 kept spare; max_total_tokens="
                f"{cfg.max_total_tokens}); raise max_total_tokens (to {need * cfg.page_size}, "
                f"say) or lower max_tokens")
        self.adapter.check_request(self.cache, what, length)
        return [int(t) for t in tokens]

    # ------------------------------------------------------------------ KV files
    @property
    def fingerprint(self) -> Optional[dict]:
        """The model's fingerprint (``kvcache.integrations.fingerprint.model_fingerprint`` of
        the adapter's ``model``: architecture, layers, heads, head dims, RoPE, a hash of the
        parameter shapes, and with ``fingerprint_weights`` of the weights), which the
        engine's KV files carry and are checked against; computed once. None for an adapter
        without a ``model``: its files carry none and are checked against none."""
        if self._fingerprint is None:
            model = getattr(self.adapter, "model", None)
            if model is None:
                return None
            from .fingerprint import model_fingerprint
            self._fingerprint = model_fingerprint(
                model, weights=self.engine_config.fingerprint_weights)
        return dict(self._fingerprint)

    def save_prefix_cache(self, path, conversations: Optional[Sequence[Sequence[int]]] = None
                          ) -> int:
        """Write the prefix cache to the file ``path`` with the model's ``fingerprint``
        (``cache.prefix_cache.save``): every cached prefix (``conversations`` None), or the
        longest cached prefix of each token id list in ``conversations``, whole pages; e.g. a
        conversation's prompt followed by the tokens the engine generated for it, saved once
        its request finished (a finished request leaves its full pages cached). Another engine
        loads it (``load_prefix_cache``, ``prefix_file``) or goes on with the conversation
        (``resume``). Returns the pages written. Raises ``InvalidArgumentError`` with
        ``prefix_cache=False``."""
        with self._lock:
            return self.cache.save_prefix_cache(path, self.fingerprint, conversations)

    def load_prefix_cache(self, path) -> int:
        """Load a prefix cache file (``save_prefix_cache``'s, from any engine, process or
        backend of the same model; or a KV file of sequences with token ids) into the prefix
        cache as cached pages, checked against the model's ``fingerprint`` first: a request
        that begins with one of its prefixes starts from it (``stats.prefix_hit_tokens``).
        Returns the pages the prefix cache gained. Raises ``InvalidArgumentError`` naming the
        field for a file of another model or a corrupt one, ``CacheFullError`` without room;
        nothing is loaded then. ``prefix_file`` calls it at start."""
        with self._lock:
            return self.cache.load_prefix_cache(path, self.fingerprint)

    def resume(self, path, prompt: Sequence[int], params: Optional[SamplingParams] = None, *,
               drawn: int = 0) -> int:
        """Go on with a conversation another engine saved (``save_prefix_cache(path,
        [tokens])``, ``tokens`` its prompt and generated tokens): load ``path``
        (``load_prefix_cache``), then queue ``prompt``, the saved tokens and what follows them
        (a next turn), as ``add_request`` does; returns the request id. The request starts
        from the loaded pages and computes the rest (the last partial page, the new turn).
        Greedy tokens are those of a run that never stopped (the conversation as one request)
        with ``deterministic=True``: a token's output is the same bits whether it arrives in
        a prefill chunk or a decode step; without it, those of a next turn on the saving
        engine (on the same backend). ``drawn``: how many of the conversation's last tokens
        the saving engine's sample drew (its ``max_tokens`` so far) when the resumed request
        goes on with that sample (no new turn): its draws then count from there, so with the
        same seed and ``deterministic=True`` a sampled continuation is that of the run that
        never stopped too (0: they count from this request's start, as a new turn's do).
        ``prompt``, ``params`` and ``drawn`` are checked first (nothing is loaded for a bad
        one)."""
        with self._lock:
            self._admit(prompt, params)
            check_drawn(drawn)        # before anything is loaded
            self.load_prefix_cache(path)
            return self.add_request(prompt, params, drawn=drawn)

    # ------------------------------------------------------------------ wrappers
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params=None, *,
                 max_new_tokens: Optional[int] = None, n: Optional[int] = None,
                 temperature: Optional[float] = None, seed: Optional[int] = None,
                 stop_token_ids: Optional[Sequence[int]] = None, ignore_eos: Optional[bool] = None,
                 return_logprobs: bool = False):
        """Generate for every prompt and wait for all of them.

        ``prompts``: token id lists. ``sampling_params``: a ``SamplingParams`` for every
        prompt, or a list with one per prompt; or the keyword shorthands ``max_new_tokens``
        (default 32), ``n``, ``temperature`` (0: greedy), ``seed`` (prompt ``i`` draws with
        seed ``seed * 1000003 + i * n``), ``stop_token_ids``, ``ignore_eos`` (not both). A sample
        ends at a stop token or the model's EOS (kept as its last token) unless ``ignore_eos``.

        Returns ``out[i][j]``: the new token ids of sample ``j`` of prompt ``i``; with
        ``return_logprobs`` (or any request's ``logprobs``) the pair ``(out, logprobs)``. Every
        prompt is checked before anything runs (``InvalidArgumentError`` naming the prompt).
        Needs an engine with no other unfinished requests."""
        params = sampling_params_for(
            prompts, sampling_params, max_new_tokens=max_new_tokens, n=n, temperature=temperature,
            seed=seed, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
        if return_logprobs:             # (0: the chosen token's log-probability)
            params = [p if _wants_logprobs(p) else dataclasses.replace(p, logprobs=0)
                      for p in params]
        ids = self._add_all(prompts, params)
        outs: dict = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, params)}
        lps: dict = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, params)}
        for out in self._drive(ids):
            outs[out.request_id][out.index].extend(out.new_token_ids)
            if out.logprobs is not None:
                lps[out.request_id][out.index].extend(out.logprobs)
        tokens = [outs[rid] for rid in ids]
        if return_logprobs or any(_wants_logprobs(p) for p in params):
            return tokens, [lps[rid] for rid in ids]
        return tokens

    def stream(self, prompts: Sequence[Sequence[int]], sampling_params=None, **kwargs):
        """``generate`` as an iterator: yields each ``RequestOutput`` as its step ends (new
        tokens of one sample of one prompt; ``request_id`` is that prompt's index)."""
        params = sampling_params_for(prompts, sampling_params, **kwargs)
        ids = self._add_all(prompts, params)
        index = {rid: i for i, rid in enumerate(ids)}
        for out in self._drive(ids):
            yield dataclasses.replace(out, request_id=index[out.request_id])

    async def astream(self, prompt: Sequence[int], params: Optional[SamplingParams] = None):
        """Stream one request's outputs in an asyncio server: many coroutines may each
        ``async for out in engine.astream(prompt, params)`` at once; one task steps the engine
        (in one worker thread of its own, where the model's session lives) while any of them is
        unfinished. Leaving the iteration early aborts the request."""
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.add_request(prompt, params)
        self._streams[rid] = queue
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive_async())
        left = (params or SamplingParams()).n
        try:
            while left:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                left -= out.finished
                yield out
        finally:
            self._streams.pop(rid, None)
            if left:
                self.abort(rid)

    async def _drive_async(self) -> None:
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvcache-engine")
        loop = asyncio.get_running_loop()
        while self.has_unfinished():
            try:
                outs = await loop.run_in_executor(self._worker, self.step)
            except BaseException as exc:                       # every stream hears of it
                for queue in self._streams.values():
                    queue.put_nowait(exc)
                raise
            for out in outs:
                queue = self._streams.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            await asyncio.sleep(0)

    def _add_all(self, prompts, params) -> list:
        """Check every prompt, then queue them all (nothing queued if one is bad)."""
        if self.has_unfinished():
            raise InvalidArgumentError(
                f"generate/stream need an idle engine, but {len(self.scheduler.requests)} "
                f"requests are unfinished; step() them to the end or abort() them")
        if not self.cache.is_empty:
            raise InvalidArgumentError(
                f"generate needs an empty cache, but it holds {self.cache.num_sequences} "
                f"sequences; call engine.cache.clear()")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            self._admit(prompt, p, f"prompt {i}")
        return [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]

    def _drive(self, ids: list):
        """Step until every request in ``ids`` is done, yielding their outputs."""
        total = sum(r.params.max_tokens * r.params.n for r in
                    (self.scheduler.requests[i] for i in ids))
        bar = Progress(total, self.progress, self)
        try:
            while self.has_unfinished():
                outs = self.step()
                bar.update(outs)
                yield from outs
        except BaseException:
            self.core.reset()
            raise
        finally:
            bar.close()
