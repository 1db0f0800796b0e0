"""What the scheduler hands the runner per forward (``StepPlan``, with a ``Draw`` per pick) and
what comes back (``StepOutput``): the two records of ``Scheduler.schedule`` and
``Scheduler.update``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["SLOT", "Draw", "Inflight", "StepOutput", "StepPlan"]

SLOT = -1
"""The id a ``StepPlan`` packs for a token that is a pick still on its way (a placeholder,
``AsyncScheduler``): the runner writes the pick over it (``slot_dst`` / ``slot_src``)."""


@dataclasses.dataclass
class StepPlan:
    """One forward, as the runner takes it (the typed per-step metadata).

    ``seq_ids`` / ``lens``: the sequences and their new tokens (``cache.forward``'s arguments);
    empty when nothing is left to run (no forward: ``update`` it all the same). ``tokens`` /
    ``positions``: the new tokens, packed, and their positions; ``tokens[d]`` for ``d`` in
    ``slot_dst`` is ``SLOT``, the pick at row ``slot_src`` of ``slot_picks`` (the step before's,
    still on its way); ``logit_rows``: the packed rows whose next-token logits are wanted, one
    per sequence in ``wants``; ``draws``: the picks to make from those logits (a synchronous
    step); ``pipelined``: its picks are all greedy, one per sequence in ``wants``, and are booked
    before they reach the host (``AsyncScheduler``; ``draws`` is then empty); ``logprobs``: some
    request wants log-probabilities; ``decode``: every sequence runs one token it decodes;
    ``top_logprobs``: the largest number of likeliest alternatives a request of the step wants
    per token (0: none; such a step is not pipelined)."""

    seq_ids: list
    lens: list
    tokens: list
    positions: list
    logit_rows: list
    wants: list
    slot_dst: list
    slot_src: list
    pipelined: bool
    logprobs: bool
    decode: bool
    batch: list
    """The scheduler's own ``(Seq, chunk)`` pairs behind ``seq_ids`` (same order), which
    ``Scheduler.update`` books the step against after the forward; ``lens`` holds the chunks as
    run. Not for the runner."""
    top_logprobs: int = 0
    draws: list = dataclasses.field(default_factory=list)
    slot_picks: Any = None

    @classmethod
    def idle(cls) -> "StepPlan":
        """The plan of a step with nothing to run."""
        return cls([], [], [], [], [], [], [], [], False, False, False, [])


@dataclasses.dataclass
class Draw:
    """A pick to make from a step's logits: row ``row`` (an index into ``logit_rows`` and
    ``wants``) for sample ``sample`` of that sequence's request; ``step`` is how many tokens
    that sample drew before."""

    row: int
    params: Any
    seed: int
    step: int
    sample: int = 0


@dataclasses.dataclass
class StepOutput:
    """What the runner made of one ``StepPlan``, for ``Scheduler.update``.

    A synchronous step: host ``tokens`` ((D,) int64) and ``logprobs`` ((D,) float64, NaN
    where nobody asked), one per ``plan.draws``, and ``alternatives`` (host ``(ids (D, k),
    logprobs (D, k))``) when ``plan.top_logprobs``. A pipelined step: ``pending``, its picks
    (one per ``plan.wants``) still on their way (``.tokens`` where the device has them,
    ``.result()`` waits for the host's copy), read by a later ``update``."""

    tokens: Any = ()
    logprobs: Any = ()
    alternatives: Optional[tuple] = None
    pending: Any = None


@dataclasses.dataclass
class Inflight:
    """A pipelined step whose picks the host has not read yet (``AsyncScheduler``)."""

    wants: list
    picks: Any                         # the runner's pending picks, one per sequence of wants
    rows: dict                         # id(seq) -> its row in picks (those given a placeholder)
