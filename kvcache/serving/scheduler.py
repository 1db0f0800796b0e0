"""The scheduler: requests, their sequences in the cache, and what each forward runs.

Pure Python over the cache's public API (no array library, no model library), so it is tested
with a fake runner. Per step (one forward):

* every sequence holds ``tokens`` (what it must have in the cache; with ``AsyncScheduler`` also
  ``ahead`` placeholders, picks still on their way) and ``cached`` (what it has); its pending
  tokens are one token for a decoding sample and a chunk of the prompt for a prefill;
* decodes first, oldest first; then prefills oldest first, chunked to the forward's token budget
  (``prefill_chunk_size``) and admitted only while the free pages cover them;
* ``n > 1`` samples fork from their prompt, prefilled once (``kvcache.serving.sequences``);
  prompts that share a whole page or more share it through the prefix cache: a younger prompt
  waits while an older one computes it (``kvcache.serving.batching``);
* the oldest unfinished sequence (the *head*) is in every forward and is never preempted: when
  the free pages do not cover a token of it, the youngest other sequences in the cache are
  preempted until they do (the prompt it is about to fork from last). So every forward advances
  the oldest request, and every request that fits the cache alone finishes;
* a forward that does not fit (``CacheFullError``) preempts the youngest sequence other than the
  head and is planned again. A preempted sequence is recomputed later from its tokens (re-forking
  from its prompt, or starting from the prefix cache, when that still holds them), or, with a host tier, parked in host memory
  and restored when it is scheduled again.

The engine core calls it twice a step (vLLM v1's ``schedule`` / ``update_from_output``):
``schedule()`` plans the forward (a ``StepPlan``, with a ``Draw`` per pick) and ``update(plan,
output)`` books it with the runner's ``StepOutput`` and returns the step's ``RequestOutput``
records; a forward that did not fit is reported as ``update(plan, CacheFullError)``. This
scheduler is synchronous: a step's picks are read before the next is planned.
``AsyncScheduler`` (``kvcache.serving.async_scheduler``) keeps the host one step ahead of the
device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from ..errors import CacheFullError
from .batching import Batching
from .plan import Draw, StepOutput, StepPlan
from .request import Request, RequestOutput, Sample
from .sequences import Seq, Sequences
from .stats import EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from .protocols import HostStore, SchedulerCache

__all__ = ["Scheduler"]


class Scheduler(Batching):
    """Requests and sequences on one ``PagedKVCache`` (see the module docstring).

    ``cache``: the cache (what the scheduler calls of it: ``SchedulerCache``); ``host_tier``: a
    ``kvcache.HostTier`` preempted sequences are parked in (None: they are recomputed);
    ``stats``: the ``EngineStats`` it counts in."""

    def __init__(self, cache: SchedulerCache, host_tier: Optional[HostStore] = None,
                 stats: Optional[EngineStats] = None):
        self.cache = cache
        self.config = cache.config
        self.host_tier = host_tier
        self.stats = stats if stats is not None else EngineStats()
        self.requests: dict = {}           # request_id -> Request, unfinished
        self.seqs = Sequences(cache, host_tier, self.stats)
        self._fresh: list = []             # requests added since the last plan
        self.held: dict = {}               # request_id -> sequence id kept (hold_kv), finished
        self._orders = 0
        self._head: Optional[Seq] = None

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue ``request`` (validated by the caller); its samples get their seeds."""
        request.order = self._orders
        self._orders += 1
        self.requests[request.request_id] = request
        self._fresh.append(request)

    def has_unfinished(self) -> bool:
        """A request is queued or running."""
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        """Sequences in the cache that produce tokens (prompts and samples; shared prefixes not
        counted)."""
        return sum(1 for s in self.seqs.by_sid.values() if s.live and s.kind != "prefix")

    @property
    def num_waiting(self) -> int:
        """Unfinished requests with no sequence in the cache: not admitted yet, or every
        sequence preempted."""
        return len(self.requests) - len({id(s.req) for s in self.seqs.by_sid.values()
                                          if s.live and s.req is not None})

    def abort(self, request_id: int) -> list:
        """End every sample of the request now; its sequences leave the cache (their pages are
        free when this returns, unless a forward in flight still reads them). Returns the
        outputs that report it (``finish_reason="abort"``); [] for an unknown or finished id."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        if req in self._fresh:
            self._fresh.remove(req)
        for seq in req.seqs:
            self.seqs.drop(seq)
        out = []
        for j, smp in enumerate(req.samples):
            if not smp.done:
                smp.finish_reason = "abort"
                out.append(self._output(req, j, smp))
        return out

    # ---------------------------------------------- planning (the batch policy: .batching)
    def schedule(self) -> StepPlan:
        """The next forward, its sequences admitted to the cache, with the picks to make from
        its logits (``plan.draws``); a plan with no sequences when nothing is left to run.
        Hand it to ``update`` with what the runner made of it, run or not."""
        if self._fresh:
            fresh, self._fresh = self._fresh, []
            self.seqs.take_fresh(fresh)
        while True:
            batch = self._choose()
            if batch is None:
                return StepPlan.idle()
            try:
                for seq, _ in batch:
                    if not seq.live:
                        self.seqs.admit(seq)
            except CacheFullError as exc:
                self.seqs.preempt(str(exc), keep=self._head)
                continue
            return self._plan(batch)

    def _plan(self, batch) -> StepPlan:
        plan = self._pack(batch)
        plan.draws = self._draws(plan.wants)
        return plan

    def _draws(self, wants: list) -> list:
        """One ``Draw`` per unfinished sample of each sequence in ``wants`` (a prompt's ``n``
        samples draw from its row); ``step`` counts the sample's picks, those still on their
        way and those drawn before the request (``Request.drawn``) included."""
        out = []
        for k, seq in enumerate(wants):
            req = seq.req
            group = range(len(req.samples)) if seq.kind == "prompt" else (seq.sample,)
            for j in group:
                smp = req.samples[j]
                if not smp.done:
                    out.append(Draw(k, req.params, smp.seed,
                                    req.drawn + len(smp.tokens) + seq.ahead, j))
        return out

    # ------------------------------------------------------------------ after the forward
    def update(self, plan: StepPlan, output: Union[StepOutput, CacheFullError]) -> list:
        """Book ``plan`` (from ``schedule``) with ``output``, what the runner made of it:

        * a ``StepOutput``: the forward ran (or ``plan`` had nothing to run); its sequences hold
          their new tokens and each sample takes its pick (one per ``plan.draws``, in order).
          A prompt with one sample goes on as it; with ``n > 1`` its sequence becomes the
          samples' shared prefix and each sample forks from it;
        * a ``CacheFullError``: the forward did not fit and changed nothing; the youngest
          sequence other than the head is preempted, and the next ``schedule`` plans again.

        Returns the ``RequestOutput`` of every sample that got tokens or ended."""
        if isinstance(output, CacheFullError):
            self.seqs.preempt(str(output), keep=self._head)
            return []
        if plan.seq_ids:
            self._ran(plan)
        return self._consume(plan, output)

    def _ran(self, plan: StepPlan) -> None:
        """The planned forward ran (``EngineCore`` counted it): its sequences hold their new
        tokens."""
        stats = self.stats
        for (seq, _), chunk in zip(plan.batch, plan.lens):
            if seq.kind == "sample" and chunk == 1 and seq.computed == seq.cached:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += chunk
            stats.recomputed_tokens += max(0, min(chunk, seq.computed - seq.cached))
            seq.cached += chunk
            seq.computed = max(seq.computed, seq.cached)
            if seq.kind == "prefix":
                self.seqs.maybe_retire(seq)

    def _consume(self, plan: StepPlan, output: StepOutput) -> list:
        """Each draw's sample takes its pick (a sample that ended since the plan was made drops
        it), then each sequence of ``plan.wants`` goes on or ends. Returns the outputs."""
        tokens, logprobs, alternatives = output.tokens, output.logprobs, output.alternatives
        wants, touched = plan.wants, []
        for d, draw in enumerate(plan.draws):
            req = wants[draw.row].req
            if self._draw(req, req.samples[draw.sample], int(tokens[d]), float(logprobs[d]),
                          _top(alternatives, d, req.top_logprobs)):
                touched.append((req, draw.sample))
        for seq in wants:
            req = seq.req
            if seq.kind != "prompt":
                self._after(seq, req.samples[seq.sample])
            elif len(req.samples) == 1:
                seq.go_on_as_sample()
                self._after(seq, req.samples[0])
            else:
                seq.kind = "prefix"
                for j, smp in enumerate(req.samples):
                    if smp.done:
                        continue
                    child = self.seqs.new(kind="sample", tokens=seq.tokens + [smp.tokens[-1]],
                                          order=(req.order, 2, j), req=req, sample=j,
                                          origin=seq, computed=len(seq.tokens))
                    self.seqs.attach(child, seq)
                self.seqs.maybe_retire(seq)
        return self._outputs(touched)

    def reset(self) -> None:
        """Forget every request and sequence; the cache is cleared (after an error)."""
        self.requests.clear()
        self.seqs.clear()
        self.held.clear()
        self._fresh = []
        self._head = None
        self.cache.clear()
        if self.host_tier is not None:
            self.host_tier.clear()

    def _after(self, seq: Seq, smp: Sample) -> None:
        if smp.done:
            self._finish(seq)
        else:
            seq.tokens.append(smp.tokens[-1])

    def _finish(self, seq: Seq) -> None:
        """A sample's sequence is done: it leaves the cache, or stays there for the caller
        (``hold_kv``: one sample of one token, so the sequence holds exactly the prompt)."""
        if seq.req is not None and seq.req.hold_kv:
            self.seqs.hold(seq)
            self.held[seq.req.request_id] = seq.sid
        else:
            self.seqs.retire(seq)

    def release(self, request_id: int) -> bool:
        """Remove the sequence a finished ``hold_kv`` request keeps; False if it keeps none."""
        sid = self.held.pop(request_id, None)
        if sid is None:
            return False
        self.cache.remove_sequence(sid)
        return True

    @staticmethod
    def _draw(req: Request, smp: Sample, token: int, logprob: float, top=None) -> bool:
        if smp.done:
            return False
        smp.tokens.append(token)
        smp.logprobs.append(logprob)
        if top is not None:
            smp.top.append(top)
        if token in req.stops:
            smp.finish_reason = "stop"
        elif len(smp.tokens) >= req.max_tokens:
            smp.finish_reason = "length"
        return True

    def _outputs(self, touched: list) -> list:
        out = []
        for req, j in touched:
            out.append(self._output(req, j, req.samples[j]))
            if req.finished:
                self.requests.pop(req.request_id, None)
        return out

    @staticmethod
    def _output(req: Request, j: int, smp: Sample) -> RequestOutput:
        new = smp.tokens[smp.emitted:]
        lps = smp.logprobs[smp.emitted:] if req.wants_logprobs else None
        top = smp.top[smp.emitted:] if req.top_logprobs else None
        smp.emitted = len(smp.tokens)
        held = req.held if smp.done and smp.finish_reason != "abort" else None
        return RequestOutput(req.request_id, j, new, smp.done, smp.finish_reason, lps, held, top)


def _top(alternatives, d: int, k: int):
    """Draw ``d``'s ``k`` likeliest ``(token_id, logprob)`` pairs, or None (``k == 0``)."""
    if not k or alternatives is None:
        return None
    ids, lps = alternatives
    return [(int(i), float(lp)) for i, lp in zip(ids[d][:k], lps[d][:k])]
