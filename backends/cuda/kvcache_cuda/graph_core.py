"""The one capture/replay core of whole static-shape steps (``CacheConfig(static_decode=True)``):
``DecodeGraphs`` (this package: the caller's step over the caller's buffers) and the engine's
``kvcache.integrations.torch_graphs.StepGraphs`` (a model's whole step over its token buffers)
both drive a ``GraphCore``; the kernel benchmarks' ``bench_kit.Timer`` uses its two functions.

It lives in the cuda backend because only this backend (and rocm, built on it) offers
``static_decode``: the integrations import it lazily once such a cache exists, an arrow down;
this package never imports ``kvcache.integrations`` (an arrow back up), and ``kvcache``'s core
stays free of torch.

Per key (a batch bucket, or ``(ForwardPlan.static_kind, bucket)``) a ``GraphSlot`` holds the
captured graph, its static outputs, the layers the step ran and the address of the index buffer
it read; owners subclass it for their static inputs. ``capture``: warm-up runs on a side stream
(kernels compile and autotune outside capture), then the step recorded into the core's one
memory pool and replayed once. ``replay``: the slot's graph, its layers counted as run. On a CPU
device (the CPU test mode, the Triton interpreter) nothing is recorded: ``HostGraph`` re-runs
the step eagerly on the same buffers, the same data path without a device graph.
``open_bucket`` refuses (typed error) a forward that no bucket fits.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Optional, TypeVar

from kvcache.errors import ForwardStateError, InvalidArgumentError

try:  # torch is optional at import time (kvcache_cuda.backend explains its absence)
    import torch
except Exception:  # pragma: no cover - exercised only where torch is missing
    torch = None  # type: ignore[assignment]

__all__ = ["GraphCore", "GraphSlot", "HostGraph", "record_graph", "warm_up"]


def warm_up(step: Callable, device, times: int, before: Optional[Callable] = None) -> None:
    """Run ``step()`` ``times`` times on a side stream ordered after the compute stream's work
    and before its next (``before()`` ahead of each run): kernels compile and autotune, and
    the allocator meets the step's tensors, outside the capture."""
    compute = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for _ in range(times):
            if before is not None:
                before()
            step()
    compute.wait_stream(side)


def record_graph(step: Callable, device, pool: Any = None) -> tuple:
    """``step()`` recorded (not run) as a CUDA graph in ``pool``: ``(graph, its static
    outputs)``. A failed capture re-raises with the compute stream current again (a failed
    ``capture_end`` leaves its own stream current)."""
    compute = torch.cuda.current_stream(device)
    graph = torch.cuda.CUDAGraph()
    # no garbage collection inside the capture: collecting another graph there (a reference
    # cycle freed late) resets it mid-capture and invalidates this one
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = step()
    except BaseException:
        torch.cuda.set_stream(compute)
        raise
    finally:
        if collecting:
            gc.enable()
    return graph, out


class HostGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph``: replay lets the open forward's layers run
    again and re-runs the step eagerly, returning its fresh outputs."""

    def __init__(self, step: Callable, cache):
        self.step, self.cache = step, cache

    def replay(self):
        self.cache.rerun_layers()
        return self.step()


class GraphSlot:
    """One key's captured step: ``graph`` (None until captured), its static ``outputs``, the
    ``layers`` it ran and the index buffer ``address`` it read."""

    def __init__(self, key):
        self.key = key
        self.graph: Any = None
        self.outputs: Any = None
        self.layers: frozenset = frozenset()
        self.address: Optional[int] = None


Slot = TypeVar("Slot", bound=GraphSlot)


class GraphCore:
    """Capture and replay of whole steps of ``cache`` (``static_decode=True``), keyed by the
    owner (``slots``: key -> ``GraphSlot``); ``device``: the torch device the steps run on
    (default the cache's); ``warmup``: eager runs before a GPU capture; ``owner`` names the
    caller in errors. ``captures`` counts recordings, ``replays`` every run of a captured step
    (a capture includes its first replay). Every capture shares one memory pool."""

    def __init__(self, cache, device=None, warmup: int = 1, owner: str = "GraphCore"):
        if not cache.config.static_decode:
            raise InvalidArgumentError(f"{owner} needs a cache built with CacheConfig(static_decode=True)")
        if warmup < 1:
            raise InvalidArgumentError(
                f"warmup must be at least 1 (kernels compile outside capture), got {warmup}")
        self.cache = cache
        self.owner = owner
        self.device = torch.device(cache.backend.torch_device if device is None else device)
        self.on_gpu = self.device.type != "cpu"
        self.warmup = int(warmup)
        self.slots: dict = {}
        self.captures = 0
        self.replays = 0
        self._pool: Any = None

    def open_bucket(self, what: str, decode_only: bool = False) -> int:
        """The open forward's bucket; refuses (typed error, nothing run) no forward, and a
        forward no bucket fits (``decode_only``: a static-shape mixed step too)."""
        plan = self.cache.open_plan
        if plan is None:
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        if plan.static_bucket is None or (decode_only and plan.static_mixed):
            kind = (f"decode step (one token per committed sequence, at most "
                    f"{self.cache.config.static_buckets[-1]} sequences)") if decode_only else "step"
            raise InvalidArgumentError(
                f"{what}: the open forward over sequences {plan.seq_ids} is not a static-shape "
                f"{kind}; run it eagerly")
        return plan.static_bucket

    def address(self) -> int:
        """Where the open forward's index arrays live: fixed per kind of static-shape step, so
        a graph captured at another address would read stale memory."""
        positions = self.cache.forward_aux().tokens.q_positions
        return positions.data_ptr() if hasattr(positions, "data_ptr") else id(positions)

    def slot(self, key, make: Callable[[Any], "Slot"]) -> "Slot":
        """The slot of ``key``, ``make(key)`` on first use (a ``GraphSlot`` subclass that holds
        an owner's static inputs)."""
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = make(key)
        return slot

    def warm(self, step: Callable) -> None:
        """``warmup`` runs of ``step`` ahead of a capture (GPU only: on a CPU nothing compiles
        and nothing is captured). Appends are idempotent: each run writes the same rows."""
        if self.on_gpu:
            warm_up(step, self.device, self.warmup, before=self.cache.rerun_layers)

    def record(self, slot: GraphSlot, step: Callable):
        """The capture proper, in the open forward: ``step`` recorded into ``slot`` and replayed
        once, so its outputs (returned) hold this step's values; on a CPU, run once."""
        cache = self.cache
        cache.rerun_layers()
        if self.on_gpu:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph, out = record_graph(step, self.device, self._pool)
            graph.replay()                  # capture only records: run it for this step
        else:
            graph, out = HostGraph(step, cache), step()
        slot.graph, slot.outputs = graph, out
        slot.layers = cache.layers_run
        slot.address = self.address()
        self.captures += 1
        self.replays += 1
        return out

    def capture(self, slot: GraphSlot, step: Callable):
        """Warm-up, then ``record``; returns the step's outputs."""
        self.warm(step)
        return self.record(slot, step)

    def replay(self, slot: GraphSlot):
        """Replay ``slot``'s graph in the open forward; returns its static outputs."""
        result = slot.graph.replay()
        if result is not None:              # the CPU stand-in's fresh outputs
            slot.outputs = result
        # a device graph's replay runs no Python: its layers are counted as run here
        self.cache.mark_layers_run(slot.layers)
        self.replays += 1
        return slot.outputs
