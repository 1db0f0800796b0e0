"""What the scheduler hands the runner per forward (``StepPlan``) and per pick (``Draw``)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["SLOT", "Draw", "Inflight", "StepPlan"]

SLOT = -1
"""A token id in a sequence's tokens that stands for a pick still on its way (pipelined mode)."""


@dataclasses.dataclass
class StepPlan:
    """One forward, as the runner takes it (the typed per-step metadata).

    ``seq_ids`` / ``lens``: the sequences and their new tokens (``cache.forward``'s arguments);
    ``tokens`` / ``positions``: the new tokens, packed, and their positions; ``tokens[d]`` for
    ``d`` in ``slot_dst`` is ``SLOT``, the pick at row ``slot_src`` of the step before (still on
    its way); ``logit_rows``: the packed rows whose next-token logits are wanted, one per
    sequence in ``wants``; ``pipelined``: its picks are all greedy, one per sequence, and may be
    booked before they reach the host; ``logprobs``: some request wants log-probabilities;
    ``decode``: every sequence runs one token it decodes; ``top_logprobs``: the largest number
    of likeliest alternatives a request of the step wants per token (0: none; such a step is
    not pipelined)."""

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
    ``Scheduler.ran`` books the step against after the forward; ``lens`` holds the chunks as
    run. Not for the runner."""
    top_logprobs: int = 0


@dataclasses.dataclass
class Draw:
    """A pick to make from a step's logits: row ``row`` (an index into ``logit_rows``) for
    ``sample`` of ``request``; ``step`` is how many tokens that sample drew before."""

    row: int
    params: Any
    seed: int
    step: int


@dataclasses.dataclass
class Inflight:
    """A pipelined step whose picks the host has not read yet."""

    wants: list
    picks: Any                         # the runner's PendingPicks
    slots: dict                        # id(seq) -> (index of its SLOT token, row)
