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
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from kvcache.errors import ForwardStateError, InvalidArgumentError

try:  # torch is optional at import time (kvcache_cuda.backend explains its absence)
    import torch
except Exception:  # pragma: no cover - exercised only where torch is missing
    torch = None  # type: ignore[assignment]


class _HostGraph:
    """CPU test mode stand-in for ``torch.cuda.CUDAGraph``: replay re-runs the step eagerly."""

    def __init__(self, step, reset):
        self.step, self.reset = step, reset

    def replay(self):
        self.reset()
        return self.step()


class DecodeGraphs:
    def __init__(self, cache, warmup: int = 1):
        if not cache.config.static_decode:
            raise InvalidArgumentError("DecodeGraphs needs a cache built with CacheConfig(static_decode=True)")
        if warmup < 1:
            raise InvalidArgumentError(f"warmup must be at least 1 (Triton compiles outside capture), got {warmup}")
        self.cache = cache
        self.warmup = warmup
        self.graphs: dict = {}          # bucket -> (graph, outputs)
        self._buffer_ptr: Optional[int] = None
        self._pool: Any = None
        self._last_plan = None
        self._layers: dict = {}         # bucket -> the layers its step runs (end_forward needs all)

    @property
    def buckets(self) -> list:
        """Buckets captured so far."""
        return sorted(self.graphs)

    def _bucket(self, what: str) -> int:
        plan = self.cache.open_plan
        if plan is None:
            raise ForwardStateError(f"{what} needs an open forward: call begin_forward first")
        if plan.static_bucket is None or plan.static_mixed:
            raise InvalidArgumentError(
                f"{what}: the open forward over sequences {plan.seq_ids} is not a static-shape decode "
                f"step (one token per committed sequence, at most "
                f"{self.cache.config.static_buckets[-1]} sequences); run it eagerly")
        return plan.static_bucket

    def _buffer(self) -> int:
        buf = self.cache.aux_manager.static_device_buffer
        return buf.data_ptr() if hasattr(buf, "data_ptr") else id(buf)

    def _reset_layers(self) -> None:
        self.cache.rerun_layers()   # warm-up and capture run every layer again

    def capture(self, step: Callable):
        """Run ``step()`` eagerly ``warmup`` times, then capture it for the open forward's bucket
        (replacing an earlier graph of that bucket) and replay it once. ``step`` calls
        ``cache.attention`` for every layer on fixed input tensors of the bucket's rows and
        returns its outputs, which become the graph's static outputs (a ``window_left`` that
        ``step`` passes is a plain kernel argument: replays use the captured one); they hold this step's
        values on return (appends are idempotent, so the repeated runs write the same KV)."""
        bucket = self._bucket("capture")
        backend = self.cache.backend
        if not backend.on_gpu:
            for _ in range(self.warmup):
                self._reset_layers()
                out = step()
            self.graphs[bucket] = (_HostGraph(step, self._reset_layers), out)
        else:
            side = torch.cuda.Stream(device=backend.torch_device)
            side.wait_stream(torch.cuda.current_stream(backend.torch_device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._reset_layers()
                    step()
            torch.cuda.current_stream(backend.torch_device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            self._reset_layers()
            with torch.cuda.graph(graph, pool=self._pool):
                out = step()
            graph.replay()       # capture only records: run it so ``out`` holds this step's values
            self.graphs[bucket] = (graph, out)
        self._buffer_ptr = self._buffer()
        self._last_plan = self.cache.open_plan
        self._layers[bucket] = self.cache.layers_run
        return out

    def replay(self):
        """Replay the graph of the open forward's bucket; returns its static outputs."""
        bucket = self._bucket("replay")
        plan = self.cache.open_plan
        if bucket not in self.graphs:
            raise InvalidArgumentError(
                f"decode batch of {len(plan.seq_ids)} sequences pads to bucket {bucket}, but graphs "
                f"were captured for buckets {self.buckets}; capture one for {bucket} first")
        if self._buffer() != self._buffer_ptr:
            raise ForwardStateError("the cache's graph aux buffer moved since capture; capture again")
        if plan is self._last_plan:
            raise ForwardStateError(
                "this forward already ran (captured or replayed); call end_forward and begin_forward "
                "before the next replay")
        graph, out = self.graphs[bucket]
        self._last_plan = plan
        result = graph.replay()
        self.cache.mark_layers_run(self._layers[bucket])    # the replay ran them
        return out if result is None else result
