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

Warm-up, capture into one memory pool, replay and the CPU stand-in (on a CPU device, the cuda
backend's CPU test mode, "capture" records nothing and a replay re-runs the step eagerly on the
static buffers) are ``kvcache_cuda.graph_core.GraphCore``'s, the core ``kvcache_cuda.DecodeGraphs``
drives too; this module owns the model's input assembly and the eager fall-back. The adapters
import this module lazily, when an engine wants graphs: only the cuda backend (rocm on it) offers
``static_decode``, so the core is installed whenever a cache can have graphs (an arrow down), and
the backend never imports the integrations.

A step whose capture fails (the model's code does what a CUDA graph cannot hold: a float32 MoE's
grouped matmul copies between host and device, "Cannot copy between CPU and CUDA tensors during
CUDA graph capture") runs eagerly on the same static buffers instead, as every later step of its
kind and bucket does: one ``GraphCaptureWarning`` per ``StepGraphs``, never an error; ``eager``
lists the (kind, bucket) keys that fell back, ``eager_runs`` counts their steps.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import numpy as np

from kvcache_cuda.graph_core import GraphCore, GraphSlot

from ..errors import InvalidArgumentError

__all__ = ["GraphCaptureWarning", "StepGraphs"]


class GraphCaptureWarning(RuntimeWarning):
    """A kind of step could not be captured as a CUDA graph and runs eagerly (once per engine)."""


class _Bucket(GraphSlot):
    """One key's slot of the core, with the step's static input buffer and its host staging;
    ``logits``: the captured step's static output."""

    def __init__(self, torch, key, rows: int, device):
        super().__init__(key)
        bucket = key[1]
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
        self.eager = False              # its capture failed: its steps run eagerly

    @property
    def logits(self):
        """The captured step's static output (its logits), valid until the next run."""
        return self.outputs


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
    their steps (not counted in ``captures`` / ``replays``). ``core``: the ``GraphCore`` that
    captures and replays; ``buckets``: its slots, ``(kind, bucket)`` -> slot.
    """

    def __init__(self, cache, step: Callable, device, warmup: int = 1):
        import torch
        self.core = GraphCore(cache, device, warmup, owner="StepGraphs")
        self.torch = torch
        self.cache = cache
        self.step = step
        self.device = self.core.device
        self.buckets = self.core.slots
        self.eager: dict = {}           # (kind, bucket) -> why its capture failed
        self.eager_runs = 0

    @property
    def captures(self) -> int:
        """Steps captured (the core's count)."""
        return self.core.captures

    @property
    def replays(self) -> int:
        """Steps run through a captured graph, each capture's first run included."""
        return self.core.replays

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
        core, cache = self.core, self.cache
        bucket = core.open_bucket("StepGraphs.run")
        key = (cache.open_plan.static_kind, bucket)
        n, r = len(tokens), len(logit_rows)
        rows = min(bucket, cache.config.max_batch_size)
        if n > bucket or len(positions) != n or r > min(n, rows):
            raise InvalidArgumentError(
                f"StepGraphs.run: {n} tokens, {len(positions)} positions and {r} logit rows do not "
                f"fit bucket {bucket} (at most {rows} logit rows)")
        slot = core.slot(key, lambda k: _Bucket(self.torch, k, rows, self.device))
        self._load(slot, tokens, positions, logit_rows)
        if slot.eager:
            self._eager(slot)
        elif slot.graph is None or slot.address != core.address():
            # (a graph captured over another index buffer would read stale memory: capture again)
            self._capture(slot, key)
        else:
            core.replay(slot)
        return slot.logits[:r]

    # ------------------------------------------------------------------ internals
    def _load(self, slot: _Bucket, tokens, positions, logit_rows) -> None:
        """This step's inputs into the bucket's device buffer, on the compute stream."""
        on_gpu = self.core.on_gpu
        if slot.pending:
            slot.copied.synchronize()           # the staging array's last copy has left it
        host, n, r = slot.host_np, len(tokens), len(logit_rows)
        on_device = self.torch.is_tensor(tokens)
        host[0, :n] = 0 if on_device else tokens
        host[1, :n] = positions
        host[2, :r] = logit_rows
        host[:2, n:] = 0                        # padded rows: token 0 at position 0
        host[2, r:] = 0
        slot.inputs.copy_(slot.host, non_blocking=on_gpu)
        if on_device:       # the previous step's picks, not yet on the host: a device copy
            slot.inputs[0, :n].copy_(tokens)
        if on_gpu:
            slot.copied.record()
            slot.pending = True

    def _run_of(self, slot: _Bucket) -> Callable:
        """The bucket's step over its buffers (``self.step`` read at each run: it may be swapped)."""
        return lambda: self.step(slot.args)

    def _capture(self, slot: _Bucket, key) -> None:
        """Warm up, capture the bucket's step and run it (the first replay); when the capture
        fails the step runs eagerly instead (``_fall_back``). A warm-up that fails is the
        model's own error: it propagates."""
        self.core.warm(self._run_of(slot))
        try:
            self._record(slot)
        except RuntimeError as exc:         # (the warm-up ran the same step eagerly: it can run)
            self._fall_back(slot, key, exc)

    def _record(self, slot: _Bucket) -> None:
        """The capture proper (``GraphCore.record``), inside an open forward whose layers may
        run again."""
        self.core.record(slot, self._run_of(slot))

    def _eager(self, slot: _Bucket) -> None:
        """The bucket's step run eagerly on its buffers (a bucket whose capture failed)."""
        self.cache.rerun_layers()
        slot.outputs = self.step(slot.args)
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
