"""The send side of a transfer: ``send_sequence``, the head, data and tail messages it posts
(``_group_message``, ``_tail``), and ``_LayerSender``, which sends a transfer made inside a
forward layer group by layer group as the forward writes them.
"""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import numpy as np

from ..config import itemsize
from ..errors import UnsupportedFeatureError
from ..transfer import FORMAT_VERSION
from .endpoints import _arrays, _ids, _sums, _torch, _transport
from .handle import TransferHandle
from .wire import (MESSAGE_BYTES, STREAM_MESSAGES, _array_dtype, _row, chain_pages,
                   head_message, layers_per_message, transfer_chains)


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


def _staged(torch, host, transport):
    """``host`` (a small CPU tensor) on ``transport``: through pinned memory without waiting
    on a GPU (a copy from pageable memory would wait for the forwards queued before it)."""
    if transport.type == "cpu":
        return host
    with torch.inference_mode(False):
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(transport, non_blocking=True)


def send_sequence(cache, seq_ids, dst: int, group: Any = None, *,
                  starts: Optional[Sequence[int]] = None,
                  message_bytes: Optional[int] = None, tokens: Optional[Sequence] = None,
                  page_hashes: Optional[bool] = None) -> TransferHandle:
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

    ``tokens``: per sequence None or its token ids from token 0 to its end (after the forward,
    inside one; the ids of a prefix not sent included): they travel in the header, are hashed
    with the pages, and the receiver records them (``extend_tokens``: with the prefix cache
    the sequence's full pages join its index). ``page_hashes``: send the SHA-256 hash chain
    of the pages (a KV file's, ``kvcache.files``: rooted at each payload header, over the
    token ids and the rows as sent) in the tail, which the receiver checks before the
    sequences appear (``recv_sequence``'s ``verify``); None (the default): where the messages
    are host memory (gloo), not under NCCL, where hashing would copy every byte to the host
    (the device sums still check the data there).

    Raises what ``export_sequences`` raises, InvalidArgumentError for ``tokens`` that do not
    fit, UnsupportedFeatureError for a backend whose arrays are not torch/numpy,
    ForwardStateError without an initialized process group, MissingExtraError without torch;
    no message is sent then."""
    torch, dist = _torch()
    ids = _ids(seq_ids, "seq_ids")
    c = cache.config
    kind, device = _arrays(cache, torch)
    transport = _transport(torch, dist, group, device)
    from ..core.validate import bool_arg
    hashed = (transport.type == "cpu" if page_hashes is None
              else bool_arg(page_hashes, "page_hashes"))
    dtype = _array_dtype(c)
    row_bytes = c.num_layers * c.num_kv_heads * _row(c) * itemsize(dtype)
    streamed = cache.open_plan is not None
    hint = 2 * _tokens_hint(cache, ids, starts) * row_bytes
    if streamed:
        per = (-(-c.num_layers // STREAM_MESSAGES) if message_bytes is None
               else layers_per_message(c.num_layers, hint, int(message_bytes), pipeline=False))
        unset = [x for x in range(c.num_layers) if c.kv_format.scaled
                 and cache.kv_scales(x) is None]
        if unset:
            raise UnsupportedFeatureError(
                f"send_sequence of sequences {ids} inside a forward: fp8 layers {unset} have no "
                f"scales yet, and the header (sent first) carries them: set_kv_scales first, "
                f"or send after end_forward")
    else:
        per = layers_per_message(c.num_layers, hint,
                                 MESSAGE_BYTES if message_bytes is None else int(message_bytes))
    # every check made before any message, the headers alone: the head leaves before any
    # gather is queued, so the receiver checks it and reserves its pages while this side
    # gathers (inside a forward each group goes once the forward has written it)
    headers, _, _ = cache.export_sequences(ids, starts, layers=range(0, 0))
    ids_sent = _token_lists(tokens, ids, headers)
    total = sum(h.num_tokens for h in headers)
    nbytes = total * row_bytes
    shape = [c.num_layers, total, c.num_kv_heads, _row(c)]
    msg = {"version": FORMAT_VERSION, "kv_dtype": c.kv_dtype, "dtype": dtype, "shape": shape,
           "nbytes": nbytes, "payloads": [h.header() for h in headers]}
    if any(t is not None for t in ids_sent):
        msg["tokens"] = ids_sent
    pages = 0
    if hashed:
        msg["page_size"] = c.page_size
        pages = chain_pages(headers, c.page_size)
    body = json.dumps(msg).encode()
    # what the receiver hashes: the payload headers as the JSON carries them
    chain = None if not hashed else _ChainSpec(json.loads(body), shape, itemsize(dtype), per,
                                               pages)
    head, rest = head_message(body, nbytes, c.num_layers, per, streamed, pages)
    tensors = [_staged(torch, torch.from_numpy(head), transport)]
    if rest:
        tensors.append(_staged(torch, torch.frombuffer(bytearray(rest), dtype=torch.uint8),
                               transport))
    works = [dist.isend(t, dst, group=group) for t in tensors]
    handle = TransferHandle(works, tensors, ids, f"send of sequences {ids} to rank {dst}")
    if streamed:
        cache.watch_forward(_LayerSender(torch, cache, ids, starts, nbytes, per, transport,
                                         handle, dst, group, chain))
        return handle
    sums, messages = [], []
    for first in range(0, c.num_layers if total else 0, per):
        # each message's layers are gathered while the last message is on the wire
        _, k, v = cache.export_sequences(ids, starts,
                                         layers=range(first, min(first + per, c.num_layers)))
        messages.append(_group_message(torch, k, v, transport))
        _post_send(handle, messages[-1], dst, group)
        sums.append(_sums(torch, handle._buffers[-1], cache.backend))
    words = None if chain is None else chain.words(torch, messages)
    _post_send(handle, _tail(torch, True, sums, transport, words), dst, group)
    return handle


def _token_lists(tokens, ids: list, headers: list) -> list:
    """``send_sequence``'s ``tokens`` checked: per sequence None or the ids of its tokens 0 to
    its end (``header.end``), each in [0, 2**31)."""
    from ..errors import InvalidArgumentError
    if tokens is None:
        return [None] * len(ids)
    if isinstance(tokens, (str, bytes)) or len(tokens) != len(ids):
        raise InvalidArgumentError(
            f"send_sequence of sequences {ids}: tokens must hold one entry (None or a list of "
            f"ids) per sequence, got {tokens!r:.80}")
    out: list = []
    for sid, h, t in zip(ids, headers, tokens):
        if t is None:
            out.append(None)
            continue
        try:
            t = [int(x) for x in t]
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"send_sequence: sequence {sid}: tokens must be a list of ints, got "
                f"{type(t).__name__}") from None
        if len(t) != h.end or not all(0 <= x < 2**31 for x in t):
            raise InvalidArgumentError(
                f"send_sequence: sequence {sid} ends at token {h.end}: its tokens must be "
                f"that many ids (from token 0) in [0, 2**31), got {len(t)}")
        out.append(t)
    return out


class _ChainSpec:
    """What the hash chain of a transfer's pages needs besides the messages: the JSON (its
    payload headers, tokens and page size), the arrays' shape, item size and layer groups."""

    def __init__(self, msg: dict, shape: list, size: int, per: int, pages: int):
        self.msg, self.shape, self.size, self.pages = msg, tuple(shape), size, pages
        self.spans = [range(f, min(f + per, shape[0])) for f in range(0, shape[0], per)]

    def words(self, torch, messages: Optional[list]) -> np.ndarray:
        """The tail's chain: int64, 4 a page (its 32-byte digest), the sequences one after
        another; zeros when ``messages`` is None (an aborted forward's transfer)."""
        if messages is None or not self.shape[1]:
            return np.zeros(4 * self.pages, np.int64)
        host = [(m if m.device.type == "cpu" else m.cpu()).numpy() for m in messages]
        chains = transfer_chains(self.msg["payloads"], self.msg.get("tokens") or
                                 [None] * len(self.msg["payloads"]), self.msg["page_size"],
                                 self.spans, host, self.shape, self.size)
        return np.frombuffer(b"".join(d for chain in chains for d in chain), "<i8").copy()


def _tail(torch, ended: bool, sums: list, transport, chain: Optional[np.ndarray] = None):
    """A transfer's last message: int64 ``[ended, messages, (the two sums of each data
    message)..., (the pages' hash chain, 4 a page)...]`` on ``transport`` (the sums stay where
    they were computed: no host wait)."""
    fixed = _staged(torch, torch.tensor([int(ended), len(sums)], dtype=torch.int64), transport)
    rest = [x.to(transport) for x in sums]
    if chain is not None and chain.size:
        rest.append(_staged(torch, torch.from_numpy(chain), transport))
    return torch.cat([fixed] + rest) if rest else fixed


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
                 dst: int, group, chain: Optional[_ChainSpec] = None):
        self.torch, self.cache, self.ids, self.starts = torch, cache, ids, starts
        self.nbytes, self.per, self.transport = nbytes, per, transport
        self.handle, self.dst, self.group = handle, dst, group
        self.chain = chain
        self.sums: list = []
        self.messages: list = []
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
        self.messages.append(message)
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
            words = None if self.chain is None else self.chain.words(
                torch, self.messages if committed else None)
            _post_send(self.handle, _tail(torch, committed, self.sums, self.transport, words),
                       self.dst, self.group)
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
