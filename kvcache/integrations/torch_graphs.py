"""Whole steps of a torch model and its cache, captured once per bucket and replayed: decode steps
per batch bucket, and with ``CacheConfig(static_mixed=True)`` mixed steps (prefill chunks beside
decode rows) per token bucket.

Used by the engine adapters whose model is a torch module (``kvcache.integrations.transformers``)
on a cache built with ``CacheConfig(static_decode=True)``. A static-shape decode ``begin_forward``
pads the batch to its bucket and puts the cache's index arrays at fixed addresses; this module
does the same for the model's inputs: one ``(3, bucket)`` int64 device buffer per bucket holds the
token ids, positions and logit-row indices, and the captured step (embedding, every layer with its
``cache.attention``, the LM head) reads only that buffer. Padded rows hold token 0 at position 0:
the model computes them row by row (the cache's attention returns zeros for them and appends them
nowhere), so they never change a real row.

Run-ahead: the step's inputs are copied into the bucket's buffer on the compute stream, so the copy
is ordered after the previous replay that read the buffer and before this one; on a GPU the copy
comes from a pinned staging array whose previous copy the host waits for (an event) before
rewriting it. The logits are the graph's static output: the caller consumes (copies to the host)
one step's logits before the next replay overwrites them.

On a CPU device (the cuda backend's CPU test mode) "capture" records nothing and a replay re-runs
the step eagerly on the static buffers: the same data path, without a device graph.

A step whose capture fails (the model's code does what a CUDA graph cannot hold: a float32 MoE's
grouped matmul copies between host and device, "Cannot copy between CPU and CUDA tensors during
CUDA graph capture") runs eagerly on the same static buffers instead, as every later step of its
kind and bucket does: one ``GraphCaptureWarning`` per ``StepGraphs``, never an error; ``eager``
lists the (kind, bucket) keys that fell back, ``eager_runs`` counts their steps.
"""

from __future__ import annotations

import gc
import warnings
from typing import Any, Callable, Optional

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["GraphCaptureWarning", "StepGraphs"]


class GraphCaptureWarning(RuntimeWarning):
    """A kind of step could not be captured as a CUDA graph and runs eagerly (once per engine)."""


class _Bucket:
    """One bucket's static input buffer, host staging, captured graph and static output."""

    def __init__(self, torch, bucket: int, rows: int, device):
        self.size = bucket
        self.rows = rows
        on_gpu = device.type != "cpu"
        self.inputs = torch.zeros((3, bucket), dtype=torch.int64, device=device)
        # what the step reads: ids and positions of every row, the first ``rows`` logit rows
        # (a mixed step's bucket holds many more tokens than sequences: its static logits, one
        # row per kept index, stay ``rows x vocab``)
        self.args = (self.inputs[0], self.inputs[1], self.inputs[2, :rows])
        self.host = torch.zeros((3, bucket), dtype=torch.int64, pin_memory=on_gpu)
        self.host_np = self.host.numpy()
        # event: the last copy out of ``host`` (GPU only; one per bucket, re-recorded each step)
        self.copied: Any = torch.cuda.Event() if on_gpu else None
        self.pending = False
        self.graph: Any = None
        self.logits: Any = None
        self.aux_address: Optional[int] = None
        self.eager = False              # its capture failed: its steps run eagerly


class StepGraphs:
    """Capture/replay of whole decode steps on ``cache`` (``static_decode=True``).

    ``cache``: the engine's cache; ``step``: ``step(inputs)`` runs the model over the packed batch
    whose ``inputs`` are three int64 device tensors, token ids and positions ``(bucket,)`` (row
    ``r`` of the batch at index ``r``) and logit-row indices ``(min(bucket, max_batch_size),)``,
    inside the cache's open forward, and returns the logits of those rows; ``device``: the
    model's torch device; ``warmup``: eager runs before a capture (kernels compile and autotune
    outside capture).

    ``captures`` and ``replays`` count what ``run`` did (a capture includes its first replay).
    A step whose capture fails runs eagerly on the bucket's buffers, and so do the later steps
    of its key (see the module docstring): ``eager`` holds those keys, ``eager_runs`` counts
    their steps (not counted in ``captures`` / ``replays``).
    """

    def __init__(self, cache, step: Callable, device, warmup: int = 1):
        import torch
        if not cache.config.static_decode:
            raise InvalidArgumentError("StepGraphs needs a cache built with CacheConfig(static_decode=True)")
        if warmup < 1:
            raise InvalidArgumentError(f"warmup must be at least 1, got {warmup}")
        self.torch = torch
        self.cache = cache
        self.step = step
        self.device = torch.device(device)
        self.on_gpu = self.device.type != "cpu"
        self.warmup = int(warmup)
        self.buckets: dict = {}          # (mixed step?, bucket) -> _Bucket
        self.captures = 0
        self.replays = 0
        self._pool: Any = None
        self._layers = list(range(cache.config.num_layers))
        self.eager: dict = {}           # (kind, bucket) -> why its capture failed
        self.eager_runs = 0

    # ------------------------------------------------------------------ public
    def run(self, tokens: np.ndarray, positions: np.ndarray, logit_rows: np.ndarray):
        """Run the open forward's step through its bucket's graph (captured on first use).

        ``tokens``, ``positions`` (T,) int64: the open forward's new tokens (a static-shape
        decode step: one per sequence; a static-shape mixed step: its prefill chunks and decode
        rows), in ``begin_forward`` order; ``tokens`` may be a device tensor (the previous
        step's picks, copied on the device in stream order); ``logit_rows`` (R,) int64, R <= T:
        the rows whose logits are wanted. Returns the logits ``(R, vocab)``: a view of the
        graph's static output, valid until the next ``run``. Steps of one bucket size but
        another ``ForwardPlan.static_kind`` (decode, mixed, mixed over a shared prefix) are
        captured apart."""
        cache = self.cache
        bucket = cache.static_bucket
        if bucket is None:
            raise InvalidArgumentError(
                f"StepGraphs.run: the open forward over sequences {cache.open_plan.seq_ids} is not a "
                f"static-shape step; run it eagerly")
        key = (cache.open_plan.static_kind, bucket)
        n, r = len(tokens), len(logit_rows)
        rows = min(bucket, cache.config.max_batch_size)
        if n > bucket or len(positions) != n or r > min(n, rows):
            raise InvalidArgumentError(
                f"StepGraphs.run: {n} tokens, {len(positions)} positions and {r} logit rows do not "
                f"fit bucket {bucket} (at most {rows} logit rows)")
        slot = self.buckets.get(key)
        if slot is None:
            slot = self.buckets[key] = _Bucket(self.torch, bucket, rows, self.device)
        self._load(slot, tokens, positions, logit_rows)
        if slot.eager:
            self._eager(slot)
            return slot.logits[:r]
        address = self._aux_address()      # per kind of step: its own fixed buffer
        if slot.graph is None or slot.aux_address != address:
            if not self._capture(slot, key):
                return slot.logits[:r]      # ran eagerly: the capture failed
            slot.aux_address = address
            self.captures += 1
        else:
            if self.on_gpu:
                slot.graph.replay()
            else:                       # CPU stand-in: the same step, run again
                cache.rerun_layers()
                slot.logits = self.step(slot.args)
            cache.mark_layers_run(self._layers)     # the replay ran every layer's attention
        self.replays += 1
        return slot.logits[:r]

    # ------------------------------------------------------------------ internals
    def _load(self, slot: _Bucket, tokens, positions, logit_rows) -> None:
        """This step's inputs into the bucket's device buffer, on the compute stream."""
        if slot.pending:
            slot.copied.synchronize()           # the staging array's last copy has left it
        host, n, r = slot.host_np, len(tokens), len(logit_rows)
        on_device = self.torch.is_tensor(tokens)
        host[0, :n] = 0 if on_device else tokens
        host[1, :n] = positions
        host[2, :r] = logit_rows
        host[:2, n:] = 0                        # padded rows: token 0 at position 0
        host[2, r:] = 0
        slot.inputs.copy_(slot.host, non_blocking=self.on_gpu)
        if on_device:       # the previous step's picks, not yet on the host: a device copy
            slot.inputs[0, :n].copy_(tokens)
        if self.on_gpu:
            slot.copied.record()
            slot.pending = True

    def _aux_address(self) -> int:
        """Where the open forward's index arrays live (fixed for a static-shape cache); a graph
        captured at another address would read stale memory, so it is captured again."""
        positions = self.cache.forward_aux().tokens.q_positions
        return positions.data_ptr() if hasattr(positions, "data_ptr") else id(positions)

    def _capture(self, slot: _Bucket, key) -> bool:
        """Capture the bucket's step and run it (the first replay); False when the capture
        failed and the step ran eagerly instead (``_fall_back``)."""
        torch, cache = self.torch, self.cache
        if self.on_gpu:
            compute = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(compute)
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    cache.rerun_layers()            # appends are idempotent: the same rows again
                    self.step(slot.args)
            compute.wait_stream(side)
        cache.rerun_layers()
        try:
            self._record(slot)
        except RuntimeError as exc:         # (the warm-up ran the same step eagerly: it can run)
            if self.on_gpu:
                torch.cuda.set_stream(compute)  # a failed capture_end leaves its stream current
            self._fall_back(slot, key, exc)
            return False
        return True

    def _record(self, slot: _Bucket) -> None:
        """The capture proper, inside an open forward whose layers may run again: the step
        recorded as a CUDA graph over the bucket's buffers, then replayed for this step (on a
        CPU: the step run once, nothing recorded)."""
        torch = self.torch
        if not self.on_gpu:
            slot.graph = True
            slot.logits = self.step(slot.args)
            return
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # no garbage collection inside the capture: collecting another engine's graph there
        # (a reference cycle freed late) resets it mid-capture and invalidates this one
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self.step(slot.args)
        finally:
            if collecting:
                gc.enable()
        graph.replay()                          # capture only records: run it for this step
        slot.graph, slot.logits = graph, logits

    def _eager(self, slot: _Bucket) -> None:
        """The bucket's step run eagerly on its buffers (a bucket whose capture failed)."""
        self.cache.rerun_layers()
        slot.logits = self.step(slot.args)
        self.eager_runs += 1

    def _fall_back(self, slot: _Bucket, key, exc: BaseException) -> None:
        """A failed capture: this step runs eagerly on the bucket's buffers, and so will every
        later step of ``key``; the first failure of this ``StepGraphs`` warns. An eager run that
        fails too raises its own error (the model cannot run the step at all: no warning)."""
        slot.graph = None
        self._eager(slot)
        slot.eager = True
        first = not self.eager
        self.eager[key] = f"{type(exc).__name__}: {exc}"
        if first:
            (mixed, depths), bucket = key
            what = f"mixed steps of token bucket {bucket}" if mixed else \
                f"decode steps of batch bucket {bucket}"
            warnings.warn(
                f"a whole-step CUDA graph could not be captured for {what} ({depths} depth(s)) "
                f"({type(exc).__name__}: {str(exc)[:200]}); such steps run "
                f"eagerly on the same buffers (tokens unchanged, without the graph's speed-up). "
                f"Pass graphs=False to the Engine to run every step eagerly; "
                f"engine.decode_graphs.eager lists the steps that fell back",
                GraphCaptureWarning, stacklevel=2)
