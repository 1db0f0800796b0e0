"""Capture a decode step in a CUDA (or HIP) graph once per batch bucket, replay it every step.

With static-shape decode (``CacheConfig(static_decode=True)``) a decode ``begin_forward`` pads
the batch to a bucket, copies the step's index arrays into one fixed-address device buffer, and
makes every launch parameter depend on the bucket alone; kernels read lengths and page lists from that
buffer. A graph captured on one step therefore serves any later step of the same bucket, with
other sequences and longer histories::

    graphs = DecodeGraphs(cache)
    cache.begin_forward(ids, [1] * len(ids))           # any batch that pads to this bucket
    out = graphs.capture(step)                         # step(): every layer's cache.attention
    cache.end_forward()
    ...
    cache.begin_forward(other_ids, [1] * len(other_ids))
    fill the static inputs step() reads (rows past len(other_ids) are padding)
    out = graphs.replay()                              # the bucket's graph; raises if none fits
    cache.end_forward()

``replay`` refuses (typed error, nothing launched) when the open forward is not a static-shape
decode step, when no graph was captured for its bucket, when the cache's graph buffer moved, or
when the step was already replayed, so a graph never runs on stale index data.

Warm-up, capture, the memory pool, replay and the CPU stand-in are ``graph_core.GraphCore``'s,
shared with the engine's whole-step graphs; this class adds the caller-facing refusals.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Callable

from kvcache.errors import ForwardStateError, InvalidArgumentError

from .graph_core import GraphCore, GraphSlot


class _Captured(MutableMapping):
    """``DecodeGraphs.graphs``: bucket -> ``(graph, outputs)``, a view of the core's slots
    (tools look a bucket up; a test swaps a graph for one that runs no Python)."""

    def __init__(self, slots: dict):
        self._slots = slots

    def __getitem__(self, bucket):
        slot = self._slots[bucket]
        return slot.graph, slot.outputs

    def __setitem__(self, bucket, value):
        slot = self._slots[bucket]
        slot.graph, slot.outputs = value

    def __delitem__(self, bucket):
        del self._slots[bucket]

    def __iter__(self):
        return iter(self._slots)

    def __len__(self):
        return len(self._slots)


class DecodeGraphs:
    """Decode steps of ``cache`` (``static_decode=True``) captured per batch bucket and replayed
    (see the module docstring); ``warmup``: eager runs before a GPU capture; ``core``: the
    ``GraphCore`` that captures and replays; ``graphs``: bucket -> ``(graph, outputs)``."""

    def __init__(self, cache, warmup: int = 1):
        self.core = GraphCore(cache, warmup=warmup, owner="DecodeGraphs")
        self.cache = cache
        self.warmup = warmup
        self.graphs = _Captured(self.core.slots)
        self._last_plan = None

    @property
    def buckets(self) -> list:
        """Buckets captured so far."""
        return sorted(self.core.slots)

    def capture(self, step: Callable):
        """Run ``step()`` eagerly ``warmup`` times (on a GPU), then capture it for the open forward's bucket
        (replacing an earlier graph of that bucket) and replay it once. ``step`` calls
        ``cache.attention`` for every layer on fixed input tensors of the bucket's rows and
        returns its outputs, which become the graph's static outputs (a ``window_left`` that
        ``step`` passes is a plain kernel argument: replays use the captured one); they hold this step's
        values on return (appends are idempotent, so the repeated runs write the same KV)."""
        bucket = self.core.open_bucket("capture", decode_only=True)
        slot = GraphSlot(bucket)
        out = self.core.capture(slot, step)
        self.core.slots[bucket] = slot          # only a capture that succeeded replaces one
        self._last_plan = self.cache.open_plan
        return out

    def replay(self):
        """Replay the graph of the open forward's bucket; returns its static outputs."""
        core = self.core
        bucket = core.open_bucket("replay", decode_only=True)
        plan = self.cache.open_plan
        slot = core.slots.get(bucket)
        if slot is None:
            raise InvalidArgumentError(
                f"decode batch of {len(plan.seq_ids)} sequences pads to bucket {bucket}, but graphs "
                f"were captured for buckets {self.buckets}; capture one for {bucket} first")
        if core.address() != slot.address:
            raise ForwardStateError("the cache's graph aux buffer moved since capture; capture again")
        if plan is self._last_plan:
            raise ForwardStateError(
                "this forward already ran (captured or replayed); call end_forward and begin_forward "
                "before the next replay")
        self._last_plan = plan
        return core.replay(slot)
