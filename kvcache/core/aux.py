"""Aux-data managers: move a forward's host int32 index arrays (``ForwardPlan``) to the device
and hand back their device twin (``ForwardAux``: the same records, the same field names).

* ``PlainAuxManager`` (Metal, reference): one copy per array on the compute stream.
* ``MergedAuxManager`` (CUDA, ROCm): every array packed at aligned offsets into one host staging
  buffer, one host-to-device copy on the copy stream, device views sliced from one device buffer;
  the compute stream waits on an event recorded after the copy. Two staging/device buffer pairs
  alternate: the host waits for the copy that last read a staging buffer before rewriting it, and
  the copy stream waits for the compute work that last read a device buffer before overwriting it.

Both are driven lazily by ``PagedKVCache``: the copy is issued by the first call that needs
device aux data after ``begin_forward``, never eagerly. The exception is a static-shape decode
step (``CacheConfig(static_decode=True)``): ``begin_forward`` itself copies into one
fixed-address device buffer (``upload_static``), since a replayed capture runs no Python that
could issue it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from .plan import ForwardAux, ForwardPlan, device_twin, walk

ALIGN = 16  # int32 elements: 64-byte alignment for every packed array


class PlainAuxManager:
    kind = "plain"

    def __init__(self, backend):
        self.backend = backend
        self.copies = 0

    def upload(self, plan: ForwardPlan) -> ForwardAux:
        """One copy per array, in ``walk`` order."""
        to_device = self.backend.aux_to_device
        views = [to_device(array) for _, _, array in walk(plan)]
        self.copies += len(views)
        return device_twin(plan, iter(views).__next__)

    def release(self) -> None:
        pass


class _Slot:
    """One staging buffer and its device buffer (backend handles and arrays; None until the
    first upload allocates them)."""

    def __init__(self):
        self.capacity = 0
        self.host_handle: Any = None
        self.host: Any = None
        self.device: Any = None
        self.copy_event: Any = None
        self.release_event: Any = None


class _StaticBuffers:
    """Static-shape decode: one device buffer at a fixed address (captured steps read it), laid
    out once from the capacity plan (page list last: each copy stops at the end of the data,
    not of the capacity), fed from two alternating pinned staging buffers."""

    def __init__(self, backend, capacity: ForwardPlan):
        arrays = [array for _, _, array in walk(capacity)]
        self.capacities = [len(a) for a in arrays]
        self.page_list = [name == "page_indices" for _, name, _ in walk(capacity)]
        # page lists at the end of the buffer whatever follows them in walk order (a depth's
        # tree arrays): each copy stops at the end of the data, not of the lists' capacity
        order = sorted(range(len(arrays)), key=lambda i: self.page_list[i])
        laid, self.total = MergedAuxManager.layout([arrays[i] for i in order])
        self.offsets = [0] * len(arrays)
        for i, off in zip(order, laid):
            self.offsets[i] = off
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
                 static_capacity: Optional[Callable[[tuple], ForwardPlan]] = None):
        self.backend = backend
        self.copy_stream = copy_stream
        self.slots = [_Slot() for _ in range(num_buffers)]
        self.initial_capacity = initial_capacity
        self.next = 0
        self.current: Optional[int] = None
        self.copies = 0
        self.allocations = 0
        # the capacity plan of a kind of static-shape step (``ForwardPlan.static_kind``)
        self.static_capacity = static_capacity
        self._statics: dict = {}             # per kind of static-shape step: its buffers
        self._static_open: Optional[_StaticBuffers] = None

    @staticmethod
    def layout(arrays: list) -> tuple[list, int]:
        """Aligned offsets of each array in the packed buffer, and the packed length."""
        offsets, top = [], 0
        for array in arrays:
            offsets.append(top)
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

    def upload(self, plan: ForwardPlan) -> ForwardAux:
        """Pack, copy once on the copy stream, and view (see the module docstring)."""
        arrays = [array for _, _, array in walk(plan)]
        offsets, total = self.layout(arrays)
        slot = self.slots[self.next]
        self._ensure(slot, total)
        if slot.copy_event is not None:          # the last copy from this staging buffer is done
            self.backend.event_synchronize(slot.copy_event)
        host = slot.host
        for off, array in zip(offsets, arrays):
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
        view = self.backend.aux_view
        views = iter([view(slot.device, off, len(array)) for off, array in zip(offsets, arrays)])
        return device_twin(plan, views.__next__)

    def upload_static(self, plan: ForwardPlan) -> ForwardAux:
        """Like ``upload`` but into the fixed static-shape buffer: the device views have the same
        addresses every step (page lists: their whole capacity), so a step captured once reads
        every later step's arrays."""
        kind = plan.static_kind
        g = self._statics.get(kind)
        if g is None:
            if self.static_capacity is None:
                raise AssertionError("upload_static on a cache built without static_decode")
            g = self._statics[kind] = _StaticBuffers(self.backend, self.static_capacity(kind))
            self.allocations += 1
        arrays = [array for _, _, array in walk(plan)]
        if len(arrays) != len(g.capacities) or any(
                len(a) > c for a, c in zip(arrays, g.capacities)):
            raise AssertionError("a static-shape plan's arrays exceed the capacity plan's")
        host_handle, host = g.hosts[g.next]
        if g.copy_events[g.next] is not None:      # the last copy from this staging buffer is done
            self.backend.event_synchronize(g.copy_events[g.next])
        end = 0
        for off, array in zip(g.offsets, arrays):
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
        self._static_open = g
        views = iter([self.backend.aux_view(g.device, off, cap if full else len(array))
                      for off, cap, full, array in zip(g.offsets, g.capacities, g.page_list,
                                                       arrays)])
        return device_twin(plan, views.__next__)

    @property
    def static_device_buffer(self):
        """The fixed device buffer of static-shape decode (None before its first step)."""
        return self.static_buffer(mixed=False)

    def static_buffer(self, mixed: bool, depths: int = 1):
        """The fixed device buffer of static-shape decode steps (``mixed``: of static-shape
        mixed steps of ``depths`` depths: ``ForwardPlan.static_kind``); None before the first
        such step."""
        g = self._statics.get((bool(mixed), depths))
        return None if g is None else g.device

    def release(self) -> None:
        if self._static_open is not None:
            self._static_open.release_event = self.backend.record_event()
            self._static_open = None
        elif self.current is not None:
            self.slots[self.current].release_event = self.backend.record_event()


def pack_reference(plan: ForwardPlan) -> np.ndarray:
    """The packed buffer as the merged manager lays it out (tests compare device views to it)."""
    arrays = [array for _, _, array in walk(plan)]
    offsets, total = MergedAuxManager.layout(arrays)
    out = np.zeros(total, np.int32)
    for off, array in zip(offsets, arrays):
        out[off:off + len(array)] = array
    return out
