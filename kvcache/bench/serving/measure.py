"""The serving bench's measurements of one system: ``measure`` (the decode-step difference, the
GPU busy fraction under ``torch.profiler``, the whole workload's tokens/s) and the interval
arithmetic behind the busy fraction (``union_length``, ``tail_busy``)."""

from __future__ import annotations

import time
from typing import Callable, Generator, Optional

from .model import _sync
from .runners import Runner


def _timed(fn: Callable, device: str):
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - t0, result


def _gpu_spans(fn: Callable, device: str) -> tuple:
    """(wall s, [(start us, end us)] of the GPU's activity: kernels, copies, memsets) of
    ``fn()`` under ``torch.profiler`` (GPU activity only: recording host ops would slow the host
    and understate the busy fraction)."""
    from torch.profiler import ProfilerActivity, profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall, _ = _timed(fn, device)
    return wall, [(e.time_range.start, e.time_range.end) for e in prof.events()
                  if e.device_type.name == "CUDA"]


def union_length(spans) -> float:
    """Total length covered by the intervals ``spans`` ((start, end) pairs), overlaps once."""
    busy, end = 0.0, -float("inf")
    for s, t in sorted(spans):
        if t <= end:
            continue
        busy += t - max(s, end)
        end = t
    return busy


def tail_busy(spans, window: float) -> Optional[float]:
    """The fraction of the last ``window`` (same unit as ``spans``) before the end of the last
    span that ``spans`` cover; None without spans or window."""
    if not spans or window <= 0:
        return None
    lo = max(t for _, t in spans) - window
    return union_length([(max(s, lo), t) for s, t in spans if t > lo]) / window


def measure(runner: Runner, prompts: list, new_tokens: int, decode_prompts: list, n1: int,
            n2: int, device: str, profile_busy: bool, say: Callable = lambda msg: None) -> tuple:
    """Warm up, time the decode difference (and profile it), then time the whole run; checks
    every request produced its tokens. Returns (the system's row, the timed whole run's
    tokens); ``say(phase)`` before each phase. One round of ``measure_rounds``."""
    rounds = measure_rounds(runner, prompts, new_tokens, decode_prompts, n1, n2, device,
                            profile_busy, 1, say)
    row = next(rounds)
    rounds.close()
    return row


def measure_rounds(runner: Runner, prompts: list, new_tokens: int, decode_prompts: list, n1: int,
                   n2: int, device: str, profile_busy: bool, rounds: int,
                   say: Callable = lambda msg: None) -> Generator[tuple, None, None]:
    """``measure``'s timed measurement ``rounds`` times: yields (row, tokens) per round, so that
    a caller can interleave systems round by round (``rounds.interleave``). The first round is
    ``measure``'s, warm-ups included; a later one repeats the timed runs only (the decode
    difference, then the whole run, cold again), the GPU busy fraction measured once."""
    busy = None
    for i in range(rounds):
        tag = "" if rounds == 1 else f"round {i + 1}/{rounds}: "
        runner.phase(whole=False)
        # round 1: the warm-up (compiles, graph captures) at n2: at n1 (1 with --tiny: prefill
        # only) the timed wall(n2) paid the first decode steps' one-time costs; a later round:
        # the same run caches the decode prompts' pages again (the whole run evicted them), so
        # that both timed runs meet them as in round 1
        say(f"{tag}decode warm-up (B={len(decode_prompts)}, {n2} tokens)")
        runner.run(decode_prompts, n2)
        walls = {}
        for n in (n1, n2):
            say(f"{tag}decode timed to {n} tokens")
            walls[n], out = _timed(lambda: runner.run(decode_prompts, n), device)
            _check(runner, out, len(decode_prompts), n)
        step = (walls[n2] - walls[n1]) / (n2 - n1)
        if profile_busy and i == 0:
            # busy over the last (n2 - n1) steps of one profiled run (their length: the
            # difference of two profiled runs), never over 100% (a difference of two busy
            # totals read 172%); the throwaway first run pays CUPTI's start-up
            say("gpu busy (torch.profiler, 3 runs)")
            _gpu_spans(lambda: runner.run(decode_prompts, n1), device)
            w1, _ = _gpu_spans(lambda: runner.run(decode_prompts, n1), device)
            w2, spans = _gpu_spans(lambda: runner.run(decode_prompts, n2), device)
            busy = tail_busy(spans, (w2 - w1) * 1e6)
        runner.phase(whole=True)
        if i == 0:
            # the whole workload once untimed: every system meets its batch sizes, prompt
            # lengths and chunk shapes here first (compiles, graph captures, allocator growth),
            # so the timed run is its steady state (one-time costs were 54% of (a)'s first run
            # on the H100)
            say(f"whole workload warm-up ({len(prompts)} requests x {new_tokens} tokens)")
            runner.run(prompts, new_tokens)
        # the timed run serves its prompts cold: after the warm-up of the same prompts (or an
        # earlier round) (a)'s prefix cache held most of their pages, and the timed run hit as
        # many as eviction left
        runner.forget()
        say(f"{tag}whole workload timed")
        wall, out = _timed(lambda: runner.run(prompts, new_tokens), device)
        tokens = _check(runner, out, len(prompts), new_tokens)
        yield {"system": runner.name, "wall_s": wall, "tokens": tokens,
               "tokens_per_s": tokens / wall, "decode_step_ms": step * 1e3,
               "decode_walls_s": {str(k): v for k, v in walls.items()}, "gpu_busy": busy}, out


def _check(runner, out, requests: int, new_tokens: int) -> int:
    lengths = [len(o) for o in out]
    if len(out) != requests or any(n != new_tokens for n in lengths):
        raise RuntimeError(f"{runner.name}: expected {requests} requests of {new_tokens} new "
                           f"tokens, got {len(out)} requests of lengths {sorted(set(lengths))}")
    return sum(lengths)
