"""Per-forward launch records of the Triton launchers (no torch / triton import here).

Everything a per-layer launch needs that depends only on the config, the tuning and the forward's
plan (grids, split-K factors, constexpr dicts, index-array tuples, split-K scratch) is computed on
the first layer of a forward and reused by every later layer: the per-layer Python is then the
output allocations and the kernel launches.

Safety (docs/architecture.md, "Streams, buffers and the run-ahead rule"):

* a record is keyed by the *identity* of the plan object it was built from (a ``DepthAux`` or the
  forward's ``qo_indptr``) and holds a strong reference to it, so an id is never reused while its
  record lives; each forward uploads new plan objects, so a new forward builds new records;
* only internal scratch is cached (split-K partials, the ragged path's finite-V copy and flags):
  they are written and read by kernels of one layer on the caller's stream, so the next layer (or
  a later forward) reusing them is ordered after those reads by the stream itself; the split-K
  decode's merge counters (``counters``, one zeroed int32 buffer per stream) are left at zero by
  every launch that uses them, for the same reason; outputs handed
  to the caller are allocated per call;
* scratch is carved from one byte arena per stream (``arenas``) that only grows: every user of a
  scratch buffer (split-K decode then merge, finite-V copy then the two ragged passes) is queued
  within one attention call on that stream, so any later call on the same stream, this forward's
  next layer or a later forward, is ordered after those reads by the stream itself. A grown
  arena's old block stays alive while records still view it and then returns to torch's caching
  allocator, which reuses it in stream order. Steady state therefore allocates nothing;
* while a CUDA graph is being captured, records are built and kept apart (``captured=True``):
  their scratch and merge counters come from the graph's private pool (torch.zeros there is a
  memset node, so a replay zeroes the counters before its first layer), never from the arena, so
  a graph never points at a cached buffer that a later eviction frees, and eager calls never use
  the graph's buffers. Later layers of the capture reuse the record as eager layers do. A
  capture's plan objects are its forward's own, so no later capture finds its records (its
  memset must not be skipped); an evicted capture record frees pool memory that only a later
  capture into the same pool can take, and that graph writes it before reading it.
"""

from __future__ import annotations

from collections import OrderedDict


class LaunchCache:
    """Launch records of one backend instance, keyed by plan identity (most recent first out).

    ``allocations`` counts arena (re)allocations (tests assert it stays flat in steady state: after
    a warm-up step, neither later layers nor later forwards allocate); ``builds`` counts records
    built (one per plan object and launcher kind, i.e. per forward).
    """

    # a forward has a handful of records (ragged + one per block depth); keeping a few forwards'
    # worth bounds the scratch held while never evicting a record of the open forward
    MAX_RECORDS = 16

    def __init__(self):
        self._records: OrderedDict = OrderedDict()
        self._captured: OrderedDict = OrderedDict()     # records built during graph capture
        self.allocations = 0
        self.builds = 0
        self.static: dict = {}       # config/tuning-only values (per launcher kind)
        self.arenas: dict = {}       # (device, stream) -> flat uint8 scratch tensor
        self.counters: dict = {}     # (device, stream) -> int32 zeros of the fused split-K merge

    def get(self, key, captured: bool = False):
        """The record stored under ``key`` (a tuple whose first item is ``id(plan_object)``), or
        None; ``captured``: among the records built while a graph was captured."""
        entry = (self._captured if captured else self._records).get(key)
        return None if entry is None else entry[1]

    def put(self, key, anchor, record, captured: bool = False):
        """Store ``record`` under ``key``, keeping ``anchor`` (the plan object) alive with it."""
        records = self._captured if captured else self._records
        records[key] = (anchor, record)
        self.builds += 1
        while len(records) > self.MAX_RECORDS:
            records.popitem(last=False)
        return record

    def clear(self):
        """Drop every record and config-derived value (tuning changed); arenas stay."""
        self._records.clear()
        self._captured.clear()
        self.static.clear()

    def __len__(self):
        return len(self._records)
