"""Cache configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional, Union

from .core.validate import INT32_MAX, bool_arg, float_arg, int_arg, int_values
from .errors import InvalidArgumentError, UnsupportedFeatureError
from .formats import FORMAT_TABLE as KV_TABLE, KVFormat, kv_format, quantized_names

DTYPES = tuple(name for name, fmt in KV_TABLE.items() if not fmt.quantized)
"""The cache dtypes a ``CacheConfig`` accepts (compute and storage): ``"float16"``,
``"bfloat16"``, ``"float32"`` (``kvcache.formats.FORMAT_TABLE``' unquantized names)."""
ROPE_MODES = ("none", "normal", "inline")
"""``CacheConfig.rope_mode`` values: the model rotates q/k itself; the cache rotates them as K/V
are written; the cache rotates inside attention (sliding windows need it)."""


KV_FORMATS = quantized_names()
"""The quantized storage formats (``kvcache.formats.FORMAT_TABLE``' quantized names) ``CacheConfig.kv_dtype`` names besides ``"auto"`` (a backend
declares the ones it stores in ``Capabilities.kv_dtypes``): fp8 e4m3 with one float32 scale
per (layer, KV head); affine 8- and 4-bit codes with a scale and a bias per group of
``kv_quant_group`` values along the head dim, in ``dtype`` (mlx-lm's quantized cache)."""
KV_QUANT_GROUPS = (32, 64, 128)
"""``CacheConfig.kv_quant_group`` values (mlx's affine group sizes)."""


def itemsize(dtype: str) -> int:
    """Bytes per element of a cache dtype name (``DTYPES``): 4 for float32, 2 otherwise; 1 for
    "uint8" (the packed int8 / int4 rows payloads carry)."""
    return 4 if dtype == "float32" else 1 if dtype == "uint8" else 2

@dataclass(frozen=True)
class Window:
    """A layer kind of ``CacheConfig.layer_kinds``: sliding-window attention over ``size``
    positions, as ``attention(..., window_left=size)`` means it: a query at position ``p`` sees
    the keys at positions ``p - size .. p``. The layers of one ``Window`` form a *window group*
    with a page pool of its own, and each sequence keeps only the group's pages that a later
    query can still see: a page whose last key lies below ``length - size`` is freed when the
    forward that makes the sequence that long ends (docs/hybrid.md). ``size``: an int >= 0
    (InvalidArgumentError otherwise). A model library's ``sliding_window=W`` (each query sees
    ``W`` positions, itself included) is ``Window(W - 1)``."""

    size: int

    def __post_init__(self):
        object.__setattr__(self, "size", int_arg(self.size, "Window.size", 0, INT32_MAX))

    def __repr__(self) -> str:
        return f"Window({self.size})"


@dataclass(frozen=True)
class State:
    """A layer kind of ``CacheConfig.layer_kinds``: a recurrent layer (Mamba-2, gated DeltaNet,
    a short convolution) that keeps one fixed-size state per sequence instead of K/V pages.
    The layers of one ``State`` form a *state group*; each sequence holds one *slot* of every
    state array of those layers from ``add_sequence`` to ``remove_sequence``
    (``CacheConfig.num_state_slots`` slots), read and written in a forward with
    ``PagedKVCache.get_state`` / ``set_state``, copied by ``fork_sequence`` and restored by an
    aborted forward (docs/hybrid.md, increment 4).

    ``shapes``: ``{name: shape}``, at least one named array per layer, each shape a tuple of
    ints >= 1 (``()``: one value per sequence), e.g. Mamba-2's ``{"conv": (d_conv - 1,
    conv_dim), "ssm": (heads, head_dim, d_state)}``; a sequence's state of ``name`` is an array
    of that shape in ``dtype``. Read back ``shapes`` is a tuple of ``(name, shape)``
    pairs sorted by name (hashable: equal kinds form one group). ``dtype``: the states'
    storage dtype, one of ``DTYPES`` (None, the default: the cache ``dtype``); a recurrence
    whose model keeps its state in float32 under a 16-bit model (Mamba-2's SSM state, a gated
    DeltaNet's) asks for ``"float32"``, so rounding does not compound step after step.
    InvalidArgumentError for an empty mapping, a name that is not a non-empty string, a shape
    that is not a tuple of ints >= 1, or a dtype not in ``DTYPES``."""

    shapes: Union[Mapping, tuple]
    dtype: Optional[str] = None

    def __post_init__(self):
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidArgumentError(
                f"State.dtype={self.dtype!r:.40} must be None (the cache dtype) or one of "
                f"{DTYPES}")
        value = self.shapes
        pairs = list(value.items()) if isinstance(value, Mapping) else value
        if not isinstance(pairs, (list, tuple)) or not pairs:
            raise InvalidArgumentError(
                f"State.shapes must be a non-empty mapping {{name: shape}}, got {value!r:.80}")
        out: dict = {}
        for item in pairs:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise InvalidArgumentError(
                    f"State.shapes must be a mapping {{name: shape}} or (name, shape) pairs, "
                    f"got the item {item!r:.80}")
            name, shape = item
            if not isinstance(name, str) or not name:
                raise InvalidArgumentError(
                    f"State.shapes: a state name must be a non-empty string, got {name!r:.40}")
            if name in out:
                raise InvalidArgumentError(f"State.shapes names {name!r} twice")
            if not isinstance(shape, (tuple, list)):
                raise InvalidArgumentError(
                    f"State.shapes[{name!r}] must be a tuple of ints >= 1, got {shape!r:.80}")
            out[name] = tuple(int_arg(d, f"State.shapes[{name!r}][{i}]", 1, INT32_MAX)
                              for i, d in enumerate(shape))
        object.__setattr__(self, "shapes", tuple(sorted(out.items())))

    @property
    def names(self) -> tuple:
        """The state names, sorted."""
        return tuple(name for name, _ in self.shapes)

    def shape(self, name: str) -> tuple:
        """The per-sequence shape of state ``name`` (KeyError if the kind has none)."""
        return dict(self.shapes)[name]

    def elements(self) -> int:
        """Values one sequence's states of one layer hold, over every name."""
        total = 0
        for _, shape in self.shapes:
            n = 1
            for d in shape:
                n *= d
            total += n
        return total

    def storage(self, cache_dtype: str) -> str:
        """The dtype the states are stored in, in a cache of ``cache_dtype``."""
        return self.dtype or cache_dtype

    def __repr__(self) -> str:
        extra = "" if self.dtype is None else f", dtype={self.dtype!r}"
        return f"State({dict(self.shapes)}{extra})"


_UNSET = type("RopeModeUnset", (), {"__repr__": lambda self: "'normal' (unset)"})()


@dataclass(frozen=True)
class CacheConfig:
    """The shape and limits of a ``PagedKVCache``: the model's attention geometry, the page
    size, the capacity, and how RoPE is applied. Frozen, and validated on construction
    (``InvalidArgumentError`` naming the field; numpy scalars become Python ints / floats).

    ``CacheConfig(num_layers=32, num_qo_heads=32, num_kv_heads=8, head_dim=128,
    rope_mode="none")`` is a Llama-3-8B-like cache whose model rotates q and k itself. The
    properties derive the rest: ``num_pages`` (pages per layer), ``kv_bytes`` (the page
    arrays' size), ``group_size``, ``page_row_dim``, and with ``layer_kinds`` the window groups
    (``window_groups``, ``full_layers``, ``window_group_pages``). Use ``dataclasses.replace`` for a
    variant (pass ``head_dim_v`` too when changing ``head_dim``).
    """

    num_layers: int
    """Attention layers, each with its own page array (an int >= 1)."""
    num_qo_heads: int
    """Query (and output) heads per layer: ``q`` is ``(T, num_qo_heads, head_dim)``."""
    num_kv_heads: int
    """Key/value heads per layer: ``k`` is ``(T, num_kv_heads, head_dim)``; ``num_qo_heads``
    must be a multiple of it (grouped-query attention: query head ``h`` reads KV head
    ``h // group_size``)."""
    head_dim: int
    """Dims per query / key head, ``D``; even (RoPE rotates halves), and one of the backend's
    ``Capabilities.head_dims``."""
    page_size: int = 16
    """Tokens per page (rows of a page array): the unit of allocation and of sharing between
    forks."""
    max_batch_size: int = 128
    """The most sequences one forward takes (``begin_forward``'s ``B``)."""
    max_total_tokens: int = 65536
    """The tokens the cache holds over all sequences: ``num_pages`` is derived from it (rounded
    up to whole pages, plus spares). Bounded by int32 page slots."""
    prefill_chunk_size: int = 4096
    """The most new tokens one forward takes over all its sequences (``T``): longer prompts are
    run in chunks (the engines do that)."""
    dtype: str = "bfloat16"
    """The compute and storage dtype of q, k, v, the output and the pages: one of ``DTYPES``
    ("float16", "bfloat16", "float32"), and one of the backend's ``Capabilities.dtypes``."""
    rope_mode: str = _UNSET
    """"none" (the model rotates q/k itself) | "normal" | "inline"; left out: "normal", with a
    FutureWarning (a model that applies its own RoPE would be rotated twice)."""
    rope_theta: float = 10000.0
    """Base of the default RoPE frequencies ``rope_theta ** (-2i / R)``."""
    rope_scale: float = 1.0
    """Multiplies every RoPE position: ``angle_i = position * rope_scale * inv_freq_i`` (linear
    position interpolation by a factor f is ``rope_scale = 1/f``). Not a frequency scaling
    scheme: llama3 / YaRN scaling is given as ``rope_inv_freq``."""
    rope_inv_freq: tuple = ()
    """The model's own RoPE inverse frequencies, ``R/2`` floats (R: ``rope_rotary_dim`` or
    head_dim), e.g. a transformers model's ``rotary_emb.inv_freq``; they replace the
    ``rope_theta`` ones and carry the model's scaling (linear, llama3, YaRN). Empty: theta's."""
    rope_rotary_dim: int = 0
    """Partial rotary: RoPE rotates the first ``rope_rotary_dim`` dims of each head (even,
    at most head_dim) and leaves the rest; 0: every dim."""
    support_sliding_window: bool = False
    """Allow ``enable_sliding_window`` (eviction with attention sinks): RoPE then runs inside
    attention (``effective_rope_mode``) and ``num_pages`` has one spare page per batch slot.
    Needs the backend's ``sliding_window`` capability; no token trees in such a cache."""
    static_decode: bool = False
    """Static-shape decode: a decode step's batch is padded to a bucket, its index arrays go to
    one fixed-address device buffer at ``begin_forward``, and every shape and launch parameter
    depends on the bucket alone, so a backend can capture the step once per bucket and replay
    it (CUDA/HIP graphs; ``mx.compile``). Needs a backend declaring the ``static_decode``
    capability."""
    static_decode_batch_sizes: tuple = ()
    """Batch buckets a static-shape decode is padded to (default: powers of two up to and
    including max_batch_size)."""
    static_mixed: bool = False
    """Static-shape mixed steps (needs ``static_decode``): a forward that is not a static-shape
    decode step (prefill chunks, prefills beside decodes), with no token tree and no sliding
    window, is planned as one paged pass per layer over each sequence's history and new tokens
    (K/V written first; a sequence's new tokens see one another causally, as a chain token
    tree), padded to a token bucket (``static_mixed_token_sizes``) and to ``max_batch_size``
    entries, its arrays in a second fixed-address buffer: a backend can capture such a step
    once per token bucket and replay it. Off: those forwards run eagerly (a ragged pass over
    the new tokens plus paged passes over the history)."""
    static_mixed_token_sizes: tuple = ()
    """Token buckets a static-shape mixed step is padded to (default: powers of two from 16 to
    256, then steps of 256, then ``prefill_chunk_size``); a step of more tokens than the last
    runs eagerly."""
    head_dim_v: int = None  # type: ignore[assignment]   # None in, always an int after init
    """Head dim of values and of the attention output (None: ``head_dim``). Another value than
    head_dim is MLA in expanded form (DeepSeek's 192 / 128); it needs a backend declaring it in
    ``head_dims_v``. A page row is ``max(head_dim, head_dim_v)`` wide (``page_row_dim``). Read
    back it is always an int (None becomes head_dim), so ``dataclasses.replace(config,
    head_dim=...)`` keeps the old value: pass head_dim_v too."""
    batch_invariant: bool = False
    """Batch-invariant attention: every forward is planned as one paged pass per layer over each
    sequence's whole page list (K/V written first, the new tokens a chain token tree; no ragged
    pass, no shared-prefix depth, no merge), so a token's attention output and lse are the
    same bits whatever else runs in its forward, however its prompt was chunked, whether its
    prefix came from the prefix cache, a fork or its own prefill, and whether it arrived in a
    prefill chunk or a decode step. Needs a backend declaring ``batch_invariant`` (and
    ``tree_attention``); not with ``support_sliding_window`` or token trees (refused). Costs
    what reading a shared prefix once per sequence costs. See docs/determinism.md."""
    prefix_cache: bool = False
    """Automatic prefix caching: full pages are indexed by the token ids that produced them
    (``add_sequence(seq_id, tokens=...)`` / ``extend_tokens`` tell the cache the ids), a
    sequence added with its tokens starts from the longest cached prefix, and pages no sequence
    holds stay cached until pages are needed (then evicted least recently used; they count as
    available meanwhile). See docs/prefix-caching.md."""
    kv_dtype: str = "auto"
    """The storage format of the pages, separate from ``dtype`` (q, k, v in and the output
    out): ``"auto"`` (``dtype``; read back it is always the concrete name) or one of
    ``KV_FORMATS`` (``"float8_e4m3"``, ``"int8"``, ``"int4"``), which needs a backend declaring
    it in ``Capabilities.kv_dtypes``. ``get_kv`` returns dequantized values in ``dtype``."""
    kv_quant_group: int = 64
    """Values per scale and bias of the affine formats (``"int8"`` / ``"int4"``), along the
    head dim: one of ``KV_QUANT_GROUPS``, dividing ``head_dim`` and ``head_dim_v``."""
    layer_kinds: Union[Mapping, tuple] = ()
    """The kind of each layer that is not full attention: a mapping ``{layer: Window(w)}`` (or
    pairs ``(layer, Window(w))``); full attention is the default. A ``State(shapes)`` layer is
    a recurrent layer with per-sequence state slots and no pages (``state_groups``;
    capability ``state_slots``; ``get_state`` / ``set_state`` in a forward instead of
    ``attention``; docs/hybrid.md, increment 4). Layers with the same
    ``Window`` form a *window group*: their page arrays have ``window_group_pages`` pages (far
    fewer than ``num_pages``), each sequence keeps only the pages its later queries can see,
    and their attention calls use the window (``window_left`` at most ``w``; -1 means ``w``).
    Read back it is a tuple of ``(layer, kind)`` pairs sorted by layer. Needs a backend
    declaring ``window_groups``. With ``prefix_cache`` the index also holds each cached
    page's window-group pages (docs/hybrid.md), and with ``State`` layers it keeps state
    checkpoints at page boundaries (``state_checkpoint_interval``, ``max_state_checkpoints``),
    so that a hit restores the states at the prefix's end (docs/hybrid.md, increment 6).
    Not yet with ``support_sliding_window``,
    ``static_decode`` / ``static_mixed`` or ``batch_invariant`` (UnsupportedFeatureError); a
    cache with window groups also refuses token trees, ``popn`` below a window, and exports,
    imports, files and the host tier of a sequence (docs/hybrid.md, increment 1)."""
    max_state_slots: int = 0
    """The sequences a cache with ``State`` layers holds at once: each holds one slot of every
    state array (``num_state_slots``; 0, the default: ``max_batch_size``). ``add_sequence`` and
    ``fork_sequence`` raise CacheFullError naming this limit when every slot is taken;
    ``remove_sequence`` gives the slot back. Unused without ``State`` layers."""
    state_checkpoint_interval: int = 1
    """With ``prefix_cache`` and ``State`` layers: a sequence's states are kept (a
    *checkpoint*) at every boundary of this many pages its forwards pass, so that a later
    sequence sharing the prefix up to there restores them instead of recomputing the prefix
    (a prefix hit ends at the deepest boundary with a checkpoint). An int >= 1."""
    max_state_checkpoints: int = 0
    """With ``prefix_cache`` and ``State`` layers: how many checkpoints the cache keeps
    (``num_state_checkpoints``; 0, the default: ``4 * num_state_slots``), the least recently
    used dropped first when a new one needs room. Each holds every state of every state layer
    (``state_bytes`` counts them). Unused otherwise."""

    def __post_init__(self):
        # normalise numpy scalars to Python ints / floats / bools (the dataclass is frozen)
        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
                     "max_batch_size", "prefill_chunk_size"):
            put(name, int_arg(getattr(self, name), f"CacheConfig.{name}", 1, INT32_MAX))
        # bounded above by the int32 page slots it implies (checked below, with the page count)
        put("max_total_tokens", int_arg(self.max_total_tokens, "CacheConfig.max_total_tokens", 1))
        if self.num_qo_heads % self.num_kv_heads:
            raise InvalidArgumentError(
                f"CacheConfig.num_qo_heads={self.num_qo_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise InvalidArgumentError(f"CacheConfig.head_dim={self.head_dim} must be even (RoPE halves)")
        put("prefix_cache", bool_arg(self.prefix_cache, "CacheConfig.prefix_cache"))
        put("head_dim_v", self.head_dim if self.head_dim_v is None else
            int_arg(self.head_dim_v, "CacheConfig.head_dim_v", 1, INT32_MAX))
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidArgumentError(f"CacheConfig.dtype={self.dtype!r} is not one of {DTYPES}")
        kv = self.kv_dtype
        quantized = quantized_names()
        if not isinstance(kv, str) or kv not in ("auto", self.dtype) + quantized:
            raise InvalidArgumentError(
                f"CacheConfig.kv_dtype={kv!r} is not 'auto', dtype={self.dtype!r} or one of "
                f"{quantized}")
        put("kv_dtype", self.dtype if kv == "auto" else kv)
        group = int_arg(self.kv_quant_group, "CacheConfig.kv_quant_group", 1, INT32_MAX)
        if group not in KV_QUANT_GROUPS:
            raise InvalidArgumentError(
                f"CacheConfig.kv_quant_group={group} is not one of {KV_QUANT_GROUPS}")
        put("kv_quant_group", group)
        if self.kv_format.packed and (self.head_dim % group or self.head_dim_v % group):
            raise InvalidArgumentError(
                f"CacheConfig.kv_dtype={self.kv_dtype!r} quantizes groups of kv_quant_group="
                f"{group} values: head_dim={self.head_dim} and head_dim_v={self.head_dim_v} "
                f"must be multiples of it")
        if self.rope_mode is _UNSET:
            warnings.warn("CacheConfig without rope_mode: the cache rotates q and k itself "
                          "('normal'); pass rope_mode='none' if the model applies its own RoPE, "
                          "or rope_mode='normal' to keep this", FutureWarning, stacklevel=3)
            put("rope_mode", "normal")
        if not isinstance(self.rope_mode, str) or self.rope_mode not in ROPE_MODES:
            raise InvalidArgumentError(f"CacheConfig.rope_mode={self.rope_mode!r} is not one of {ROPE_MODES}")
        put("rope_theta", float_arg(self.rope_theta, "CacheConfig.rope_theta", positive=True))
        put("rope_scale", float_arg(self.rope_scale, "CacheConfig.rope_scale"))
        rot = int_arg(self.rope_rotary_dim, "CacheConfig.rope_rotary_dim", 0, self.head_dim)
        if rot % 2:
            raise InvalidArgumentError(
                f"CacheConfig.rope_rotary_dim={rot} must be even (RoPE halves), 0 for every dim")
        put("rope_rotary_dim", rot)
        freqs = self.rope_inv_freq
        if hasattr(freqs, "tolist"):                 # a numpy / torch / mlx array
            freqs = freqs.tolist()
        if not isinstance(freqs, (tuple, list)):
            raise InvalidArgumentError(
                f"CacheConfig.rope_inv_freq must be a sequence of floats, got {type(freqs).__name__}")
        freqs = tuple(float_arg(f, f"CacheConfig.rope_inv_freq[{i}]") for i, f in enumerate(freqs))
        want = (rot or self.head_dim) // 2
        if freqs and len(freqs) != want:
            raise InvalidArgumentError(
                f"CacheConfig.rope_inv_freq has {len(freqs)} values, expected {want} "
                f"(half of {'rope_rotary_dim' if rot else 'head_dim'} {rot or self.head_dim})")
        put("rope_inv_freq", freqs)
        put("support_sliding_window",
            bool_arg(self.support_sliding_window, "CacheConfig.support_sliding_window"))
        put("static_decode", bool_arg(self.static_decode, "CacheConfig.static_decode"))

        put("static_decode_batch_sizes",
            _sizes(self.static_decode_batch_sizes, "static_decode_batch_sizes",
                   self.max_batch_size, "max_batch_size"))
        put("static_mixed", bool_arg(self.static_mixed, "CacheConfig.static_mixed"))
        put("batch_invariant", bool_arg(self.batch_invariant, "CacheConfig.batch_invariant"))
        if self.batch_invariant and self.support_sliding_window:
            raise InvalidArgumentError(
                "CacheConfig.batch_invariant=True with support_sliding_window=True: a sliding "
                "window's forward writes K/V after attention, which the one-pass plan cannot; "
                "leave one of them off")
        if self.static_mixed and not self.static_decode:
            raise InvalidArgumentError(
                "CacheConfig.static_mixed=True needs static_decode=True (its steps are captured "
                "beside the static-shape decode steps)")
        put("static_mixed_token_sizes",
            _sizes(self.static_mixed_token_sizes, "static_mixed_token_sizes",
                   self.prefill_chunk_size, "prefill_chunk_size"))

        put("layer_kinds", _layer_kinds(self.layer_kinds, self.num_layers))
        put("max_state_slots",
            int_arg(self.max_state_slots, "CacheConfig.max_state_slots", 0, INT32_MAX))
        put("state_checkpoint_interval",
            int_arg(self.state_checkpoint_interval, "CacheConfig.state_checkpoint_interval", 1,
                    INT32_MAX))
        put("max_state_checkpoints",
            int_arg(self.max_state_checkpoints, "CacheConfig.max_state_checkpoints", 0,
                    INT32_MAX))
        if self.layer_kinds:
            for name in ("support_sliding_window", "static_decode",
                         "static_mixed", "batch_invariant"):
                if getattr(self, name):
                    raise UnsupportedFeatureError(
                        f"CacheConfig.{name}=True with layer groups (layer_kinds "
                        f"{dict(self.layer_kinds)}): not composed with window groups or state "
                        f"layers yet (docs/hybrid.md); leave one of them out")

        slots = self.num_pages * self.page_size
        if slots > INT32_MAX:
            raise InvalidArgumentError(
                f"CacheConfig.max_total_tokens={self.max_total_tokens} needs {self.num_pages} pages "
                f"of {self.page_size} tokens ({self.kv_bytes} bytes of KV): {slots} token slots, "
                f"but slots are int32 (at most {INT32_MAX})")

    def rope_spec(self):
        """The ``RopeSpec`` the kernels get (theta, scale, the model's frequencies, rotary dims)."""
        from .backend import RopeSpec
        return RopeSpec(self.rope_theta, self.rope_scale, self.rope_inv_freq or None,
                        self.rope_rotary_dim if self.rope_rotary_dim != self.head_dim else 0)

    @property
    def static_buckets(self) -> tuple:
        """The batch sizes a static-shape decode batch is padded to; the last one is the
        largest batch a static-shape decode step takes (larger ones run eagerly)."""
        if self.static_decode_batch_sizes:
            return self.static_decode_batch_sizes
        sizes, b = [], 1
        while b < self.max_batch_size:
            sizes.append(b)
            b *= 2
        return tuple(sizes) + (self.max_batch_size,)

    def static_bucket(self, batch: int) -> int:
        """The bucket a static-shape decode batch of ``batch`` sequences is padded to."""
        for size in self.static_buckets:
            if batch <= size:
                return size
        raise InvalidArgumentError(
            f"a static-shape decode batch of {batch} sequences exceeds the largest bucket "
            f"{self.static_buckets[-1]} (static_decode_batch_sizes={self.static_buckets})")

    @property
    def static_mixed_buckets(self) -> tuple:
        """The token counts a static-shape mixed step is padded to; the last one is the most
        tokens such a step takes (larger ones run eagerly)."""
        if self.static_mixed_token_sizes:
            return self.static_mixed_token_sizes
        # padded rows cost the model's GEMMs as real ones: powers of two up to 256, then steps
        # of 256 (at most a tenth padded past 2,560 tokens)
        sizes, t = [], 16
        while t < self.prefill_chunk_size:
            sizes.append(t)
            t = 2 * t if t < 256 else t + 256
        return tuple(sizes) + (self.prefill_chunk_size,)

    def static_mixed_bucket(self, tokens: int) -> Optional[int]:
        """The bucket a static-shape mixed step of ``tokens`` new tokens is padded to (None:
        more than the largest bucket)."""
        for size in self.static_mixed_buckets:
            if tokens <= size:
                return size
        return None

    @property
    def kv_format(self) -> KVFormat:
        """The storage format ``kv_dtype`` names (``kvcache.formats.FORMAT_TABLE``): what the
        pages hold (``scaled``, ``packed``, ``quantized``, ``row_bytes``)."""
        return kv_format(self.kv_dtype)

    @property
    def kv_quantized(self) -> bool:
        """Whether the pages hold a quantized format (``kv_format.quantized``: ``kv_dtype`` in
        ``KV_FORMATS``)."""
        return self.kv_format.quantized

    @property
    def page_row_dim(self) -> int:
        """Width of one page row: ``max(head_dim, head_dim_v)`` (K and V share the row shape)."""
        return max(self.head_dim, self.head_dim_v)

    @property
    def token_kv_bytes(self) -> int:
        """Bytes one token's K and V take over every layer, in the storage format (with the
        affine formats' scales and biases; fp8's per-head scales are outside the pages)."""
        row_bytes = self.kv_format.row_bytes(self.page_row_dim, self.dtype, self.kv_quant_group)
        return self.num_layers * 2 * self.num_kv_heads * row_bytes

    @property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_qo_heads // self.num_kv_heads

    @property
    def num_pages(self) -> int:
        """Pages per layer: capacity plus one spare, and with sliding window one spare page per
        sequence of a batch (a window's forward takes its new pages before its slide frees any)."""
        pages = -(-self.max_total_tokens // self.page_size) + 1
        if self.support_sliding_window:
            pages += self.max_batch_size
        return pages

    @property
    def kv_bytes(self) -> int:
        """Bytes of the page arrays: ``num_pages`` pages of (2, num_kv_heads, page_size,
        page_row_dim) per full-attention layer and ``window_group_pages(g)`` per layer of
        window group ``g``, in the storage format (``token_kv_bytes``)."""
        if not self.layer_kinds:
            return self.num_pages * self.page_size * self.token_kv_bytes
        pages = sum(self.layer_pages(layer) for layer in range(self.num_layers))
        return pages * self.page_size * (self.token_kv_bytes // self.num_layers)

    @property
    def state_groups(self) -> tuple:
        """The state groups: ``(State, layers)`` pairs of the ``State`` layers of
        ``layer_kinds``, the layers a sorted tuple, groups in the order of their first layer
        (empty: no state layers)."""
        groups: dict = {}
        for layer, kind in self.layer_kinds:
            if isinstance(kind, State):
                groups.setdefault(kind, []).append(layer)
        return tuple((kind, tuple(layers)) for kind, layers in groups.items())

    @property
    def state_layers(self) -> dict:
        """``{layer: State}`` of the state layers (a new dict; empty without them)."""
        return {layer: kind for layer, kind in self.layer_kinds if isinstance(kind, State)}

    @property
    def num_state_slots(self) -> int:
        """State slots of a cache with ``State`` layers: ``max_state_slots``, or
        ``max_batch_size`` when that is 0; 0 without state layers."""
        if not self.state_layers:
            return 0
        return self.max_state_slots or self.max_batch_size

    @property
    def num_state_checkpoints(self) -> int:
        """State checkpoints a cache keeps with ``prefix_cache`` and ``State`` layers:
        ``max_state_checkpoints``, or ``4 * num_state_slots`` when that is 0; 0 otherwise."""
        if not (self.prefix_cache and self.state_layers):
            return 0
        return self.max_state_checkpoints or 4 * self.num_state_slots

    @property
    def state_bytes(self) -> int:
        """Bytes of the state arrays: ``num_state_slots`` slots and ``num_state_checkpoints``
        checkpoints of every state layer's arrays (``State.shapes``) in ``dtype``; 0 without
        state layers. The pages (``kv_bytes``) are separate: state layers have none."""
        per_slot = sum(kind.elements() * itemsize(kind.storage(self.dtype))
                       for kind in self.state_layers.values())
        return (self.num_state_slots + self.num_state_checkpoints) * per_slot

    @property
    def window_groups(self) -> tuple:
        """The window groups: ``(Window, layers)`` pairs, the layers a sorted tuple, groups in
        the order of their smallest window (empty: every layer is full attention)."""
        groups: dict = {}
        for layer, kind in self.layer_kinds:
            if isinstance(kind, Window):
                groups.setdefault(kind, []).append(layer)
        return tuple((kind, tuple(layers)) for kind, layers in
                     sorted(groups.items(), key=lambda item: item[0].size))

    @property
    def full_layers(self) -> tuple:
        """The full-attention layers (every layer without a ``layer_kinds`` entry: neither a
        window nor a state layer)."""
        windowed = {layer for layer, _ in self.layer_kinds}
        return tuple(layer for layer in range(self.num_layers) if layer not in windowed)

    def layer_group(self, layer: int) -> int:
        """The index in ``window_groups`` of ``layer``'s group; -1 for a full-attention layer."""
        for g, (_, layers) in enumerate(self.window_groups):
            if layer in layers:
                return g
        return -1

    def window_group_pages(self, g: int) -> int:
        """Pages per layer of window group ``g`` (``window_groups[g]``, window ``w``): enough
        for ``max_batch_size`` sequences to run one forward, at most ``num_pages``:
        ``max_batch_size * (ceil(w / page_size) + 2) + ceil(prefill_chunk_size / page_size)``.

        Why: between forwards a sequence of length ``L`` keeps the pages from the one holding
        position ``max(0, L - w)`` on, at most ``ceil(w / page_size) + 1`` pages; a forward
        appending ``c`` tokens to it holds at most ``ceil((w + c) / page_size) + 1`` until it
        ends, and a forward's appends add up to at most ``prefill_chunk_size``. A cache that
        holds more sequences than ``max_batch_size`` may run out of a group's pages before the
        full pool (``CacheFullError`` names the group; the page queries answer per group).
        Capped at ``num_pages``: a group never needs more pages than the full pool."""
        w = self.window_groups[g][0].size
        ps = self.page_size
        per_sequence = -(-w // ps) + 2
        return min(self.num_pages,
                   self.max_batch_size * per_sequence + -(-self.prefill_chunk_size // ps))

    def layer_pages(self, layer: int) -> int:
        """Pages of ``layer``'s page array: ``num_pages``, or its window group's pages; 0 for
        a state layer (it has no page array)."""
        if layer in self.state_layers:
            return 0
        g = self.layer_group(layer)
        return self.num_pages if g < 0 else self.window_group_pages(g)

    @property
    def effective_rope_mode(self) -> str:
        """Sliding windows re-position kept tokens, so RoPE must be applied inside attention."""
        if self.support_sliding_window and self.rope_mode == "normal":
            return "inline"
        return self.rope_mode


def _layer_kinds(value, num_layers: int) -> tuple:
    """``CacheConfig.layer_kinds`` as a tuple of ``(layer, kind)`` pairs sorted by layer,
    from a mapping or pairs; InvalidArgumentError naming the layer, the value and the limit."""
    name = "CacheConfig.layer_kinds"
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (tuple, list)):
        pairs = list(value)
        for item in pairs:
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise InvalidArgumentError(
                    f"{name} must be a mapping {{layer: kvcache.Window(w)}} or (layer, Window) "
                    f"pairs, got the item {item!r}")
    else:
        raise InvalidArgumentError(
            f"{name} must be a mapping {{layer: kvcache.Window(w)}}, got {type(value).__name__}")
    out: dict = {}
    for layer, kind in pairs:
        layer = int_arg(layer, f"{name}: layer", 0, num_layers - 1,
                        limit=f"num_layers={num_layers}")
        if not isinstance(kind, (Window, State)):
            raise InvalidArgumentError(
                f"{name}[{layer}]={kind!r} is not a kvcache.Window or kvcache.State (full "
                f"attention is the default: leave layer {layer} out)")
        if layer in out:
            raise InvalidArgumentError(f"{name} gives layer {layer} twice")
        out[layer] = kind
    return tuple(sorted(out.items()))


def _sizes(value, field: str, top: int, top_name: str) -> tuple:
    """A bucket list field: a strictly increasing tuple of ints in ``[1, top]``."""
    name = f"CacheConfig.{field}"
    if not isinstance(value, (tuple, list)):
        raise InvalidArgumentError(f"{name} must be a tuple of ints, got {value!r}")
    sizes = tuple(int_values(value, name, 1, top, limit=top_name))
    if list(sizes) != sorted(set(sizes)):
        raise InvalidArgumentError(
            f"{name}={sizes!r} must be a strictly increasing tuple "
            f"of ints in [1, {top_name}={top}]")
    return sizes
