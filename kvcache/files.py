"""KV files: sequences saved to disk and loaded into any cache, checked page by page
(``PagedKVCache.save_sequences`` / ``load_sequences``; the format: docs/kv-files.md).

A file is a safetensors container, written and read here with no dependency beyond numpy:

* 8 bytes, little-endian: the length ``n`` of the JSON header that follows;
* ``n`` bytes of JSON: one entry per array (``{"dtype", "shape", "data_offsets"}``,
  safetensors' names and rules) and ``"__metadata__": {"kvcache": "<the file header, JSON>"}``;
* the arrays' bytes, in the order of their offsets.

The file header (``FILE_FORMAT``, ``FILE_VERSION``) holds the writer's optional model
fingerprint, the hash chain's ``page_size`` and one entry per sequence: its payload header
(``SequencePayload.header()``, the same fields and CRC-32 a transfer carries), its token ids
(or null), the names of its K and V arrays, and ``pages``: the hash chain. Page ``p`` covers
the tokens ``p * page_size ..`` of the sequence; its digest ``d_p`` is the SHA-256 of the
page's token ids as little-endian int32 (nothing when the file holds no ids), then for K and
then V each layer's rows of the page (C order); the chain is ``c_p = sha256(c_{p-1} + d_p)``
from ``c_-1 = sha256("kvcache-kv-file/1\n" + the payload header's canonical JSON)``, and
``pages`` lists ``c_p`` in hex. So each page's entry covers its bytes, its ids, every page
before it and the header; a reader can check a prefix of the pages alone.

Loading checks everything before it changes anything: the container's bounds, the header's
fields and types, the format and version, the fingerprint against the caller's, every page of
the chain, each payload's CRC and geometry against the cache (``import_sequence``'s checks),
and room for all; a file that fails any is refused with a typed error naming the field (or the
page), and the cache keeps what it had.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from .arrays import np_dtype
from .errors import InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from .transfer import UNCHECKED_FIELDS, SequencePayload

__all__ = ["FILE_FORMAT", "FILE_VERSION", "save_sequences", "load_sequences", "read_header"]

FILE_FORMAT = "kvcache-kv-file"
"""The ``format`` field of a KV file's header."""
FILE_VERSION = 1
"""The file format version this kvcache writes and reads."""

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint8": "U8"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 1 << 28
"""A container header longer than this is refused (a corrupt length, not a real file)."""


def _root(payload_header: dict) -> bytes:
    """The chain's start: SHA-256 of ``FILE_FORMAT``, ``/``, the version, a newline and the
    payload header's canonical JSON (its fields but ``UNCHECKED_FIELDS``, sorted keys, no
    spaces), so the chain covers what the header says of the arrays too."""
    canonical = {k: v for k, v in payload_header.items() if k not in UNCHECKED_FIELDS}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=float)
    return hashlib.sha256(f"{FILE_FORMAT}/{FILE_VERSION}\n{text}".encode()).digest()


def _page_hashes(k: np.ndarray, v: np.ndarray, tokens: Optional[Sequence[int]],
                 page_size: int, root: bytes) -> list:
    """The hash chain (module doc) of host arrays ``k``, ``v`` (num_layers, tokens, ...),
    C-contiguous: each page's digest on a thread of its own (hashlib lets go of the GIL on
    large buffers), then the chain over the digests."""
    n = k.shape[1]

    def digest(j0: int) -> bytes:
        j1 = min(j0 + page_size, n)
        h = hashlib.sha256()
        if tokens is not None:
            h.update(np.asarray(tokens[j0:j1], dtype="<i4").tobytes())
        for a in (k, v):
            for layer in range(a.shape[0]):
                h.update(np.ascontiguousarray(a[layer, j0:j1]).view(np.uint8).data)
        return h.digest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(digest, range(0, n, page_size)))
    out, prev = [], root
    for d in digests:
        prev = hashlib.sha256(prev + d).digest()
        out.append(prev.hex())
    return out


def save_sequences(cache, path, seq_ids: Sequence[int], tokens: Optional[Sequence] = None,
                   fingerprint: Optional[dict] = None) -> None:
    """Write sequences ``seq_ids`` of ``cache`` to the file ``path`` (replaced whole: written
    beside it, then renamed). ``tokens``: per sequence its token ids (a list, or None where
    unknown), or None for none; ``fingerprint``: a JSON-able dict naming the model (compared
    by ``load_sequences``). Raises SequenceNotFoundError, ForwardStateError inside a forward,
    InvalidArgumentError for tokens that do not fit a sequence's length; nothing is written
    then."""
    ids = [int(s) for s in seq_ids]
    if tokens is not None and len(tokens) != len(ids):
        raise InvalidArgumentError(
            f"save_sequences: {len(tokens)} token lists for {len(ids)} sequences")
    if fingerprint is not None:
        _json_dict(fingerprint, "save_sequences: fingerprint")
    payloads = [cache.export_sequence(s).to_numpy() for s in ids]
    ps = cache.config.page_size
    entries, arrays = [], []
    for i, (sid, p) in enumerate(zip(ids, payloads)):
        toks = None if tokens is None or tokens[i] is None else [int(t) for t in tokens[i]]
        if toks is not None and len(toks) != p.num_tokens:
            raise InvalidArgumentError(
                f"save_sequences: sequence {sid} holds {p.num_tokens} tokens, its token ids "
                f"list {len(toks)}")
        if toks is not None and not all(0 <= t < 2**31 for t in toks):
            raise InvalidArgumentError(
                f"save_sequences: sequence {sid}: token ids must lie in [0, 2**31) (the file "
                f"hashes them as int32)")
        entries.append({"payload": p.header(), "tokens": toks, "k": f"s{i}.k", "v": f"s{i}.v",
                        "pages": _page_hashes(p.k, p.v, toks, ps, _root(p.header()))})
        arrays += [(f"s{i}.k", p.k, p.array_dtype), (f"s{i}.v", p.v, p.array_dtype)]
    header = {"format": FILE_FORMAT, "version": FILE_VERSION, "fingerprint": fingerprint,
              "page_size": ps, "sequences": entries}
    tensors: dict = {}
    offset = 0
    for name, a, dtype in arrays:
        tensors[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(a.shape),
                         "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    tensors["__metadata__"] = {"kvcache": json.dumps(header, separators=(",", ":"))}
    head = json.dumps(tensors, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for _, a, _ in arrays:
                f.write(np.ascontiguousarray(a).view(np.uint8).data)     # (no copy)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _refuse(path, what: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"KV file {os.fspath(path)!r}: {what}; nothing was loaded")


def _json_dict(x, where: str) -> None:
    if not isinstance(x, dict):
        raise InvalidArgumentError(f"{where} must be a dict, got {type(x).__name__}")
    try:
        json.dumps(x)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{where} must be JSON-able: {exc}") from None


def _container(path) -> tuple:
    """(tensor table, file header, data start, file size) of the file at ``path``."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise _refuse(path, f"{size} bytes: too short for a KV file's header length")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise _refuse(path, f"header length {n} does not fit the file's {size} bytes "
                                f"(truncated or not a KV file)")
        head = f.read(n)
    try:
        table = json.loads(head)
        meta = table.pop("__metadata__")
        header = json.loads(meta["kvcache"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise _refuse(path, "its header is not a KV file's JSON (a corrupt or foreign file)") \
            from None
    if not isinstance(header, dict) or not isinstance(table, dict):
        raise _refuse(path, "its header is not a KV file's JSON")
    return table, header, 8 + n, size


def read_header(path) -> dict:
    """The file header of the KV file at ``path`` (format, version, fingerprint, page size,
    per sequence its payload header, tokens and page hashes), without reading the arrays.
    Raises InvalidArgumentError for a file that is not a KV file, UnsupportedFeatureError for
    another format version."""
    header = _container(path)[1]
    _check_header(path, header)
    return header


def _check_header(path, header: dict) -> None:
    if header.get("format") != FILE_FORMAT:
        raise _refuse(path, f"format={header.get('format')!r}, expected {FILE_FORMAT!r}")
    if header.get("version") != FILE_VERSION:
        raise UnsupportedFeatureError(
            f"KV file {os.fspath(path)!r}: version={header.get('version')!r}; this kvcache "
            f"reads version {FILE_VERSION}; nothing was loaded")
    ps = header.get("page_size")
    if not isinstance(ps, int) or isinstance(ps, bool) or ps < 1:
        raise _refuse(path, f"page_size={ps!r} must be a positive int")
    seqs = header.get("sequences")
    if not isinstance(seqs, list):
        raise _refuse(path, f"sequences={type(seqs).__name__} must be a list")
    for i, e in enumerate(seqs):
        if not isinstance(e, dict) or not all(key in e for key in ("payload", "tokens", "k",
                                                                   "v", "pages")):
            raise _refuse(path, f"sequence {i}: an entry needs payload, tokens, k, v and pages")
        toks = e["tokens"]
        if toks is not None and not (isinstance(toks, list) and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                for t in toks)):
            raise _refuse(path, f"sequence {i}: tokens must be null or a list of ids >= 0")
        pages = e["pages"]
        if not isinstance(pages, list) or not all(isinstance(h, str) for h in pages):
            raise _refuse(path, f"sequence {i}: pages must be a list of hex digests")


def _array(path, table: dict, name, start: int, size: int, f) -> np.ndarray:
    """The array ``name`` of the container, its bounds and dtype checked."""
    spec = table.get(name) if isinstance(name, str) else None
    if not isinstance(spec, dict):
        raise _refuse(path, f"array {name!r} is not in the file")
    st = _ST_NAMES.get(str(spec.get("dtype")))
    shape, offs = spec.get("shape"), spec.get("data_offsets")
    if st is None or not isinstance(shape, list) or not isinstance(offs, list) \
            or len(offs) != 2 or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _refuse(path, f"array {name!r}: dtype, shape or offsets malformed")
    dt = np_dtype(st)
    count = int(np.prod(shape)) if shape else 1
    lo, hi = offs
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi
            and hi - lo == count * dt.itemsize):
        raise _refuse(path, f"array {name!r}: offsets {offs} do not match its shape {shape}")
    if start + hi > size:
        raise _refuse(path, f"array {name!r} ends at byte {start + hi}, the file at {size} "
                            f"(truncated)")
    f.seek(start + lo)
    raw = f.read(hi - lo)
    return np.frombuffer(raw, dtype=dt).reshape(shape)


def load_sequences(cache, path, seq_ids: Optional[Sequence[int]] = None,
                   fingerprint: Optional[dict] = None, convert_dtype: bool = False) -> list:
    """Load every sequence of the KV file ``path`` into ``cache``; returns their new ids
    (``seq_ids``, or else the next free ids after the cache's largest). Checks all of the file
    first (module doc); ``fingerprint``: the model the caller runs, compared key by key with
    the file's when both have one; ``convert_dtype``: as ``import_sequence``'s. A sequence
    saved with token ids has them recorded (``extend_tokens``), so with the prefix cache on
    its full pages join the index. Raises InvalidArgumentError (the field or page named),
    UnsupportedFeatureError, SequenceExistsError, CacheFullError, ForwardStateError inside a
    forward; the cache is unchanged then."""
    table, header, start, size = _container(path)
    _check_header(path, header)
    theirs = header.get("fingerprint")
    if fingerprint is not None:
        _json_dict(fingerprint, "load_sequences: fingerprint")
        if theirs is not None:
            for key in sorted(set(fingerprint) | set(theirs)):
                if fingerprint.get(key) != theirs.get(key):
                    raise _refuse(path, f"fingerprint field {key!r} is {theirs.get(key)!r} in "
                                        f"the file, {fingerprint.get(key)!r} here")
    seqs = header["sequences"]
    ids = _new_ids(cache, len(seqs)) if seq_ids is None else [int(s) for s in seq_ids]
    if len(ids) != len(seqs):
        raise _refuse(path, f"{len(seqs)} sequences, {len(ids)} ids given")
    payloads = []
    with open(path, "rb") as f:
        for i, e in enumerate(seqs):
            k = _array(path, table, e["k"], start, size, f)
            v = _array(path, table, e["v"], start, size, f)
            try:
                # the header's, the arrays' (shapes, CRC-32) and the cache's (geometry, RoPE,
                # dtype) checks, for every sequence before the first is imported
                p = dataclasses.replace(SequencePayload.from_header(e["payload"]), k=k, v=v)
                p.check_fits(cache.config, ids[i], convert_dtype)
            except KVCacheError as exc:
                raise _refuse(path, f"sequence {i}: {exc}") from None
            toks = e["tokens"]
            if toks is not None and len(toks) != p.num_tokens:
                raise _refuse(path, f"sequence {i}: {len(toks)} token ids for "
                                    f"{p.num_tokens} tokens")
            want = _page_hashes(k, v, toks, header["page_size"], _root(e["payload"]))
            bad = next((j for j, (a, b) in enumerate(zip(want, e["pages"])) if a != b), None)
            if bad is None and len(want) != len(e["pages"]):
                bad = min(len(want), len(e["pages"]))
            if bad is not None:
                raise _refuse(path, f"sequence {i}: page {bad} (tokens "
                                    f"{bad * header['page_size']}..) fails its hash: its bytes, "
                                    f"ids or a page before it changed")
            payloads.append((p, toks))
    done: list = []
    try:
        for sid, (p, _) in zip(ids, payloads):
            cache.import_sequence(sid, p, convert_dtype=convert_dtype)
            done.append(sid)
    except BaseException:
        for sid in done:                # all or nothing: the sequences loaded so far go again
            cache.remove_sequence(sid)
        raise
    # the ids last: recorded ids put full pages in the prefix index, which a rollback's
    # remove_sequence would leave cached
    for sid, (_, toks) in zip(ids, payloads):
        if toks is not None:
            cache.extend_tokens(sid, toks)
    return ids


def _new_ids(cache, n: int) -> list:
    have = cache.sequence_ids
    first = max(have) + 1 if have else 0
    return list(range(first, first + n))

