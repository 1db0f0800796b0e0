"""``HostTier``: a host-memory tier under a cache, where whole idle sequences are parked (their
K/V as host payloads, checked on the way back: a SHA-256 hash chain over their pages, the one
KV files carry, and device checksums of the uploaded copies) and restored on demand."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from .arrays import to_numpy
from .errors import InvalidArgumentError, KVCacheError
from .transfer import SequencePayload


@dataclasses.dataclass
class _Parked:
    payload: SequencePayload
    sums: list                      # Backend.checksum of K and of V, as offloaded
    tokens: Optional[np.ndarray]    # its token ids (little-endian int32), or None
    pages: Optional[list]           # the hash chain (kvcache.files), None without verify


def verify_by_default(device) -> bool:
    """Whether a ``HostTier`` of a cache on ``device`` (a backend's ``device``: None or a
    string such as ``"cpu"`` or ``"cuda:0"``) checks its parked copies by their hash chain when
    ``verify`` is not given: only where the cache lives in host memory. On an accelerator the
    parked copy is one DMA and the chain's SHA-256 pass costs about 12 times it (two H200s,
    2026-11-28: 242 ms against 19 ms a GiB), which would undo what the tier is for; the
    device checksums still refuse a changed byte there."""
    return str(device or "cpu").startswith("cpu")


class HostTier:
    """A host-memory tier under a cache: ``offload`` parks a whole idle sequence there (its
    K/V copied to host numpy arrays, the sequence removed, its pages free), ``restore``
    brings it back on demand (possibly sharing a prefix with a sequence still in the cache).

    ``cache``: the ``PagedKVCache`` whose sequences it holds; ``capacity_tokens``: the most
    tokens it holds at once (None: no bound). A parked sequence is held by its id; the cache
    may reuse that id meanwhile (``restore`` then needs ``new_id``). Host memory is what the
    backend's ``host_copy`` gives (pinned on a GPU: the copies run at the link's speed); an
    offload waits for its device-to-host copy, which a preemption needs anyway before the freed
    pages are reused.

    Checked moves: with ``verify`` ``offload`` computes the SHA-256 hash chain
    of the parked copy as a KV file holds it (rooted at the payload header, over each page's
    token ids when given, K and V: ``kvcache.files``), and ``restore`` computes it again
    before anything is uploaded; a parked byte of K, V, a scale, a token id or the header that
    changed meanwhile raises ``KVCacheError`` naming the sequence and the page, and the
    sequence stays parked (nothing changes). The chain costs a pass of SHA-256 over the bytes
    each way, on the host's hashing threads (docs/kv-files.md has the numbers): about 12
    times the copy itself where the copy is a DMA at the link's speed, so ``verify=None``
    (the default, ``verify_by_default``) takes it only for a cache in host memory (its
    device the CPU), not for one on an accelerator (a GPU: the Engine's preemption tier);
    ``verify=False`` leaves the device checksums alone. Those are always kept: each parked K
    and V keeps a checksum computed on the device (``Backend.checksum``), checked again on
    the device after ``restore`` uploads them (a copy changed on the way up raises
    ``KVCacheError`` too)."""

    def __init__(self, cache, capacity_tokens: Optional[int] = None, *,
                 verify: Optional[bool] = None):
        from .cache import PagedKVCache
        from .core.validate import bool_arg, int_arg
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgumentError(
                f"HostTier(cache): cache must be a kvcache.PagedKVCache, got {type(cache).__name__}")
        if capacity_tokens is not None:
            capacity_tokens = int_arg(capacity_tokens, "HostTier capacity_tokens", 0)
        self.cache = cache
        self.capacity_tokens = capacity_tokens
        self.verify = (verify_by_default(cache.backend.device) if verify is None
                       else bool_arg(verify, "HostTier verify"))
        """Whether parked copies are checked by their hash chain (see the class doc)."""
        self._held: dict[int, _Parked] = {}
        self.tokens = 0
        """Tokens held now."""

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity_tokens is None else self.capacity_tokens
        return f"HostTier(sequences={len(self._held)}, tokens={self.tokens}, capacity={cap})"

    def __contains__(self, seq_id) -> bool:
        from .core.validate import seq_id_arg
        return seq_id_arg(seq_id) in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def seq_ids(self) -> list:
        """The ids of the parked sequences, oldest first."""
        return list(self._held)

    def length(self, seq_id: int) -> int:
        """Tokens of the parked sequence ``seq_id`` (SequenceNotFoundError when it is not
        parked)."""
        return self._parked(seq_id, "length").payload.num_tokens

    def _parked(self, seq_id, what: str) -> _Parked:
        from .core.validate import seq_id_arg
        from .errors import SequenceNotFoundError
        seq_id = seq_id_arg(seq_id)
        if seq_id not in self._held:
            raise SequenceNotFoundError(
                f"{what}: sequence {seq_id} is not in the host tier ({len(self._held)} "
                f"sequences parked)")
        return self._held[seq_id]

    def parked(self, seq_id: int) -> SequencePayload:
        """The payload of parked sequence ``seq_id``: its K/V in host memory, as stored
        (SequenceNotFoundError when it is not parked). Its arrays are the tier's own: change
        them and ``restore`` refuses the sequence (its hash chain and checksums no longer
        match)."""
        return self._parked(seq_id, "parked").payload

    def parked_tokens(self, seq_id: int) -> Optional[np.ndarray]:
        """The token ids parked with sequence ``seq_id`` (``offload(..., tokens=...)``): the
        tier's own int32 array, checked like its K/V; None when none were given."""
        return self._parked(seq_id, "parked_tokens").tokens

    def offload(self, seq_id: int, tokens=None) -> int:
        """Park sequence ``seq_id`` of the cache here and remove it from the cache; returns its
        length. ``tokens``: its token ids (as many as its tokens, each in [0, 2**31)), parked
        and checked with it, and recorded again by ``restore`` (``extend_tokens``: with the
        prefix cache its full pages rejoin the index); None: none. Raises CacheFullError when
        the tier lacks room, SequenceExistsError when the id is already parked,
        InvalidArgumentError for ``tokens`` that do not fit, and what ``export_sequence``
        raises; nothing changes then."""
        from .core.validate import seq_id_arg
        from .errors import CacheFullError, SequenceExistsError
        seq_id = seq_id_arg(seq_id)
        if seq_id in self._held:
            raise SequenceExistsError(f"offload: sequence {seq_id} is already in the host tier")
        length = self.cache.sequence_length(seq_id)
        ids = None if tokens is None else _token_ids(tokens, seq_id, length)
        if self.capacity_tokens is not None and self.tokens + length > self.capacity_tokens:
            raise CacheFullError(
                f"offload: sequence {seq_id} has {length} tokens but the host tier holds "
                f"{self.tokens} of {self.capacity_tokens}")
        payload = self.cache.export_sequence(seq_id)
        b = self.cache.backend
        # the checksums are computed where the rows are (at device speed), the copies go to
        # memory the device writes at the link's speed; one wait for all four
        sums = [b.checksum(payload.k), b.checksum(payload.v)]
        (k, _), (v, done) = b.host_copy(payload.k), b.host_copy(payload.v)
        b.event_synchronize(done)
        host = dataclasses.replace(payload, k=k, v=v, backend=None, device=None)
        pages = self._chain(host, ids) if self.verify else None
        self.cache.remove_sequence(seq_id)
        self._held[seq_id] = _Parked(host, [to_numpy(x).tolist() for x in sums], ids, pages)
        self.tokens += length
        return length

    def _chain(self, payload: SequencePayload, ids) -> Optional[list]:
        """The hash chain of a parked copy now (None when it cannot be computed: arrays that
        are no longer host arrays, a header no longer JSON: changed, as a differing chain)."""
        from .files import payload_chain
        try:
            return payload_chain(payload, ids, self.cache.config.page_size)
        except (TypeError, ValueError, AttributeError):
            return None

    def restore(self, seq_id: int, *, new_id: Optional[int] = None,
                parent_id: Optional[int] = None, fork_pos: Optional[int] = None) -> int:
        """Bring parked sequence ``seq_id`` back into the cache (as ``new_id``, default the
        same id) and drop it from the tier; returns the tokens written (its length, less a
        shared prefix). ``parent_id``/``fork_pos``: share the first ``fork_pos`` tokens with
        that sequence of the cache instead of writing them (the caller vouches they are the
        same tokens). Its token ids, when parked with it, are recorded (``extend_tokens``).
        Raises KVCacheError when the parked copy changed (its hash chain, with ``verify``, or
        the device checksums of the uploaded copy), and what ``import_sequence`` raises
        (CacheFullError when the cache lacks pages); the sequence stays parked then, and the
        cache is unchanged."""
        parked = self._parked(seq_id, "restore")
        payload = parked.payload
        sid = int(seq_id)
        if parked.pages is not None:
            # checked on the host before anything is uploaded: a changed byte never reaches
            # the pages
            from .files import first_difference
            now = self._chain(payload, parked.tokens)
            bad = 0 if now is None else first_difference(parked.pages, now)
            if bad is not None:
                ps = self.cache.config.page_size
                raise KVCacheError(
                    f"restore: sequence {sid}'s parked K/V changed in host memory since it was "
                    f"offloaded: page {bad} (tokens {bad * ps}..) fails its hash (a byte of "
                    f"its K/V, scales, token ids or header); it stays parked, drop it and "
                    f"recompute")
        target = seq_id if new_id is None else new_id
        b = self.cache.backend
        k, v = b.from_host(payload.k), b.from_host(payload.v)
        sums = [to_numpy(b.checksum(x)).tolist() for x in (k, v)]     # (waits for the copies)
        if sums != parked.sums:
            raise KVCacheError(
                f"restore: sequence {sid}'s parked K/V changed in host memory since it was "
                f"offloaded (checksums {parked.sums} then, {sums} now); it stays parked, "
                f"drop it and recompute")
        device = dataclasses.replace(payload, k=k, v=v, backend=b.name, device=b.device)
        self.cache.import_sequence(target, device, parent_id=parent_id, fork_pos=fork_pos)
        if parked.tokens is not None:
            self.cache.extend_tokens(target, parked.tokens.tolist())
        del self._held[sid]
        self.tokens -= payload.num_tokens
        shared = 0 if parent_id is None else (payload.start if fork_pos is None else int(fork_pos))
        return payload.num_tokens - shared

    def drop(self, seq_id: int) -> None:
        """Forget the parked sequence ``seq_id`` (SequenceNotFoundError when it is not
        parked)."""
        parked = self._parked(seq_id, "drop")
        del self._held[int(seq_id)]
        self.tokens -= parked.payload.num_tokens

    def clear(self) -> None:
        """Forget every parked sequence."""
        self._held.clear()
        self.tokens = 0


def _token_ids(tokens, seq_id: int, length: int) -> np.ndarray:
    """``tokens`` as the tier parks them (little-endian int32), checked against the
    sequence's ``length``: InvalidArgumentError naming the sequence, the count and the limit."""
    try:
        ids = [int(t) for t in tokens]
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"offload: sequence {seq_id}: tokens must be a list of ints, got "
            f"{type(tokens).__name__}") from None
    if len(ids) != length:
        raise InvalidArgumentError(
            f"offload: sequence {seq_id} holds {length} tokens, its token ids list {len(ids)}")
    bad = next((t for t in ids if not 0 <= t < 2**31), None)
    if bad is not None:
        raise InvalidArgumentError(
            f"offload: sequence {seq_id}: token id {bad} must lie in [0, 2**31) (hashed as "
            f"int32)")
    return np.asarray(ids, dtype="<i4")


__all__ = ["HostTier"]
