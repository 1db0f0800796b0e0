"""``HostTier``: a host-memory tier under a cache, where whole idle sequences are parked (their
K/V as host payloads, checked with device checksums on the way back) and restored on demand."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .arrays import to_numpy
from .errors import InvalidArgumentError
from .transfer import SequencePayload


class HostTier:
    """A host-memory tier under a cache: ``offload`` parks a whole idle sequence there (its
    K/V copied to host numpy arrays, the sequence removed, its pages free), ``restore``
    brings it back on demand (possibly sharing a prefix with a sequence still in the cache).

    ``cache``: the ``PagedKVCache`` whose sequences it holds; ``capacity_tokens``: the most
    tokens it holds at once (None: no bound). A parked sequence is held by its id; the cache
    may reuse that id meanwhile (``restore`` then needs ``new_id``). Host memory is what the
    backend's ``host_copy`` gives (pinned on a GPU: the copies run at the link's speed); an
    offload waits for its device-to-host copy, which a preemption needs anyway before the freed
    pages are reused. Each parked K and V keeps a checksum computed on the device
    (``Backend.checksum``), checked again on the device after ``restore`` uploads them: host
    memory that changed meanwhile raises ``KVCacheError`` and the sequence stays parked."""

    def __init__(self, cache, capacity_tokens: Optional[int] = None):
        from .cache import PagedKVCache
        from .core.validate import int_arg
        if not isinstance(cache, PagedKVCache):
            raise InvalidArgumentError(
                f"HostTier(cache): cache must be a kvcache.PagedKVCache, got {type(cache).__name__}")
        if capacity_tokens is not None:
            capacity_tokens = int_arg(capacity_tokens, "HostTier capacity_tokens", 0)
        self.cache = cache
        self.capacity_tokens = capacity_tokens
        # seq id -> (its payload in host memory, the checksums of its K and V: Backend.checksum)
        self._held: dict[int, tuple[SequencePayload, list]] = {}
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
        return self._payload(seq_id, "length").num_tokens

    def _payload(self, seq_id, what: str) -> SequencePayload:
        from .core.validate import seq_id_arg
        from .errors import SequenceNotFoundError
        seq_id = seq_id_arg(seq_id)
        if seq_id not in self._held:
            raise SequenceNotFoundError(
                f"{what}: sequence {seq_id} is not in the host tier ({len(self._held)} "
                f"sequences parked)")
        return self._held[seq_id][0]

    def parked(self, seq_id: int) -> SequencePayload:
        """The payload of parked sequence ``seq_id``: its K/V in host memory, as stored
        (SequenceNotFoundError when it is not parked). Its arrays are the tier's own: change
        them and ``restore`` refuses the sequence (its checksums no longer match)."""
        return self._payload(seq_id, "parked")

    def offload(self, seq_id: int) -> int:
        """Park sequence ``seq_id`` of the cache here and remove it from the cache; returns its
        length. Raises CacheFullError when the tier lacks room, SequenceExistsError when the
        id is already parked, and what ``export_sequence`` raises; nothing changes then."""
        from .core.validate import seq_id_arg
        from .errors import CacheFullError, SequenceExistsError
        seq_id = seq_id_arg(seq_id)
        if seq_id in self._held:
            raise SequenceExistsError(f"offload: sequence {seq_id} is already in the host tier")
        length = self.cache.sequence_length(seq_id)
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
        self.cache.remove_sequence(seq_id)
        self._held[seq_id] = (dataclasses.replace(payload, k=k, v=v, backend=None, device=None),
                              [to_numpy(x).tolist() for x in sums])
        self.tokens += length
        return length

    def restore(self, seq_id: int, *, new_id: Optional[int] = None,
                parent_id: Optional[int] = None, fork_pos: Optional[int] = None) -> int:
        """Bring parked sequence ``seq_id`` back into the cache (as ``new_id``, default the
        same id) and drop it from the tier; returns the tokens written (its length, less a
        shared prefix). ``parent_id``/``fork_pos``: share the first ``fork_pos`` tokens with
        that sequence of the cache instead of writing them (the caller vouches they are the
        same tokens). Errors as ``import_sequence`` (CacheFullError when the cache lacks
        pages); the sequence stays parked then."""
        payload = self._payload(seq_id, "restore")
        target = seq_id if new_id is None else new_id
        b = self.cache.backend
        k, v = b.from_host(payload.k), b.from_host(payload.v)
        sums = [to_numpy(b.checksum(x)).tolist() for x in (k, v)]     # (waits for the copies)
        then = self._held[int(seq_id)][1]
        if sums != then:
            from .errors import KVCacheError
            raise KVCacheError(
                f"restore: sequence {int(seq_id)}'s parked K/V changed in host memory since it was "
                f"offloaded (checksums {then} then, {sums} now); it stays parked, "
                f"drop it and recompute")
        device = dataclasses.replace(payload, k=k, v=v, backend=b.name, device=b.device)
        self.cache.import_sequence(target, device, parent_id=parent_id, fork_pos=fork_pos)
        del self._held[int(seq_id)]
        self.tokens -= payload.num_tokens
        shared = 0 if parent_id is None else (payload.start if fork_pos is None else int(fork_pos))
        return payload.num_tokens - shared

    def drop(self, seq_id: int) -> None:
        """Forget the parked sequence ``seq_id`` (SequenceNotFoundError when it is not
        parked)."""
        payload = self._payload(seq_id, "drop")
        del self._held[int(seq_id)]
        self.tokens -= payload.num_tokens

    def clear(self) -> None:
        """Forget every parked sequence."""
        self._held.clear()
        self.tokens = 0


__all__ = ["HostTier"]
