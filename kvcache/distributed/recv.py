"""The receive side of a transfer: ``recv_sequence``, which reads and checks the head, reserves
the pages and posts the data's receives, and the small receives it makes on a side stream so
that a GPU cache's queued forwards are not waited for.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Optional, Sequence

import numpy as np

from ..errors import ForwardStateError, InvalidArgumentError, KVCacheError
from .endpoints import _arrays, _ids, _sums, _torch, _transport
from .handle import TransferHandle
from .wire import (_FIXED, _JSON_LIMIT, HEAD_BYTES, MAGIC, _array_dtype, _packed_fits,
                   _read_header, _row, _spans, check_chain_header, transfer_chains)


def _per_sequence(values, count: int, name: str) -> list:
    if values is None:
        return [None] * count
    values = list(values)
    if len(values) != count:
        raise InvalidArgumentError(f"{name} has {len(values)} entries for {count} sequences")
    return values


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
    difference; then, when the sender hashed the pages (``send_sequence``'s
    ``page_hashes``: by default over gloo), the SHA-256 hash chain of every sequence's pages
    (a KV file's: rooted at its payload header as received, over its token ids and rows as
    they arrived) against the sender's, raising KVCacheError naming the sequence and the
    page, keeping nothing, on a difference. Token ids the sender sent are recorded
    (``extend_tokens``) once the sequences appear. On a GPU ``wait()`` then waits for the data to arrive and be summed, on a side
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
    magic, size, nbytes, num_layers, per, streamed, crc, pages = (
        int(x) for x in raw[:_FIXED * 8].view(np.int64)[:8])
    if magic != MAGIC:
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: the message from rank {src} is not a kvcache "
            f"transfer of this version (first value {magic:#x}, expected {MAGIC:#x}); both "
            f"sides must pair their calls and run one kvcache version")
    c = cache.config
    most = cache.num_total_pages * c.page_size      # (a page hashes one token at least)
    if not 0 <= size <= _JSON_LIMIT or streamed not in (0, 1) or not 0 <= pages <= most:
        raise InvalidArgumentError(
            f"recv_sequence of sequences {ids}: rank {src} announced a header of {size} bytes "
            f"(a sender's is within [0, {_JSON_LIMIT}]), streamed={streamed} (0 or 1), the "
            f"hashes of {pages} pages (this cache holds at most {most} tokens)")
    inline = min(size, HEAD_BYTES - _FIXED * 8)
    text = raw[_FIXED * 8:_FIXED * 8 + inline].tobytes()
    if size > inline:
        text += _read_small(torch, dist, torch.empty(size - inline, dtype=torch.uint8,
                                                     device=transport), src, group).numpy().tobytes()
    # the data messages the sender posted, per ``per`` layers, received whatever the JSON
    # says (a refused one is drained); posted now, so that their wire time covers the checks
    # and the page reservation below
    spans = _spans(nbytes, num_layers, per, ids, src,
                   limit=cache.num_total_pages * c.page_size * c.num_layers * c.num_kv_heads
                   * max(_row(c), c.head_dim) * 4)
    buffers = [torch.empty(2 * (nbytes // num_layers) * len(layers), dtype=torch.uint8,
                           device=transport) for layers in spans]
    works = [dist.irecv(buf, src, group=group) for buf in buffers]
    # every transfer ends with its tail: [ended, messages, each data message's two sums, the
    # pages' hash chain (4 words a page)] (read once, by whichever of finish / cancel / a
    # refusal asks first)
    tail = functools.cache(_post_small(
        torch, dist, torch.empty(2 + 2 * len(spans) + 4 * pages, dtype=torch.int64,
                                 device=transport), src, group))
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
        chain_ps = check_chain_header(msg, headers, pages,
                                      f"recv_sequence of sequences {ids} from rank {src}")
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
        if verify and pages:
            _check_chain(torch, msg, headers, chain_ps, spans, buffers, shape, sent,
                         end[2 + 2 * len(spans):], ids, src)
        cache.commit_import(res)
        for sid, toks in zip(ids, msg["tokens"]):
            if toks is not None:
                cache.extend_tokens(sid, toks)

    def cancel():
        tail()
        cache.cancel_import(res)

    return TransferHandle(works, buffers, ids, f"receive of sequences {ids} from rank {src}",
                          finish=finish, cancel=cancel)


def _check_chain(torch, msg: dict, headers: list, page_size: int, spans: list, buffers: list,
                 shape: tuple, dtype: str, theirs: np.ndarray, ids: list, src: int) -> None:
    """KVCacheError naming the sequence and the first page whose hash chain, computed over
    the received buffers (on the host: a GPU's are copied there), differs from the sender's
    (``theirs``: the tail's chain words)."""
    from ..config import itemsize
    host = [(b if b.device.type == "cpu" else b.cpu()).numpy() for b in buffers]
    mine = transfer_chains(msg["payloads"], msg["tokens"], page_size, spans, host, shape,
                           itemsize(dtype))
    sent = np.ascontiguousarray(theirs, dtype="<i8").tobytes()
    at = 0
    from ..files import first_difference
    for sid, h, chain in zip(ids, headers, mine):
        want = [sent[at + 32 * j:at + 32 * (j + 1)] for j in range(len(chain))]
        at += 32 * len(chain)
        bad = first_difference(want, chain)
        if bad is not None:
            raise KVCacheError(
                f"recv_sequence of sequences {ids} from rank {src}: sequence {sid}'s page {bad} "
                f"(its tokens from {h.start + bad * page_size}) fails its hash: its K/V, a "
                f"scale, a token id or its header differs from what the sender hashed; "
                f"nothing was kept")


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
