"""``EngineCore``: the one loop that turns requests into tokens.

It joins a ``Scheduler`` (which sequences run, pure Python; an ``AsyncScheduler`` keeps the
host one step ahead of the device) and a runner (the model on the device: ``ModelRunner`` in
``kvcache.serving.protocols``). A step is two calls of the scheduler, as vLLM v1's engine
core makes them::

    plan = scheduler.schedule()                 # StepPlan: what the forward runs, its picks
    output = <the runner runs plan>             # StepOutput: the picks (or picks on their way)
    outputs = scheduler.update(plan, output)    # booked; the RequestOutputs

and a forward that does not fit (``CacheFullError``, nothing changed) is handed to
``update(plan, error)`` in place of its output, which preempts, and the step plans again.

Pure Python: it is driven with a fake runner in the tests.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Optional

from ..errors import CacheFullError, InvalidArgumentError
from .plan import StepOutput, StepPlan
from .request import Request, RequestOutput, Sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler

if TYPE_CHECKING:  # pragma: no cover
    from .protocols import ModelRunner

__all__ = ["EngineCore"]



def check_drawn(drawn) -> None:
    """``add_request``'s ``drawn`` checked: an int in [0, 2**62) (InvalidArgumentError)."""
    if isinstance(drawn, bool) or not isinstance(drawn, int) or not 0 <= drawn < 2**62:
        raise InvalidArgumentError(f"drawn={drawn!r:.40} must be an int in [0, 2**62)")

class EngineCore:
    """``add_request`` / ``step`` / ``abort`` / ``has_unfinished`` over one scheduler and one
    runner. ``admit(prompt, params) -> (prompt, params, stops)`` validates a request before it
    is queued (raising a typed error that names the bad value) and returns the prompt as a list
    of ints, the ``SamplingParams`` to use and the token ids that end a sample."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner, admit: Callable):
        self.scheduler = scheduler
        self.runner = runner
        self._admit = admit
        self._next_id = 0
        self._pending: list = []            # outputs to report at the next step (aborts)
        self._session: Optional[contextlib.ExitStack] = None

    @property
    def stats(self):
        """The scheduler's ``EngineStats`` (forwards, tokens, preemptions ...), updated by
        every ``step``."""
        return self.scheduler.stats

    def add_request(self, prompt, params: Optional[SamplingParams] = None, *,
                    hold_kv: bool = False, kv_seq_id: Optional[int] = None,
                    drawn: int = 0) -> int:
        """Queue a request; returns its id. ``params``: a ``SamplingParams`` (None: the
        defaults). Raises ``InvalidArgumentError`` (nothing queued) on a bad prompt or one that
        cannot fit the cache even alone.

        Disaggregated serving: ``hold_kv=True`` (with ``max_tokens=1``, ``n=1``) keeps the
        request's sequence in the cache when it finishes, holding exactly the prompt's KV; its
        last ``RequestOutput`` names it (``seq_id``) for ``kvcache.distributed.send_sequence``,
        and ``release(request_id)`` removes it. ``kv_seq_id``: a sequence already in the cache
        (imported, e.g. by ``recv_sequence``, under an id from ``new_seq_id()``) that holds the
        KV of ``prompt``'s first tokens, at least one fewer than the prompt: the request starts
        from it instead of prefilling them.

        ``drawn``: picks the request's sample drew before it (an int >= 0; a resumed
        conversation's generated tokens, ``Engine.resume``): its draws count from there, so
        with the same seed (and batch-invariant logits) a sampled continuation draws what the
        uninterrupted request would have."""
        prompt, params, stops = self._admit(prompt, params)
        if not isinstance(hold_kv, bool):
            raise InvalidArgumentError(f"hold_kv={hold_kv!r} must be True or False")
        check_drawn(drawn)
        if hold_kv and (params.max_tokens != 1 or params.n != 1):
            raise InvalidArgumentError(
                f"hold_kv=True needs max_tokens=1 and n=1 (the held sequence is the prompt's), "
                f"got max_tokens={params.max_tokens}, n={params.n}")
        if kv_seq_id is not None:
            self._check_adopted(kv_seq_id, len(prompt))
        rid = self._next_id
        self._next_id += 1
        samples = [Sample(seed=params.sample_seed(j)) for j in range(params.n)]
        self.scheduler.add(Request(rid, prompt, params, frozenset(stops), 0, samples,
                                   hold_kv=hold_kv, kv_seq_id=kv_seq_id, drawn=drawn))
        return rid

    def _check_adopted(self, sid, prompt_len: int) -> None:
        sched = self.scheduler
        if isinstance(sid, bool) or not isinstance(sid, int):
            raise InvalidArgumentError(f"kv_seq_id={sid!r} must be an int sequence id")
        if sid in sched.seqs.by_sid or sid in sched.held.values() or any(
                r.kv_seq_id == sid for r in sched.requests.values()):
            raise InvalidArgumentError(f"kv_seq_id={sid}: that sequence already belongs to a request")
        have = sched.cache.sequence_length(sid)         # SequenceNotFoundError if absent
        if have >= prompt_len:
            raise InvalidArgumentError(
                f"kv_seq_id={sid} holds {have} tokens; the prompt ({prompt_len} tokens) must "
                f"extend it by at least one")

    def new_seq_id(self) -> int:
        """A cache sequence id the engine never uses for its own sequences: import a sequence
        under it, then ``add_request(..., kv_seq_id=it)``."""
        return self.scheduler.seqs.new_seq_id()

    def release(self, request_id: int) -> bool:
        """Remove the sequence a finished ``hold_kv`` request keeps (its pages come back);
        False if it keeps none."""
        return self.scheduler.release(request_id)

    def abort(self, request_id: int) -> None:
        """End a request now: its sequences leave the cache at once (its pages are available
        when this returns) and the next ``step`` reports it finished with ``"abort"``. An
        unknown or finished id is ignored."""
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise InvalidArgumentError(f"request_id={request_id!r} must be an int from add_request")
        self._pending.extend(self.scheduler.abort(request_id))

    def has_unfinished(self) -> bool:
        """``step`` has more to do or report: a request still runs or waits, a pipelined
        step's picks are unread, or an abort is not reported yet. Loop ``while
        has_unfinished(): step()``."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list:
        """Run one forward (when there is work) and return the ``RequestOutput`` of every sample
        that got tokens or ended. In pipelined mode a greedy step's tokens are reported by the
        next call (the host reads them after launching the next forward); a call with nothing
        left to launch reads the last ones."""
        out, self._pending = self._pending, []
        if not self.scheduler.has_unfinished():
            self._close()
            return out
        if self._session is None:
            self._session = contextlib.ExitStack()
            self._session.enter_context(self.runner.session())
        try:
            with self._step_context():
                out.extend(self._step())
        except BaseException:
            self.reset()
            raise
        if not self.scheduler.has_unfinished():
            self._close()
        return out

    def _step_context(self):
        enter = getattr(self.runner, "step_context", None)
        return enter() if enter is not None else contextlib.nullcontext()

    def _step(self) -> list:
        sched = self.scheduler
        while True:
            plan = sched.schedule()
            try:
                output = self._execute(plan)
            except CacheFullError as exc:
                sched.update(plan, exc)         # preempts for the head: plan again
                continue
            return sched.update(plan, output)

    def _execute(self, plan: StepPlan) -> StepOutput:
        """Run ``plan`` on the runner: its forward (none for an empty plan) and its picks, on
        their way for a pipelined step, else on the host."""
        if not plan.seq_ids:
            return StepOutput()
        runner = self.runner
        logits = runner.forward(plan, plan.slot_picks)
        self.scheduler.stats.forwards += 1      # counted once it ran, before its picks are made
        if plan.pipelined:
            return StepOutput(pending=runner.greedy_async(logits, plan.logprobs)
                              if plan.wants else None)
        draws = plan.draws
        if not draws:
            return StepOutput()
        tokens, logprobs = runner.pick(logits, draws, plan.logprobs)
        alternatives = None
        if plan.top_logprobs:
            alternatives = runner.alternatives(logits, [d.row for d in draws], plan.top_logprobs)
        return StepOutput(tokens, logprobs, alternatives)

    def reset(self) -> None:
        """Drop every request and sequence (after an error: the cache is cleared)."""
        self.scheduler.reset()
        self._pending = []
        self._close()

    def _close(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            session.close()
