"""Moving sequences' KV between the caches of two processes over torch.distributed.

One call moves a batch of sequences in a few point-to-point messages, in this order:

1. the head: ``HEAD_BYTES`` uint8, whatever the batch: eight int64 ``[MAGIC, n, nbytes,
   num_layers, layers_per_message, streamed, CRC-32 of the JSON, 0]`` then the first bytes
   of ``n`` bytes of JSON
   ``{"version", "payloads": [SequencePayload.header() per sequence], "kv_dtype", "dtype",
   "shape", "nbytes"}`` (``nbytes``: the bytes of K, and of V, that follow; in the fixed part
   too, with the layer grouping, so that the receiver posts the data's receives before it
   reads the JSON, and one that refuses the JSON still knows what to drain; ``dtype``: the
   arrays' dtype, the compute dtype for fp8 pages, whose arrays hold the values read back and
   whose payload headers carry the scales; None or absent: ``kv_dtype``). A JSON longer than
   the head holds sends its rest in a second message of exactly those bytes;
2. for each group of ``layers_per_message`` consecutive layers, one message: K's rows of those
   layers then V's, each the raw bytes of a contiguous (layers, total tokens, num_kv_heads,
   head_dim) array in ``dtype``, the sequences' tokens one sequence after another (what
   ``PagedKVCache.export_sequences(..., layers=...)`` gathers; none when there are no tokens).
   One group holds every layer up to ``MESSAGE_BYTES`` of K and V; a larger transfer comes in
   groups of about that size, at least ``MIN_MESSAGES`` of them (``layers_per_message``), so
   that the sender gathers a group while the last is on the wire and the receiver writes one
   while the next arrives;
3. the tail: int64 ``[ended, messages, then per data message the two sums of its bytes]``
   (``ended`` 0: the forward a send from inside it watched was aborted), the sums computed on
   the sender's device behind each gather, checked on the receiver's (``verify``).

A transfer thus costs the receiver one round trip to its host (the head), whose checks and page
reservation run while the data is on the wire.

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

import functools
import json
import sys
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..config import DTYPES, itemsize
from ..errors import ForwardStateError, InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from ..kv_quant import AFFINE_BITS, affine_row_bytes
from ..transfer import FORMAT_VERSION, PAYLOAD_FORMATS, SequencePayload

MAGIC = 0x6B76_6361_6368_6532    # "kvcache2": the first int64 of every transfer
"""The first int64 of every transfer ("kvcache2" in ASCII, the wire's second layout): a
receiver that reads anything else is not talking to this ``send_sequence`` and raises instead of
misreading the bytes."""
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


def _torch():
    """(torch, torch.distributed), initialized; typed errors otherwise."""
    torch = sys.modules.get("torch")        # imported already: no import machinery a call
    if torch is None or not hasattr(torch, "distributed"):
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
    """('torch' | 'numpy', the device of the cache's arrays), read off its pages (no device
    work: a probe array uploaded from the host would wait for every forward queued);
    UnsupportedFeatureError for other array types."""
    probe = cache.pages[0]
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


def _to_wire(torch, array):
    """The bytes of ``array`` as a flat uint8 tensor (a view where possible)."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return array.detach().contiguous().reshape(-1).view(torch.uint8)


def _group_message(torch, k, v, transport):
    """One data message: K's bytes then V's, on ``transport``. A view when the gather put V
    right behind K in one allocation (the cuda backend does), else one copy."""
    kb, vb = _to_wire(torch, k), _to_wire(torch, v)
    if (kb.device == vb.device and kb.untyped_storage().data_ptr() == vb.untyped_storage().data_ptr()
            and kb.data_ptr() + kb.numel() == vb.data_ptr()):
        return kb.as_strided((kb.numel() + vb.numel(),), (1,), kb.storage_offset()).to(transport)
    return torch.cat([kb.to(transport), vb.to(transport)])


def head_message(body: bytes, nbytes: int, num_layers: int, per: int,
                 streamed: bool = False) -> tuple:
    """``(head, rest)``: a transfer's first message (``HEAD_BYTES`` uint8, numpy) for a JSON
    header ``body``, ``nbytes`` bytes each of K and V over ``num_layers`` layers, ``per`` a data
    message, ``streamed``: sent during the forward that writes it; the JSON's CRC-32 goes in
    the fixed part too. ``rest``: the JSON's bytes that did not fit (b"" but for very large
    batches), the second message. The one writer of the wire's head."""
    head = np.zeros(HEAD_BYTES, np.uint8)
    head[:_FIXED * 8].view(np.int64)[:7] = (MAGIC, len(body), nbytes, num_layers, per,
                                            int(streamed), zlib.crc32(body))
    inline = body[:HEAD_BYTES - _FIXED * 8]
    head[_FIXED * 8:_FIXED * 8 + len(inline)] = np.frombuffer(inline, np.uint8)
    return head, body[len(inline):]


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
        from ..arrays import np_dtype
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
        self._streaming = False          # a sender's: the forward it watches is still open
        self._waited: set = set()
        self._done = False
        self._error: Optional[BaseException] = None

    def __repr__(self) -> str:
        state = "done" if self._done else "failed" if self._error else "in flight"
        return f"TransferHandle({self.what}, {state})"

    def is_completed(self) -> bool:
        """Whether every message of this transfer has completed (never blocks)."""
        return self._done or self._received or (
            not self._streaming and all(w.is_completed() for w in self._works))

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
        if self._streaming:
            raise ForwardStateError(
                f"{self.what}: the forward that writes its KV is still open; wait after "
                f"end_forward (or abort_forward)")
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
    bytes (K and V together) one data message holds (None: ``MESSAGE_BYTES``): a large
    batch goes a few layers a message, each message's layers gathered while the last is on
    the wire (the receiver writes each as it arrives). The cache may go on (forwards,
    removing the sequences) at once: the rows were copied out on the device first. fp8 pages
    are sent as their values in the compute dtype with the layer scales in the headers
    (``export_sequences``), int8 / int4 pages as their packed rows.

    **Inside an open forward** (its thread; e.g. the prefill of the sequences) the transfer
    is layer-pipelined: the header goes now, describing the sequences as they will be after
    the forward, and each group of layers' KV (``STREAM_MESSAGES`` groups; ``message_bytes``:
    about that many bytes a message) is gathered and sent as soon as the forward has written
    it, on the wire while the next layers compute (``PagedKVCache.watch_forward``); a last message says whether the
    forward ended (the receiver's ``wait()`` then makes the sequences appear) or was aborted
    (the remaining messages carry nothing, and the receiver's ``wait()`` raises
    KVCacheError and keeps nothing). This handle's ``wait()`` raises ForwardStateError
    while the forward is open. Refused (UnsupportedFeatureError, before any message) for fp8
    pages whose layers lack scales (set them with ``set_kv_scales``: the header carries
    them) and, as ``export_sequences``, for a sliding-window forward.

    Raises what ``export_sequences`` raises, UnsupportedFeatureError for a backend whose
    arrays are not torch/numpy, ForwardStateError without an initialized process group,
    MissingExtraError without torch; no message is sent then."""
    torch, dist = _torch()
    ids = _ids(seq_ids, "seq_ids")
    c = cache.config
    kind, device = _arrays(cache, torch)
    transport = _transport(torch, dist, group, device)
    dtype = _array_dtype(c)
    row_bytes = c.num_layers * c.num_kv_heads * _row(c) * itemsize(dtype)
    streamed = cache.open_plan is not None
    hint = 2 * _tokens_hint(cache, ids, starts) * row_bytes
    if streamed:
        per = (-(-c.num_layers // STREAM_MESSAGES) if message_bytes is None
               else layers_per_message(c.num_layers, hint, int(message_bytes), pipeline=False))
        unset = [x for x in range(c.num_layers) if c.kv_dtype == "float8_e4m3"
                 and cache.kv_scales(x) is None]
        if unset:
            raise UnsupportedFeatureError(
                f"send_sequence of sequences {ids} inside a forward: fp8 layers {unset} have no "
                f"scales yet, and the header (sent first) carries them: set_kv_scales first, "
                f"or send after end_forward")
    else:
        per = layers_per_message(c.num_layers, hint,
                                 MESSAGE_BYTES if message_bytes is None else int(message_bytes))
    # every check made before any message; the first message's layers gathered now (inside
    # a forward: none, each group once the forward has written it)
    headers, k, v = cache.export_sequences(ids, starts,
                                           layers=range(0, 0) if streamed else range(0, per))
    total = sum(h.num_tokens for h in headers)
    nbytes = total * row_bytes
    shape = [c.num_layers, total, c.num_kv_heads, _row(c)]
    body = json.dumps({"version": FORMAT_VERSION, "kv_dtype": c.kv_dtype, "dtype": dtype,
                       "shape": shape, "nbytes": nbytes,
                       "payloads": [h.header() for h in headers]}).encode()
    head, rest = head_message(body, nbytes, c.num_layers, per, streamed)
    tensors = [_staged(torch, torch.from_numpy(head), transport)]
    if rest:
        tensors.append(_staged(torch, torch.frombuffer(bytearray(rest), dtype=torch.uint8),
                               transport))
    works = [dist.isend(t, dst, group=group) for t in tensors]
    handle = TransferHandle(works, tensors, ids, f"send of sequences {ids} to rank {dst}")
    if streamed:
        cache.watch_forward(_LayerSender(torch, cache, ids, starts, nbytes, per, transport,
                                         handle, dst, group))
        return handle
    sums = []
    for first in range(0, c.num_layers if total else 0, per):
        # each message's layers are gathered while the last message is on the wire
        if first:
            _, k, v = cache.export_sequences(ids, starts,
                                             layers=range(first, min(first + per, c.num_layers)))
        _post_send(handle, _group_message(torch, k, v, transport), dst, group)
        sums.append(_sums(torch, handle._buffers[-1], cache.backend))
    _post_send(handle, _tail(torch, True, sums, transport), dst, group)
    return handle


def _sums(torch, message, backend=None):
    """``Backend.checksum`` of ``message`` (a flat uint8 tensor), computed where it lives: on a
    GPU by ``backend`` (the cache's), on the host by ``checksum_words`` (as a tensor)."""
    if message.device.type == "cpu":
        from ..backend import checksum_words
        return torch.from_numpy(checksum_words(message.numpy()))
    return backend.checksum(message)


def _tail(torch, ended: bool, sums: list, transport):
    """A transfer's last message: int64 ``[ended, messages, (the two sums of each data
    message)...]`` on ``transport`` (the sums stay where they were computed: no host wait)."""
    fixed = _staged(torch, torch.tensor([int(ended), len(sums)], dtype=torch.int64), transport)
    return torch.cat([fixed] + [x.to(transport) for x in sums]) if sums else fixed


def _post_send(handle: "TransferHandle", tensor, dst: int, group) -> None:
    import torch.distributed as dist
    handle._buffers.append(tensor)      # alive until the send is done
    handle._works.append(dist.isend(tensor, dst, group=group))


class _LayerSender:
    """A send inside a forward (``send_sequence``): watches the forward
    (``PagedKVCache.watch_forward``) and sends each group of ``per`` layers once the forward
    has written them all, in layer order; at the forward's close the rest (zeros, after an
    abort) and the tail (``_tail``: ended or aborted, and the messages' sums)."""

    def __init__(self, torch, cache, ids, starts, nbytes: int, per: int, transport, handle,
                 dst: int, group):
        self.torch, self.cache, self.ids, self.starts = torch, cache, ids, starts
        self.nbytes, self.per, self.transport = nbytes, per, transport
        self.handle, self.dst, self.group = handle, dst, group
        self.sums: list = []
        self.num_layers = cache.config.num_layers
        self.written = set(cache.layers_run)
        self.next = 0 if nbytes else self.num_layers     # the first layer not yet sent
        handle._streaming = True
        self._flush()

    def _group(self) -> range:
        return range(self.next, min(self.next + self.per, self.num_layers))

    def _flush(self) -> None:
        while self.next < self.num_layers and set(self._group()) <= self.written:
            _, k, v = self.cache.export_sequences(self.ids, self.starts, layers=self._group())
            self._send(_group_message(self.torch, k, v, self.transport))
            self.next = self._group().stop

    def _send(self, message) -> None:
        _post_send(self.handle, message, self.dst, self.group)
        self.sums.append(_sums(self.torch, message, self.cache.backend))

    def layer_written(self, layer: int) -> None:
        self.written.add(layer)
        self._flush()

    def forward_closed(self, committed: bool) -> None:
        torch = self.torch
        try:
            while self.next < self.num_layers:      # aborted: what the receiver still awaits
                group = self._group()
                self._send(torch.zeros(2 * self.nbytes // self.num_layers * len(group),
                                       dtype=torch.uint8, device=self.transport))
                self.next = group.stop
            _post_send(self.handle, _tail(torch, committed, self.sums, self.transport), self.dst,
                       self.group)
        finally:
            self.handle._streaming = False


def _tokens_hint(cache, ids: list, starts) -> int:
    """The tokens a transfer of ``ids`` from ``starts`` holds, to size its messages (0 where
    an argument is bad: ``export_sequences`` then names it)."""
    try:
        firsts = [0] * len(ids) if starts is None else [int(x) for x in starts]
        return sum(max(cache.sequence_length(i) - f, 0) for i, f in zip(ids, firsts))
    except Exception:
        return 0


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


def recv_sequence(cache, seq_ids, src: int, group: Any = None, *,
                  parent_ids: Optional[Sequence[Optional[int]]] = None,
                  fork_pos: Optional[Sequence[Optional[int]]] = None,
                  convert_dtype: bool = False, verify: bool = True) -> TransferHandle:
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
    or compute dtype; a header whose CRC-32 is not the sender's) the data is still received
    and dropped, so the two sides stay in step for the next transfer, and the error is
    raised; the cache is unchanged.

    ``verify`` (default True): ``wait()`` checks each data message against the two sums the
    sender computed on its device (the tail message carries them), computed here where the
    message landed, and raises KVCacheError naming the layers, keeping nothing, on a
    difference. On a GPU ``wait()`` then waits for the data to arrive and be summed, on a side
    stream (not for the forwards this cache queued before); ``verify=False`` leaves integrity to
    the transport and ``wait()`` only queues the writes behind the data (it still waits for
    the tail of a transfer sent during its forward, which says whether that forward ended)."""
    torch, dist = _torch()
    ids = _ids(seq_ids, "seq_ids")
    from ..core.validate import bool_arg
    verify = bool_arg(verify, "verify")
    parents = _per_sequence(parent_ids, len(ids), "parent_ids")
    positions = _per_sequence(fork_pos, len(ids), "fork_pos")
    if cache.open_plan is not None:
        raise ForwardStateError(
            f"recv_sequence of sequences {ids}: a forward is open; receive after end_forward")
    kind, device = _arrays(cache, torch)
    transport = _transport(torch, dist, group, device)
    # (empty, not zeros: a fill queued on the cache's stream could land after the message)
    raw = _read_small(torch, dist, torch.empty(HEAD_BYTES, dtype=torch.uint8, device=transport),
                      src, group).numpy()
    magic, size, nbytes, num_layers, per, streamed, crc = (
        int(x) for x in raw[:_FIXED * 8].view(np.int64)[:7])
    if magic != MAGIC:
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: the message from rank {src} is not a kvcache "
            f"transfer of this version (first value {magic:#x}, expected {MAGIC:#x}); both "
            f"sides must pair their calls and run one kvcache version")
    if not 0 <= size <= _JSON_LIMIT or streamed not in (0, 1):
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: rank {src} announced a header of {size} bytes "
            f"(a sender's is within [0, {_JSON_LIMIT}]), streamed={streamed} (0 or 1)")
    inline = min(size, HEAD_BYTES - _FIXED * 8)
    text = raw[_FIXED * 8:_FIXED * 8 + inline].tobytes()
    if size > inline:
        text += _read_small(torch, dist, torch.empty(size - inline, dtype=torch.uint8,
                                                     device=transport), src, group).numpy().tobytes()
    # the data messages the sender posted, per ``per`` layers, received whatever the JSON
    # says (a refused one is drained); posted now, so that their wire time covers the checks
    # and the page reservation below
    c = cache.config
    spans = _spans(nbytes, num_layers, per, ids, src,
                   limit=cache.num_total_pages * c.page_size * c.num_layers * c.num_kv_heads
                   * max(_row(c), c.head_dim) * 4)
    buffers = [torch.empty(2 * (nbytes // num_layers) * len(layers), dtype=torch.uint8,
                           device=transport) for layers in spans]
    works = [dist.irecv(buf, src, group=group) for buf in buffers]
    # every transfer ends with its tail: [ended, messages, each data message's two sums]
    # (read once, by whichever of finish / cancel / a refusal asks first)
    tail = functools.cache(_post_small(
        torch, dist, torch.empty(2 + 2 * len(spans), dtype=torch.int64, device=transport),
        src, group))
    try:
        if zlib.crc32(text) != crc & 0xFFFF_FFFF:
            raise InvalidArgumentError(
                f"recv_sequence of sequences {ids} from rank {src}: the header's CRC-32 is "
                f"{zlib.crc32(text):08x}, the sender's {crc & 0xFFFF_FFFF:08x}: changed on the way")
        msg, shape, headers = _read_header(text, nbytes, ids, src)
        if nbytes and shape[0] != num_layers:
            raise InvalidArgumentError(
                f"recv_sequence of sequences {ids} from rank {src}: the header's shape has "
                f"{shape[0]} layers, its fixed part {num_layers}")
        _packed_fits(cache.config, msg, f"recv_sequence of sequences {ids} from rank {src}")
        res = cache.reserve_import(list(zip(ids, headers, parents, positions)), convert_dtype)
    except BaseException:
        for w in works:             # the data the sender posted, consumed and dropped
            w.wait()
        tail()
        raise
    sent, want = msg["dtype"], _array_dtype(cache.config)

    def finish(arrived):
        # NCCL: waiting on a message only orders the device's stream after it, so every
        # message's rows are written (queued) as they arrive; the host waits (on a side
        # stream, not for the forwards queued before) for the tail, and with ``verify`` for
        # the data's sums, before the sequences appear
        try:
            for layers, buf, w in zip(spans, buffers, works):
                arrived([w])
                half = buf.numel() // 2
                k, v = (_from_wire(torch, part, sent, (len(layers),) + tuple(shape[1:]), kind,
                                   device, want) for part in (buf[:half], buf[half:]))
                cache.write_import(res, k, v, layers=layers)
            got = _received_sums(torch, buffers, works, cache.backend) if verify else None
        except ForwardStateError:
            raise                   # wait() may be called again after end_forward
        except BaseException:
            tail()
            raise
        end = np.asarray(tail(), np.int64).reshape(-1)
        if int(end[0]) != 1:
            raise KVCacheError(
                f"recv_sequence of sequences {ids}: rank {src} aborted the forward that wrote "
                f"their KV while sending it; nothing was kept")
        if got is not None:
            theirs = end[2:].reshape(-1, 2)
            bad = [i for i in range(len(spans)) if not np.array_equal(got[i], theirs[i])]
            if bad:
                i = bad[0]
                raise KVCacheError(
                    f"recv_sequence of sequences {ids} from rank {src}: the data of layers "
                    f"{list(spans[i])} arrived with sums {got[i].tolist()}, sent with "
                    f"{theirs[i].tolist()} ({len(bad)} of {len(spans)} messages differ): "
                    f"changed on the way; nothing was kept")
        cache.commit_import(res)

    def cancel():
        tail()
        cache.cancel_import(res)

    return TransferHandle(works, buffers, ids, f"receive of sequences {ids} from rank {src}",
                          finish=finish, cancel=cancel)


def _received_sums(torch, buffers: list, works: list, backend) -> np.ndarray:
    """(messages, 2) int64 on the host: ``_sums`` of each received buffer, computed where it
    lives once it arrived (on a GPU on the side stream, which waits for the messages alone)."""
    if not buffers:
        return np.zeros((0, 2), np.int64)
    device = buffers[0].device
    if device.type == "cpu":
        return np.stack([_sums(torch, b).numpy() for b in buffers])
    side = _side_stream(torch, device)
    with torch.inference_mode(False):
        host = torch.empty((len(buffers), 2), dtype=torch.int64, pin_memory=True)
    with torch.cuda.stream(side):
        for w in works:
            w.wait()                    # the side stream waits for the data
        host.copy_(torch.stack([_sums(torch, b, backend) for b in buffers]), non_blocking=True)
        done = torch.cuda.Event()
        done.record(side)
    done.synchronize()
    return host.numpy()


_SIDE_STREAMS: dict = {}             # device -> the stream headers are read on


def _side_stream(torch, device):
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return side


def _read_small(torch, dist, buf, src: int, group):
    """Receive ``buf`` (a small header part) and return it on the host (``_post_small``,
    then waiting for it)."""
    return _post_small(torch, dist, buf, src, group)()


def _post_small(torch, dist, buf, src: int, group):
    """Post the receive of ``buf`` (a small message) and return a call that waits for it and
    returns it on the host. On a GPU the receive and the copy to the host run on a side
    stream, and the call waits for that stream alone: not for the forwards the cache queued
    before it (a decode worker keeps its run-ahead). The call raises what the receive does."""
    if buf.device.type == "cpu":
        work = dist.irecv(buf, src, group=group)

        def read_cpu():
            work.wait()
            return buf
        return read_cpu
    side = _side_stream(torch, buf.device)
    with torch.inference_mode(False):
        host = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        work = dist.irecv(buf, src, group=group)

    def read_gpu():
        with torch.cuda.stream(side):
            work.wait()                 # the side stream waits for the message
            host.copy_(buf, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()
        return host
    return read_gpu


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


__all__ = ["HEAD_BYTES", "MAGIC", "MESSAGE_BYTES", "TransferHandle", "head_message",
           "layers_per_message", "recv_sequence", "send_sequence"]
