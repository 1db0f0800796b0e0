"""The scheduler's batch policy: which sequences, and how many pending tokens of each, the next
forward runs, and the ``StepPlan`` that becomes; apart from ``kvcache.serving.scheduler`` (whose
docstring gives the rules, and whose ``Scheduler`` inherits it) to keep each module small."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .plan import SLOT, StepPlan
from .sequences import Seq

if TYPE_CHECKING:  # pragma: no cover
    from .protocols import SchedulerCache
    from .sequences import Sequences


class Batching:
    """``Scheduler``'s planning methods (``Scheduler.schedule`` calls them), over the
    scheduler's cache and sequences."""

    if TYPE_CHECKING:  # pragma: no cover: what they read of the Scheduler
        cache: SchedulerCache
        config: Any
        seqs: Sequences
        _head: Optional[Seq]

    def _choose(self):
        """The next forward's (seq, chunk) list with the head in it, preempting for the head
        when the free pages do not cover a token of it; None when no work is left."""
        while True:
            work = [s for s in self.seqs.by_sid.values() if s.pending > 0]
            if not work:
                return None
            is_decode = [s.live and s.kind == "sample" and s.pending == 1 for s in work]
            decodes = sorted((s for s, d in zip(work, is_decode) if d), key=lambda s: s.order)
            rest = sorted((s for s, d in zip(work, is_decode) if not d), key=lambda s: s.order)
            head = min(decodes[:1] + rest[:1], key=lambda s: s.order)
            while not self.seqs.ready(head):           # (a parent is older: this ends at once)
                assert head.parent is not None
                head = head.parent
            alone = not any(s.live and s is not head for s in self.seqs.by_sid.values())
            batch = self._fill(decodes, rest, head, force=alone)
            if batch is not None:
                self._head = head
                return batch
            self.seqs.preempt("no room for the oldest unfinished sequence", keep=head)

    def _room(self, s: Seq, free: int, budget: int) -> tuple:
        """``(start, tokens, pages)``: where ``s``'s next chunk starts, how many of its pending
        tokens (at most ``budget``) fit in ``free`` free pages, and the pages that chunk takes.
        A sequence in the cache asks the cache (``append_room`` / ``pages_needed``: its own
        last page, windows); one still to be admitted starts in fresh pages after what its
        admission takes (a restore, or the partial page a fork copies)."""
        if s.live:
            want = min(s.pending, budget)
            chunk = self.cache.append_room(s.sid, free, want)
            return s.cached, chunk, self.cache.pages_needed([s.sid], [chunk]) if chunk else 0
        ps = self.config.page_size
        restore = self.seqs.restore_pages(s)
        if restore is not None:                               # parked: restored, then run on
            start, taken = s.parked, restore
        elif self.seqs.shares(s):
            start = s.fork_pos
            taken = 1 if start % ps else 0                    # the fork copies a partial page
        elif self.config.prefix_cache:                        # from its cached prefix, which
            start, taken = self.cache.prefix_admission(self.seqs.known_ids(s))  # it then holds
        else:
            start, taken = 0, 0
        want = min(s.length - start, budget)
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
        admitted while the free pages cover them: the pages every group of the cache can give
        (``num_appendable_pages``: with window groups the most constrained group's)."""
        cfg = self.config
        budget, free = cfg.prefill_chunk_size, self.cache.num_appendable_pages
        # with State layers every sequence admitted takes a state slot: a forward admits no
        # more than are free, else an admission fails, preempts the one just admitted and
        # the same forward is planned again (a livelock); None: no state layers
        slots_free = (getattr(self.cache, "num_available_state_slots", 0)
                      if getattr(cfg, "state_layers", None) else None)
        head_decodes = bool(decodes) and decodes[0] is head
        slots = min(cfg.max_batch_size, budget) - (0 if head_decodes else 1)
        chunk = pages = 0
        if not head_decodes:
            own = budget - min(len(decodes), slots)
            start, chunk, pages = self._room(head, free, own)
            if slots_free is not None and not head.live:
                if slots_free == 0 and not force:
                    return None                 # preempt for the head's state slot
                slots_free -= 1
            if chunk <= 0:
                if not force:
                    return None
                chunk, pages = min(head.length - start, own), 0          # try anyway
            free -= pages
        batch = [(s, 1) for s in decodes[:slots]]
        if batch:                           # the cache counts the decodes' new pages
            free -= self.cache.pages_needed([s.sid for s, _ in batch], [1] * len(batch))
            budget -= len(batch)
        if not head_decodes:
            batch.append((head, chunk))
            budget -= chunk
            rest = rest[1:]
        reserve = len(decodes)              # a page per running decode for the steps to come
        sharing = _Sharing(self.seqs, cfg.page_size, batch) if cfg.prefix_cache else None
        for s in rest:
            if len(batch) == cfg.max_batch_size or budget == 0:
                break
            if not s.live and free <= reserve:
                continue                                      # no page to admit it with
            if not self.seqs.ready(s):
                continue
            if slots_free is not None and not s.live and slots_free <= 0:
                continue                                      # no state slot to admit it with
            start, chunk, pages = self._room(s, free - (0 if s.live else reserve), budget)
            if chunk <= 0:
                continue                                      # wait for pages to free up
            if sharing is not None and s.kind == "prompt" and not s.live and not s.parked:
                if sharing.defers(s, start):
                    continue                        # an older prompt computes its prefix
                sharing.add(s)
            batch.append((s, chunk))
            budget -= chunk
            free -= pages
            if slots_free is not None and not s.live:
                slots_free -= 1
        return batch

    def _pack(self, batch, sources: Optional[dict] = None) -> StepPlan:
        """The ``StepPlan`` of ``batch``'s (seq, chunk) pairs: the chunks' tokens packed, and a
        logit row for each sequence whose chunk reaches its end; no picks (``draws``) yet. A
        chunk that ends in a placeholder (``Seq.ahead``: an ``AsyncScheduler``'s pick still on
        its way, one at most: one step is in flight) packs it as ``SLOT`` at ``slot_dst``, its
        pick at ``slot_src``: the row ``sources[id(seq)]`` of the step in flight's picks."""
        ids: list = []
        lens: list = []
        toks: list = []
        pos: list = []
        rows: list = []
        wants: list = []
        dst: list = []
        src: list = []
        decode = True
        for seq, chunk in batch:
            tokens = seq.tokens
            known = len(tokens)
            length = known + seq.ahead
            start = seq.cached
            chunk = min(chunk, length - start)
            end = start + chunk
            ids.append(seq.sid)
            lens.append(chunk)
            if end > known:
                toks.extend(tokens[start:])
                dst.append(len(toks))
                src.append(sources[id(seq)])            # type: ignore[index]
                toks.append(SLOT)
            else:
                toks.extend(tokens[start:end])
            pos.extend(range(start, end))
            decode = decode and chunk == 1 and seq.kind == "sample"
            if end == length and seq.kind != "prefix":
                rows.append(len(toks) - 1)
                wants.append(seq)
        reqs = [s.req for s in wants]
        return StepPlan(ids, lens, toks, pos, rows, wants, dst, src, pipelined=False,
                        logprobs=any(r.wants_logprobs for r in reqs), decode=decode, batch=batch,
                        top_logprobs=max((r.top_logprobs for r in reqs), default=0))


class _Sharing:
    """In-batch prefix sharing through the prefix cache: a prompt still to be admitted waits
    while an older prompt in the cache or in this forward computes a whole page more of its
    prefix than the prefix cache holds now; once computed, those pages are in the prefix cache
    and the younger prompt starts from them (``prefix_admission``) instead of computing them
    again. The older prompt is planned first at every step (it is older), so a wait ends."""

    def __init__(self, seqs: Sequences, page_size: int, batch: list) -> None:
        self.seqs, self.ps, self.batch = seqs, page_size, batch
        self.by_page: Optional[dict] = None       # first page's tokens -> prompts; built lazily

    def add(self, seq: Seq) -> None:
        """``seq`` joins this forward (``_fill`` admits it): it may compute a shared prefix."""
        if self.by_page is not None and seq.kind == "prompt" and not seq.live:
            self._file(seq)

    def _file(self, seq: Seq) -> None:
        if len(seq.tokens) > self.ps and seq.cached < len(seq.tokens):
            self.by_page.setdefault(tuple(seq.tokens[:self.ps]), []).append(seq)  # type: ignore[union-attr]

    def defers(self, s: Seq, start: int) -> bool:
        """Whether ``s`` (not in the cache; its admission would start at ``start``) waits."""
        ps, toks = self.ps, s.tokens
        if len(toks) <= ps + start:
            return False                      # no whole page to gain before its last token
        if self.by_page is None:
            self.by_page = {}
            for seq in self.seqs.by_sid.values():
                if seq.kind == "prompt" and seq.live:
                    self._file(seq)
            for seq, _ in self.batch:
                self.add(seq)
        for o in self.by_page.get(tuple(toks[:ps]), ()):
            if o.order >= s.order:
                continue
            other = o.tokens
            m = min(len(other), len(toks) - 1)   # a match leaves the last token to compute
            n = ps
            while n < m and other[n] == toks[n]:
                n += 1
            whole = n - n % ps
            if whole > start and o.cached < whole:
                return True
        return False
