"""The contract between the core and a backend.

The core owns sequences, blocks and pages and builds every index array on the host. A backend
owns memory, streams and kernels, and knows nothing about sequences: each kernel below receives
page arrays and int32 index arrays (already on the backend's device) and is specified by its
docstring plus the reference implementation in ``kvcache.reference``.

Shared conventions
------------------
* ``pages``: one array per layer, of the shape ``Backend.page_shape`` declares (by default
  ``(num_pages, 2, num_kv_heads, page_size, head_dim)``, ``[:, 0]`` K and ``[:, 1]`` V) in the
  config's ``kv_dtype``.  A *slot* is ``page * page_size + offset``.
* New tokens of a forward are packed: ``q`` is ``(T, num_qo_heads, D)``, ``k``/``v`` are
  ``(T, num_kv_heads, D)``; tokens of entry ``i`` are rows ``qo_indptr[i]:qo_indptr[i+1]``.
* Grouped-query attention: query head ``h`` reads KV head ``h // (num_qo_heads // num_kv_heads)``.
* Attention kernels return ``(o, lse)``: ``o`` ``(T, num_qo_heads, Dv)`` in the cache dtype and
  ``lse`` ``(T, num_qo_heads)`` float32, natural log of the softmax denominator (with the
  ``sm_scale`` already applied to the logits).  A row that sees no key has ``o = 0`` and
  ``lse = -inf`` (``lse = sinks[h]`` when ``sinks`` are given).
* Value head dim (``Dv = config.head_dim_v``, capability ``head_dims_v``): values and outputs may
  have another head dim than queries and keys (MLA in expanded form, 192 / 128).  ``v`` is
  ``(T, num_kv_heads, Dv)``; a page row is ``max(D, Dv)`` wide, K in its first ``D`` entries
  and V in its first ``Dv`` (``Dv == D``: the plain layout).
* Quantized pages (``config.kv_dtype`` one of ``kvcache.config.KV_FORMATS``, capability
  ``kv_dtypes``): the kernels store and read the format as ``kvcache.kv_quant`` defines it.
  Every kernel reads K/V as stored, a forward's own new rows too (``ragged_attention`` rounds
  them through the format), so a result does not depend on how the tokens were chunked.
  One store/load contract for every format: ``append_kv`` stores values (the compute dtype)
  as the format encodes them and ``gather_kv`` loads them back decoded, in the cache dtype.
  The optional scale: with a scaled format (``KVFormat.scaled``, fp8) the core passes
  ``kv_scale`` to ``append_kv``, ``rope_append``, ``ragged_attention`` and
  ``paged_attention`` (the layer's ``(2, Hkv)`` float32 array: K's scales, then V's) and to
  ``gather_kv`` (a list of them, one per page array); never for other formats. With a packed
  format (``KVFormat.packed``: int8 / int4) the rows also move as stored: ``packed=True`` on
  ``gather_kv``, ``append_kv`` and ``append_kv_layers`` reads or writes the uint8 rows of
  ``kvcache.kv_quant.affine_pack`` unchanged (export, import and the host tier, so a sequence
  comes back with its codes); the core passes it for packed formats only.
* Logit soft-capping (``logit_softcap``, capability ``logit_softcap``): ``c > 0`` turns each
  score ``s = q . k * sm_scale`` into ``c * tanh(s / c)`` before the softmax (and the lse);
  ``0``: off.
* Attention sinks (``sinks``, capability ``attention_sinks``): a ``(num_qo_heads,)`` float array
  of logits, one per query head, that join every row's softmax denominator and carry no value:
  ``o = sum_j e^{s_j} v_j / (e^{sinks[h]} + sum_j e^{s_j})`` and ``lse`` includes the sink.  The
  core passes ``sinks`` to exactly one of a layer's attention calls (the partial results merge
  by lse, so the sink counts once).
* Per-query window (``window_left``, capability ``window_left``): -1 sees every key; ``w >= 0``
  hides from a query at position ``p`` every key at a position below ``p - w``.  Positions are
  the cache's RoPE positions: ``q_positions`` for queries, ``k_rope_offset[i] + j`` for key ``j``
  of a paged entry, and in the ragged pass key row ``c`` of a sequence sits ``r - c`` positions
  before query row ``r``.  (Under sliding-window eviction these are the cache's positions: the
  sinks keep theirs and the kept window follows them, so distances within the window are the
  original ones.)
* RoPE (``RopeSpec``): rotate-half over the first ``R = rope.rotary(D)`` dims (``D`` unless a
  partial ``rotary_dim``); for position ``p`` and ``i < R/2``,
  ``angle_i = p * scale * inv_freq_i`` with ``inv_freq_i = theta ** (-2i / R)`` unless the spec
  carries the model's own ``inv_freq`` (``rope.frequencies(D)`` gives ``scale * inv_freq``);
  ``out[:R/2] = x1*cos - x2*sin``, ``out[R/2:R] = x2*cos + x1*sin``, ``out[R:] = x[R:]``.
  Kernels compute in float32 (or wider) and round once.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional, Sequence

import numpy as np

from .errors import UnsupportedFeatureError


def _cap(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do. Defaults are conservative; each field's doc sentence is the reason a
    conformance test is skipped when the backend lacks it."""

    dtypes: tuple = _cap(("float32",), "Compute dtypes of q, k, v and the attention output.")
    kv_dtypes: tuple = _cap((), "Storage formats of the KV pages (default: the compute dtypes).")
    copy_stream: bool = _cap(False, "Moves aux arrays to the device on a separate copy stream.")
    merged_aux: bool = _cap(False, "Packs all aux arrays into one pinned host buffer and copies "
                                   "them in one transfer.")
    static_decode: bool = _cap(False, "Static-shape decode (CacheConfig(static_decode=True)): decode "
                                      "reads fixed-address index arrays with launch shapes set by "
                                      "the batch bucket alone, so it can be captured and replayed.")
    tree_attention: bool = _cap(False, "Token-tree (speculative decoding) attention masks and "
                                       "commit compaction.")
    sliding_window: bool = _cap(False, "Sliding-window attention with attention sinks.")
    fused_rope_append: bool = _cap(False, "Rotates q/k and writes K/V into pages in one kernel launch.")
    inline_rope: bool = _cap(False, "Applies RoPE to cached K inside attention (rope_mode 'inline').")
    rope_frequencies: bool = _cap(False, "RoPE with the model's own inverse frequencies "
                                         "(rope_inv_freq) and partial rotary (rope_rotary_dim).")
    window_left: bool = _cap(False, "Per-query sliding-window attention (window_left: a query at "
                                    "position p sees only keys at positions p-window_left..p).")
    head_dims: tuple = _cap((64, 128, 256), "Head dimensions the kernels support.")
    head_dims_v: tuple = _cap((), "Value head dimensions (CacheConfig.head_dim_v) the kernels "
                                  "support where they differ from head_dim (MLA in expanded form).")
    logit_softcap: bool = _cap(False, "Logit soft-capping: scores become cap * tanh(score / cap) "
                                      "before the softmax (attention(..., logit_softcap=cap)).")
    attention_sinks: bool = _cap(False, "Learned attention sinks: one logit per query head joins "
                                        "the softmax denominator with no value "
                                        "(attention(..., sinks=...)).")
    batch_invariant: bool = _cap(False, "Batch-invariant attention (CacheConfig(batch_invariant="
                                        "True)): a token's output and lse depend only on its own "
                                        "sequence's keys and values, bit for bit: not on the "
                                        "batch around it, how its prompt was chunked, or which "
                                        "pages it shares.")
    window_groups: bool = _cap(False, "Window groups (CacheConfig(layer_kinds={layer: "
                                      "Window(w)})): a windowed layer's pages are a pool of "
                                      "its own, and its attention reads one entry per sequence "
                                      "whose keys start at the first live page (k_rope_offset "
                                      "its first position) with window_left; needs "
                                      "window_left.")
    state_slots: bool = _cap(False, "State slots (CacheConfig(layer_kinds={layer: State(shapes)})): "
                                    "per-sequence recurrent states in arrays of (slots, *shape) "
                                    "in the cache dtype, moved by slot index "
                                    "(allocate_state, gather_state, scatter_state).")

    def __post_init__(self):
        if not self.kv_dtypes:      # pages stored as computed, the only format today
            object.__setattr__(self, "kv_dtypes", tuple(self.dtypes))

    def describe(self) -> dict:
        """{field name: value} of every capability (for ``kvcache info``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def reason(cls, name: str) -> str:
        """'name: doc sentence', the skip reason for a missing capability."""
        doc = {f.name: f.metadata["doc"] for f in fields(cls)}[name]
        return f"capability {name!r} not declared ({doc})"


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters handed to kernels.

    ``theta``: the base of the default frequencies ``theta ** (-2i / R)``; ``scale``: multiplies
    every position before the rotation (``angle_i = p * scale * inv_freq_i``; linear position
    interpolation by a factor f is ``scale = 1/f``); ``inv_freq``: the model's own inverse
    frequencies, ``R/2`` floats (they replace theta's and already hold any scaling the model
    applies: linear, llama3, YaRN; keep ``scale = 1`` then); ``rotary_dim``: ``R``, the leading
    dims that rotate (0: all of them; partial rotary leaves ``x[R:]`` as is)."""

    theta: float = 10000.0
    scale: float = 1.0
    inv_freq: Optional[tuple] = None
    rotary_dim: int = 0

    def rotary(self, head_dim: int) -> int:
        """R: the number of leading dims of a ``head_dim``-wide head that rotate."""
        return self.rotary_dim or head_dim

    @property
    def default_frequencies(self) -> bool:
        """Whether this is plain theta RoPE over every dim (the kernels' fast path)."""
        return self.inv_freq is None and self.rotary_dim == 0

    def frequencies(self, head_dim: int):
        """``scale * inv_freq`` as float64 numpy (R/2,) for heads of ``head_dim`` dims: the
        angle per unit position."""
        import numpy as np
        rot = self.rotary(head_dim)
        if self.inv_freq is not None:
            inv = np.asarray(self.inv_freq, dtype=np.float64)
        else:
            inv = self.theta ** (-2.0 * np.arange(rot // 2, dtype=np.float64) / rot)
        return self.scale * inv


@dataclass
class TreeMask:
    """Token-tree visibility for the last ``tree_len`` keys of each entry.

    ``indptr`` (n+1,) int32: entry ``i`` owns tree nodes ``indptr[i]:indptr[i+1]``; its tree size
    is ``indptr[i+1] - indptr[i]`` (0: no tree, every key visible).
    ``mask`` (2 * indptr[-1],) int32: for each node, ``(order, upper)`` of a depth-first walk; key
    node ``m`` is visible to query node ``n`` iff ``order[m] <= order[n] < upper[m]``
    (m is n or an ancestor of n).
    The entry's queries are its *last* tree nodes: query row ``r`` of an entry with ``nq`` queries
    and tree size ``t`` is node ``t - nq + r``. A node's ancestors come before it (a parent's
    index is smaller than its child's), so no query sees a tree key after its own node.
    ``chains``: every entry's tree is a chain (node ``m``'s parent is ``m - 1``: causal
    attention among the tree keys); a hint a kernel may use to leave the keys every query of
    a tile sees unmasked. The mask holds the same visibility either way.
    """

    indptr: Any
    mask: Any
    chains: bool = False


@dataclass(frozen=True)
class DepthAux:
    """Index arrays of one block depth, on the backend's device (int32).

    ``n`` entries; entry ``i`` reads the queries ``q[qo_indptr[i]:qo_indptr[i+1]]`` and the keys
    in pages ``page_indices[page_indptr[i]:page_indptr[i+1]]``.
    Keys are numbered ``j = 0 .. kv_len[i]-1``; key ``j`` lives at in-entry offset
    ``off = j if j < sink_size[i] else j - sink_size[i] + window_offset[i]`` (a sliding window
    keeps its sinks at the front and its window after a gap), i.e. in page
    ``page_indices[page_indptr[i] + off // page_size]`` at row ``off % page_size``.
    ``last_page_len[i]`` is the used rows of the entry's last page (FlashInfer convention).
    Inline RoPE rotates key ``j`` at position ``k_rope_offset[i] + j``.
    Attention over a depth is *not* causal: every key of the entry is visible to every query of
    the entry, except the tree part (``tree``) when given.
    ``use_decode``: every entry has exactly one query (a decode kernel may be used).
    """

    qo_indptr: Any
    """(n+1,): entry ``i``'s queries are rows ``qo_indptr[i]:qo_indptr[i+1]`` of ``q``."""
    page_indptr: Any
    """(n+1,): entry ``i``'s pages are ``page_indices[page_indptr[i]:page_indptr[i+1]]``."""
    page_indices: Any
    """(num_pages,) or longer: page ids, entry after entry, in key order."""
    last_page_len: Any
    """(n,): rows used in each entry's last page (FlashInfer's convention)."""
    kv_len: Any
    """(n,): keys of each entry (sinks plus window for a sliding entry)."""
    sink_size: Any
    """(n,): keys at the front of each entry that a sliding window keeps (0: none)."""
    window_offset: Any
    """(n,): in-entry offset of the first window key after the sinks (0: no gap)."""
    k_rope_offset: Any
    """(n,): RoPE position of each entry's key 0 (inline RoPE rotates key ``j`` at
    ``k_rope_offset[i] + j``)."""
    num_entries: int
    """``n``, the entries (host int)."""
    use_decode: bool
    """Every entry has exactly one query (host bool)."""
    tree: Optional[TreeMask] = None
    """Token-tree visibility of the entries' last keys (None: every key visible)."""
    max_kv_len: int = 0
    """Host-side maximum of kv_len (for launch sizing; static-shape decode uses a bound instead)."""
    max_qo_len: int = 0
    """Host-side maximum number of queries of one entry (for launch sizing)."""
    num_pages: int = 0
    """Pages in use in ``page_indices`` (a static-shape plan's list may be longer)."""
    shared: bool = False
    """Entries group the queries of several sequences over blocks they share (a coalesced
    depth): few entries, each with many queries over the same keys, so a kernel may split an
    entry's keys over programs and merge them (host bool; a hint, results are the same)."""
    covers_rows: bool = False
    """The entries' queries are every row of ``q`` (``qo_indptr[0] == 0`` and
    ``qo_indptr[n] == T``; host bool): a kernel that writes each entry's rows leaves no row
    to fill with o = 0 / lse = -inf. False: unknown (a static-shape plan's padding rows), fill."""
    uniform: bool = False
    """Every entry has ``max_qo_len`` queries and ``max_kv_len`` keys, with no sinks or window
    gap (host bool): a kernel may view the entries as one (n, len, ...) batch, no padding.
    False: unknown."""


class Backend(abc.ABC):
    """One device family. Subclasses set ``name``, ``priority`` and ``capabilities`` and implement
    the abstract methods. Public cache methods validate; backends may assume valid input."""

    name: ClassVar[str] = "abstract"
    """The registered name (``PagedKVCache(config, backend=name)``, ``kvcache info``)."""
    priority: ClassVar[int] = 0
    """Rank among available backends for ``backend="auto"``: the highest available one wins."""
    capabilities: ClassVar[Capabilities] = Capabilities()
    """What the backend can do: ``PagedKVCache`` refuses a config it cannot run, and the
    conformance suite skips the tests of what it lacks."""
    description: ClassVar[str] = ""
    """A line for ``kvcache info`` (the hardware and kernels it runs)."""
    benchmarks: ClassVar[Optional[str]] = None
    """``"module:function"`` of the backend's kernel benchmarks (``kvcache bench --backend
    NAME``), called as ``function(argv, backend_cls=cls)`` and returning an exit status; None:
    it ships none. Named, not imported, so that the backend's module does not import its
    benchmarks (which import it)."""

    # ------------------------------------------------------------------ discovery
    @classmethod
    @abc.abstractmethod
    def availability(cls, device: Optional[str] = None) -> tuple[bool, str]:
        """(True, what will run) or (False, why not); never a bare False. ``device``: a device
        name of this backend (None: its default device)."""

    @classmethod
    def devices(cls) -> list[str]:
        """Device names this backend can run on here (for ``kvcache info``)."""
        return []

    @classmethod
    def run_benchmarks(cls, argv: Optional[Sequence[str]] = None) -> int:
        """Run the kernel benchmarks ``benchmarks`` names with ``argv`` (its own options);
        UnsupportedFeatureError where the backend ships none."""
        if cls.benchmarks is None:
            from .errors import UnsupportedFeatureError
            raise UnsupportedFeatureError(f"backend {cls.name!r} ships no kernel benchmarks")
        import importlib
        module, _, function = cls.benchmarks.partition(":")
        return int(getattr(importlib.import_module(module), function)(
            list(argv or []), backend_cls=cls) or 0)

    @classmethod
    def platform(cls) -> dict:
        """Vendor / runtime facts for ``kvcache info`` (e.g. {'vendor': 'nvidia', 'runtime': 'cuda'})."""
        return {}

    def __init__(self, config, device: Optional[str] = None):
        self.config = config
        self.device = device

    # ------------------------------------------------------------------ memory
    def memory_capacity(self) -> Optional[int]:
        """Bytes the device can hold: ``PagedKVCache`` refuses (``CacheFullError``) page arrays
        larger than this before allocating. None: no bound. Default: the host's physical
        memory (right for host backends and unified-memory devices)."""
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            return None

    def page_shape(self, num_pages: int) -> tuple:
        """The page layout: shape of one layer's page array of ``num_pages`` pages,
        ``(num_pages, 2, num_kv_heads, page_size, max(head_dim, head_dim_v))`` with ``[:, 0]`` K
        (its first head_dim entries) and ``[:, 1]`` V (its first head_dim_v entries).
        A backend that stores pages otherwise overrides this and its kernels together; nothing
        outside the backend indexes a page array."""
        c = self.config
        return (num_pages, 2, c.num_kv_heads, c.page_size, c.page_row_dim)

    @abc.abstractmethod
    def allocate_pages(self, num_pages: int) -> list:
        """Zeroed page arrays, one per layer, of shape ``page_shape(num_pages)`` in the config's
        ``kv_dtype``."""

    def allocate_group_pages(self, num_pages: int, num_layers: int) -> list:
        """``num_layers`` zeroed page arrays of shape ``page_shape(num_pages)`` in the
        config's ``kv_dtype``: the pages of one layer group (``CacheConfig.layer_kinds``: the
        full-attention layers get ``num_pages``, each window group its own, smaller pool).
        Default: ``allocate_pages`` with the config's ``num_layers`` set to ``num_layers`` for
        the call; a backend whose ``allocate_pages`` reads more than ``page_shape`` and the
        layer count from its config overrides this."""
        import dataclasses
        config = self.config
        self.config = dataclasses.replace(config, num_layers=num_layers, layer_kinds=())
        try:
            return self.allocate_pages(num_pages)
        finally:
            self.config = config

    @abc.abstractmethod
    def from_numpy(self, array, dtype: Optional[str] = None):
        """A native array on the device with the given dtype name (None: keep int32 / use cache dtype
        for floats)."""

    @abc.abstractmethod
    def to_numpy(self, array):
        """A host numpy copy of a native array (float arrays as float32, bf16 widened)."""

    @abc.abstractmethod
    def is_native(self, array) -> bool:
        """Whether ``array`` is this backend's array type (for input validation)."""

    @abc.abstractmethod
    def dtype_name(self, array) -> str:
        """'float16' | 'bfloat16' | 'float32' | 'int32' | ... for a native array."""

    # ------------------------------------------------------------------ host tier
    def host_copy(self, array) -> tuple:
        """``(host, event)``: a host numpy copy of native ``array`` with its bits as stored
        (bfloat16 as ml_dtypes' type, never widened), in memory the device copies at full speed
        (pinned, on a GPU), copied asynchronously: wait for ``event``
        (``event_synchronize``) before reading it. The host tier parks sequences this way.
        Default: a plain synchronous copy (``event`` None)."""
        from .arrays import to_host
        return to_host(array, self.dtype_name(array)), None

    def from_host(self, host):
        """A native array holding ``host``'s bits (a ``host_copy``), uploaded asynchronously
        where the memory allows (the host array must stay unchanged until the device has read
        it: until a later ``synchronize`` or a read of something computed from the result).
        Default: ``from_numpy`` in the host array's dtype."""
        return self.from_numpy(host, host.dtype.name)

    def checksum(self, array):
        """A native int64 array of two values that change when any bit of ``array`` does: the
        sum of its bytes as little-endian int64 words, and the sum of its 64-word rows' sums
        times their index + 1 (both modulo 2**64; an array whose size is not a multiple of 8
        bytes is zero-padded). Computed where the array lives (the host tier checks a parked
        sequence with it at device speed); read it with ``kvcache.to_numpy``. Default: computed
        on the host (``checksum_words``), a numpy array."""
        from .arrays import to_host
        bits = to_host(array, self.dtype_name(array))       # a contiguous copy, as stored
        return checksum_words(bits.reshape(-1).view(np.uint8))

    # ------------------------------------------------------------------ streams
    def create_stream(self):
        """A new stream (the copy stream); backends without streams return None."""
        return None

    def current_stream(self):
        """The stream kernels are launched on now."""
        return None

    def synchronize(self) -> None:
        """Wait on the host for all queued device work."""

    # ------------------------------------------------------------------ aux transfer
    def aux_to_device(self, host_array):
        """Plain path: a device copy of ``host_array``, one host int32 numpy array."""
        return self.from_numpy(host_array)

    def aux_alloc_host(self, num_int32: int):
        """Merged path: (handle, numpy int32 view) of a host staging buffer of ``num_int32``
        elements (pinned where it matters)."""
        raise NotImplementedError

    def aux_alloc_device(self, num_int32: int):
        """Merged path: a device int32 buffer of ``num_int32`` elements."""
        raise NotImplementedError

    def aux_copy_async(self, device_buffer, host_handle, num_int32: int, stream):
        """Merged path: copy the first ``num_int32`` elements of the staging buffer
        ``host_handle`` (from ``aux_alloc_host``) into ``device_buffer`` (from
        ``aux_alloc_device``) on ``stream``; return an event recorded after the copy (``None``
        where copies are synchronous)."""
        raise NotImplementedError

    def aux_view(self, device_buffer, offset: int, length: int):
        """Merged path: a view of ``length`` int32 of ``device_buffer`` from ``offset`` on (no
        copy)."""
        raise NotImplementedError

    def event_synchronize(self, event) -> None:
        """Host waits until ``event`` has completed (guards reuse of a staging buffer)."""

    def stream_wait_event(self, event, stream=None) -> None:
        """``stream`` (default: current) waits on ``event`` on the device."""

    def record_event(self, stream=None):
        """An event recorded on ``stream`` (default current); None where there are no streams."""
        return None

    # ------------------------------------------------------------------ kernels
    @abc.abstractmethod
    def rope(self, x, positions, rope: RopeSpec):
        """``x`` (T, H, D) rotated at ``positions`` (T,) int32 as ``rope`` specifies (see the
        module docstring); returns a new array, cache dtype."""

    @abc.abstractmethod
    def append_kv(self, pages, k, v, slots, positions=None, rope: Optional[RopeSpec] = None, *,
                  kv_scale=None, packed: bool = False) -> None:
        """Write ``k[t]`` (T, Hkv, D) / ``v[t]`` (T, Hkv, Dv) into ``pages`` at ``slots[t]`` (-1: skip the token).
        With ``rope``, K is rotated at ``positions[t]`` before it is stored (fused RoPE).
        ``kv_scale``: a scaled format's (2, Hkv) float32 scales of the layer (see the module
        docstring). ``packed`` (packed formats only, no ``rope``): ``k`` / ``v`` are rows as
        stored, uint8 ``(T, Hkv, affine_row_bytes(D))`` (v: of ``Dv``), written unchanged, so
        that reading them back gives their codes, scales and biases. A backend that stores a
        packed format implements it (``UnsupportedFeatureError`` where it cannot)."""

    def append_kv_layers(self, pages_per_layer: Sequence, k, v, slots, *,
                         packed: bool = False) -> None:
        """Write ``k[l]`` / ``v[l]`` into ``pages_per_layer[l]`` at ``slots`` (an int32 device
        array (T,); -1: skip the token) for every layer ``l``: ``k`` (L, T, Hkv, D) and ``v``
        (L, T, Hkv, Dv) native arrays, ``len(pages_per_layer) == L``; no RoPE, no scales: the
        rows of a plain format in its dtype, or with ``packed`` a packed format's stored rows
        (``append_kv``). A transfer's import writes all its layers with one call; this default
        calls ``append_kv`` once per layer, and a backend may override it with one launch for
        all of them."""
        for i, pages in enumerate(pages_per_layer):
            if packed:
                self.append_kv(pages, k[i], v[i], slots, packed=True)
            else:                      # backends without packed formats never see the keyword
                self.append_kv(pages, k[i], v[i], slots)

    def rope_append(self, pages, q, k, v, slots, positions, rope: RopeSpec, **quant):
        """Rotate ``q`` (T, Hq, D) and ``k`` (T, Hkv, D) at ``positions`` (T,) as ``rope``
        specifies, store rotated K and ``v`` (T, Hkv, Dv) in ``pages`` (one layer's page array)
        at ``slots`` (T,) (-1: skip the token); return (q_rot, k_rot). Backends with
        ``fused_rope_append`` do this in one launch; this default uses two kernels."""
        q_rot = self.rope(q, positions, rope)
        k_rot = self.rope(k, positions, rope)
        self.append_kv(pages, k_rot, v, slots, **quant)
        return q_rot, k_rot

    @abc.abstractmethod
    def ragged_attention(self, q, k, v, qo_indptr, sm_scale: float, *, num_seqs: int,
                         max_len: int, tree: Optional[TreeMask] = None,
                         rope: Optional[RopeSpec] = None, q_positions=None, k_rope_offset=None,
                         window_left: int = -1, logit_softcap: float = 0.0, sinks=None,
                         kv_scale=None):
        """Causal self-attention among each sequence's new tokens (rows ``qo_indptr[i]:qo_indptr[i+1]``
        of q, k, v): row ``r`` sees rows ``0..r`` of its sequence; with ``tree`` (tree size equal to
        the append length) row ``r`` sees only its tree ancestors and itself. With ``rope`` (inline
        mode) q row is rotated at ``q_positions`` and key row ``r`` at ``k_rope_offset[i] + r``.
        ``window_left`` >= 0 (never with ``tree``): row ``r`` also sees no row below
        ``r - window_left``. ``logit_softcap`` and ``sinks``: see the module docstring (never
        passed by the core unless the capability is declared). ``sm_scale`` multiplies every
        logit; ``num_seqs`` is the number of sequences (``qo_indptr`` has ``num_seqs + 1``
        entries) and ``max_len`` the most new rows of one sequence (host ints, for launch
        sizing). ``q`` (T, Hq, D), ``k`` (T, Hkv, D), ``v``
        (T, Hkv, Dv). Returns (o, lse): (T, Hq, Dv) in the cache dtype and (T, Hq) float32."""

    @abc.abstractmethod
    def paged_attention(self, q, pages, depth: DepthAux, sm_scale: float, *,
                        rope: Optional[RopeSpec] = None, q_positions=None, window_left: int = -1,
                        logit_softcap: float = 0.0, sinks=None, kv_scale=None):
        """Attention of each entry's queries (rows of ``q``, (T, Hq, D)) over that entry's keys in
        ``pages`` (one layer's page array), as the index arrays of ``depth`` (one block depth,
        see ``DepthAux``) lay them out, each logit scaled by ``sm_scale``; with ``rope`` (inline
        mode) q row ``t`` is rotated at ``q_positions[t]`` and key ``j`` of entry ``i`` at
        ``k_rope_offset[i] + j``.
        ``window_left`` >= 0: query row ``t`` sees key ``j`` of entry ``i`` only if
        ``k_rope_offset[i] + j >= q_positions[t] - window_left`` (``q_positions`` is then always
        given; never with a tree). ``logit_softcap``, ``sinks``: see the module docstring.
        Returns (o, lse), (T, Hq, Dv) in the cache dtype and (T, Hq) float32, for all T rows of
        ``q``; rows covered by no entry get o = 0 and lse = -inf (``sinks[h]`` with sinks)."""

    @abc.abstractmethod
    def merge_attention(self, o_a, lse_a, o_b, lse_b):
        """Combine two partial attentions over disjoint key sets (``o_*`` (T, Hq, Dv),
        ``lse_*`` (T, Hq) float32):
        ``lse = logaddexp(lse_a, lse_b)``, ``o = o_a*exp(lse_a-lse) + o_b*exp(lse_b-lse)``
        (both -inf: o = 0, lse = -inf). Returns (o, lse); may reuse the inputs' storage."""

    @abc.abstractmethod
    def copy_page_prefix(self, pages_per_layer: Sequence, src_page: int, dst_page: int,
                         length: int) -> None:
        """Copy rows ``0..length-1`` of page ``src_page`` into ``dst_page`` in every layer's
        page array of ``pages_per_layer`` (fork)."""

    @abc.abstractmethod
    def compact_kv(self, pages_per_layer: Sequence, src_slots, dst_slots) -> None:
        """For every layer's page array of ``pages_per_layer`` and every i, copy the K/V row at
        ``src_slots[i]`` to ``dst_slots[i]`` (int32 device arrays of one length; tree commit).
        Sources are read before any destination is written."""

    @abc.abstractmethod
    def gather_kv(self, pages_per_layer: Sequence, slots, *, kv_scale=None, packed: bool = False):
        """(k, v), (num_layers, len(slots), Hkv, D) and (num_layers, len(slots), Hkv, Dv): the
        rows at ``slots`` (an int32 device array) in every layer's page array of
        ``pages_per_layer`` (``num_layers`` is its length), decoded into the cache dtype for
        quantized formats (``kv_scale``: a scaled format's per-page-array scales). ``packed``
        (packed formats only): the rows as stored instead, uint8 ``(num_layers, len(slots),
        Hkv, affine_row_bytes(D))`` (v: of ``Dv``), as ``append_kv(..., packed=True)`` takes
        them."""

    def gather_kv_into(self, pages_per_layer: Sequence, slots: np.ndarray, k_out: np.ndarray,
                       v_out: np.ndarray) -> bool:
        """``gather_kv`` of a format that is not quantized, written into the host arrays
        ``k_out`` and ``v_out`` (C-contiguous numpy arrays of its shapes, in the storage dtype)
        instead of new arrays; ``slots``: host int32. Returns False, writing nothing, where this
        backend has no such path (the caller then calls ``gather_kv``). The reference backend
        has one (a KV file saved through a few reused buffers, not a fresh gigabyte a
        gigabyte)."""
        return False

    # ------------------------------------------------------------------ state slots
    def allocate_state(self, num_slots: int, shape: tuple, dtype: Optional[str] = None):
        """A zeroed array of shape ``(num_slots, *shape)`` in ``dtype`` (a ``DTYPES`` name;
        None: the config's ``dtype``) on the device: one named state of one state layer
        (``CacheConfig.layer_kinds`` with ``State``; ``State.dtype``), row ``s`` the state of
        the sequence holding slot ``s``. The cache passes ``dtype`` only for a state whose
        dtype differs from the config's. Capability ``state_slots``; this default raises
        UnsupportedFeatureError."""
        raise UnsupportedFeatureError(
            f"backend {self.name!r} does not implement allocate_state: "
            f"{Capabilities.reason('state_slots')}")

    def gather_state(self, states, slots):
        """A new array ``(n, *shape)``: row ``i`` is ``states[slots[i]]``; ``states`` an array
        of ``allocate_state``, ``slots`` an int32 device array of ``n`` slot indices (in
        range). The result must not change when ``states`` is written later (a copy, or a
        value the stream orders before later writes). Default: raises
        UnsupportedFeatureError."""
        raise UnsupportedFeatureError(
            f"backend {self.name!r} does not implement gather_state: "
            f"{Capabilities.reason('state_slots')}")

    def scatter_state(self, states, slots, values) -> None:
        """In place: ``states[slots[i]] = values[i]`` for each ``i``; ``values`` ``(n, *shape)``
        in the cache dtype, ``slots`` an int32 device array of ``n`` distinct slot indices.
        ``states`` stays the same object (the cache holds it). Queued like ``append_kv``, no
        synchronization. Default: raises UnsupportedFeatureError."""
        raise UnsupportedFeatureError(
            f"backend {self.name!r} does not implement scatter_state: "
            f"{Capabilities.reason('state_slots')}")

    # ------------------------------------------------------------------ helpers for the core
    def split_qkv(self, qkv):
        """Split ``qkv`` (T, Hq + 2*Hkv, D) into views q (T, Hq, D), k, v (T, Hkv, D)."""
        hq, hkv = self.config.num_qo_heads, self.config.num_kv_heads
        return qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]

    def shape_of(self, array) -> tuple:
        """The shape of a native array as a tuple of ints."""
        return tuple(array.shape)


__all__ = ["Backend", "Capabilities", "RopeSpec", "TreeMask", "DepthAux"]


def checksum_words(data: np.ndarray) -> np.ndarray:
    """``Backend.checksum`` of the bytes ``data`` (uint8) on the host: int64 ``[sum of the
    int64 words, sum of the 64-word rows' sums times index + 1]`` modulo 2**64."""
    pad = (-data.size) % 512                    # whole rows of 64 words
    if pad:
        data = np.concatenate([data, np.zeros(pad, np.uint8)])
    words = data.view("<i8").reshape(-1, 64)
    with np.errstate(over="ignore"):
        rows = words.sum(axis=1, dtype=np.int64)
        weights = np.arange(1, rows.size + 1, dtype=np.int64)
        return np.array([rows.sum(dtype=np.int64), (rows * weights).sum(dtype=np.int64)], np.int64)
