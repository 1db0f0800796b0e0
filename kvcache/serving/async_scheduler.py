"""``AsyncScheduler``: the ``Scheduler`` with the host one step ahead of the device (vLLM's
async scheduling; ``Engine(overlap=True)``).

A step whose picks are all greedy and one per sequence (no ``n > 1``, no alternatives) is
*pipelined*: ``update`` books it before its picks reach the host. Each sequence that goes on
gets a placeholder (``Seq.ahead``, a count: its tokens hold only ids the host has), so the next
step is planned and launched with that token packed as ``SLOT`` and taken from those picks
where they are (on the device: ``plan.slot_picks``, ``slot_dst`` / ``slot_src``). The picks are
read (*settled*) by the ``update`` of the step after, once it is launched: each sample takes
its token, which replaces the placeholder. A sample that its settled pick stops had one more
step launched for it: that pick is dropped, as is a synchronous step's pick for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from ..errors import CacheFullError
from .plan import SLOT, Inflight, StepOutput, StepPlan
from .scheduler import Scheduler
from .stats import EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from .protocols import HostStore, SchedulerCache

__all__ = ["AsyncScheduler"]


class AsyncScheduler(Scheduler):
    """A ``Scheduler`` that books pipelined steps before their picks reach the host (see the
    module docstring); the tokens are the same as the synchronous one's. ``cache``,
    ``host_tier``, ``stats``: as ``Scheduler``."""

    def __init__(self, cache: SchedulerCache, host_tier: Optional[HostStore] = None,
                 stats: Optional[EngineStats] = None):
        super().__init__(cache, host_tier, stats)
        self._inflight: Optional[Inflight] = None

    def has_unfinished(self) -> bool:
        """A request is queued or running, or a pipelined step's picks are still unread."""
        return bool(self.requests) or self._inflight is not None

    def _plan(self, batch) -> StepPlan:
        inflight = self._inflight
        plan = self._pack(batch, inflight.rows if inflight is not None else None)
        if plan.slot_dst:
            assert inflight is not None
            plan.slot_picks = inflight.picks
        assert len(plan.slot_dst) == plan.tokens.count(SLOT), \
            "a pick still on its way has no source in the step before"
        plan.pipelined = plan.top_logprobs == 0 and all(
            s.req.greedy and s.req.params.n == 1 for s in plan.wants)
        if not plan.pipelined:
            plan.draws = self._draws(plan.wants)
        return plan

    def update(self, plan: StepPlan, output: Union[StepOutput, CacheFullError]) -> list:
        """``Scheduler.update``, one step behind for pipelined steps: a pipelined ``plan`` is
        booked with its picks still on their way (``output.pending``); each sequence that goes
        on gets a placeholder, and a sample those picks bring to ``max_tokens`` leaves the cache
        now (the forward in flight still writes its pages: the cache keeps them until it is
        done). Pipelined or not, the step in flight before ``plan`` (if any) is settled: its
        picks are read and taken. ``plan`` / ``output``: as ``Scheduler.update`` (a
        ``CacheFullError`` only preempts; the step in flight stays). Returns the
        ``RequestOutput`` of every sample that got tokens or ended."""
        if isinstance(output, CacheFullError):
            return super().update(plan, output)
        before, self._inflight = self._inflight, None
        if plan.seq_ids:
            self._ran(plan)
            if before is not None:
                self.stats.overlapped_forwards += 1
        if plan.pipelined:
            if plan.wants:
                self._launch(plan, output.pending)
            return [] if before is None else self._settle(before)
        out = [] if before is None else self._settle(before)
        return out + self._consume(plan, output)

    def _launch(self, plan: StepPlan, picks) -> None:
        """Book a pipelined step's ``picks`` (one per ``plan.wants``) before the host has them:
        a prompt's sequence goes on as its sample; a sample these picks bring to
        ``max_tokens`` ends; every other one gets a placeholder for its pick."""
        rows = {}
        for k, seq in enumerate(plan.wants):
            if seq.kind == "prompt":
                seq.go_on_as_sample()
            smp = seq.req.samples[seq.sample]
            # picks launched for it: those read, those on their way, and this one
            if smp.done or len(smp.tokens) + seq.ahead + 1 >= seq.req.max_tokens:
                self._finish(seq)
            else:
                seq.ahead += 1
                rows[id(seq)] = k
        self._inflight = Inflight(list(plan.wants), picks, rows)

    def _settle(self, inflight: Inflight) -> list:
        """Read a pipelined step's picks: each sample takes its token (none once it has ended),
        a placeholder becomes that token, and a sample that ended leaves the cache. Returns the
        outputs."""
        tokens, logprobs = inflight.picks.result()
        rows, touched = inflight.rows, []
        for k, seq in enumerate(inflight.wants):
            req = seq.req
            smp = req.samples[seq.sample]
            if self._draw(req, smp, int(tokens[k]), float(logprobs[k])):
                touched.append((req, seq.sample))
            if id(seq) not in rows:
                continue
            seq.ahead -= 1
            if smp.done:
                self.seqs.retire(seq)
            else:
                seq.tokens.append(int(tokens[k]))
        return self._outputs(touched)

    def reset(self) -> None:
        """``Scheduler.reset``; a step in flight is forgotten."""
        super().reset()
        self._inflight = None
