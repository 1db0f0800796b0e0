"""The scheduler's sequences and their life in the cache: admission (add, from the prefix
cache, fork or restore from the host tier), preemption, retirement.

A request has a *prompt* sequence; a prompt with ``n > 1`` samples becomes their *prefix* and
each *sample* forks from it. Prompts that share a prefix share it through the cache's prefix
cache (a younger one waits while an older one computes it: ``kvcache.serving.batching``). Pure
Python over the cache's public API.
"""

from __future__ import annotations

import array
import dataclasses
from typing import TYPE_CHECKING, Optional

from ..errors import CacheFullError
from .request import Request
from .stats import EngineStats

if TYPE_CHECKING:  # pragma: no cover
    from .protocols import HostStore, SchedulerCache

__all__ = ["Seq", "Sequences"]


@dataclasses.dataclass(eq=False)
class Seq:
    sid: int
    kind: str                          # "prefix" | "prompt" | "sample"
    tokens: list
    order: tuple                       # smaller is older; the youngest is preempted first
    req: Optional[Request] = None      # the request it serves (its prompt, samples or their prefix)
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
    recorded: int = 0                  # its first tokens whose ids the cache knows (prefix cache)
    ids: Optional[array.array] = None  # ``tokens`` as int64 (prefix cache lookups), cached
    ahead: int = 0                     # placeholders after ``tokens``: picks on their way (async)

    @property
    def length(self) -> int:
        """The tokens it holds once its picks on their way come: ``tokens`` and placeholders."""
        return len(self.tokens) + self.ahead

    @property
    def pending(self) -> int:
        return len(self.tokens) + self.ahead - self.cached

    def go_on_as_sample(self) -> None:
        """A prompt's sequence with one sample (``n == 1``) goes on as that sample."""
        self.kind, self.sample = "sample", 0
        self.order = (self.order[0], 2, 0)


class Sequences:
    """The sequences of one cache (``by_sid``: those not retired), with the host tier
    preempted ones are parked in (None: they are recomputed)."""

    def __init__(self, cache: SchedulerCache, host_tier: Optional[HostStore], stats: EngineStats):
        self.cache = cache
        self.config = cache.config
        self.host_tier = host_tier
        self.stats = stats
        self.by_sid: dict = {}
        self.next_sid = 0

    def clear(self) -> None:
        self.by_sid.clear()

    def new(self, **kw) -> Seq:
        seq = Seq(sid=self.next_sid, **kw)
        self.next_sid += 1
        self.by_sid[seq.sid] = seq
        if seq.req is not None:
            seq.req.seqs.append(seq)
        return seq

    def take_fresh(self, fresh: list) -> None:
        """A prompt sequence for each of the ``fresh`` requests (added since the last plan), or
        the sequence already in the cache that an adopting request (``kv_seq_id``) goes on from.
        Prompts that share a prefix share it through the prefix cache (``Batching``'s deferral),
        not through a sequence of their own."""
        for req in fresh:
            if req.kv_seq_id is not None:           # adopted: its KV is in the cache already
                seq = Seq(sid=req.kv_seq_id, kind="prompt", tokens=list(req.prompt),
                          order=(req.order, 1, 0), req=req, live=True,
                          cached=self.cache.sequence_length(req.kv_seq_id))
                seq.computed = seq.cached
                self.by_sid[seq.sid] = seq
                req.seqs.append(seq)
                continue
            self.new(kind="prompt", tokens=list(req.prompt), order=(req.order, 1, 0), req=req)

    def new_seq_id(self) -> int:
        """A sequence id the scheduler never gives one of its own sequences (for a sequence
        imported into the cache and adopted by a request: ``kv_seq_id``)."""
        sid = self.next_sid
        self.next_sid += 1
        return sid

    def hold(self, seq: Seq) -> None:
        """``seq``'s request is done but keeps its KV (``hold_kv``): it stays in the cache, out
        of the scheduler's reach (never planned, preempted or retired) until released."""
        assert seq.req is not None and seq.live
        seq.req.held = seq.sid
        self.by_sid.pop(seq.sid, None)

    def attach(self, seq: Seq, parent: Optional[Seq]) -> None:
        """Make ``seq`` fork from ``parent`` (a prefix sequence, or the nearest one of its
        origins still in use) when admitted; from nothing when none is."""
        while parent is not None and parent.retired:
            parent = parent.origin
        if parent is not None:
            seq.parent = parent
            seq.fork_pos = min(len(parent.tokens), seq.length - 1)
            parent.waiting += 1
        else:
            seq.parent, seq.fork_pos = None, 0

    def ready(self, seq: Seq) -> bool:
        p = seq.parent
        return p is None or p.retired or (p.live and p.cached >= seq.fork_pos)

    def shares(self, seq: Seq) -> bool:
        return seq.parent is not None and not seq.parent.retired

    def maybe_retire(self, seq: Seq) -> None:
        """A prefix sequence that nobody waits on any more leaves the cache, prefilled or not
        (nothing will fork from it: every request sharing it was aborted or has forked), and
        stops being waited on by its own parent prefix."""
        if seq.kind == "prefix" and seq.waiting == 0 and not seq.retired:
            self.drop(seq)

    def unwait(self, seq: Seq) -> None:
        """``seq`` stops waiting on its parent (it forked, or is gone): the parent prefix, and
        up its chain each one nobody waits on any more, leaves the cache (``maybe_retire``)."""
        parent = seq.parent
        if parent is not None:
            parent.waiting -= 1
            seq.parent = None
            self.maybe_retire(parent)

    @staticmethod
    def known_ids(seq: Seq) -> array.array:
        """``seq``'s tokens as an int64 ``array`` (prefix cache lookups), made once per length: a
        waiting request's lookups (one per step it waits, then its admission) convert it once.
        Tokens are only appended (a pick on its way is a count, ``Seq.ahead``, not a token), so
        the same length and last token are the same ids."""
        tokens, ids = seq.tokens, seq.ids
        if ids is None or len(ids) != len(tokens) or (tokens and ids[-1] != tokens[-1]):
            ids = seq.ids = array.array("q", tokens)
        return ids

    def record(self, seq: Seq) -> None:
        """Tell the prefix cache the ids of ``seq``'s tokens it does not know yet, so that its
        full pages stay cached after it leaves."""
        if not self.cache.config.prefix_cache or not seq.live:
            return
        if len(seq.tokens) > seq.recorded:
            self.cache.extend_tokens(seq.sid, seq.tokens[seq.recorded:])
            seq.recorded = len(seq.tokens)

    def retire(self, seq: Seq) -> None:
        if seq.live:
            self.record(seq)
            self.cache.remove_sequence(seq.sid)
        seq.live, seq.retired = False, True
        self.by_sid.pop(seq.sid, None)

    def drop(self, seq: Seq) -> None:
        """``seq`` is gone for good (abort): out of the cache, the tier and its parent's count."""
        if seq.retired:
            return
        if not seq.live:
            self.unwait(seq)
        if seq.parked and self.host_tier is not None:
            self.host_tier.drop(seq.sid)
            seq.parked = 0
        self.retire(seq)

    def restore_pages(self, seq: Seq) -> Optional[int]:
        """Pages that restoring a parked ``seq`` takes, or None when it is not restored (not
        parked, or its parent now holds more of its tokens than the tier does)."""
        if not seq.parked or seq.live or (self.shares(seq) and seq.fork_pos > seq.parked):
            return None
        ps = self.config.page_size
        base = seq.fork_pos - seq.fork_pos % ps if self.shares(seq) else 0
        return -(-(seq.parked - base) // ps)

    def admit(self, seq: Seq) -> None:
        cache, stats = self.cache, self.stats
        parent = seq.parent
        restore = self.restore_pages(seq) is not None
        if restore:
            assert self.host_tier is not None
            if self.shares(seq):
                assert parent is not None
                saved = self.host_tier.restore(seq.sid, parent_id=parent.sid, fork_pos=seq.fork_pos)
                stats.forks += 1
                stats.shared_prefix_tokens += seq.fork_pos
            else:
                saved = self.host_tier.restore(seq.sid)
            seq.cached = seq.parked
            seq.recorded = 0                        # an import knows no ids
            stats.recompute_tokens_saved += saved
        elif parent is not None and not parent.retired:
            cache.fork_sequence(parent.sid, seq.sid, seq.fork_pos)
            seq.cached = seq.fork_pos
            seq.recorded = min(seq.fork_pos, parent.recorded)
            stats.forks += 1
            stats.shared_prefix_tokens += seq.fork_pos
        elif cache.config.prefix_cache:         # starts from the longest cached prefix
            known = self.known_ids(seq)
            missed = cache.prefix_miss_tokens_by_reason
            seq.cached = cache.add_sequence(seq.sid, known)
            seq.recorded = len(known)
            seq.computed = max(seq.computed, seq.cached)
            stats.prefix_hit_tokens += seq.cached
            for why, n in cache.prefix_miss_tokens_by_reason.items():
                if n > missed.get(why, 0):
                    by = stats.prefix_miss_tokens_by_reason
                    by[why] = by.get(why, 0) + n - missed.get(why, 0)
        else:
            cache.add_sequence(seq.sid)
            seq.cached = 0
        if seq.parked and not restore:              # the parent holds more: fork instead
            assert self.host_tier is not None
            self.host_tier.drop(seq.sid)
        seq.parked = 0
        seq.live = True
        self.record(seq)
        self.unwait(seq)

    def preempt(self, why: str, keep: Optional[Seq] = None) -> None:
        """Remove the youngest sequence in the cache other than ``keep`` (the head) to free its
        pages; it is parked in the host tier (when on, and it has room) or recomputed later.
        The prefix ``keep`` is still to fork from goes last."""
        live = [s for s in self.by_sid.values() if s.live and s is not keep]
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
                self.attach(victim, victim.origin)     # restored onto its prefix if in use
                return
        self.record(victim)                     # its full pages stay cached for its return
        self.cache.remove_sequence(victim.sid)
        victim.live, victim.cached = False, 0
        if victim.kind == "prefix":
            # sharing is an optimisation: a preempted prefix is dropped for good, and the
            # sequences that would have forked from it start from its own prefix (or nothing)
            victim.retired = True
            self.by_sid.pop(victim.sid, None)
            for s in list(self.by_sid.values()):
                if s.parent is victim and not s.live:
                    victim.waiting -= 1
                    self.attach(s, victim.origin)
            return
        self.attach(victim, victim.origin)
