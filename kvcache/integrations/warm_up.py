"""``Engine.warm_up()``: the engine's first-use costs paid before it serves.

On a GPU an engine's first steps of each shape are slow: each compiles kernels (seconds per
Triton variant on a cold cache) and, with whole-step graphs, captures its bucket's graph (and
compiles the captured step with ``compile_step``). Served as they come, those seconds land on
whichever requests meet a new shape first (their time to first token) and on the run's
tokens per second. ``warm_up`` runs one forward of every kind of step the engine's graphs hold
(``(ForwardPlan.static_kind, bucket)``), on throwaway sequences that take no prefix-cache entry
and leave no page behind:

* decode steps, one per batch bucket (``CacheConfig.static_buckets``);
* with ``mixed_graphs``, prefill steps, one per token bucket (``static_mixed_buckets``), and the
  same buckets with two depths (sequences that share a prefix: forked samples);
* without graphs, one prefill and one decode step (the eager kernels compile);
* a sequence forked inside a page (the partial page's rows copied);
* with a host tier, a sequence parked there and restored (its copy kernels compile);
* the pickers (greedy with log-probabilities, a filtered draw) once.

A kind of step that does not fit the cache's free pages is skipped and named in the result.
The engine's counters (``EngineStats``) do not count the warm-up; ``WarmUp`` does.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..errors import CacheFullError, InvalidArgumentError
from ..serving.plan import Draw, StepPlan
from ..serving.sampling_params import SamplingParams

__all__ = ["WarmUp", "warm_up"]


@dataclasses.dataclass
class WarmUp:
    """What ``Engine.warm_up`` ran: ``seconds`` (wall time), ``forwards``, ``captures``
    (whole-step graphs captured), ``steps`` (each step run, as ``(what, size)``: ``("decode",
    batch bucket)``, ``("prefill", token bucket)``, ``("shared prefix", token bucket)``,
    ``("fork", tokens)``, ``("host tier", tokens)``) and ``skipped`` (those the free pages could
    not hold)."""

    seconds: float = 0.0
    forwards: int = 0
    captures: int = 0
    steps: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)

    def text(self) -> str:
        skipped = f"; skipped (no room): {self.skipped}" if self.skipped else ""
        return (f"{self.seconds:.1f} s: {self.forwards} forwards, {self.captures} graphs "
                f"captured{skipped}")


def plan_steps(config, graphs: bool, mixed: bool, host_tier: bool) -> list:
    """The warm-up's steps for a cache ``config``: ``(what, size)`` pairs (see the module doc)."""
    if not graphs:
        steps = [("prefill", min(config.prefill_chunk_size, 16 * config.page_size)),
                 ("decode", 1)]
    else:
        steps = [("decode", b) for b in config.static_buckets]
        if mixed:
            buckets = config.static_mixed_buckets
            steps += [("prefill", t) for t in buckets]
            if config.max_batch_size >= 2:
                steps += [("shared prefix", t) for t in buckets]
    if config.page_size > 1:
        steps.append(("fork", config.page_size + config.page_size // 2))
    if host_tier:
        steps.append(("host tier", 2 * config.page_size))
    return steps


class _Runs:
    """Forwards of throwaway sequences through the engine's runner."""

    def __init__(self, engine):
        self.engine, self.cache, self.runner = engine, engine.cache, engine.runner
        self.ids: list = []
        self.forwards = 0

    def new(self, n: int) -> list:
        ids = [self.engine.core.new_seq_id() for _ in range(n)]
        for sid in ids:
            self.cache.add_sequence(sid)
            self.ids.append(sid)
        return ids

    def fork(self, parent: int, n: int) -> list:
        ids = [self.engine.core.new_seq_id() for _ in range(n)]
        for sid in ids:
            self.cache.fork_sequence(parent, sid)
            self.ids.append(sid)
        return ids

    def drop(self, ids) -> None:
        for sid in ids:
            self.cache.remove_sequence(sid)
            self.ids.remove(sid)

    def forward(self, ids: list, lens: list, starts: list, decode: bool) -> None:
        tokens = [0] * int(sum(lens))
        positions = [p for s, n in zip(starts, lens) for p in range(s, s + n)]
        rows = [int(r) - 1 for r in np.cumsum(lens)]
        plan = StepPlan(list(ids), list(lens), tokens, positions, rows, [], [], [], False, False,
                        decode, [])
        runner = self.runner
        with runner.step_context():
            logits = runner.forward(plan)
            if not self.forwards:   # the pickers' first use too: greedy on the device, drawn
                runner.greedy_async(logits, True).result()
                params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01)
                runner.pick(logits, [Draw(0, params, 1, 0)], True)
            self.engine.adapter.to_numpy(logits)       # the step ran (and its errors surface)
        self.forwards += 1

    def prefill(self, sid, n: int) -> None:
        """``n`` tokens of sequence ``sid`` from its start, in forwards of at most the cache's
        ``prefill_chunk_size`` (a warm-up step longer than a chunk, in a cache of small
        chunks)."""
        chunk = self.cache.config.prefill_chunk_size
        for start in range(0, n, chunk):
            self.forward([sid], [min(chunk, n - start)], [start], decode=False)


def _run_step(runs: _Runs, what: str, size: int, ps: int) -> None:
    if what == "decode":
        ids = runs.new(size)
        runs.forward(ids, [1] * size, [0] * size, decode=False)
        runs.forward(ids, [1] * size, [1] * size, decode=True)
    elif what == "fork":            # forked inside a page: the partial page's rows are copied
        ids = runs.new(1)
        runs.prefill(ids[0], size)
        ids += runs.fork(ids[0], 1)
    elif what == "host tier":       # parked and restored: the tier's copy kernels
        ids = runs.new(1)
        runs.prefill(ids[0], size)
        tier = runs.engine.host_tier
        tier.offload(ids[0])
        tier.restore(ids[0])
    elif what == "prefill":
        ids = runs.new(1)
        runs.forward(ids, [size], [0], decode=False)
    else:       # two samples forked from a prompt of whole pages, then a step of them both
        root = runs.new(1)
        prompt = 4 * ps
        runs.prefill(root[0], prompt)
        ids = runs.fork(root[0], 2)
        half = max(1, size // 2)
        runs.forward(ids, [half, max(1, size - half)], [prompt, prompt], decode=False)
        runs.drop(ids)
        ids = root
    runs.drop(ids)


def warm_up(engine) -> WarmUp:
    """Run ``engine``'s warm-up (``Engine.warm_up``). Raises ``InvalidArgumentError`` while the
    engine has requests (warm it up before serving, or between runs)."""
    if engine.has_unfinished():
        raise InvalidArgumentError(
            "Engine.warm_up(): the engine has unfinished requests; warm it up before adding "
            "requests (or once they are done)")
    scales = engine.cache.scales
    if engine.graphs and scales is not None and not scales.all_calibrated():
        # its steps' tokens are zeros: they must not set the scales real requests are stored
        # with, and a captured step cannot calibrate them
        raise InvalidArgumentError(
            f"Engine.warm_up(): the fp8 scales (kv_dtype={engine.cache.config.kv_dtype!r}) are "
            f"not calibrated yet, and the warm-up's dummy tokens must not set them; serve a "
            f"first request (its forward calibrates them) or give them with "
            f"cache.set_kv_scales, then warm up")
    cache, stats = engine.cache, engine.stats
    saved = dataclasses.asdict(stats)
    result = WarmUp()
    runs = _Runs(engine)
    t0 = time.perf_counter()
    try:
        with engine.runner.session():
            for what, size in plan_steps(cache.config, engine.graphs, engine.mixed_graphs,
                                         engine.host_tier is not None):
                before = stats.graph_captures
                try:
                    _run_step(runs, what, size, cache.config.page_size)
                    result.steps.append((what, size))
                except CacheFullError:
                    result.skipped.append((what, size))
                finally:
                    runs.drop(list(runs.ids))
                result.captures += stats.graph_captures - before
    finally:
        for key, value in saved.items():
            setattr(stats, key, value)
    result.forwards = runs.forwards
    result.seconds = time.perf_counter() - t0
    return result
