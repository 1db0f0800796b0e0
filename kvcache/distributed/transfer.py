"""Moving sequences' KV between the caches of two processes over torch.distributed.

One call moves a batch of sequences in a few point-to-point messages, in this order:

1. a header: an int64 tensor ``[MAGIC, n, nbytes, num_layers, layers_per_message]`` then ``n``
   uint8 bytes of JSON ``{"version", "payloads": [SequencePayload.header() per sequence],
   "kv_dtype", "dtype", "shape", "nbytes"}`` (``nbytes``: the bytes of K, and of V, that
   follow; in the fixed-size part too, with the layer grouping, so that a receiver that
   refuses the JSON still knows what to drain; ``dtype``: the arrays' dtype, the compute dtype
   for fp8 pages, whose arrays hold the values read back and whose payload headers carry the
   scales; None or absent: ``kv_dtype``);
2. for each group of ``layers_per_message`` consecutive layers, K then V: the sequences'
   tokens, one sequence after another, as the raw bytes of a contiguous (layers, total tokens,
   num_kv_heads, head_dim) array in ``dtype`` (what ``PagedKVCache.export_sequences(...,
   layers=...)`` gathers; none when there are no tokens). One group holds every layer up to
   ``MESSAGE_BYTES`` of K; a larger transfer comes in groups of about that size, at least
   ``MIN_MESSAGES`` of them (``layers_per_message``), so that the sender gathers a group while
   the last is on the wire and the receiver writes one while the next arrives.

fp8 pages (``kv_dtype="float8_e4m3"``) move as ``export_sequence`` / ``import_sequence`` move
them: the values with the scales, which the receiver adopts for layers it has none of (at the
commit in ``wait()``) and stores again, giving the sender's codes. The affine formats (int8,
int4) move as their packed rows (``dtype`` "uint8", the last axis of ``shape`` the row's
bytes: ``kvcache.kv_quant.affine_pack``), stored unchanged, into a cache of the same format,
group size and compute dtype only (InvalidArgumentError otherwise: ``import_sequence`` of an
``export_sequence`` payload converts).

The sender gathers the rows out of its pages on the device (a gather per group, queued on
the cache's stream after every forward queued before it, so a forward that is still running
ahead cannot be missed or torn) and posts non-blocking sends of those buffers; the pages
themselves are free to change or be reused at once, the buffers are what is sent. The
receiver reads the header (a receive of a few hundred bytes, on a side stream on a GPU, so it
does not wait for the forwards its cache queued), checks it against its cache and reserves
the pages (``PagedKVCache.reserve_import``), then posts non-blocking receives into a pair of
buffers per group on its device; ``TransferHandle.wait()`` writes each group's rows into the
reserved pages behind its arrival (page sizes may differ: the write is per token) and makes
the sequences appear.

Transports: with an NCCL group and a CUDA/ROCm cache the buffers are device tensors (no host
staging); otherwise (gloo) CPU tensors: a GPU cache is then staged through host memory, a
reference (numpy) cache is viewed as torch tensors without a copy. A backend whose arrays are
neither torch tensors nor numpy arrays (metal's MLX arrays) raises UnsupportedFeatureError:
move ``export_sequence(...).to_numpy()`` payloads yourself there.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..config import DTYPES, itemsize
from ..errors import ForwardStateError, InvalidArgumentError, UnsupportedFeatureError
from ..kv_quant import AFFINE_BITS, affine_row_bytes
from ..transfer import FORMAT_VERSION, PAYLOAD_FORMATS, SequencePayload

MAGIC = 0x6B76_6361_6368_65      # "kvcache": the first int64 of every transfer
"""The first int64 of every transfer ("kvcache" in ASCII): a receiver that reads anything else
is not talking to ``send_sequence`` and raises instead of misreading the bytes."""
TORCH_DTYPES = ("float16", "bfloat16", "float32")
MESSAGE_BYTES = 64 << 20
"""About how many bytes of K (and as many of V) one data message of a large transfer holds."""
MIN_MESSAGES = 4
"""A large transfer's data comes in at least this many K/V message pairs (a pipeline)."""


def _torch():
    """(torch, torch.distributed), initialized; typed errors otherwise."""
    from ..integrations import require
    torch = require("torch", "distributed", "2.4")
    dist = torch.distributed
    if not dist.is_available():
        raise UnsupportedFeatureError(
            f"torch {torch.__version__} was built without torch.distributed")
    if not dist.is_initialized():
        raise ForwardStateError(
            "kvcache.distributed needs a process group: call "
            "torch.distributed.init_process_group first (gloo on CPUs, nccl on GPUs)")
    return torch, dist


def _ids(value, name: str) -> list:
    from ..core.validate import is_int, seq_id_list
    return [int(value)] if is_int(value) else seq_id_list(value, name)


def _per_sequence(values, count: int, name: str) -> list:
    if values is None:
        return [None] * count
    values = list(values)
    if len(values) != count:
        raise InvalidArgumentError(f"{name} has {len(values)} entries for {count} sequences")
    return values


def _arrays(cache, torch):
    """('torch' | 'numpy', the device of the cache's arrays); UnsupportedFeatureError for
    other array types."""
    probe = cache.from_numpy(np.zeros(1, np.float32))
    if isinstance(probe, torch.Tensor):
        return "torch", probe.device
    if isinstance(probe, np.ndarray):
        return "numpy", torch.device("cpu")
    raise UnsupportedFeatureError(
        f"kvcache.distributed moves torch tensors or numpy arrays; backend "
        f"{cache.backend.name!r} keeps {type(probe).__module__}.{type(probe).__name__}: send "
        f"cache.export_sequence(...).to_numpy() payloads yourself and import_sequence them")


def _transport(torch, dist, group, device):
    """Where the messages' tensors live: the cache's GPU under NCCL, else the host."""
    name = str(dist.get_backend(group)).lower()
    if device.type != "cpu" and "nccl" in name:
        return device
    return torch.device("cpu")


def _to_wire(torch, array, transport):
    """The bytes of ``array`` as a flat uint8 tensor on ``transport`` (a view where possible)."""
    if isinstance(array, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    else:
        t = array.detach().contiguous().reshape(-1).view(torch.uint8)
    return t.to(transport)


def _staged(torch, host, transport):
    """``host`` (a small CPU tensor) on ``transport``: through pinned memory without waiting
    on a GPU (a copy from pageable memory would wait for the forwards queued before it)."""
    if transport.type == "cpu":
        return host
    with torch.inference_mode(False):
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(transport, non_blocking=True)


def _array_dtype(config) -> str:
    """The dtype of the K/V arrays a cache of ``config`` sends and ``write_import`` takes:
    the storage dtype, the compute dtype for fp8 pages (their values), uint8 for int8 / int4
    pages (their packed rows)."""
    if config.kv_dtype in AFFINE_BITS:
        return "uint8"
    return config.dtype if config.kv_quantized else config.kv_dtype


def _row(config) -> int:
    """The last axis of the arrays a cache of ``config`` sends: head_dim, or the bytes of a
    packed int8 / int4 row."""
    if config.kv_dtype in AFFINE_BITS:
        return affine_row_bytes(config.head_dim, AFFINE_BITS[config.kv_dtype],
                                config.kv_quant_group, config.dtype)
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


def _from_wire(torch, buf, dtype: str, shape, kind: str, device, want: str):
    """A received uint8 buffer as the cache's array of ``shape`` in ``want`` (from ``dtype``)."""
    if kind == "numpy":
        from ..reference import np_dtype
        out = buf.cpu().numpy().view(np_dtype(dtype)).reshape(shape)
        return out if dtype == want else out.astype(np_dtype(want))
    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
              "uint8": torch.uint8}
    out = buf.to(device).view(dtypes[dtype]).reshape(shape)
    return out if dtype == want else out.to(dtypes[want])


class TransferHandle:
    """A transfer in flight (from ``send_sequence`` / ``recv_sequence``).

    ``wait()`` blocks until this side's messages are done and returns the sequence ids; on the
    receiving side it then writes the KV into the reserved pages and makes the sequences
    appear in the cache (not before). ``is_completed()`` says, without blocking, whether the
    messages are done (a receiver's sequences still appear only at ``wait()``). Keep the
    handle until ``wait()``: a receiver's pages stay reserved until then (``cancel()`` gives
    them back after the data arrived)."""

    def __init__(self, works: list, buffers: list, seq_ids: list, what: str,
                 finish: Optional[Callable[[Callable], None]] = None,
                 cancel: Optional[Callable[[], None]] = None):
        self._works = works
        self._buffers = buffers          # the tensors the works read or write: alive until done
        self.seq_ids = seq_ids
        self.what = what
        self._finish, self._cancel = finish, cancel
        self._received = False
        self._waited: set = set()
        self._done = False
        self._error: Optional[BaseException] = None

    def __repr__(self) -> str:
        state = "done" if self._done else "failed" if self._error else "in flight"
        return f"TransferHandle({self.what}, {state})"

    def is_completed(self) -> bool:
        """Whether every message of this transfer has completed (never blocks)."""
        return self._done or self._received or all(w.is_completed() for w in self._works)

    def _arrive(self) -> None:
        if not self._received:
            self._wait_for(self._works)
            self._received = True

    def _wait_for(self, works) -> None:
        for w in works:
            if id(w) not in self._waited:       # (a gloo work waited twice never returns)
                w.wait()
                self._waited.add(id(w))

    def wait(self) -> list:
        """Wait for the transfer; returns the sequence ids. On the receiver the sequences
        appear now. Under NCCL the waits are in the device's stream order, not the host's: the
        receiver queues each message's rows into its pages behind that message's arrival and
        returns without blocking, and whatever the cache queues after it (a forward over the
        sequences, an export) runs after the rows are written; under gloo it blocks. A
        ForwardStateError (a forward is open) leaves the handle to wait on again after
        ``end_forward``; another error gives the reserved pages back and is raised again by
        every later ``wait()``."""
        if self._done:
            return list(self.seq_ids)
        if self._error is not None:
            raise self._error
        if self._finish is None:
            self._arrive()
        else:
            try:
                # the receiver waits for each message before it writes that message's rows
                self._finish(self._wait_for)
                self._received = True
            except ForwardStateError:
                raise
            except BaseException as exc:
                self._error = exc
                self._arrive()              # every posted receive consumed first
                if self._cancel is not None:
                    self._cancel()
                self._buffers = []
                raise
        self._done = True
        self._buffers = []
        return list(self.seq_ids)

    def cancel(self) -> None:
        """A receiver that will not take the sequences: wait for the data (the sender's
        messages must be consumed), then give the reserved pages back."""
        if self._done:
            return
        self._arrive()
        if self._cancel is not None:
            self._cancel()
        self._error = ForwardStateError(f"{self.what} was cancelled")
        self._buffers = []


def send_sequence(cache, seq_ids, dst: int, group: Any = None, *,
                  starts: Optional[Sequence[int]] = None,
                  message_bytes: Optional[int] = None) -> TransferHandle:
    """Send sequences of ``cache`` to the process of global rank ``dst`` (which calls
    ``recv_sequence`` with as many ids); returns a ``TransferHandle`` (non-blocking).

    ``seq_ids``: one id or a list (one batch: one header and the data's messages); ``starts``: per
    sequence, the first token sent (None: 0; a fork's ``fork_pos`` sends only what follows
    its shared prefix, for a receiver that imports it onto the parent); ``group``: the
    torch.distributed process group (None: the default); ``message_bytes``: about how many
    bytes of K (and as many of V) one data message holds (None: ``MESSAGE_BYTES``): a large
    batch goes a few layers a message, each message's layers gathered while the last is on
    the wire (the receiver writes each as it arrives). The cache may go on (forwards,
    removing the sequences) at once: the rows were copied out on the device first. fp8 pages
    are sent as their values in the compute dtype with the layer scales in the headers
    (``export_sequences``), int8 / int4 pages as their packed rows. Raises what
    ``export_sequences`` raises, UnsupportedFeatureError for a backend whose arrays are not
    torch/numpy, ForwardStateError without an initialized process group, MissingExtraError
    without torch; no message is sent then."""
    torch, dist = _torch()
    ids = _ids(seq_ids, "seq_ids")
    c = cache.config
    kind, device = _arrays(cache, torch)
    transport = _transport(torch, dist, group, device)
    dtype = _array_dtype(c)
    row_bytes = c.num_layers * c.num_kv_heads * _row(c) * itemsize(dtype)
    per = layers_per_message(c.num_layers, _tokens_hint(cache, ids, starts) * row_bytes,
                             MESSAGE_BYTES if message_bytes is None else int(message_bytes))
    # the first message's layers, gathered now (every check made before any message)
    headers, k, v = cache.export_sequences(ids, starts, layers=range(0, per))
    total = sum(h.num_tokens for h in headers)
    nbytes = total * row_bytes
    shape = [c.num_layers, total, c.num_kv_heads, _row(c)]
    body = json.dumps({"version": FORMAT_VERSION, "kv_dtype": c.kv_dtype, "dtype": dtype,
                       "shape": shape, "nbytes": nbytes,
                       "payloads": [h.header() for h in headers]}).encode()
    tensors = [_staged(torch, torch.tensor([MAGIC, len(body), nbytes, c.num_layers, per],
                                           dtype=torch.int64), transport),
               _staged(torch, torch.frombuffer(bytearray(body), dtype=torch.uint8), transport)]
    works = [dist.isend(t, dst, group=group) for t in tensors]
    for first in range(0, c.num_layers if total else 0, per):
        # each message's layers are gathered while the last message is on the wire
        if first:
            _, k, v = cache.export_sequences(ids, starts,
                                             layers=range(first, min(first + per, c.num_layers)))
        for array in (k, v):
            tensors.append(_to_wire(torch, array, transport))
            works.append(dist.isend(tensors[-1], dst, group=group))
    return TransferHandle(works, tensors, ids, f"send of sequences {ids} to rank {dst}")


def _tokens_hint(cache, ids: list, starts) -> int:
    """The tokens a transfer of ``ids`` from ``starts`` holds, to size its messages (0 where
    an argument is bad: ``export_sequences`` then names it)."""
    try:
        firsts = [0] * len(ids) if starts is None else [int(x) for x in starts]
        return sum(max(cache.sequence_length(i) - f, 0) for i, f in zip(ids, firsts))
    except Exception:
        return 0


def layers_per_message(num_layers: int, nbytes: int, message_bytes: int = MESSAGE_BYTES) -> int:
    """Layers whose K (and, in a second message, V) one data message of a transfer of
    ``nbytes`` bytes of K holds: ``num_layers`` for a small transfer, else about
    ``message_bytes`` a message and at least ``MIN_MESSAGES`` messages, so that gathering
    (sender) and writing (receiver) the rows of one message overlap the wire time of the
    next."""
    if nbytes <= message_bytes or num_layers == 1:
        return num_layers
    per_layer = nbytes / num_layers
    by_size = max(1, int(message_bytes // per_layer))
    return max(1, min(by_size, -(-num_layers // MIN_MESSAGES)))


def recv_sequence(cache, seq_ids, src: int, group: Any = None, *,
                  parent_ids: Optional[Sequence[Optional[int]]] = None,
                  fork_pos: Optional[Sequence[Optional[int]]] = None,
                  convert_dtype: bool = False) -> TransferHandle:
    """Receive the sequences the process of global rank ``src`` sends (``send_sequence``)
    into ``cache`` as ``seq_ids`` (one id or a list, as many as were sent, in the same order).

    ``parent_ids``/``fork_pos``: per sequence, None or the sequence of this cache (or an
    earlier one of this batch) it forks from and where, as ``import_sequence`` takes them;
    ``convert_dtype``: accept another storage dtype (and, into fp8 pages, other scales or
    another compute dtype); ``group``: the torch.distributed process group (None: the
    default), the sender's. Blocks for the small header, checks it and reserves the pages,
    then returns a ``TransferHandle`` whose ``wait()`` makes the sequences appear. An fp8 cache
    checks the sender's scales as ``import_sequence`` does and adopts them for the layers
    that have none at ``wait()`` (``reserve_import``). On a refused header (a mismatch, a
    malformed or inconsistent message, CacheFullError, an id in use: typed errors as
    ``import_sequence``; packed int8 / int4 rows into a cache of another format, group size
    or compute dtype) the data is still received and dropped, so the two sides stay in step for the next
    transfer, and the error is raised; the cache is unchanged."""
    torch, dist = _torch()
    ids = _ids(seq_ids, "seq_ids")
    parents = _per_sequence(parent_ids, len(ids), "parent_ids")
    positions = _per_sequence(fork_pos, len(ids), "fork_pos")
    if cache.open_plan is not None:
        raise ForwardStateError(
            f"recv_sequence of sequences {ids}: a forward is open; receive after end_forward")
    kind, device = _arrays(cache, torch)
    transport = _transport(torch, dist, group, device)
    # (empty, not zeros: a fill queued on the cache's stream could land after the message)
    meta = torch.empty(5, dtype=torch.int64, device=transport)
    magic, size, nbytes, num_layers, per = (int(x) for x in _read_small(torch, dist, meta, src, group))
    if magic != MAGIC:
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: the message from rank {src} is not a kvcache "
            f"transfer (first value {magic:#x}); both sides must pair their calls")
    text = _read_small(torch, dist, torch.empty(size, dtype=torch.uint8, device=transport),
                       src, group)
    # the K and V messages the sender posted, per ``per`` layers: received (or drained)
    # whatever the JSON says
    spans = _spans(nbytes, num_layers, per, ids, src)
    try:
        msg, shape, headers = _read_header(bytes(text.numpy()), nbytes, ids, src)
        if nbytes and shape[0] != num_layers:
            raise InvalidArgumentError(
                f"recv_sequence of sequences {ids} from rank {src}: the header's shape has "
                f"{shape[0]} layers, its fixed part {num_layers}")
        _packed_fits(cache.config, msg, f"recv_sequence of sequences {ids} from rank {src}")
        res = cache.reserve_import(list(zip(ids, headers, parents, positions)), convert_dtype)
    except BaseException:
        for layers in spans:        # consume the data the sender has posted
            for _ in range(2):
                dist.recv(torch.empty(nbytes // num_layers * len(layers), dtype=torch.uint8,
                                      device=transport), src, group=group)
        raise
    sent, want = msg["dtype"], _array_dtype(cache.config)
    buffers, works = [], []
    for layers in spans:
        pair = [torch.empty(nbytes // num_layers * len(layers), dtype=torch.uint8,
                            device=transport) for _ in range(2)]
        buffers.append(pair)
        works.append([dist.irecv(buf, src, group=group) for buf in pair])

    def finish(arrived):
        # NCCL: waiting on a message only orders the device's stream after it, so every
        # message's rows are written (queued) as they arrive and the host never waits
        for layers, pair, ws in zip(spans, buffers, works):
            arrived(ws)
            k, v = (_from_wire(torch, buf, sent, (len(layers),) + tuple(shape[1:]), kind,
                               device, want) for buf in pair)
            cache.write_import(res, k, v, layers=layers)
        cache.commit_import(res)

    return TransferHandle([w for ws in works for w in ws], buffers, ids,
                          f"receive of sequences {ids} from rank {src}",
                          finish=finish, cancel=lambda: cache.cancel_import(res))


_SIDE_STREAMS: dict = {}             # device -> the stream headers are read on


def _read_small(torch, dist, buf, src: int, group):
    """Receive ``buf`` (a small header part) and return it on the host. On a GPU the receive and
    the copy to the host run on a side stream, and the host waits for that stream alone: not
    for the forwards the cache queued before this call (a decode worker keeps its run-ahead)."""
    if buf.device.type == "cpu":
        dist.recv(buf, src, group=group)
        return buf
    side = _SIDE_STREAMS.get(buf.device)
    if side is None:
        side = _SIDE_STREAMS[buf.device] = torch.cuda.Stream(device=buf.device)
    with torch.inference_mode(False):
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        dist.irecv(buf, src, group=group).wait()        # the side stream waits for the message
        host.copy_(buf, non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return host


def _spans(nbytes: int, num_layers: int, per: int, ids: list, src: int) -> list:
    """The layer ranges of a transfer's data messages (none without data), from the fixed
    part of its header: InvalidArgumentError when they cannot be a sender's."""
    if not nbytes:
        return []
    if num_layers < 1 or per < 1 or nbytes % num_layers:
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: rank {src} announced {nbytes} bytes over "
            f"{num_layers} layers, {per} a message: not a kvcache transfer of this version")
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
    if not isinstance(kv_dtype, str) or kv_dtype not in PAYLOAD_FORMATS:
        raise InvalidArgumentError(
            f"{where}: kv_dtype={kv_dtype!r} must be one of {PAYLOAD_FORMATS}")
    dtype = msg.get("dtype")
    if dtype is None and kv_dtype in DTYPES:
        dtype = kv_dtype
    packed = kv_dtype in AFFINE_BITS
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
    return msg, shape, headers


__all__ = ["MAGIC", "MESSAGE_BYTES", "TransferHandle", "layers_per_message", "recv_sequence",
           "send_sequence"]
