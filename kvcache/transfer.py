"""Moving a sequence's KV out of a cache and into another: the portable payload
(``SequencePayload``, made by ``PagedKVCache.export_sequence`` and taken by
``PagedKVCache.import_sequence``) and a host tier that parks idle sequences off the device
(``HostTier``). ``kvcache.distributed`` moves payloads between processes.

A payload holds the K/V of a range of a sequence's tokens *as stored* (K post-RoPE in "normal"
mode, unrotated in "inline" mode) plus everything the receiving cache needs to check that it
would store and read them the same way (heads, head_dim, storage dtype, RoPE settings) and to
recreate the sequence's state (sliding window and sinks). See docs/distributed.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import zlib
from dataclasses import dataclass
from typing import Any, Optional, cast

import numpy as np

from . import kv_quant
from .arrays import to_host, to_numpy
from .config import DTYPES, KV_QUANT_GROUPS, ROPE_MODES, itemsize
from .errors import InvalidArgumentError, UnsupportedFeatureError
from .formats import FORMAT_TABLE

FORMAT_VERSION = 1
"""The payload format this version of kvcache writes and reads."""

HEADER_FIELDS = ("version", "start", "num_tokens", "source_length", "num_layers",
                 "num_kv_heads", "head_dim", "kv_dtype", "rope_mode", "rope_theta", "rope_scale",
                 "rope_inv_freq", "rope_rotary_dim", "window_size", "sink_size", "backend",
                 "device")
"""The keys of ``SequencePayload.header()`` (every field but the arrays); ``checksum``,
``dtype``, ``kv_scales`` and ``kv_quant_group`` are there too, optional when read (None: not
computed, the arrays in ``kv_dtype``, no scales, no groups)."""


UNCHECKED_FIELDS = ("backend", "device", "checksum")
"""The header fields a payload's checksum does not cover: where the arrays live, and itself."""


def checksum(k: np.ndarray, v: np.ndarray, header: Optional[dict] = None) -> str:
    """The CRC-32 of ``header`` in canonical form (every field but ``UNCHECKED_FIELDS``, sorted
    JSON) then ``k``'s bytes then ``v``'s (host arrays), as 8 hex digits: what a host payload
    carries (``header``: its ``header()``) so that an importer can tell that its arrays and
    what it says of them (positions, window, scales, group, dtype, RoPE...) are the ones the
    exporter wrote. Without ``header``: the arrays' alone."""
    crc = 0 if header is None else header_crc(header)
    # the arrays' bytes as they are (a uint8 view, no copy)
    crc = zlib.crc32(np.ascontiguousarray(k).view(np.uint8).data, crc)
    return f"{zlib.crc32(np.ascontiguousarray(v).view(np.uint8).data, crc):08x}"


def header_crc(header: dict) -> int:
    """The CRC-32 of ``header`` in canonical form (every field but ``UNCHECKED_FIELDS``, sorted
    keys, no spaces): where ``checksum`` starts, before the arrays' bytes."""
    canonical = {name: value for name, value in header.items() if name not in UNCHECKED_FIELDS}
    return zlib.crc32(json.dumps(canonical, sort_keys=True, separators=(",", ":"),
                                 default=float).encode())


@dataclass(frozen=True)
class SequencePayload:
    """The K/V of tokens ``start .. start + num_tokens - 1`` of one sequence, as stored.

    ``k``, ``v``: arrays of shape (num_layers, num_tokens, num_kv_heads, head_dim) in
    ``kv_dtype``: the exporting backend's native arrays (``backend``/``device`` name where they
    live) or, after ``to_numpy()``, host numpy arrays (``backend`` None; bfloat16 as
    ml_dtypes' type). Token ``j`` has RoPE position ``start + j`` (``positions``): a cache
    gives every token the position of its index among the sequence's kept tokens, so the
    tokens must land at that index again.

    ``start``: the index of the first exported token among the sequence's kept tokens;
    ``num_tokens``: how many were exported (``end = start + num_tokens``). ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``kv_dtype``: the exporting cache's geometry and storage
    dtype, which an importing cache must share. ``source_length``: the sequence's length when exported (``end == source_length`` for a
    whole tail). ``rope_mode``: the exporting cache's effective mode ("none" | "normal" |
    "inline"; sliding windows force "inline"), with its ``rope_theta``, ``rope_scale``,
    ``rope_inv_freq`` (the model's frequencies, () for theta's) and ``rope_rotary_dim`` (0:
    every dim). ``window_size`` (-1: none) and ``sink_size``: the sequence's sliding window.
    ``version``: ``FORMAT_VERSION`` of the writer. ``checksum``: ``checksum(k, v, header())`` of
    a host payload (``to_numpy()`` computes it; None for device arrays, which never left the
    process): the header's fields but ``backend``, ``device`` and itself, then K, then V;
    ``import_sequence`` recomputes it and refuses a payload whose arrays or header differ.

    From fp8 pages (``kv_dtype="float8_e4m3"``) the arrays hold the values read back
    (``code * scale``) in the cache's compute dtype ``dtype`` (exact enough that storing them
    again with the same scales gives the same codes), and ``kv_scales`` the exporting cache's
    scales: per layer ``((K's per KV head), (V's per KV head))``, or None for a layer it never
    wrote. ``dtype`` None: the arrays are in ``kv_dtype``.

    From int8 / int4 pages the arrays hold the rows as stored, packed (``uint8``, shape
    ``(num_layers, num_tokens, num_kv_heads, kv_quant.affine_row_bytes(head_dim, ...))``:
    codes, then scales and biases in the compute dtype ``dtype``; ``kv_quant.affine_pack``),
    with the group size ``kv_quant_group``: an importing cache of the same format stores the
    same codes. ``values()`` gives any payload's K/V as values.
    """

    k: Any
    v: Any
    start: int
    num_tokens: int
    source_length: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    rope_mode: str
    rope_theta: float = 10000.0
    rope_scale: float = 1.0
    rope_inv_freq: tuple = ()
    rope_rotary_dim: int = 0
    window_size: int = -1
    sink_size: int = 0
    backend: Optional[str] = None
    device: Optional[str] = None
    version: int = FORMAT_VERSION
    checksum: Optional[str] = None
    dtype: Optional[str] = None
    kv_scales: Optional[tuple] = None
    kv_quant_group: Optional[int] = None

    # ------------------------------------------------------------------ derived
    @property
    def end(self) -> int:
        """One past the last exported token."""
        return self.start + self.num_tokens

    @property
    def positions(self) -> np.ndarray:
        """(num_tokens,) int32: the RoPE position of each exported token."""
        return np.arange(self.start, self.end, dtype=np.int32)

    @property
    def affine(self) -> bool:
        """Whether the arrays hold packed int8 / int4 rows."""
        fmt = FORMAT_TABLE.get(self.kv_dtype)
        return fmt is not None and fmt.packed

    @property
    def shape(self) -> tuple:
        """The shape of ``k`` and of ``v``: the last axis is ``head_dim``, or for packed rows
        their bytes."""
        row = self.head_dim
        if self.affine:
            _, group, dtype = self._affine_format()
            row = FORMAT_TABLE[self.kv_dtype].row_bytes(self.head_dim, dtype, group)
        return (self.num_layers, self.num_tokens, self.num_kv_heads, row)

    def _affine_format(self) -> tuple[int, int, str]:
        """(bits, group, compute dtype) of an int8 / int4 payload (checked by ``check``)."""
        return (FORMAT_TABLE[self.kv_dtype].bits, cast(int, self.kv_quant_group),
                cast(str, self.dtype))

    @property
    def array_dtype(self) -> str:
        """The dtype of ``k`` and ``v``: "uint8" for packed rows, else ``dtype``, or
        ``kv_dtype`` where that is None."""
        if self.affine:
            return "uint8"
        return self.kv_dtype if self.dtype is None else self.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of K and V together."""
        return 2 * math.prod(self.shape) * itemsize(self.array_dtype)

    def values(self) -> tuple:
        """Host float32 ``(k, v)`` of shape (num_layers, num_tokens, num_kv_heads, head_dim):
        the values the exporting cache reads back (packed rows decoded by the format's rule)."""
        k, v = to_host(self.k, self.array_dtype), to_host(self.v, self.array_dtype)
        if not self.affine:
            return k.astype(np.float32), v.astype(np.float32)
        bits, group, dtype = self._affine_format()

        def decode(x):
            codes, scales, biases = kv_quant.affine_unpack(x, self.head_dim, bits, group, dtype)
            return kv_quant.affine_dequantize(codes, scales, biases, group)

        return decode(k), decode(v)

    # ------------------------------------------------------------------ forms
    def header(self) -> dict:
        """Every field but the arrays, as JSON-friendly Python values."""
        out = {name: getattr(self, name) for name in HEADER_FIELDS}
        out["rope_inv_freq"] = list(self.rope_inv_freq)
        out["checksum"] = self.checksum
        out["dtype"] = self.dtype
        out["kv_quant_group"] = self.kv_quant_group
        out["kv_scales"] = None if self.kv_scales is None else [
            None if s is None else [list(s[0]), list(s[1])] for s in self.kv_scales]
        return out

    @classmethod
    def from_header(cls, header: dict, k: Any = None, v: Any = None) -> SequencePayload:
        """A payload of ``header`` (as ``header()`` gives) with the arrays ``k``, ``v`` (None: a
        header-only payload, for checking and reserving before the arrays arrive). Raises
        UnsupportedFeatureError for another format version, InvalidArgumentError for missing
        fields or a field of the wrong type (naming it and its value)."""
        if not isinstance(header, dict):
            raise InvalidArgumentError(f"a payload header is a dict, got {type(header).__name__}")
        version = header.get("version")
        if not _is_version(version):
            raise UnsupportedFeatureError(
                f"payload format version {version!r} is not supported: this kvcache reads "
                f"version {FORMAT_VERSION}")
        missing = [name for name in HEADER_FIELDS if name not in header]
        if missing:
            raise InvalidArgumentError(f"payload header lacks {missing}")
        fields = {name: header[name] for name in HEADER_FIELDS}
        inv = fields["rope_inv_freq"]
        if not isinstance(inv, (list, tuple)) or not all(_real(f) for f in inv):
            raise InvalidArgumentError(
                f"payload header: rope_inv_freq={inv!r} must be a list of numbers (empty: "
                f"theta's frequencies)")
        fields["rope_inv_freq"] = tuple(float(f) for f in inv)
        scales = header.get("kv_scales")
        if scales is not None:
            scales = _scales_tuple(scales)
        payload = cls(k=k, v=v, checksum=header.get("checksum"), dtype=header.get("dtype"),
                      kv_scales=scales, kv_quant_group=header.get("kv_quant_group"), **fields)
        payload.check("payload header")
        return payload

    def to_numpy(self, with_checksum: bool = True) -> SequencePayload:
        """The same payload with host numpy arrays in ``kv_dtype`` (the bits as stored; waits
        for the device copy) and their ``checksum`` (``with_checksum=False``: none, for a copy
        that stays in this process, e.g. the host tier). ``backend`` and ``device`` become
        None."""
        if self.k is None:
            return self
        self.check_arrays("to_numpy")
        k, v = to_host(self.k, self.array_dtype), to_host(self.v, self.array_dtype)
        out = dataclasses.replace(self, k=k, v=v, backend=None, device=None, checksum=None)
        if not with_checksum:
            return out
        return dataclasses.replace(out, checksum=checksum(k, v, out.header()))

    def without_arrays(self) -> SequencePayload:
        """The header-only form (``k`` and ``v`` None)."""
        return dataclasses.replace(self, k=None, v=None)

    # ------------------------------------------------------------------ checks
    def check(self, where: str = "payload") -> None:
        """InvalidArgumentError / UnsupportedFeatureError when the payload is inconsistent in
        itself: version, counts, field types, and the arrays against the header
        (``check_arrays``). ``where`` names the payload in the message."""
        if not _is_version(self.version):
            raise UnsupportedFeatureError(
                f"{where}: format version {self.version!r} is not supported: this kvcache reads "
                f"version {FORMAT_VERSION}")
        # isinstance first: `in` on a numpy array value raises an untyped ValueError
        if not isinstance(self.kv_dtype, str) or self.kv_dtype not in FORMAT_TABLE:
            raise InvalidArgumentError(
                f"{where}: kv_dtype={self.kv_dtype!r} must be one of {tuple(FORMAT_TABLE)}")
        self._check_format(where)
        if not isinstance(self.rope_mode, str) or self.rope_mode not in ROPE_MODES:
            raise InvalidArgumentError(
                f"{where}: rope_mode={self.rope_mode!r} must be one of {ROPE_MODES}")
        for name in ("rope_theta", "rope_scale"):
            if not _real(getattr(self, name)):
                raise InvalidArgumentError(f"{where}: {name}={getattr(self, name)!r} must be a number")
        if not isinstance(self.rope_inv_freq, tuple) or not all(_real(f) for f in self.rope_inv_freq):
            raise InvalidArgumentError(
                f"{where}: rope_inv_freq={self.rope_inv_freq!r} must be a tuple of numbers")
        for name in ("backend", "device", "checksum"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(
                    f"{where}: {name}={getattr(self, name)!r} must be a string or None")
        for name in ("start", "num_tokens", "source_length", "num_layers", "num_kv_heads",
                     "head_dim", "rope_rotary_dim", "sink_size", "window_size"):
            value = getattr(self, name)
            low = -1 if name == "window_size" else 0
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise InvalidArgumentError(f"{where}: {name}={value!r} must be an int >= {low}")
        if self.end > self.source_length:
            raise InvalidArgumentError(
                f"{where}: tokens [{self.start}, {self.end}) exceed source_length "
                f"{self.source_length}")
        if self.window_size == 0 or (self.window_size > 0 and not 0 <= self.sink_size < self.window_size):
            raise InvalidArgumentError(
                f"{where}: window_size={self.window_size}, sink_size={self.sink_size}: need "
                f"window_size -1 (none) or > 0 and 0 <= sink_size < window_size")
        if self.k is None and self.v is None:
            return
        self.check_arrays(where)

    def _check_format(self, where: str) -> None:
        """``dtype``, ``kv_scales`` and ``kv_quant_group`` against ``kv_dtype``: the compute
        dtype and the scales per layer from fp8 pages, the compute dtype and the group size
        from int8 / int4 pages, none of them otherwise."""
        if self.kv_dtype in DTYPES:
            if (self.dtype not in (None, self.kv_dtype) or self.kv_scales is not None
                    or self.kv_quant_group is not None):
                raise InvalidArgumentError(
                    f"{where}: kv_dtype={self.kv_dtype!r} is a plain dtype, but dtype="
                    f"{self.dtype!r}, kv_scales or kv_quant_group={self.kv_quant_group!r} are "
                    f"given (only quantized payloads carry them)")
            return
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise InvalidArgumentError(
                f"{where}: a {self.kv_dtype} payload needs dtype (its arrays' compute dtype) in "
                f"{DTYPES}, got {self.dtype!r}")
        if self.affine:
            group = self.kv_quant_group
            if (self.kv_scales is not None or isinstance(group, bool) or group not in
                    KV_QUANT_GROUPS or not isinstance(self.head_dim, int)
                    or self.head_dim % group):
                raise InvalidArgumentError(
                    f"{where}: a {self.kv_dtype} payload needs kv_quant_group in "
                    f"{KV_QUANT_GROUPS} dividing head_dim={self.head_dim!r} and no kv_scales, "
                    f"got kv_quant_group={group!r}")
            return
        if self.kv_quant_group is not None:
            raise InvalidArgumentError(
                f"{where}: a {self.kv_dtype} payload has no kv_quant_group, got "
                f"{self.kv_quant_group!r}")
        scales = self.kv_scales
        n = self.num_layers if isinstance(self.num_layers, int) else -1
        if not isinstance(scales, tuple) or len(scales) != n:
            raise InvalidArgumentError(
                f"{where}: a {self.kv_dtype} payload needs kv_scales, one entry per layer "
                f"({self.num_layers}), got {scales!r:.200}")
        for layer, entry in enumerate(scales):
            if entry is None:
                continue
            ok = (isinstance(entry, tuple) and len(entry) == 2
                  and all(isinstance(row, tuple) and len(row) == self.num_kv_heads
                          and all(_real(x) and x > 0 for x in row) for row in entry))
            if not ok:
                raise InvalidArgumentError(
                    f"{where}: kv_scales[{layer}]={entry!r:.200} must be None or (K's, V's) "
                    f"scales, {self.num_kv_heads} positive numbers each")

    def check_arrays(self, where: str = "payload") -> None:
        """InvalidArgumentError unless ``k`` and ``v`` are what the header says: arrays (numpy,
        or a backend's torch / MLX arrays) of ``shape`` in ``kv_dtype`` exactly (no
        conversion from other types: bool, ints, float64, strings, objects are refused), of
        ``nbytes`` together, and, for host arrays with a ``checksum``, those very bytes.
        ``where`` names the payload in the message."""
        for name in ("k", "v"):
            a = getattr(self, name)
            dtype = _dtype_name(a)
            shape = tuple(int(x) for x in getattr(a, "shape", ()) or ()) if dtype else ()
            want = self.array_dtype
            if dtype is None:
                raise InvalidArgumentError(
                    f"{where}: {name} must be an array (numpy, torch or MLX) of {want}, "
                    f"got {type(a).__name__}")
            if dtype != want:
                raise InvalidArgumentError(
                    f"{where}: {name} holds {dtype} but the header says "
                    f"{'dtype' if self.dtype is not None else 'kv_dtype'}={want} (the bits are "
                    f"taken as stored: no conversion)")
            if shape != self.shape:
                raise InvalidArgumentError(
                    f"{where}: {name} has shape {shape}, expected {self.shape} (num_layers, "
                    f"num_tokens, num_kv_heads, head_dim)")
            size = getattr(a, "nbytes", None)
            if size is not None and int(size) != self.nbytes // 2:
                raise InvalidArgumentError(
                    f"{where}: {name} holds {int(size)} bytes, the header {self.nbytes // 2}")
        if self.checksum is not None:
            if not (isinstance(self.k, np.ndarray) and isinstance(self.v, np.ndarray)):
                raise InvalidArgumentError(
                    f"{where}: a payload with a checksum carries host numpy arrays, got "
                    f"{type(self.k).__name__}")
            got = checksum(self.k, self.v, self.header())
            if got != self.checksum:
                raise InvalidArgumentError(
                    f"{where}: the checksum of the header and arrays is {got}, the header's "
                    f"{self.checksum}: the K/V or what the header says of them (a field but "
                    f"{', '.join(UNCHECKED_FIELDS)}) are not the ones exported")

    def check_fits(self, config, seq_id, convert_dtype: bool = False) -> None:
        """Raise a typed error naming ``seq_id``, the payload's value and the cache's when a
        cache of ``config`` would store or read these tokens otherwise: layers, KV heads,
        head_dim, RoPE mode and settings, storage dtype (unless ``convert_dtype``)."""
        where = f"import of sequence {seq_id}"
        self.check(where)
        mine = {"num_layers": config.num_layers, "num_kv_heads": config.num_kv_heads,
                "head_dim": config.head_dim, "rope_mode": config.effective_rope_mode}
        for name, want in mine.items():
            got = getattr(self, name)
            if got != want:
                extra = (" (a cache with sliding windows applies RoPE inline)"
                         if name == "rope_mode" and config.support_sliding_window else "")
                raise InvalidArgumentError(
                    f"{where}: the payload has {name}={got!r}, this cache {name}={want!r}{extra}")
        if self.rope_mode != "none":
            spec = config.rope_spec()
            rope = {"rope_theta": spec.theta, "rope_scale": spec.scale,
                    "rope_inv_freq": tuple(spec.inv_freq or ()),
                    "rope_rotary_dim": spec.rotary_dim}
            for name, want in rope.items():
                got = getattr(self, name)
                if got != want:
                    raise InvalidArgumentError(
                        f"{where}: the payload's K was stored with {name}={got!r}, this cache "
                        f"uses {name}={want!r}")
        if config.kv_format.quantized and self.kv_dtype != config.kv_dtype:
            raise InvalidArgumentError(
                f"{where}: the payload stores {self.kv_dtype}, this cache {config.kv_dtype}: "
                f"only a {config.kv_dtype} payload can be imported here")
        if self.kv_dtype != config.kv_dtype and not convert_dtype:
            raise InvalidArgumentError(
                f"{where}: the payload stores {self.kv_dtype}, this cache {config.kv_dtype}; pass "
                f"convert_dtype=True to convert (rounding to {config.kv_dtype})")
        if config.kv_format.quantized and self.dtype != config.dtype and not convert_dtype:
            raise InvalidArgumentError(
                f"{where}: the payload's values are in {self.dtype}, this cache computes "
                f"in {config.dtype}; pass convert_dtype=True to convert")
        if self.affine and self.kv_quant_group != config.kv_quant_group and not convert_dtype:
            raise InvalidArgumentError(
                f"{where}: the payload's {self.kv_dtype} groups hold {self.kv_quant_group} "
                f"values, this cache's {config.kv_quant_group}; pass convert_dtype=True to store "
                f"its values again (rounded twice)")
        if self.window_size != -1 and not config.support_sliding_window:
            raise InvalidArgumentError(
                f"{where}: the payload has a sliding window (window_size={self.window_size}, "
                f"sink_size={self.sink_size}) but this cache was built with "
                f"support_sliding_window=False")


def _scales_tuple(scales) -> Any:
    """A header's ``kv_scales`` (lists) as the payload's nested tuples; other values as they
    are, for ``check`` to name."""
    if not isinstance(scales, (list, tuple)):
        return scales
    out = []
    for entry in scales:
        if isinstance(entry, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in entry):
            entry = tuple(tuple(r) for r in entry)
        out.append(entry)
    return tuple(out)


def _is_version(x) -> bool:
    # a plain int compare: an array-valued field must not reach `!=` (untyped ValueError)
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x == FORMAT_VERSION


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(float(x))


def _dtype_name(array) -> Optional[str]:
    """'float16' / 'bfloat16' / 'float32' / another dtype's short name of a numpy, torch or
    MLX array; None for anything that is not an array."""
    if isinstance(array, np.ndarray):
        return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name
    module = type(array).__module__.split(".")[0]
    if module not in ("torch", "mlx") or not hasattr(array, "dtype") or not hasattr(array, "shape"):
        return None
    return str(array.dtype).rsplit(".", 1)[-1]


def payload_fields(config) -> dict:
    """The header fields a cache of ``config`` writes (all but the token range, the window and
    the arrays' location)."""
    spec = config.rope_spec()
    return dict(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim, kv_dtype=config.kv_dtype,
                dtype=config.dtype if config.kv_format.quantized else None,
                rope_mode=config.effective_rope_mode, rope_theta=spec.theta,
                rope_scale=spec.scale, rope_inv_freq=tuple(spec.inv_freq or ()),
                rope_rotary_dim=spec.rotary_dim,
                kv_quant_group=config.kv_quant_group if config.kv_format.packed else None)


__all__ = ["FORMAT_VERSION", "HEADER_FIELDS", "SequencePayload", "UNCHECKED_FIELDS", "checksum"]
