"""The scheduler: requests, their sequences in the cache, and what each forward runs.

Pure Python over the cache's public API (no array library, no model library), so it is tested
with a fake runner. Per step (one forward):

* every sequence holds ``tokens`` (what it must have in the cache) and ``cached`` (what it has);
  its pending tokens ``tokens[cached:]`` are one token for a decoding sample and a chunk of the
  prompt for a prefill;
* decodes first, oldest first; then prefills oldest first, chunked to the forward's token budget
  (``prefill_chunk_size``) and admitted only while the free pages cover them;
* prompts added together that share a prefix of at least one page get a *prefix sequence* that
  is prefilled once; each prompt forks from it (the pages are shared). Prefixes nest;
* ``n > 1`` samples: the prompt's sequence is prefilled once, then each sample forks from it;
* the oldest unfinished sequence (the *head*) is in every forward and is never preempted: when
  the free pages do not cover a token of it, the youngest other sequences in the cache are
  preempted until they do (the prefix it is about to fork from last). So every forward advances
  the oldest request, and every request that fits the cache alone finishes;
* a forward that does not fit (``CacheFullError``) preempts the youngest sequence other than the
  head and is planned again. A preempted sequence is recomputed later from its tokens (re-forking
  from its prefix when that is still in the cache), or, with a host tier, parked in host memory
  and restored when it is scheduled again.

*Pipelined mode* (the host one step ahead of the device): a step whose picks are all greedy and
one per sequence is booked before its picks reach the host (``launched``): each sequence that
goes on gets a placeholder token (``SLOT``) that the next step takes from those picks where they
are (on the device), and the picks are read (``settle``) after the next step is launched. A
sample that the settled picks stop had one more step launched for it: that pick is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..errors import CacheFullError
from .request import Request, RequestOutput, Sample
from .stats import EngineStats

__all__ = ["SLOT", "Scheduler", "StepPlan"]

SLOT = -1
"""A token id in a sequence's tokens that stands for a pick still on its way (pipelined mode)."""


@dataclasses.dataclass(eq=False)
class Seq:
    sid: int
    kind: str                          # "prefix" | "prompt" | "sample"
    tokens: list
    order: tuple                       # smaller is older; the youngest is preempted first
    req: Optional[Request] = None      # None for a prefix shared by several requests
    sample: int = -1
    parent: Optional["Seq"] = None     # sequence it forks from when admitted
    origin: Optional["Seq"] = None     # the sequence it shares a prefix with (re-fork after preemption)
    fork_pos: int = 0
    cached: int = 0
    parked: int = 0                    # tokens held in the host tier (0: none)
    live: bool = False                 # holds a sequence in the cache
    retired: bool = False              # done (removed for good): dependants start from scratch
    waiting: int = 0                   # dependants not yet forked from it
    computed: int = 0                  # tokens ever run for it (recompute accounting)

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.cached

    def go_on_as_sample(self) -> None:
        """A prompt's sequence with one sample (``n == 1``) goes on as that sample."""
        self.kind, self.sample = "sample", 0
        self.order = (self.order[0], 2, 0)


@dataclasses.dataclass
class StepPlan:
    """One forward, as the runner takes it (the typed per-step metadata).

    ``seq_ids`` / ``lens``: the sequences and their new tokens (``cache.forward``'s arguments);
    ``tokens`` / ``positions``: the new tokens, packed, and their positions; ``tokens[d]`` for
    ``d`` in ``slot_dst`` is ``SLOT``, the pick at row ``slot_src`` of the step before (still on
    its way); ``logit_rows``: the packed rows whose next-token logits are wanted, one per
    sequence in ``wants``; ``pipelined``: its picks are all greedy, one per sequence, and may be
    booked before they reach the host; ``logprobs``: some request wants log-probabilities;
    ``decode``: every sequence runs one token it decodes."""

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
    batch: list                        # (Seq, chunk)


@dataclasses.dataclass
class Draw:
    """A pick to make from a step's logits: row ``row`` (an index into ``logit_rows``) for
    ``sample`` of ``request``; ``step`` is how many tokens that sample drew before."""

    row: int
    params: Any
    seed: int
    step: int


@dataclasses.dataclass
class _Inflight:
    wants: list
    picks: Any                         # the runner's PendingPicks
    slots: dict                        # id(seq) -> (index of its SLOT token, row)


class Scheduler:
    """Requests and sequences on one ``PagedKVCache`` (see the module docstring).

    ``cache``: the cache; ``host_tier``: a ``kvcache.HostTier`` preempted sequences are parked
    in (None: they are recomputed); ``stats``: the ``EngineStats`` it counts in;
    ``pipelined``: the host one step ahead for greedy steps."""

    def __init__(self, cache, host_tier=None, stats: Optional[EngineStats] = None,
                 pipelined: bool = True):
        self.cache = cache
        self.config = cache.config
        self.host_tier = host_tier
        self.stats = stats if stats is not None else EngineStats()
        self.pipelined = pipelined
        self.requests: dict = {}           # request_id -> Request, unfinished
        self._seqs: dict = {}              # sid -> Seq, not retired
        self._fresh: list = []             # requests added since the last plan
        self._next_sid = 0
        self._orders = 0
        self._head: Optional[Seq] = None
        self._inflight: Optional[_Inflight] = None

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        """Queue ``request`` (validated by the caller); its samples get their seeds."""
        request.order = self._orders
        self._orders += 1
        self.requests[request.request_id] = request
        self._fresh.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    @property
    def num_running(self) -> int:
        return sum(1 for s in self._seqs.values() if s.live and s.kind != "prefix")

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len({id(s.req) for s in self._seqs.values()
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
            self._drop(seq)
        out = []
        for j, smp in enumerate(req.samples):
            if not smp.done:
                smp.finish_reason = "abort"
                out.append(self._output(req, j, smp))
        return out

    def _drop(self, seq: Seq) -> None:
        """``seq`` is gone for good (abort): out of the cache, the tier and its parent's count."""
        if seq.retired:
            return
        if seq.parent is not None and not seq.live:
            seq.parent.waiting -= 1
            parent, seq.parent = seq.parent, None
            self._maybe_retire(parent)
        if seq.parked and self.host_tier is not None:
            self.host_tier.drop(seq.sid)
            seq.parked = 0
        self._retire(seq)

    # ------------------------------------------------------------------ sequences
    def _new_seq(self, **kw) -> Seq:
        seq = Seq(sid=self._next_sid, **kw)
        self._next_sid += 1
        self._seqs[seq.sid] = seq
        if seq.req is not None:
            seq.req.seqs.append(seq)
        return seq

    def _take_fresh(self) -> None:
        """Sequences for the requests added since the last plan: a prefix sequence for each
        group of their prompts sharing at least a page, and a prompt sequence each."""
        fresh, self._fresh = self._fresh, []
        prompts = [r.prompt for r in fresh]
        parents: list = [None] * len(fresh)
        minimum = self.config.page_size

        def common(idx, start):
            first = prompts[idx[0]]
            length = len(first)
            for i in idx[1:]:
                other = prompts[i]
                m = min(length, len(other))
                k = start
                while k < m and first[k] == other[k]:
                    k += 1
                length = k
            return length

        def build(idx, depth, parent):
            groups: dict = {}
            for i in idx:
                if len(prompts[i]) > depth:
                    groups.setdefault(prompts[i][depth], []).append(i)
                else:
                    parents[i] = parent
            for members in groups.values():
                if len(members) == 1:
                    parents[members[0]] = parent
                    continue
                length = common(members, depth)
                node = parent
                if length >= minimum and (parent is None or length > len(parent.tokens)):
                    node = self._new_seq(kind="prefix", tokens=list(prompts[members[0]][:length]),
                                         order=(min(fresh[i].order for i in members), 0, length),
                                         origin=parent)
                    self._attach(node, parent)
                build(members, length, node)

        build(list(range(len(fresh))), 0, None)
        for req, parent in zip(fresh, parents):
            seq = self._new_seq(kind="prompt", tokens=list(req.prompt), order=(req.order, 1, 0),
                                req=req, origin=parent)
            self._attach(seq, parent)

    def _attach(self, seq: Seq, parent: Optional[Seq]) -> None:
        """Make ``seq`` fork from ``parent`` (a prefix sequence, or the nearest one of its
        origins still in use) when admitted; from nothing when none is."""
        while parent is not None and parent.retired:
            parent = parent.origin
        if parent is not None:
            seq.parent = parent
            seq.fork_pos = min(len(parent.tokens), len(seq.tokens) - 1)
            parent.waiting += 1
        else:
            seq.parent, seq.fork_pos = None, 0

    def _ready(self, seq: Seq) -> bool:
        p = seq.parent
        return p is None or p.retired or (p.live and p.cached >= seq.fork_pos)

    def _shares(self, seq: Seq) -> bool:
        return seq.parent is not None and not seq.parent.retired

    def _maybe_retire(self, seq: Seq) -> None:
        """A prefix sequence that nobody waits on any more leaves the cache."""
        if seq.kind == "prefix" and seq.waiting == 0 and seq.pending == 0 and not seq.retired:
            self._retire(seq)

    def _retire(self, seq: Seq) -> None:
        if seq.live:
            self.cache.remove_sequence(seq.sid)
        seq.live, seq.retired = False, True
        self._seqs.pop(seq.sid, None)

    # ------------------------------------------------------------------ planning
    def schedule(self) -> Optional[StepPlan]:
        """The next forward, its sequences admitted to the cache; None when nothing is left to
        run (a pipelined step may still be in flight: ``settle`` it)."""
        if self._fresh:
            self._take_fresh()
        while True:
            batch = self._choose()
            if batch is None:
                return None
            try:
                for seq, _ in batch:
                    if not seq.live:
                        self._admit(seq)
            except CacheFullError as exc:
                self._preempt(str(exc), keep=self._head)
                continue
            return self._plan(batch)

    def _choose(self):
        """The next forward's (seq, chunk) list with the head in it, preempting for the head
        when the free pages do not cover a token of it; None when no work is left."""
        while True:
            work = [s for s in self._seqs.values() if s.pending > 0]
            if not work:
                return None
            is_decode = [s.live and s.kind == "sample" and s.pending == 1 for s in work]
            decodes = sorted((s for s, d in zip(work, is_decode) if d), key=lambda s: s.order)
            rest = sorted((s for s, d in zip(work, is_decode) if not d), key=lambda s: s.order)
            head = min(decodes[:1] + rest[:1], key=lambda s: s.order)
            while not self._ready(head):           # (a parent is older: this ends at once)
                assert head.parent is not None
                head = head.parent
            alone = not any(s.live and s is not head for s in self._seqs.values())
            batch = self._fill(decodes, rest, head, force=alone)
            if batch is not None:
                self._head = head
                return batch
            self._preempt("no room for the oldest unfinished sequence", keep=head)

    def _room(self, s: Seq, free: int, budget: int) -> tuple:
        """``(start, tokens, pages)``: where ``s``'s next chunk starts, how many of its pending
        tokens (at most ``budget``) fit in ``free`` free pages (a restore, or the partial page a
        fork copies, taken first), and the pages that chunk takes."""
        ps = self.config.page_size
        restore = self._restore_pages(s)
        if restore is not None:                               # parked: restored, then run on
            start, taken = s.parked, restore
        elif s.live:
            start, taken = s.cached, 0
        elif self._shares(s):
            start = s.fork_pos
            taken = 1 if start % ps else 0                    # the fork copies a partial page
        else:
            start, taken = 0, 0
        want = min(len(s.tokens) - start, budget)
        have = free - taken
        if have < 0 and taken:
            fits = 0                                          # no page for the restore / copy
        else:                   # room left in its last page (never shared), then whole pages
            fits = max(have, 0) * ps + (-start) % ps
        chunk = min(want, fits)
        return start, chunk, taken + -(-(start + chunk) // ps) - -(-start // ps)

    def _fill(self, decodes: list, rest: list, head: Seq, force: bool):
        """One forward's (seq, chunk) list with ``head`` in it, or None when the free pages do
        not cover a token of ``head`` (``force``: nothing else can be preempted; it is planned
        anyway and the forward decides). Decodes first; then prompt chunks oldest first,
        admitted while the free pages cover them."""
        cfg = self.config
        budget, free = cfg.prefill_chunk_size, self.cache.num_available_pages
        ps = cfg.page_size
        head_decodes = bool(decodes) and decodes[0] is head
        slots = min(cfg.max_batch_size, budget) - (0 if head_decodes else 1)
        chunk = pages = 0
        if not head_decodes:
            own = budget - min(len(decodes), slots)
            start, chunk, pages = self._room(head, free, own)
            if chunk <= 0:
                if not force:
                    return None
                chunk, pages = min(len(head.tokens) - start, own), 0     # try anyway
            free -= pages
        batch = []
        for s in decodes[:slots]:
            batch.append((s, 1))
            budget -= 1
            free -= 1 if s.cached % ps == 0 else 0
        if not head_decodes:
            batch.append((head, chunk))
            budget -= chunk
            rest = rest[1:]
        reserve = len(decodes)              # a page per running decode for the steps to come
        for s in rest:
            if len(batch) == cfg.max_batch_size or budget == 0:
                break
            if not s.live and free <= reserve:
                continue                                      # no page to admit it with
            if not self._ready(s):
                continue
            _, chunk, pages = self._room(s, free - (0 if s.live else reserve), budget)
            if chunk <= 0:
                continue                                      # wait for pages to free up
            batch.append((s, chunk))
            budget -= chunk
            free -= pages
        return batch

    def _plan(self, batch) -> StepPlan:
        ids: list = []
        lens: list = []
        toks: list = []
        pos: list = []
        rows: list = []
        wants: list = []
        dst: list = []
        src: list = []
        slots = self._inflight.slots if self._inflight is not None else {}
        decode = True
        for seq, chunk in batch:
            chunk = min(chunk, seq.pending)
            start = seq.cached
            slot = slots.get(id(seq))
            if slot is not None and start <= slot[0] < start + chunk:
                dst.append(len(toks) + slot[0] - start)
                src.append(slot[1])
            ids.append(seq.sid)
            lens.append(chunk)
            toks.extend(seq.tokens[start:start + chunk])
            pos.extend(range(start, start + chunk))
            decode = decode and chunk == 1 and seq.kind == "sample"
            if start + chunk == len(seq.tokens) and seq.kind != "prefix":
                rows.append(len(toks) - 1)
                wants.append(seq)
        assert len(dst) == toks.count(SLOT), "a pick still on its way has no source in the step before"
        reqs = [s.req for s in wants]
        return StepPlan(ids, lens, toks, pos, rows, wants, dst, src,
                        pipelined=self.pipelined and all(r.greedy and r.params.n == 1 for r in reqs),
                        logprobs=any(r.wants_logprobs for r in reqs), decode=decode, batch=batch)

    # ------------------------------------------------------------------ admission, preemption
    def _restore_pages(self, seq: Seq) -> Optional[int]:
        """Pages that restoring a parked ``seq`` takes, or None when it is not restored (not
        parked, or its parent now holds more of its tokens than the tier does)."""
        if not seq.parked or seq.live or (self._shares(seq) and seq.fork_pos > seq.parked):
            return None
        ps = self.config.page_size
        base = seq.fork_pos - seq.fork_pos % ps if self._shares(seq) else 0
        return -(-(seq.parked - base) // ps)

    def _admit(self, seq: Seq) -> None:
        cache, stats = self.cache, self.stats
        parent = seq.parent
        restore = self._restore_pages(seq) is not None
        if restore:
            assert self.host_tier is not None
            if self._shares(seq):
                assert parent is not None
                saved = self.host_tier.restore(seq.sid, parent_id=parent.sid, fork_pos=seq.fork_pos)
                stats.forks += 1
                stats.shared_prefix_tokens += seq.fork_pos
            else:
                saved = self.host_tier.restore(seq.sid)
            seq.cached = seq.parked
            stats.recompute_tokens_saved += saved
        elif parent is not None and not parent.retired:
            cache.fork_sequence(parent.sid, seq.sid, seq.fork_pos)
            seq.cached = seq.fork_pos
            stats.forks += 1
            stats.shared_prefix_tokens += seq.fork_pos
        else:
            cache.add_sequence(seq.sid)
            seq.cached = 0
        if seq.parked and not restore:              # the parent holds more: fork instead
            assert self.host_tier is not None
            self.host_tier.drop(seq.sid)
        seq.parked = 0
        seq.live = True
        if parent is not None:
            parent.waiting -= 1
            seq.parent = None
            self._maybe_retire(parent)

    def forward_failed(self, exc: CacheFullError) -> None:
        """The planned forward did not fit: preempt for the head, then plan again."""
        self._preempt(str(exc), keep=self._head)

    def _preempt(self, why: str, keep: Optional[Seq] = None) -> None:
        """Remove the youngest sequence in the cache other than ``keep`` (the head) to free its
        pages; it is parked in the host tier (when on, and it has room) or recomputed later.
        The prefix ``keep`` is still to fork from goes last."""
        live = [s for s in self._seqs.values() if s.live and s is not keep]
        if not live:
            cfg = self.config
            raise CacheFullError(
                f"the cache ({self.cache.num_total_pages} pages of {cfg.page_size} tokens, "
                f"max_total_tokens={cfg.max_total_tokens}) cannot hold the next forward even "
                f"alone: {why}")
        source = keep.parent if keep is not None and not keep.live else None
        victim = max(live, key=lambda s: (s is not source, s.order))
        self.stats.preemptions += 1
        if self.host_tier is not None and victim.kind != "prefix" and victim.cached:
            try:
                self.host_tier.offload(victim.sid)
            except CacheFullError:
                pass                                    # the tier is full: recompute it
            else:
                victim.live, victim.parked, victim.cached = False, victim.cached, 0
                self.stats.offloaded_tokens += victim.parked
                self._attach(victim, victim.origin)     # restored onto its prefix if in use
                return
        self.cache.remove_sequence(victim.sid)
        victim.live, victim.cached = False, 0
        if victim.kind == "prefix":
            # sharing is an optimisation: a preempted prefix is dropped for good, and the
            # sequences that would have forked from it start from its own prefix (or nothing)
            victim.retired = True
            self._seqs.pop(victim.sid, None)
            for s in list(self._seqs.values()):
                if s.parent is victim and not s.live:
                    victim.waiting -= 1
                    self._attach(s, victim.origin)
            return
        self._attach(victim, victim.origin)

    # ------------------------------------------------------------------ after the forward
    def ran(self, plan: StepPlan) -> None:
        """The planned forward ran: its sequences hold their new tokens."""
        stats = self.stats
        stats.forwards += 1
        for (seq, _), chunk in zip(plan.batch, plan.lens):
            if seq.kind == "sample" and chunk == 1 and seq.computed == seq.cached:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += chunk
            stats.recomputed_tokens += max(0, min(chunk, seq.computed - seq.cached))
            seq.cached += chunk
            seq.computed = max(seq.computed, seq.cached)
            if seq.kind == "prefix":
                self._maybe_retire(seq)

    def launched(self, plan: StepPlan, picks) -> None:
        """Book a pipelined step's picks before the host has them: a prompt's sequence goes on
        as its sample; a sample this pick brings to ``max_tokens`` leaves the cache now (the
        forward in flight still writes its pages: the cache keeps them until it is done); every
        other one gets a ``SLOT`` token, its next step's input, filled by ``settle``."""
        assert self._inflight is None, "settle the step before first"
        if not plan.wants:
            return
        slots = {}
        for k, seq in enumerate(plan.wants):
            if seq.kind == "prompt":
                seq.go_on_as_sample()
            smp = seq.req.samples[seq.sample]
            smp.planned += 1
            if smp.done or smp.planned >= seq.req.max_tokens:
                self._retire(seq)
            else:
                seq.tokens.append(SLOT)
                slots[id(seq)] = (len(seq.tokens) - 1, k)
        self._inflight = _Inflight(list(plan.wants), picks, slots)

    @property
    def inflight(self):
        """The pipelined step in flight (its pending picks: ``.picks``), or None."""
        return self._inflight

    def reset(self) -> None:
        """Forget every request and sequence; the cache is cleared (after an error)."""
        self.requests.clear()
        self._seqs.clear()
        self._fresh = []
        self._inflight = None
        self._head = None
        self.cache.clear()
        if self.host_tier is not None:
            self.host_tier.clear()

    def take_inflight(self):
        """The pipelined step in flight (its picks: ``.picks``), or None; it is no longer
        referenced by the next plan once taken: ``settle`` it."""
        inflight, self._inflight = self._inflight, None
        return inflight

    def settle(self, inflight, tokens, logprobs) -> list:
        """Read a pipelined step's picks (host ``tokens`` / ``logprobs``, one per sequence of
        ``inflight.wants``): each sample takes its token (none once it has ended), ``SLOT``
        tokens get their ids, and a sample that ended leaves the cache. Returns the outputs."""
        touched = []
        for k, seq in enumerate(inflight.wants):
            smp = seq.req.samples[seq.sample]
            if self._draw(seq.req, smp, int(tokens[k]), float(logprobs[k])):
                touched.append((seq.req, seq.sample))
            slot = inflight.slots.get(id(seq))
            if slot is None:
                continue
            if smp.done:
                self._retire(seq)
            else:
                seq.tokens[slot[0]] = int(tokens[k])
        return self._outputs(touched)

    def draws(self, plan: StepPlan) -> list:
        """The picks a synchronous step makes (call after settling the step before): one
        ``Draw`` per unfinished sample of each sequence in ``plan.wants`` (a prompt's ``n``
        samples draw from its row)."""
        out = []
        for k, seq in enumerate(plan.wants):
            req = seq.req
            group = range(len(req.samples)) if seq.kind == "prompt" else (seq.sample,)
            for j in group:
                smp = req.samples[j]
                if not smp.done:
                    out.append(Draw(k, req.params, smp.seed, len(smp.tokens)))
        return out

    def consume(self, plan: StepPlan, tokens, logprobs) -> list:
        """Take a synchronous step's picks (one per ``draws(plan)`` entry, in order). A prompt
        with one sample goes on as it; with ``n > 1`` its sequence becomes the samples' shared
        prefix and each sample forks from it. Returns the outputs."""
        touched, d = [], 0
        for seq in plan.wants:
            req = seq.req
            if seq.kind == "prompt":
                for j, smp in enumerate(req.samples):
                    if not smp.done:
                        if self._draw(req, smp, int(tokens[d]), float(logprobs[d])):
                            touched.append((req, j))
                        d += 1
                if len(req.samples) == 1:
                    seq.go_on_as_sample()
                    self._after(seq, req.samples[0])
                    continue
                seq.kind = "prefix"
                for j, smp in enumerate(req.samples):
                    if smp.done:
                        continue
                    child = self._new_seq(kind="sample", tokens=seq.tokens + [smp.tokens[-1]],
                                          order=(req.order, 2, j), req=req, sample=j,
                                          origin=seq, computed=len(seq.tokens))
                    self._attach(child, seq)
                self._maybe_retire(seq)
                continue
            smp = req.samples[seq.sample]
            if not smp.done:
                if self._draw(req, smp, int(tokens[d]), float(logprobs[d])):
                    touched.append((req, seq.sample))
                d += 1
            self._after(seq, smp)
        return self._outputs(touched)

    def _after(self, seq: Seq, smp: Sample) -> None:
        if smp.done:
            self._retire(seq)
        else:
            seq.tokens.append(smp.tokens[-1])

    @staticmethod
    def _draw(req: Request, smp: Sample, token: int, logprob: float) -> bool:
        if smp.done:
            return False
        smp.tokens.append(token)
        smp.logprobs.append(logprob)
        smp.planned = max(smp.planned, len(smp.tokens))
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
        smp.emitted = len(smp.tokens)
        return RequestOutput(req.request_id, j, new, smp.done, smp.finish_reason, lps)
