"""``EngineConfig``: an engine's options, in one place (each integration's ``Engine`` takes them
as keywords, or as ``config=EngineConfig(...)``). Pure Python: it checks each option's type and
range when made; which backend, device and dtype exist is asked of the plugin registry and the
model adapter when the engine is built."""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Iterable
from typing import Any, Optional

from ..errors import InvalidArgumentError

__all__ = ["EngineConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The options of an ``Engine`` (``kvcache.integrations.engine.Engine`` and the
    transformers and mlx-lm ones), checked when made: a bad one raises
    ``InvalidArgumentError`` naming the option and the value. ``dataclasses.replace`` makes a
    changed copy (checked again)."""

    backend: str = "auto"
    """A backend name, or ``"auto"`` (the highest-priority available one), as ``PagedKVCache``."""
    device: Any = None
    """The cache's device (None: the model's)."""
    dtype: Any = None
    """The cache dtype, a name (``"bfloat16"`` ...) or the model library's dtype (None: the
    model's)."""
    page_size: int = 16
    """Tokens per page."""
    max_total_tokens: Optional[int] = None
    """The cache's token capacity. None: sized from the device memory free when the engine
    starts (the model, the other engines of this process and other processes already counted
    out; memory this process's allocator holds unused counts as free): the engine takes
    ``memory_fraction`` of it, its pages and one profiled largest step together, so a second
    engine on the device gets a share of what the first left. Where the adapter cannot ask the
    device (a CPU, MLX's unified memory) ``512 * max_batch_size``. ``Engine.sizing`` says how it
    was chosen; when nothing fits, the ``InvalidArgumentError`` says who holds the device's
    memory (each other engine of this process by number, this process's other tensors, the
    rest)."""
    max_batch_size: int = 64
    """Sequences in one forward."""
    prefill_chunk_size: Optional[int] = None
    """Tokens in one forward (None: ``min(8192, max_total_tokens)``)."""
    graphs: Optional[bool] = None
    """Whole-step decode graphs (a pure decode step replays a graph captured per batch bucket).
    None: on where the backend declares ``static_decode`` and the adapter says the device gains
    from it (a GPU); True: on (``UnsupportedFeatureError`` if it cannot be); False: off."""
    graph_batch_sizes: Optional[tuple] = None
    """The graphs' batch buckets, any sequence of ints (stored as a tuple; None: powers of two
    up to ``max_batch_size``)."""
    offload: Optional[bool] = None
    """A preempted sequence is parked in a host tier (``Engine.host_tier``, of
    ``offload_tokens`` tokens) and restored later (True), or dropped and recomputed (False);
    None: on when the cache is on an accelerator."""
    offload_tokens: Optional[int] = None
    """The host tier's capacity in tokens (None: ``max_total_tokens``)."""
    overlap: bool = True
    """The host stays one step ahead of the device for greedy steps (an ``AsyncScheduler``;
    ``stats.overlapped_forwards``); the tokens are the same as with ``overlap=False``."""
    memory_fraction: float = 0.9
    """The share of the device memory free at start that the engine takes, in (0, 1] (see
    ``max_total_tokens``)."""
    prefix_cache: bool = True
    """Automatic prefix caching (``CacheConfig.prefix_cache``): a request starts from the
    longest cached prefix of its prompt, whole pages, left by any earlier request, call or turn
    of a conversation (``stats.prefix_hit_tokens``); the pages of finished requests stay cached
    until pages are needed. The tokens are the same as with it off, bit for bit where
    docs/prefix-caching.md says."""
    deterministic: bool = False
    """Batch-invariant steps: a request's logits are the same bits whatever else runs with it,
    however its prompt is chunked, whether its prefix came from the prefix cache, and after
    preemption, recompute or a round trip through the host tier. The cache is built with
    ``CacheConfig(batch_invariant=True)`` (the backend must declare ``batch_invariant``) and the
    model's own row ops run batch-invariantly during each step (the adapter's
    ``batch_invariant_ops``); an adapter or backend without them raises
    ``UnsupportedFeatureError``. Costs speed: see docs/determinism.md."""
    kv_dtype: str = "auto"
    """The pages' storage format (``CacheConfig.kv_dtype``): ``"auto"`` (the compute dtype),
    or ``"float8_e4m3"``, ``"int8"``, ``"int4"`` where the backend declares them in
    ``Capabilities.kv_dtypes``; with ``max_total_tokens=None`` a format of fewer bytes holds
    more tokens in the same memory. The affine formats quantize groups of 64 values (32 where
    the head dims are not multiples of 64). Quantized pages are offloaded as they are stored
    (fp8 with its scales, int8 / int4 as packed rows), so a restored sequence reads back the
    same values."""
    compile_step: Optional[bool] = False
    """The captured decode step's model code goes through ``torch.compile`` (the cache's
    attention an opaque op in it), so the norms, activations and residual adds between the
    GEMMs fuse; the replayed graph holds the compiled kernels (the first capture per process
    compiles: seconds to minutes). None: on where the adapter can compile (a CUDA GPU with
    Triton) and graphs are on; True: on or ``UnsupportedFeatureError``. Prefill and mixed
    steps stay eager."""
    mixed_graphs: Optional[bool] = None
    """With graphs on, steps that prefill (a prompt chunk, alone or beside decode rows) are
    captured too, once per token bucket (``CacheConfig.static_mixed``: one paged pass per
    layer, two merged where the batch shares a prefix, the batch padded to a token bucket): a
    step that admits a request then costs about what a decode step costs on the host. None: on
    where graphs are on; True: on, or ``UnsupportedFeatureError`` without graphs; False: such
    steps run eagerly. Tokens agree with eager mixed steps to the attention's rounding (another
    kernel path over the same keys)."""
    prefix_file: Any = None
    """A prefix cache file (a path: ``Engine.save_prefix_cache``'s, or any KV file whose
    sequences carry token ids) loaded when the engine starts, checked against the model's
    fingerprint (``Engine.fingerprint``; another model's file is refused): its prefixes, a
    system prompt or saved conversations, are cached pages, and a request that begins with one
    starts from it (``stats.prefix_hit_tokens``). Needs ``prefix_cache``; None: none."""
    window_groups: Optional[bool] = None
    """The model's sliding-window layers keep only the pages their windows still see
    (``CacheConfig.layer_kinds`` from the adapter's ``layer_kinds``: each windowed layer's
    memory is O(window) per sequence; docs/hybrid.md); the prefix cache then also keeps the
    window pages a hit needs (``stats.prefix_miss_tokens_by_reason`` counts the boundaries
    whose window pages were reclaimed). Window groups do not compose yet with deterministic
    mode, whole-step graphs, the host tier or a ``prefix_file`` (KV files). None: on where
    the model has windowed layers, the backend declares ``window_groups``, the adapter
    understands the model's windowing, ``deterministic`` is off, no ``prefix_file`` is given
    and ``graphs``, ``mixed_graphs`` and ``offload`` are not True, nor graphs on by default
    (a GPU: there the captured step's speed is kept; ask for window groups with True); those
    left at None are then off; else off, with the reason in ``Engine.window_groups_off`` (and
    logged). True: on (graphs left at None then off), or ``UnsupportedFeatureError`` naming
    what does not compose. False: every layer keeps
    every page (the behaviour before window groups)."""
    state_checkpoint_interval: Optional[int] = None
    """With state layers and the prefix cache: the pages between state checkpoints
    (``CacheConfig.state_checkpoint_interval``; docs/hybrid.md, increment 8): a prefix hit
    recomputes at most this many pages. None: the engine's choice, the fewest pages whose
    attention KV takes at least one checkpoint's bytes
    (``kvcache.integrations.engine.checkpoints_for``)."""
    fingerprint_weights: bool = False
    """The model fingerprint the engine writes into KV files and checks them against also
    hashes every weight (read once, when first needed: about a second per GiB), so two
    checkpoints of one architecture are told apart; False: the architecture, shapes and RoPE
    (``kvcache.integrations.fingerprint``)."""

    def __post_init__(self) -> None:
        for name in ("page_size", "max_batch_size", "max_total_tokens", "prefill_chunk_size",
                     "offload_tokens", "state_checkpoint_interval"):
            value = getattr(self, name)
            optional = name not in ("page_size", "max_batch_size")
            if value is None and optional:
                continue
            low = 0 if name == "offload_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                raise InvalidArgumentError(
                    f"{name}={value!r:.80} must be {'None or ' if optional else ''}an integer "
                    f">= {low}")
            object.__setattr__(self, name, int(value))
        for name in ("graphs", "offload", "compile_step", "mixed_graphs", "window_groups"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidArgumentError(f"{name}={value!r} must be None, True or False")
        for name in ("overlap", "prefix_cache", "deterministic", "fingerprint_weights"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidArgumentError(f"{name}={value!r} must be True or False")
        if self.prefix_file is not None:
            if not isinstance(self.prefix_file, (str, os.PathLike)):
                raise InvalidArgumentError(
                    f"prefix_file={self.prefix_file!r:.80} must be None or a path")
            if not self.prefix_cache:
                raise InvalidArgumentError(
                    f"prefix_file={str(self.prefix_file)!r:.80} loads into the prefix cache, and "
                    f"prefix_cache=False; pass prefix_cache=True or no prefix_file")
        fraction = self.memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction <= 1:
            raise InvalidArgumentError(f"memory_fraction={fraction!r} must be a number in (0, 1]")
        if not isinstance(self.kv_dtype, str):
            raise InvalidArgumentError(f"kv_dtype={self.kv_dtype!r:.80} must be 'auto' or a "
                                       f"storage format's name")
        sizes = self.graph_batch_sizes
        if sizes is not None:
            if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Iterable):
                raise InvalidArgumentError(
                    f"graph_batch_sizes={sizes!r:.80} must be None or a sequence of integers")
            sizes = tuple(sizes)
            for b in sizes:
                if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1:
                    raise InvalidArgumentError(
                        f"graph_batch_sizes={sizes!r:.80} must hold integers >= 1 (holds "
                        f"{b!r:.40})")
            object.__setattr__(self, "graph_batch_sizes", tuple(int(b) for b in sizes))

    @classmethod
    def of(cls, config: Optional["EngineConfig"] = None, **options) -> "EngineConfig":
        """The options an ``Engine`` is given: ``config`` (None: the defaults) with ``options``
        (keyword options, ``EngineConfig`` field names) over it. Raises ``TypeError`` for a
        keyword that is no option (as a signature would), ``InvalidArgumentError`` for a bad
        value or a ``config`` that is not an ``EngineConfig``."""
        unknown = sorted(set(options) - _FIELDS)
        if unknown:
            raise TypeError(f"unknown Engine option(s) {unknown}; the options are "
                            f"EngineConfig's fields: {', '.join(sorted(_FIELDS))}")
        if config is None:
            return cls(**options)
        if not isinstance(config, EngineConfig):
            raise InvalidArgumentError(f"config={config!r:.80} must be an EngineConfig or None")
        return dataclasses.replace(config, **options) if options else config


_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))
