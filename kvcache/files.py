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

The same chain checks the other moves of a sequence's K/V: the host tier's
(``HostTier(verify=True)``) and a transfer's (``kvcache.distributed``), through
``payload_chain`` / ``page_chain``.

Loading checks everything before it changes anything: the container's bounds, the header's
fields and types, the format and version, the fingerprint against the caller's, each
payload header's fit to the cache (``import_sequence``'s checks) and its arrays' place in the
file, every page of the chain, and room for all; a file that fails any is refused with a typed
error naming the field (or the page), and the cache keeps what it had. The chain covers
everything the payload's CRC-32 covers (the header's checked fields, K, V), so a reader that
checked the chain does not compute the CRC too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np

from .arrays import np_dtype, to_host
from .errors import InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from .transfer import UNCHECKED_FIELDS, SequencePayload, header_crc

__all__ = ["FILE_FORMAT", "FILE_VERSION", "save_sequences", "load_sequences", "read_header",
           "payload_chain", "page_chain", "page_chains", "chain_root"]

FILE_FORMAT = "kvcache-kv-file"
"""The ``format`` field of a KV file's header."""
FILE_VERSION = 1
"""The file format version this kvcache writes and reads."""

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint8": "U8"}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
_MAX_HEADER = 1 << 28
"""A container header longer than this is refused (a corrupt length, not a real file)."""
_INLINE_BYTES = 4 << 20
"""Less K/V than this is hashed on the calling thread (a hand-off to the pool costs more)."""
_TASK_BYTES = 8 << 20
"""About this many bytes of K/V a hashing task (whole pages)."""


def _root(payload_header: dict) -> bytes:
    """The chain's start: SHA-256 of ``FILE_FORMAT``, ``/``, the version, a newline and the
    payload header's canonical JSON (its fields but ``UNCHECKED_FIELDS``, sorted keys, no
    spaces), so the chain covers what the header says of the arrays too."""
    canonical = {k: v for k, v in payload_header.items() if k not in UNCHECKED_FIELDS}
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=float)
    return hashlib.sha256(f"{FILE_FORMAT}/{FILE_VERSION}\n{text}".encode()).digest()


chain_root = _root


_MAX_WORKERS = 32
"""At most this many hashing threads, however many cores (SHA-256 of a gigabyte takes 0.6 s on
one core: 32 of them hash faster than a page cache takes the bytes)."""


def _hash_threads() -> int:
    """The hashing threads: one per core this process may run on (its CPU affinity, not the
    host's count: a container's or a GPU job's share of a large host), 1 to ``_MAX_WORKERS``.
    The chain and CRC-32 are combined in file order, so a file is the same bytes whatever
    the count."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):           # (no affinity on macOS)
        cores = os.cpu_count() or 1
    return max(1, min(_MAX_WORKERS, cores))


_WORKERS = _hash_threads()
_POOLS: dict = {}
_POOL_LOCK = threading.Lock()


def _after_fork() -> None:
    # a forked child has none of the parent's threads, and its copy of the lock may be held
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _pool(kind: str = "hash") -> ThreadPoolExecutor:
    """The process's threads of ``kind``: "hash" (``_WORKERS`` of them, ``_hash_threads``:
    hashlib and zlib let go of the GIL on large buffers) or "io" (one: a file's reads or
    writes, in order, beside the thread that gathers or imports the K/V). A child forked
    from a process that had them starts its own (the parent's threads are not in it)."""
    want = _WORKERS if kind == "hash" else 1
    with _POOL_LOCK:
        pid, pool, count = _POOLS.get(kind, (-1, None, 0))
        if pool is None or pid != os.getpid() or count != want:
            if pool is not None and pid == os.getpid():
                pool.shutdown(wait=False)       # (``_WORKERS`` changed: its queued work runs)
            pool = ThreadPoolExecutor(max_workers=want, thread_name_prefix=f"kvcache-{kind}")
            _POOLS[kind] = (os.getpid(), pool, want)
        return pool


def _flat(a) -> memoryview:
    """The bytes of host array ``a`` (C order) as a flat memoryview, without a copy when it is
    contiguous."""
    a = np.ascontiguousarray(a)
    return memoryview(a.reshape(-1).view(np.uint8))


def _layer_parts(a) -> list:
    """``[(bytes of layer l, bytes of one token's row)]`` of a host array (num_layers, tokens,
    ...): what ``page_chain`` takes."""
    row = int(np.prod(a.shape[2:], dtype=np.int64)) * a.dtype.itemsize
    return [(_flat(a[layer]), row) for layer in range(a.shape[0])]


def _ids_bytes(tokens) -> Optional[memoryview]:
    """Token ids as little-endian int32 bytes (None: none)."""
    if tokens is None:
        return None
    return _flat(np.asarray(tokens, dtype="<i4"))


class _Chain:
    """A hash chain being computed (``page_chain`` without waiting): ``add`` hashes the pages
    of some tokens (whole pages but for the sequence's last), on the hashing threads when
    they are many; ``digests()`` waits for them and chains them."""

    def __init__(self, root: bytes, parts: Sequence[tuple] = (),
                 ids: Optional[memoryview] = None, num_tokens: int = 0, page_size: int = 1):
        self.root = root
        self._pages: list = []          # per ``add``: a list of digests, or futures of lists
        if num_tokens:
            self.add(parts, ids, num_tokens, page_size)

    def add(self, parts: Sequence[tuple], ids: Optional[memoryview], num_tokens: int,
            page_size: int, pool: bool = True) -> list:
        """Hash the pages of ``num_tokens`` tokens (``page_chain``'s ``parts``; ``ids``: their
        ids' int32 bytes or None) after those added before; returns the futures (empty when
        hashed here)."""
        starts = range(0, num_tokens, page_size)

        def run(js) -> list:
            out = []
            for j0 in js:
                j1 = min(j0 + page_size, num_tokens)
                h = hashlib.sha256()
                if ids is not None:
                    h.update(ids[4 * j0:4 * j1])
                for data, row in parts:
                    h.update(data[j0 * row:j1 * row])
                out.append(h.digest())
            return out

        per_page = page_size * (sum(row for _, row in parts) + 4)
        if not pool or per_page * len(starts) < _INLINE_BYTES or len(starts) < 2:
            self._pages.append(run(starts))
            return []
        # tasks of about _TASK_BYTES, and at least one a worker
        step = max(1, min(_TASK_BYTES // per_page, -(-len(starts) // _WORKERS)))
        futures = [_pool().submit(run, starts[i:i + step]) for i in range(0, len(starts), step)]
        self._pages += futures
        return futures

    def digests(self) -> list:
        """The chain ``c_p`` of every page (raw 32-byte digests), once its pages are hashed."""
        out, prev = [], self.root
        for part in self._pages:
            for d in (part if isinstance(part, list) else part.result()):
                prev = hashlib.sha256(prev + d).digest()
                out.append(prev)
        return out

    def hexes(self) -> list:
        return [d.hex() for d in self.digests()]

    def cancel(self) -> None:
        for part in self._pages:
            if not isinstance(part, list):
                part.cancel()


def page_chain(root: bytes, parts: Sequence[tuple], tokens, num_tokens: int,
               page_size: int) -> list:
    """The hash chain (module doc) of ``num_tokens`` tokens whose K/V are ``parts``: K's layers
    then V's, each ``(its bytes, the bytes of one token's row)``, the rows of the tokens in
    order (a layer of a host array, or of a transfer's message); ``tokens``: their ids, or
    None; ``root``: ``chain_root`` of the payload header. Raw 32-byte digests, one a page of
    ``page_size`` tokens. Pages are hashed on threads when there are many."""
    return _Chain(root, parts, _ids_bytes(tokens), num_tokens, page_size).digests()


def page_chains(items: Sequence[tuple]) -> list:
    """``page_chain`` of each ``(root, parts, tokens, num_tokens, page_size)`` of ``items``,
    all hashed at once (the threads take the pages of every item before the first is
    waited for)."""
    chains = [_Chain(root, parts, _ids_bytes(tokens), n, ps)
              for root, parts, tokens, n, ps in items]
    return [c.digests() for c in chains]


def _page_hashes(k: np.ndarray, v: np.ndarray, tokens: Optional[Sequence[int]],
                 page_size: int, root: bytes) -> list:
    """The hash chain (module doc) of host arrays ``k``, ``v`` (num_layers, tokens, ...), in
    hex: each page's digest on the hashing threads, then the chain over the digests."""
    return _Chain(root, _layer_parts(k) + _layer_parts(v), _ids_bytes(tokens), k.shape[1],
                  page_size).hexes()


def payload_chain(payload: SequencePayload, tokens=None, page_size: int = 16) -> list:
    """The hash chain of a host payload (numpy arrays: ``to_numpy()``, a host tier's) as a KV
    file's entry holds it (``pages``, raw digests): rooted at its header, over ``tokens`` (its
    tokens' ids, or None) and its K/V in pages of ``page_size`` tokens."""
    return [bytes.fromhex(h) for h in _page_hashes(
        payload.k, payload.v, tokens, page_size, _root(payload.header()))]


def first_difference(want: Sequence, got: Sequence) -> Optional[int]:
    """The first page whose digest differs between two chains (or where one ends), None when
    they are equal."""
    bad = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if bad is None and len(want) != len(got):
        bad = min(len(want), len(got))
    return bad


def _host(a, dtype: str) -> np.ndarray:
    """Native array ``a`` on the host in ``dtype`` (its bits as stored), not copied when it is
    a contiguous host numpy array already (the reference backend's gather made it for this
    call: another copy was a fresh gigabyte per gigabyte saved)."""
    if type(a) is np.ndarray and a.dtype == np_dtype(dtype) and a.flags.c_contiguous:
        return a
    return to_host(a, dtype)


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


_CRC_SHIFTS: dict = {}


def _crc_shift(nbytes: int) -> list:
    """The GF(2) operator that advances a CRC-32 over ``nbytes`` zero bytes (zlib's
    ``crc32_combine``, which Python's zlib does not expose), composed once per length."""
    op = _CRC_SHIFTS.get(nbytes)
    if op is not None:
        return op
    odd = [0xEDB88320] + [1 << n for n in range(31)]       # one zero bit
    square = [_gf2_times(odd, odd[n]) for n in range(32)]   # two
    odd = [_gf2_times(square, square[n]) for n in range(32)]  # four
    op = [1 << n for n in range(32)]                        # the identity
    length = nbytes
    while length:
        # odd: 4 zero bits; squared: one byte, then 2, 4, ... bytes: the set bits of nbytes
        square = [_gf2_times(odd, odd[n]) for n in range(32)]
        if length & 1:
            op = [_gf2_times(square, op[n]) for n in range(32)]
        length >>= 1
        odd = square
    if len(_CRC_SHIFTS) < 64:
        _CRC_SHIFTS[nbytes] = op
    return op


def _crc_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1`` of ``A``, ``crc2`` of ``B`` and ``len2 = len(B)``."""
    return _gf2_times(_crc_shift(len2), crc1) ^ crc2 if len2 else crc1


def _crcs(parts: Sequence[tuple]) -> list:
    return [zlib.crc32(data) for data, _ in parts]


_CHUNK_BYTES = 32 << 20
"""K and V of about this many bytes are saved or loaded at a time (whole hash pages): a
gigabyte moves through a few reused buffers, not a fresh gigabyte, whose first touch (page
faults) cost more than the copy on the development VM."""
_IN_FLIGHT = 3
"""Chunks whose hashes may be pending at once (the threads hash one while this thread reads or
writes the next)."""


def _chunk_tokens(per_token: int, page_size: int) -> int:
    """Tokens of one chunk: a whole number of hash pages, about ``_CHUNK_BYTES`` of K and V."""
    return max(1, _CHUNK_BYTES // max(per_token * page_size, 1)) * page_size


def _pwrite(fd: int, data: memoryview, at: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


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
    # the headers first (every id checked); the K/V a chunk at a time below
    heads = [dataclasses.replace(cache.export_sequences([s], layers=range(0, 0))[0][0],
                                 backend=None, device=None) for s in ids]
    ps = cache.config.page_size
    all_toks = []
    for i, (sid, h) in enumerate(zip(ids, heads)):
        toks = None if tokens is None or tokens[i] is None else [int(t) for t in tokens[i]]
        if toks is not None and len(toks) != h.num_tokens:
            raise InvalidArgumentError(
                f"save_sequences: sequence {sid} holds {h.num_tokens} tokens, its token ids "
                f"list {len(toks)}")
        if toks is not None and not all(0 <= t < 2**31 for t in toks):
            raise InvalidArgumentError(
                f"save_sequences: sequence {sid}: token ids must lie in [0, 2**31) (the file "
                f"hashes them as int32)")
        all_toks.append(toks)
    offsets, offset = [], 0
    for h in heads:
        offsets.append(offset)
        offset += h.nbytes

    def head(crc_of, pages_of) -> bytes:
        entries = [{"payload": dict(h.header(), checksum=crc_of(i)), "tokens": toks,
                    "k": f"s{i}.k", "v": f"s{i}.v", "pages": pages_of(i)}
                   for i, (h, toks) in enumerate(zip(heads, all_toks))]
        header = {"format": FILE_FORMAT, "version": FILE_VERSION, "fingerprint": fingerprint,
                  "page_size": ps, "sequences": entries}
        tensors: dict = {}
        for i, (h, at) in enumerate(zip(heads, offsets)):
            half = h.nbytes // 2
            for name, lo in ((f"s{i}.k", at), (f"s{i}.v", at + half)):
                tensors[name] = {"dtype": _ST_DTYPES[h.array_dtype], "shape": list(h.shape),
                                 "data_offsets": [lo, lo + half]}
        tensors["__metadata__"] = {"kvcache": json.dumps(header, separators=(",", ":"))}
        out = json.dumps(tensors, separators=(",", ":")).encode()
        return out + b" " * (-len(out) % 8)

    def fetch(sid: int):
        into = getattr(getattr(cache, "payloads", None), "export_sequence_into", None)

        def rows(t0: int, t1: int, k_out, v_out) -> tuple:
            if into is not None and into(sid, t0, t1, k_out, v_out) is not None:
                return k_out, v_out
            p = cache.export_sequence(sid, t0, t1)
            return p.k, p.v
        return rows

    _write_streamed(path, heads, all_toks, [fetch(s) for s in ids], ps, head)


def _write_streamed(path, heads: Sequence[SequencePayload], all_toks: Sequence, fetches,
                    ps: int, head) -> None:
    """Write a KV file of the sequences with header-only payloads ``heads`` (token ids
    ``all_toks``, each list or None) at ``path`` (replaced whole: written beside it, then
    renamed), their arrays one after another in ``heads``' order: ``fetches[i](t0, t1, k_out,
    v_out)`` gives sequence i's K and V of tokens ``t0 .. t1-1`` (host or native arrays in its
    ``array_dtype``, ``k_out`` / ``v_out`` themselves where it filled those reused buffers).
    ``head(crc_of, pages_of)``: the container header (8-byte aligned JSON) for the payload
    CRC-32 of each sequence (8 hex digits) and its hash chain (``pages``, hex)."""
    offsets, offset = [], 0
    for h in heads:
        offsets.append(offset)
        offset += h.nbytes
    # the header holds the CRCs and hashes, fixed-width hex: its length is known now, so the
    # arrays go in first, at their offsets, while the threads hash them; the header last
    n = len(head(lambda i: "0" * 8, lambda i: ["0" * 64] * -(-heads[i].num_tokens // ps)))
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    chains: list = []
    writes: list = []
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            crcs = [_save_one(fetch, fd, 8 + n + at, h, toks, ps, chains, writes)
                    for fetch, h, toks, at in zip(fetches, heads, all_toks, offsets)]
            for w in writes:
                w.result()
            final = head(lambda i: f"{crcs[i]():08x}", lambda i: chains[i].hexes())
            if len(final) != n:                             # (fixed-width fields: never)
                raise RuntimeError("save_sequences: the header's length changed")
            _pwrite(fd, memoryview(struct.pack("<Q", n) + final), 0)
        finally:
            for w in writes:                    # (the file stays open until they are done)
                w.cancel() or w.exception()
            os.close(fd)
        os.replace(tmp, path)
    finally:
        for c in chains:
            c.cancel()
        if os.path.exists(tmp):
            os.remove(tmp)


def _save_one(fetch, fd: int, at: int, h: SequencePayload, toks, ps: int, chains: list,
              writes: list):
    """Write a sequence's K and V (header ``h``; ``fetch``: ``_write_streamed``'s) at byte
    ``at`` of ``fd``, a chunk of tokens at a time, each gathered once (into one of a few
    reused buffers where the backend can): its rows written by the io thread, its pages
    hashed and its rows' CRCs taken on the hashing threads, while this thread gathers the
    next. Appends its hash chain to ``chains`` and the writes to ``writes``; returns a call
    that gives its payload CRC-32 (``checksum``: the header, then K's bytes, then V's,
    combined from the chunks' rows)."""
    num_layers, num = h.num_layers, h.num_tokens
    half = h.nbytes // 2
    row = half // (num_layers * num) if num else 0
    chain = _Chain(_root(h.header()))
    chains.append(chain)
    ids = _ids_bytes(toks)
    step = _chunk_tokens(2 * num_layers * row, ps)
    starts = range(0, num, step)
    small = num <= step and h.nbytes < _INLINE_BYTES        # one small chunk: no threads
    segments: list = []     # per chunk: (its tokens, the CRC of each part: a list, or a
    #                         tuple of futures of the lists of consecutive parts)
    # reused buffers, one per chunk in flight (the first touch of a fresh gigabyte a gigabyte
    # saved cost more than the gather): flat bytes, each chunk a contiguous (K/V, layers,
    # tokens, ...) view; and per buffer the work that still reads it (or the chunk that took
    # its place where the backend gave arrays of its own)
    dtype = np_dtype(h.array_dtype)
    ring = [np.empty(2 * num_layers * min(step, num) * row, np.uint8)
            for _ in range(min(_IN_FLIGHT, len(starts)))]
    held: list = [[] for _ in ring]

    def write(t0: int, parts: list) -> None:
        for i, (data, _) in enumerate(parts):       # layer l of K, then of V, at its place
            which, layer = divmod(i, num_layers)
            _pwrite(fd, data, at + which * half + (layer * num + t0) * row)

    for c, t0 in enumerate(starts):
        t1 = min(t0 + step, num)
        for f in held[c % len(ring)]:               # the buffer's last chunk is done with
            f.result()
        buf = ring[c % len(ring)][:2 * num_layers * (t1 - t0) * row].view(dtype).reshape(
            (2, num_layers, t1 - t0) + tuple(h.shape[2:]))
        k, v = fetch(t0, t1, buf[0], buf[1])
        k, v = _host(k, h.array_dtype), _host(v, h.array_dtype)
        parts = _layer_parts(k) + _layer_parts(v)
        mine = None if ids is None else ids[4 * t0:4 * t1]
        futures = chain.add(parts, mine, t1 - t0, ps, pool=not small)
        if small:
            segments.append((t1 - t0, _crcs(parts)))
            write(t0, parts)
            continue
        # the CRCs in a few tasks (one task was a 32 MiB CRC on one core per chunk: with
        # many hashing threads the SHA-256 of a chunk finishes before its CRC)
        groups = max(1, min(len(parts), _WORKERS // 4))
        per = -(-len(parts) // groups)
        crc = tuple(_pool().submit(_crcs, parts[g:g + per]) for g in range(0, len(parts), per))
        segments.append((t1 - t0, crc))
        writes.append(_pool("io").submit(write, t0, parts))
        held[c % len(ring)] = futures + list(crc) + [writes[-1]]

    def payload_crc() -> int:
        crc = header_crc(h.header())
        got = [(t, c if isinstance(c, list) else [x for f in c for x in f.result()])
               for t, c in segments]
        for part in range(2 * num_layers):          # K's layers then V's, each chunk in order
            for count, crcs in got:
                crc = _crc_combine(crc, crcs[part], count * row)
        return crc
    return payload_crc


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


def _spec(path, table: dict, name, start: int, size: int) -> tuple:
    """``(dtype name, shape, file offset, bytes)`` of the container's array ``name``, its
    bounds and dtype checked (nothing read)."""
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
    return st, tuple(shape), start + lo, hi - lo


def _read(path, f, spec: tuple, name) -> np.ndarray:
    """The array of ``spec`` (``_spec``) read from the open unbuffered file ``f`` straight
    into a new array (no intermediate bytes object)."""
    st, shape, at, nbytes = spec
    out = np.empty(shape, dtype=np_dtype(st))
    view = _flat(out) if nbytes else memoryview(b"")
    f.seek(at)
    got = 0
    while got < nbytes:                 # (a read returns at most about 2 GiB)
        n = f.readinto(view[got:])
        if not n:
            raise _refuse(path, f"array {name!r}: the file ended {nbytes - got} bytes early "
                                f"(truncated while read)")
        got += n
    return out


def _array(path, table: dict, name, start: int, size: int, f) -> np.ndarray:
    """The array ``name`` of the container, its bounds and dtype checked."""
    return _read(path, f, _spec(path, table, name, start, size), name)


def _check_fingerprint(path, header: dict, fingerprint, where: str) -> None:
    """The caller's model ``fingerprint`` (None: not checked) against the file's: every field
    equal, else InvalidArgumentError naming the first that differs. ``where`` names the
    argument in a refusal of ``fingerprint`` itself."""
    theirs = header.get("fingerprint")
    if fingerprint is None:
        return
    _json_dict(fingerprint, where)
    if theirs is None:
        return
    if not isinstance(theirs, dict):
        raise _refuse(path, f"fingerprint={type(theirs).__name__} must be an object")
    for key in sorted(set(fingerprint) | set(theirs)):
        if fingerprint.get(key) != theirs.get(key):
            raise _refuse(path, f"fingerprint field {key!r} is {theirs.get(key)!r} in "
                                f"the file, {fingerprint.get(key)!r} here")


def _checked_entry(path, table, start: int, size: int, e: dict, i: int, config, seq_id,
                   convert_dtype: bool) -> tuple:
    """Entry ``i`` of a file's ``sequences`` checked before any array is read: its payload
    header (its fit to ``config`` as ``seq_id``, ``convert_dtype`` as ``import_sequence``'s),
    its K and V arrays' dtype, shape and place, its token ids' count. Returns ``(payload
    header, k spec, v spec, token ids or None)``; raises InvalidArgumentError naming the field
    (``_refuse``)."""
    ks = _spec(path, table, e["k"], start, size)
    vs = _spec(path, table, e["v"], start, size)
    try:
        h = SequencePayload.from_header(e["payload"])
        h.check_fits(config, seq_id, convert_dtype)
    except KVCacheError as exc:
        raise _refuse(path, f"sequence {i}: {exc}") from None
    for which, (st, shape, _, _) in (("k", ks), ("v", vs)):
        if st != h.array_dtype or shape != h.shape:
            raise _refuse(path, f"sequence {i}: its {which} array is {st} {list(shape)}, "
                                f"its payload header says {h.array_dtype} {list(h.shape)}")
    toks = e["tokens"]
    if toks is not None and len(toks) != h.num_tokens:
        raise _refuse(path, f"sequence {i}: {len(toks)} token ids for {h.num_tokens} tokens")
    return h, ks, vs, toks


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
    _check_fingerprint(path, header, fingerprint, "load_sequences: fingerprint")
    seqs = header["sequences"]
    ids = _new_ids(cache, len(seqs)) if seq_ids is None else [int(s) for s in seq_ids]
    if len(ids) != len(seqs):
        raise _refuse(path, f"{len(seqs)} sequences, {len(ids)} ids given")
    ps = header["page_size"]
    # every header first (its fields, its fit to the cache, its arrays' place in the file),
    # before a byte of K/V is read
    heads, specs = [], []
    for i, e in enumerate(seqs):
        h, ks, vs, _ = _checked_entry(path, table, start, size, e, i, cache.config, ids[i],
                                      convert_dtype)
        # checked by the chain, which covers what the CRC-32 does: not computed again
        heads.append(dataclasses.replace(h, checksum=None))
        specs.append((ks, vs))
    c = cache.config
    direct = c.kv_format.payload_dtype(c.dtype)
    if all(h.array_dtype == direct and (not c.kv_format.packed or (
            h.kv_dtype, h.kv_quant_group, h.dtype) == (c.kv_dtype, c.kv_quant_group, c.dtype))
           for h in heads):
        _load_streamed(cache, path, seqs, ids, heads, specs, ps, convert_dtype)
    else:
        _load_whole(cache, path, seqs, ids, heads, specs, ps, convert_dtype)
    # the ids last: recorded ids put full pages in the prefix index, which a rollback would
    # leave cached
    for sid, e in zip(ids, seqs):
        if e["tokens"] is not None:
            cache.extend_tokens(sid, e["tokens"])
    return ids


def _refuse_page(path, i: int, page: int, ps: int) -> InvalidArgumentError:
    return _refuse(path, f"sequence {i}: page {page} (tokens {page * ps}..) fails its hash: "
                         f"its bytes, ids, payload header or a page before it changed")


def _load_streamed(cache, path, seqs, ids, heads, specs, ps: int, convert_dtype: bool) -> None:
    """Load sequences whose arrays the cache takes as they are (its storage dtype, fp8's
    compute dtype, its own packed rows) a chunk of tokens at a time: each chunk read into a
    reused buffer, written into pages reserved for the sequences (``reserve_import``) while
    the threads hash it; the sequences appear (``commit_import``) once every page's hash is
    checked, else the pages go back (``cancel_import``) and nothing was loaded."""
    b = cache.backend
    res = cache.reserve_import([(sid, h, None, None) for sid, h in zip(ids, heads)],
                               convert_dtype)
    chains: list = []
    try:
        offset = 0
        for i, (e, h, (ks, vs)) in enumerate(zip(seqs, heads, specs)):
            chains.append(_stream_one(cache, b, res, path, e, h, ks, vs, ps, offset))
            offset += h.num_tokens
        for i, (e, chain) in enumerate(zip(seqs, chains)):
            bad = first_difference(chain.hexes(), e["pages"])
            if bad is not None:
                raise _refuse_page(path, i, bad, ps)
        cache.commit_import(res)
    except BaseException:
        for chain in chains:
            chain.cancel()
        cache.cancel_import(res)
        raise


def _stream_one(cache, b, res, path, e, h, ks, vs, ps: int, offset: int,
                chain: Optional[_Chain] = None, first: int = 0,
                write_from: int = 0) -> _Chain:
    """Read and hash one sequence's K and V (header ``h``, entry ``e``, array specs ``ks`` /
    ``vs``) from its token ``first`` (a multiple of ``ps``) on, a chunk of tokens at a time,
    and write its tokens from ``write_from`` (>= ``first``) on into ``res`` (None: hashed
    only), token ``t`` of the sequence at the reservation's token ``offset + t``: the io
    thread reads the next chunks into reused buffers and the hashing threads hash the last
    ones while this thread writes one. ``chain``: the chain to go on with (None: a new one
    from the payload header: ``first`` 0); returns it (``_Chain``)."""
    num_layers, num = h.num_layers, h.num_tokens
    st, _, k_at, nbytes = ks
    v_at = vs[2]
    row = nbytes // (num_layers * num) if num else 0
    chain = _Chain(_root(e["payload"])) if chain is None else chain
    if first >= num:
        return chain
    ids = _ids_bytes(e["tokens"])
    step = _chunk_tokens(2 * num_layers * row, ps)
    starts = range(first, num, step)
    todo = 2 * num_layers * (num - first) * row
    small = len(starts) == 1 and todo < _INLINE_BYTES    # one small chunk: no threads
    # reused buffers, one per chunk in flight: a fresh gigabyte per gigabyte loaded cost more
    # in first-touch page faults than the copy
    ring = [np.empty((2, num_layers, min(step, num - first)) + h.shape[2:], np_dtype(st))
            for _ in range(min(_IN_FLIGHT, len(starts)))]
    hashed: list = [[] for _ in ring]               # per buffer: its last chunk's hashing
    fd = os.open(path, os.O_RDONLY)

    def read(c: int) -> np.ndarray:
        t0, t1 = starts[c], min(starts[c] + step, num)
        for f in hashed[c % len(ring)]:             # the buffer's last chunk is hashed
            f.result()
        buf = ring[c % len(ring)][:, :, :t1 - t0]  # (K/V, layers, tokens, ...): contiguous
        for which, at in ((0, k_at), (1, v_at)):    # a layer's rows of the chunk: one read
            for layer in range(num_layers):
                _pread(path, fd, _flat_view(buf[which, layer]), at + (layer * num + t0) * row)
        return buf

    reads: dict = {}
    try:
        for c, t0 in enumerate(starts):
            t1 = min(t0 + step, num)
            # the io thread reads ahead into the other buffers (with one buffer: this chunk)
            for ahead in range(c, min(c + max(len(ring) - 1, 1), len(starts))) \
                    if not small else ():
                if ahead not in reads:
                    reads[ahead] = _pool("io").submit(read, ahead)
            buf = read(c) if small else reads.pop(c).result()
            parts = _layer_parts(buf[0]) + _layer_parts(buf[1])
            hashed[c % len(ring)] = chain.add(
                parts, None if ids is None else ids[4 * t0:4 * t1], t1 - t0, ps, pool=not small)
            w0 = max(t0, write_from)
            if res is None or w0 >= t1:
                continue
            # (a chunk that starts before write_from: its rows the cache holds already are
            # hashed, not written)
            k, v = buf[0, :, w0 - t0:], buf[1, :, w0 - t0:]
            if not b.is_native(k):
                k, v = b.from_numpy(k, h.array_dtype), b.from_numpy(v, h.array_dtype)
            cache.write_import(res, k, v, tokens=range(offset + w0, offset + t1))
    finally:
        for r in reads.values():                    # (the file stays open until they are done)
            r.cancel() or r.exception()
        os.close(fd)
    return chain


def _flat_view(a: np.ndarray) -> memoryview:
    """The bytes of contiguous array ``a``, writable (a read goes into it: never a copy)."""
    if not a.flags.c_contiguous:
        raise RuntimeError("_flat_view: a read buffer must be contiguous")
    return a.reshape(-1).view(np.uint8).data


def _pread(path, fd: int, out: memoryview, at: int) -> None:
    while len(out):
        n = os.preadv(fd, [out], at)
        if not n:
            raise _refuse(path, f"the file ended at byte {at} (truncated while read)")
        out, at = out[n:], at + n


def _load_whole(cache, path, seqs, ids, heads, specs, ps: int, convert_dtype: bool) -> None:
    """Load sequences whose arrays the cache converts (another dtype, group size, format):
    every array read and every page hash checked, then each sequence imported
    (``import_sequence``: all or nothing)."""
    arrays, chains = [], []
    with open(path, "rb", buffering=0) as f:
        for e, (ks, vs) in zip(seqs, specs):
            k, v = _read(path, f, ks, e["k"]), _read(path, f, vs, e["v"])
            arrays.append((k, v))
            # (hashed on the threads while the next is read)
            chains.append(_Chain(_root(e["payload"]), _layer_parts(k) + _layer_parts(v),
                                 _ids_bytes(e["tokens"]), k.shape[1], ps))
    for i, (e, chain) in enumerate(zip(seqs, chains)):
        bad = first_difference(chain.hexes(), e["pages"])
        if bad is not None:
            raise _refuse_page(path, i, bad, ps)
    done: list = []
    try:
        for sid, h, (k, v) in zip(ids, heads, arrays):
            cache.import_sequence(sid, dataclasses.replace(h, k=k, v=v),
                                  convert_dtype=convert_dtype)
            done.append(sid)
    except BaseException:
        for sid in done:                # all or nothing: the sequences loaded so far go again
            cache.remove_sequence(sid)
        raise


def _new_ids(cache, n: int) -> list:
    have = cache.sequence_ids
    first = max(have) + 1 if have else 0
    return list(range(first, first + n))



# ---------------------------------------------------------------------- payload-level helpers
# (the prefix cache's files, ``kvcache.prefix_files``: entries that are not the cache's own
# sequences, and entries that continue an earlier entry)

def write_payloads(path, payloads: Sequence[SequencePayload], tokens: Sequence,
                   page_size: int, fingerprint: Optional[dict] = None,
                   parents: Optional[Sequence] = None, header_fields: Optional[dict] = None,
                   entry_fields: Optional[Sequence[dict]] = None,
                   fetches: Optional[Sequence] = None) -> None:
    """Write host payloads (``SequencePayload.to_numpy()``, checksummed) as a KV file at
    ``path`` (replaced whole, as ``save_sequences`` does), one entry each; or, with
    ``fetches``, header-only payloads whose K and V ``fetches[i](t0, t1, k_out, v_out)`` gives
    a chunk of tokens at a time (``_write_streamed``'s: the file is written as
    ``save_sequences`` writes one, through a few reused buffers). ``tokens``: per
    payload its token ids (a list of ``num_tokens`` ints in [0, 2**31), or None); ``page_size``:
    the hash chain's; ``fingerprint``: as ``save_sequences``'s. ``parents``: per payload None
    or the index of an earlier entry it continues: the payload's tokens follow that entry's
    first ``payload.start - its start`` tokens, a whole number of pages; the entry then
    records ``"parent": [index, that entry's page hash at the join]`` (``check_payloads`` checks
    it). ``header_fields`` / ``entry_fields``: more JSON fields for the file header / for each
    entry (a standard field's name is refused). Raises InvalidArgumentError for arguments that
    do not fit; nothing is written then."""
    n = len(payloads)
    parents = [None] * n if parents is None else list(parents)
    extra = [{}] * n if entry_fields is None else list(entry_fields)
    if len(tokens) != n or len(parents) != n or len(extra) != n:
        raise InvalidArgumentError(
            f"write_payloads: {n} payloads, {len(tokens)} token lists, {len(parents)} parents, "
            f"{len(extra)} entry field sets")
    if fingerprint is not None:
        _json_dict(fingerprint, "write_payloads: fingerprint")
    standard = {"payload", "tokens", "k", "v", "pages", "parent"}
    for fields, where, names in ((header_fields or {}, "header_fields",
                                  {"format", "version", "fingerprint", "page_size", "sequences"}),
                                 *((f, f"entry_fields[{i}]", standard)
                                   for i, f in enumerate(extra))):
        _json_dict(fields, f"write_payloads: {where}")
        clash = sorted(names & set(fields))
        if clash:
            raise InvalidArgumentError(
                f"write_payloads: {where} may not set the standard fields {clash}")
    all_toks: list = []
    links: list = []                    # per entry: None or (its parent, the page at the join)
    for i, (p, toks, parent) in enumerate(zip(payloads, tokens, parents)):
        if toks is not None:
            toks = [int(t) for t in toks]
            if len(toks) != p.num_tokens or not all(0 <= t < 2**31 for t in toks):
                raise InvalidArgumentError(
                    f"write_payloads: entry {i}: {p.num_tokens} tokens need as many ids in "
                    f"[0, 2**31), got {len(toks)}")
        link = None
        if parent is not None:
            up = payloads[parent] if isinstance(parent, int) and 0 <= parent < i else None
            if up is None or not (0 < p.start - up.start <= up.num_tokens
                                  and (p.start - up.start) % page_size == 0):
                raise InvalidArgumentError(
                    f"write_payloads: entry {i} (tokens from {p.start}) cannot continue entry "
                    f"{parent!r}: it must be an earlier entry whose tokens reach its start, "
                    f"in whole pages of {page_size}")
            link = (parent, (p.start - up.start) // page_size - 1)
        all_toks.append(toks)
        links.append(link)
    heads = [dataclasses.replace(p, k=None, v=None, backend=None, device=None, checksum=None)
             for p in payloads]
    ps = int(page_size)

    def head(crc_of, pages_of) -> bytes:
        entries = [{**extra[i], "payload": dict(h.header(), checksum=crc_of(i)), "tokens": toks,
                    "parent": None if link is None else [link[0], pages_of(link[0])[link[1]]],
                    "k": f"s{i}.k", "v": f"s{i}.v", "pages": pages_of(i)}
                   for i, (h, toks, link) in enumerate(zip(heads, all_toks, links))]
        header = {**(header_fields or {}), "format": FILE_FORMAT, "version": FILE_VERSION,
                  "fingerprint": fingerprint, "page_size": ps, "sequences": entries}
        tensors: dict = {}
        offset = 0
        for i, h in enumerate(heads):
            half = h.nbytes // 2
            for name in (f"s{i}.k", f"s{i}.v"):
                tensors[name] = {"dtype": _ST_DTYPES[h.array_dtype], "shape": list(h.shape),
                                 "data_offsets": [offset, offset + half]}
                offset += half
        tensors["__metadata__"] = {"kvcache": json.dumps(header, separators=(",", ":"))}
        out = json.dumps(tensors, separators=(",", ":")).encode()
        return out + b" " * (-len(out) % 8)

    def arrays(p: SequencePayload):
        def rows(t0: int, t1: int, k_out, v_out) -> tuple:
            np.copyto(k_out, p.k[:, t0:t1])
            np.copyto(v_out, p.v[:, t0:t1])
            return k_out, v_out
        return rows

    _write_streamed(path, heads, all_toks,
                    list(fetches) if fetches is not None else [arrays(p) for p in payloads],
                    ps, head)


def check_payloads(path, config, fingerprint: Optional[dict] = None,
                   convert_dtype: bool = False) -> tuple:
    """Check the KV file ``path`` for a cache of ``config`` (a ``CacheConfig``) as
    ``load_sequences`` does before it reads a byte of K/V: the container's bounds, the
    header, format and version, ``fingerprint`` against the file's, each payload header's fit
    (``convert_dtype`` as ``import_sequence``'s), its arrays' dtype, shape and place, its
    token ids' count, and each entry's ``parent`` link (``write_payloads``: an earlier entry,
    a whole number of its pages, its page hash at the join). Reads no array and changes
    nothing: the page hashes are checked as the arrays are read (``stream_payload``), and
    they cover what the payload's CRC-32 covers, which is not computed.

    Returns ``(header, entries)``: the file header and per entry ``PayloadEntry``: its
    header-only payload (``checksum`` None), token ids (or None), array specs and the index
    of the entry it continues (or None). Raises InvalidArgumentError naming the field
    (ending "nothing was loaded"), UnsupportedFeatureError for another version."""
    table, header, start, size = _container(path)
    _check_header(path, header)
    _check_fingerprint(path, header, fingerprint, "fingerprint")
    ps = header["page_size"]
    seqs = header["sequences"]
    out: list = []
    for i, e in enumerate(seqs):
        h, ks, vs, toks = _checked_entry(path, table, start, size, e, i, config, i,
                                         convert_dtype)
        link = e.get("parent")
        parent = None
        if link is not None:
            up = (out[link[0]].payload if isinstance(link, list) and len(link) == 2
                  and isinstance(link[0], int) and not isinstance(link[0], bool)
                  and 0 <= link[0] < i else None)
            joint = 0 if up is None else h.start - up.start
            if up is None or not (0 < joint <= up.num_tokens and joint % ps == 0) \
                    or seqs[link[0]]["pages"][joint // ps - 1:joint // ps] != [link[1]]:
                raise _refuse(path, f"sequence {i}: parent={link!r:.80} is not an earlier "
                                    f"entry whose page hash at token {h.start} it names")
            parent = link[0]
        elif h.start != 0:
            raise _refuse(path, f"sequence {i} starts at token {h.start} and continues no "
                                f"entry (parent=null)")
        # checked by the chain, which covers what the CRC-32 does: not computed
        out.append(PayloadEntry(dataclasses.replace(h, checksum=None), toks, (ks, vs), parent))
    return header, out


@dataclasses.dataclass(frozen=True)
class PayloadEntry:
    """One entry of a checked KV file (``check_payloads``): ``payload``, its header-only
    payload (no arrays, ``checksum`` None); ``tokens``, its token ids or None; ``specs``, its
    K and V arrays' ``(dtype name, shape, file offset, bytes)``; ``parent``, the index of the
    entry it continues, or None."""

    payload: SequencePayload
    tokens: Optional[list]
    specs: tuple
    parent: Optional[int]


def stream_payload(cache, path, header: dict, i: int, entry: PayloadEntry, reservation=None,
                   offset: int = 0, first_page: int = 0, write_from: int = 0) -> None:
    """Read entry ``i`` of the checked KV file ``path`` (``check_payloads``' ``header`` and
    ``entry``) a chunk of whole pages at a time through reused buffers, check its page hashes
    from page ``first_page`` on (the earlier pages' hashes are taken as the file gives them:
    the caller checked them, e.g. against the cache's copy of those tokens), and write its
    tokens from ``write_from`` (>= ``first_page * page_size``) on into the open
    ``reservation`` of ``cache`` (``reserve_import``; None: hashed only), token ``t`` of the
    entry at the reservation's token ``offset + t``. The reservation's arrays must be those
    the cache takes as they are (its storage dtype, fp8's compute dtype, its own packed
    rows). Raises InvalidArgumentError naming the page whose hash fails (the caller then
    cancels the reservation: nothing was loaded)."""
    ps = header["page_size"]
    e = header["sequences"][i]
    root = _root(e["payload"]) if first_page == 0 else bytes.fromhex(e["pages"][first_page - 1])
    ks, vs = entry.specs
    chain = _Chain(root)
    try:
        _stream_one(cache, cache.backend, reservation, path, e, entry.payload, ks, vs, ps,
                    offset, chain, first_page * ps, write_from)
        bad = first_difference(chain.hexes(), e["pages"][first_page:])
    finally:
        chain.cancel()
    if bad is not None:
        raise _refuse_page(path, i, first_page + bad, ps)


def read_payload(path, entry: PayloadEntry) -> SequencePayload:
    """The host payload of a checked entry (``check_payloads``): its K and V read whole (a
    load whose arrays the cache converts), ``checksum`` None (the caller checks the page
    hashes: ``payload_chain`` against the entry's ``pages``)."""
    ks, vs = entry.specs
    with open(path, "rb", buffering=0) as f:
        k, v = _read(path, f, ks, "k"), _read(path, f, vs, "v")
    return dataclasses.replace(entry.payload, k=k, v=v)


def check_pages(path, header: dict, i: int, payload: SequencePayload) -> None:
    """Check every page hash of entry ``i`` of the KV file ``path`` (``header``) against its
    host payload read whole (``read_payload``); InvalidArgumentError naming the first page
    that fails."""
    e = header["sequences"][i]
    ps = header["page_size"]
    chain = _Chain(_root(e["payload"]), _layer_parts(payload.k) + _layer_parts(payload.v),
                   _ids_bytes(e["tokens"]), payload.num_tokens, ps)
    bad = first_difference(chain.hexes(), e["pages"])
    if bad is not None:
        raise _refuse_page(path, i, bad, ps)


def rows_chain(fetch, payload_header: dict, payload: SequencePayload, tokens, page_size: int,
               num_tokens: int) -> list:
    """The hash chain (hex, ``pages``) of a payload's first ``num_tokens`` tokens (whole
    pages of ``page_size``), rooted at ``payload_header`` (a file entry's ``payload``), over
    ``tokens`` (their ids, or None) and the K/V rows that ``fetch(t0, t1, k_out, v_out)``
    gives (``write_payloads``' fetch: host or native arrays in ``payload.array_dtype``,
    ``k_out`` / ``v_out`` themselves where it filled those buffers): a cache's copy of an
    entry's tokens, checked against the file's hashes without reading the file."""
    num_layers = payload.num_layers
    rest = tuple(payload.shape[2:])
    dtype = np_dtype(payload.array_dtype)
    per_token = 2 * num_layers * int(np.prod(rest, dtype=np.int64)) * dtype.itemsize
    step = _chunk_tokens(per_token, page_size)
    chain = _Chain(_root(payload_header))
    ids = _ids_bytes(tokens)
    ring = [np.empty((2, num_layers, min(step, num_tokens)) + rest, dtype)
            for _ in range(min(2, -(-num_tokens // step)))]
    held: list = [[] for _ in ring]
    try:
        for c, t0 in enumerate(range(0, num_tokens, step)):
            t1 = min(t0 + step, num_tokens)
            for f in held[c % len(ring)]:           # the buffer's last chunk is hashed
                f.result()
            buf = ring[c % len(ring)][:, :, :t1 - t0]
            k, v = fetch(t0, t1, buf[0], buf[1])
            k, v = _host(k, payload.array_dtype), _host(v, payload.array_dtype)
            held[c % len(ring)] = chain.add(_layer_parts(k) + _layer_parts(v),
                                            None if ids is None else ids[4 * t0:4 * t1],
                                            t1 - t0, page_size)
        return chain.hexes()
    finally:
        chain.cancel()
