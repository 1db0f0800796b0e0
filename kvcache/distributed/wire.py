"""The wire format of a transfer (``transfer``'s docstring describes it): its constants, the
writer of its head, the layer groups of its data messages, the dtype and row of the arrays a
cache sends, and the receiver's checks of a head's JSON. Plain numpy and JSON: no torch here.
"""

from __future__ import annotations

import json
import zlib

import numpy as np

from ..config import DTYPES, itemsize
from ..errors import InvalidArgumentError, UnsupportedFeatureError
from ..formats import FORMAT_TABLE
from ..transfer import FORMAT_VERSION, SequencePayload

MAGIC = 0x6B76_6361_6368_6533    # "kvcache3": the first int64 of every transfer
"""The first int64 of every transfer ("kvcache3" in ASCII, the wire's third layout: the tail
carries the pages' hash chain): a receiver that reads anything else is not talking to this
``send_sequence`` and raises instead of misreading the bytes."""
HEAD_BYTES = 16 << 10
"""The size of a transfer's first message (its fixed part and the start of its JSON): fixed, so
that a receiver can post it before it knows anything of the transfer."""
_FIXED = 8                           # int64s of the head's fixed part
_JSON_LIMIT = 64 << 20               # a longer JSON is not a sender's
TORCH_DTYPES = ("float16", "bfloat16", "float32")
MESSAGE_BYTES = 128 << 20
"""About how many bytes (K and V together) one data message of a large transfer holds."""
MIN_MESSAGES = 4
"""A large transfer's data comes in at least this many messages (a pipeline)."""
STREAM_MESSAGES = 8
"""A transfer sent during its forward comes in about this many data messages (groups of
consecutive layers): each costs the sending host a gather and a send (a few hundred us), so
one a layer would slow a prefill whose layers take less GPU time than that."""


def head_message(body: bytes, nbytes: int, num_layers: int, per: int,
                 streamed: bool = False, chain_pages: int = 0) -> tuple:
    """``(head, rest)``: a transfer's first message (``HEAD_BYTES`` uint8, numpy) for a JSON
    header ``body``, ``nbytes`` bytes each of K and V over ``num_layers`` layers, ``per`` a data
    message, ``streamed``: sent during the forward that writes it, ``chain_pages``: the pages
    whose hash chain the tail carries (0: none); the JSON's CRC-32 goes in the fixed part
    too. ``rest``: the JSON's bytes that did not fit (b"" but for very large batches), the
    second message. The one writer of the wire's head."""
    head = np.zeros(HEAD_BYTES, np.uint8)
    head[:_FIXED * 8].view(np.int64)[:8] = (MAGIC, len(body), nbytes, num_layers, per,
                                            int(streamed), zlib.crc32(body), chain_pages)
    inline = body[:HEAD_BYTES - _FIXED * 8]
    head[_FIXED * 8:_FIXED * 8 + len(inline)] = np.frombuffer(inline, np.uint8)
    return head, body[len(inline):]


def layers_per_message(num_layers: int, nbytes: int, message_bytes: int = MESSAGE_BYTES,
                       pipeline: bool = True) -> int:
    """Layers whose K and V one data message of a transfer of ``nbytes`` bytes (K and V
    together) holds: ``num_layers`` for a small transfer, else about
    ``message_bytes`` a message and at least ``MIN_MESSAGES`` messages, so that gathering
    (sender) and writing (receiver) the rows of one message overlap the wire time of the
    next (``pipeline=False``: by size alone)."""
    if nbytes <= message_bytes or num_layers == 1:
        return num_layers
    per_layer = nbytes / num_layers
    by_size = max(1, int(message_bytes // per_layer))
    return by_size if not pipeline else max(1, min(by_size, -(-num_layers // MIN_MESSAGES)))


def _array_dtype(config) -> str:
    """The dtype of the K/V arrays a cache of ``config`` sends and ``write_import`` takes:
    the storage dtype, the compute dtype for fp8 pages (their values), uint8 for int8 / int4
    pages (their packed rows)."""
    return config.kv_format.payload_dtype(config.dtype)


def _row(config) -> int:
    """The last axis of the arrays a cache of ``config`` sends: head_dim, or the bytes of a
    packed int8 / int4 row."""
    if config.kv_format.packed:
        return config.kv_format.row_bytes(config.head_dim, config.dtype, config.kv_quant_group)
    return config.head_dim


def _packed_fits(config, msg: dict, where: str) -> None:
    """InvalidArgumentError unless packed int8 / int4 rows (``msg``) can be stored unchanged in
    a cache of ``config``: the same format, group size and compute dtype."""
    head = msg["payloads"][0] if msg["payloads"] else {}
    theirs = (msg["kv_dtype"], head.get("kv_quant_group"), head.get("dtype"))
    mine = (config.kv_dtype, config.kv_quant_group, config.dtype)
    if msg["dtype"] == "uint8" and theirs != mine:
        raise InvalidArgumentError(
            f"{where}: packed {theirs[0]} rows (groups of {theirs[1]}, {theirs[2]}) are stored "
            f"unchanged, so only into a cache of that format, group size and compute dtype; "
            f"this one stores {mine[0]} (groups of {mine[1]}, {mine[2]}): import an "
            f"export_sequence payload with convert_dtype=True instead")


def _spans(nbytes: int, num_layers: int, per: int, ids: list, src: int, limit: int) -> list:
    """The layer ranges of a transfer's data messages (none without data), from the fixed
    part of its header: InvalidArgumentError when they cannot be a sender's or hold more
    than ``limit`` bytes (of K: what the receiving cache could ever hold, in float32)."""
    if not nbytes:
        return []
    if (nbytes < 0 or num_layers < 1 or per < 1 or nbytes % num_layers
            or nbytes > limit):
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: rank {src} announced {nbytes} bytes over "
            f"{num_layers} layers, {per} a message: not a kvcache transfer of this version or "
            f"more than this cache could hold ({limit} bytes)")
    return [range(f, min(f + per, num_layers)) for f in range(0, num_layers, per)]


def _read_header(text: bytes, nbytes: int, ids: list, src: int):
    """``(message, shape, payload headers)`` of a transfer's JSON header, checked in itself:
    InvalidArgumentError naming what disagrees (the top-level kv_dtype, dtype and shape
    against every payload's, the byte count against the shape and the fixed-size part).
    ``message["dtype"]`` is set to the arrays' dtype (``kv_dtype`` where the sender wrote
    none)."""
    where = f"recv_sequence of sequences {ids} from rank {src}"
    try:
        msg = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgumentError(f"{where}: the header is not JSON ({exc})") from None
    if not isinstance(msg, dict):
        raise InvalidArgumentError(f"{where}: the header is a {type(msg).__name__}, not an object")
    missing = [k for k in ("version", "kv_dtype", "shape", "nbytes", "payloads") if k not in msg]
    if missing:
        raise InvalidArgumentError(f"{where}: the header lacks {missing}")
    if msg["version"] != FORMAT_VERSION:
        raise UnsupportedFeatureError(
            f"{where}: format version {msg['version']!r} is not supported: this kvcache reads "
            f"version {FORMAT_VERSION}")
    kv_dtype, raw_shape, payloads = msg["kv_dtype"], msg["shape"], msg["payloads"]
    if not isinstance(kv_dtype, str) or kv_dtype not in FORMAT_TABLE:
        raise InvalidArgumentError(
            f"{where}: kv_dtype={kv_dtype!r} must be one of {tuple(FORMAT_TABLE)}")
    dtype = msg.get("dtype")
    if dtype is None and kv_dtype in DTYPES:
        dtype = kv_dtype
    packed = FORMAT_TABLE[kv_dtype].packed
    if (not isinstance(dtype, str) or (packed and dtype != "uint8")
            or (not packed and dtype not in DTYPES)
            or (kv_dtype in DTYPES and dtype != kv_dtype)):
        raise InvalidArgumentError(
            f"{where}: dtype={dtype!r} (the arrays' dtype) must be kv_dtype itself for plain "
            f"pages, the compute dtype (one of {DTYPES}) for fp8 pages, uint8 (packed rows) "
            f"for int8 / int4 pages; kv_dtype is {kv_dtype!r}")
    msg["dtype"] = dtype
    if (not isinstance(raw_shape, list) or len(raw_shape) != 4
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in raw_shape)):
        raise InvalidArgumentError(
            f"{where}: shape={raw_shape!r} must be 4 ints >= 0 (layers, tokens, KV heads, head_dim)")
    shape = tuple(raw_shape)
    want = shape[0] * shape[1] * shape[2] * shape[3] * itemsize(dtype)
    if msg["nbytes"] != want or nbytes != want:
        raise InvalidArgumentError(
            f"{where}: {nbytes} bytes each of K and V follow (header nbytes={msg['nbytes']!r}), "
            f"but shape {list(shape)} in {dtype} is {want} bytes")
    if not isinstance(payloads, list):
        raise InvalidArgumentError(f"{where}: payloads must be a list, got {type(payloads).__name__}")
    headers = [SequencePayload.from_header(h) for h in payloads]
    if len(headers) != len(ids):
        raise InvalidArgumentError(
            f"recv_sequence got {len(ids)} seq_ids {ids} but rank {src} sent "
            f"{len(headers)} sequences")
    for h in headers:
        dims = (h.num_layers, h.num_kv_heads, h.shape[3])
        if (h.kv_dtype != kv_dtype or h.array_dtype != dtype
                or dims != (shape[0], shape[2], shape[3])
                or (h.kv_quant_group, h.dtype) != (headers[0].kv_quant_group, headers[0].dtype)):
            raise InvalidArgumentError(
                f"{where}: a payload header says kv_dtype={h.kv_dtype} (arrays in "
                f"{h.array_dtype}), kv_quant_group={h.kv_quant_group}, (layers, KV heads, "
                f"row)={dims}, the transfer {kv_dtype} (arrays in {dtype}), "
                f"{(shape[0], shape[2], shape[3])}, the first payload's kv_quant_group="
                f"{headers[0].kv_quant_group}")
    if sum(h.num_tokens for h in headers) != shape[1]:
        raise InvalidArgumentError(
            f"{where}: the payloads hold {sum(h.num_tokens for h in headers)} tokens, the "
            f"arrays {shape[1]}")
    tokens = msg.get("tokens")
    if tokens is None:
        msg["tokens"] = [None] * len(headers)
    elif not isinstance(tokens, list) or len(tokens) != len(headers) or not all(
            t is None or (isinstance(t, list) and len(t) == h.end and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in t))
            for t, h in zip(tokens, headers)):
        raise InvalidArgumentError(
            f"{where}: tokens={tokens!r:.80} must be null or per sequence null or its token "
            f"ids from token 0 to its end ({[h.end for h in headers]} of them), each in "
            f"[0, 2**31)")
    return msg, shape, headers


def chain_pages(headers: list, page_size: int) -> int:
    """The pages of a transfer's hash chain: each sequence's tokens in pages of
    ``page_size``."""
    return sum(-(-h.num_tokens // page_size) for h in headers)


def check_chain_header(msg: dict, headers: list, pages: int, where: str) -> int:
    """The chain's page size (``msg["page_size"]``) when the fixed part announced ``pages``
    hashed pages (0: none, returns 0): InvalidArgumentError unless the JSON's page size gives
    that many."""
    if not pages:
        return 0
    ps = msg.get("page_size")
    if (not isinstance(ps, int) or isinstance(ps, bool) or ps < 1
            or chain_pages(headers, ps) != pages):
        raise InvalidArgumentError(
            f"{where}: the head announced the hashes of {pages} pages, but page_size={ps!r} "
            f"makes them {chain_pages(headers, ps) if isinstance(ps, int) and ps >= 1 else '?'}")
    return ps


def transfer_chains(payloads: list, tokens: list, page_size: int, spans: list, messages: list,
                    shape: tuple, itemsize_: int) -> list:
    """Per sequence of a transfer its hash chain (``kvcache.files.page_chain``: raw 32-byte
    digests, rooted at its payload header as the JSON holds it, over its token ids' share and
    its rows) over the data ``messages`` (flat host uint8 arrays: per layer group of
    ``spans``, K's rows of those layers then V's, the sequences' tokens one after another):
    what the sender puts in the tail and the receiver computes again."""
    from ..files import chain_root, page_chains
    row = shape[2] * shape[3] * itemsize_
    layer = shape[1] * row
    ks, vs = [], []
    for span, message in zip(spans, messages):
        data = memoryview(message)
        half = len(span) * layer
        for i in range(len(span)):
            ks.append(data[i * layer:(i + 1) * layer])
            vs.append(data[half + i * layer:half + (i + 1) * layer])
    items, offset = [], 0
    for head, ids in zip(payloads, tokens):
        n, start = head["num_tokens"], head["start"]
        parts = [(x[offset * row:(offset + n) * row], row) for x in ks + vs]
        items.append((chain_root(head), parts, None if ids is None else ids[start:start + n],
                      n, page_size))
        offset += n
    return page_chains(items)
