"""Moving sequences' KV between the caches of two processes over torch.distributed.

One call moves a batch of sequences in a few point-to-point messages, in this order:

1. the head: ``HEAD_BYTES`` uint8, whatever the batch: eight int64 ``[MAGIC, n, nbytes,
   num_layers, layers_per_message, streamed, CRC-32 of the JSON, hashed pages]`` then the
   first bytes of ``n`` bytes of JSON
   ``{"version", "payloads": [SequencePayload.header() per sequence], "kv_dtype", "dtype",
   "shape", "nbytes"}`` and, optionally, ``"tokens"`` (per sequence null or its token ids
   from token 0 to its end) and ``"page_size"`` (the hash chain's pages, present when the
   fixed part announces hashed pages) (``nbytes``: the bytes of K, and of V, that follow; in
   the fixed part too, with the layer grouping and the hashed pages, so that the receiver
   posts the data's and the tail's receives before it reads the JSON, and one that refuses
   the JSON still knows what to drain; ``dtype``: the arrays' dtype, the compute dtype for fp8
   pages, whose arrays hold the values read back and whose payload headers carry the scales;
   None or absent: ``kv_dtype``). A JSON longer than the head holds sends its rest in a
   second message of exactly those bytes;
2. for each group of ``layers_per_message`` consecutive layers, one message: K's rows of those
   layers then V's, each the raw bytes of a contiguous (layers, total tokens, num_kv_heads,
   head_dim) array in ``dtype``, the sequences' tokens one sequence after another (what
   ``PagedKVCache.export_sequences(..., layers=...)`` gathers; none when there are no tokens).
   One group holds every layer up to ``MESSAGE_BYTES`` of K and V; a larger transfer comes in
   groups of about that size, at least ``MIN_MESSAGES`` of them (``layers_per_message``), so
   that the sender gathers a group while the last is on the wire and the receiver writes one
   while the next arrives;
3. the tail: int64 ``[ended, messages, then per data message the two sums of its bytes,
   then the hash chain of every sequence's pages, 4 words (32 bytes) a page]`` (``ended`` 0:
   the forward a send from inside it watched was aborted), the sums computed on the sender's
   device behind each gather, checked on the receiver's (``verify``). The chain is a KV
   file's (``kvcache.files``): per sequence, rooted at its payload header as the JSON holds
   it, each page of ``page_size`` tokens over its token ids (when sent) and its rows of K's
   layers then V's as sent; the sender hashes the messages it sent (by default over gloo,
   whose messages are host memory: ``send_sequence(..., page_hashes=...)``), the receiver
   the messages that arrived, before the sequences appear.

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

The pieces, one module each: ``wire`` (the format: constants, head, layer groups, header
checks), ``endpoints`` (what both ends share), ``handle`` (``TransferHandle``), ``send``
(``send_sequence`` and the layer-by-layer sender inside a forward) and ``recv``
(``recv_sequence``). This module is their public face.
"""

from __future__ import annotations

from .handle import TransferHandle
from .recv import recv_sequence
from .send import send_sequence
from .wire import (HEAD_BYTES, MAGIC, MESSAGE_BYTES, MIN_MESSAGES, STREAM_MESSAGES, TORCH_DTYPES,
                   head_message, layers_per_message)

__all__ = ["HEAD_BYTES", "MAGIC", "MESSAGE_BYTES", "TransferHandle", "head_message",
           "layers_per_message", "recv_sequence", "send_sequence"]
# MIN_MESSAGES, STREAM_MESSAGES and TORCH_DTYPES are imported too: code reads them from here
