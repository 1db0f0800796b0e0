"""Aux-data managers: move a forward's host int32 index arrays to the device.

* ``PlainAuxManager`` (Metal, reference): one copy per array on the compute stream.
* ``MergedAuxManager`` (CUDA, ROCm): every array packed at aligned offsets into one host staging
  buffer, one host-to-device copy on the copy stream, device views sliced from one device buffer;
  the compute stream waits on an event recorded after the copy. Two staging/device buffer pairs
  alternate: the host waits for the copy that last read a staging buffer before rewriting it, and
  the copy stream waits for the compute work that last read a device buffer before overwriting it.

Both are driven lazily by ``PagedKVCache``: the copy is issued by the first call that needs
device aux data after ``begin_forward``, never eagerly. The exception is a graph-mode decode
step (``CacheConfig(cuda_graph=True)``): ``begin_forward`` itself copies into one fixed-address
device buffer (``upload_graph``), since a replayed graph runs no Python that could issue it.
"""

from __future__ import annotations

import numpy as np

ALIGN = 16  # int32 elements: 64-byte alignment for every packed array


class PlainAuxManager:
    kind = "plain"

    def __init__(self, backend):
        self.backend = backend
        self.copies = 0

    def upload(self, arrays: dict) -> dict:
        self.copies += len(arrays)
        return {name: self.backend.aux_to_device(array) for name, array in arrays.items()}

    def release(self) -> None:
        pass


class _Slot:
    def __init__(self):
        self.capacity = 0
        self.host_handle = None
        self.host = None
        self.device = None
        self.copy_event = None
        self.release_event = None


class _GraphBuffers:
    """Graph mode: one device buffer at a fixed address (captured graphs read it), laid out
    once from capacities, fed from two alternating pinned staging buffers."""

    def __init__(self, backend, capacities: dict):
        # page lists go last: each copy stops at the end of the data, not of the capacity
        names = sorted(capacities, key=lambda n: n.endswith("page_indices"))
        self.capacities = {n: capacities[n] for n in names}
        self.offsets, self.total = MergedAuxManager.layout(
            {n: range(c) for n, c in self.capacities.items()})
        self.device, self.release_event = _fresh_device(backend, self.total)
        self.hosts = [backend.aux_alloc_host(self.total) for _ in range(2)]
        self.copy_events = [None, None]
        self.next = 0


def _fresh_device(backend, num_int32):
    """A new device buffer and the compute-stream event its first copy must wait on: the memory
    may have been freed by kernels still queued on the compute stream."""
    return backend.aux_alloc_device(num_int32), backend.record_event()


class MergedAuxManager:
    kind = "merged"

    def __init__(self, backend, copy_stream, num_buffers: int = 2, initial_capacity: int = 1 << 10,
                 graph_capacities: dict | None = None):
        self.backend = backend
        self.copy_stream = copy_stream
        self.slots = [_Slot() for _ in range(num_buffers)]
        self.initial_capacity = initial_capacity
        self.next = 0
        self.current = None
        self.copies = 0
        self.allocations = 0
        self.graph_capacities = graph_capacities
        self._graph = None
        self._graph_open = False

    @staticmethod
    def layout(arrays: dict) -> tuple[dict, int]:
        """Aligned offsets of each array in the packed buffer, and the packed length."""
        offsets, top = {}, 0
        for name, array in arrays.items():
            offsets[name] = top
            top += -(-max(len(array), 1) // ALIGN) * ALIGN
        return offsets, top

    def _ensure(self, slot: _Slot, total: int) -> None:
        if total <= slot.capacity:
            return
        if slot.copy_event is not None:
            self.backend.event_synchronize(slot.copy_event)
        capacity = max(total, 2 * slot.capacity, self.initial_capacity)
        slot.host_handle, slot.host = self.backend.aux_alloc_host(capacity)
        slot.device, slot.release_event = _fresh_device(self.backend, capacity)
        slot.capacity = capacity
        slot.copy_event = None
        self.allocations += 1

    def upload(self, arrays: dict) -> dict:
        offsets, total = self.layout(arrays)
        slot = self.slots[self.next]
        self._ensure(slot, total)
        if slot.copy_event is not None:          # the last copy from this staging buffer is done
            self.backend.event_synchronize(slot.copy_event)
        host = slot.host
        for name, array in arrays.items():
            off = offsets[name]
            host[off:off + len(array)] = array
        if slot.release_event is not None:       # kernels that read this device buffer are done
            self.backend.stream_wait_event(slot.release_event, self.copy_stream)
        slot.copy_event = self.backend.aux_copy_async(slot.device, slot.host_handle, total,
                                                      self.copy_stream)
        if slot.copy_event is not None:
            self.backend.stream_wait_event(slot.copy_event)
        self.copies += 1
        self.current = self.next
        self.next = (self.next + 1) % len(self.slots)
        return {name: self.backend.aux_view(slot.device, offsets[name], len(array))
                for name, array in arrays.items()}

    def upload_graph(self, arrays: dict) -> dict:
        """Like ``upload`` but into the fixed graph buffer: the device views have the same
        addresses every step (page lists: their whole capacity), so a graph captured on one
        step reads the next step's arrays."""
        if self._graph is None:
            self._graph = _GraphBuffers(self.backend, self.graph_capacities)
            self.allocations += 1
        g = self._graph
        for name, array in arrays.items():
            if len(array) > g.capacities[name]:
                raise AssertionError(f"graph aux array {name} of {len(array)} exceeds its capacity")
        host_handle, host = g.hosts[g.next]
        if g.copy_events[g.next] is not None:      # the last copy from this staging buffer is done
            self.backend.event_synchronize(g.copy_events[g.next])
        end = 0
        for name, array in arrays.items():
            off = g.offsets[name]
            host[off:off + len(array)] = array
            end = max(end, off + len(array))
        if g.release_event is not None:            # kernels that read the device buffer are done
            self.backend.stream_wait_event(g.release_event, self.copy_stream)
        event = self.backend.aux_copy_async(g.device, host_handle, end, self.copy_stream)
        g.copy_events[g.next] = event
        if event is not None:
            self.backend.stream_wait_event(event)
        g.next ^= 1
        self.copies += 1
        self._graph_open = True
        return {name: self.backend.aux_view(
                    g.device, g.offsets[name],
                    g.capacities[name] if name.endswith("page_indices") else len(array))
                for name, array in arrays.items()}

    @property
    def graph_device_buffer(self):
        """The fixed device buffer of graph mode (None before the first graph-mode step)."""
        return None if self._graph is None else self._graph.device

    def release(self) -> None:
        if self._graph_open:
            self._graph.release_event = self.backend.record_event()
            self._graph_open = False
        elif self.current is not None:
            self.slots[self.current].release_event = self.backend.record_event()


def pack_reference(arrays: dict) -> np.ndarray:
    """The packed buffer as the merged manager lays it out (tests compare device views to it)."""
    offsets, total = MergedAuxManager.layout(arrays)
    out = np.zeros(total, np.int32)
    for name, array in arrays.items():
        out[offsets[name]:offsets[name] + len(array)] = array
    return out
