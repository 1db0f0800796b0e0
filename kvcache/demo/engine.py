"""A continuous-batching scheduler driving one ``PagedKVCache`` the way an inference engine does,
through the public API only.

Every step builds one forward: each running sequence that decodes appends one token (or its draft
tree level), and the remaining token budget (``prefill_chunk_size``) goes to prompt chunks, oldest
request first. New requests are admitted FIFO while their prompt fits in the free pages. When a
forward (or a fork) does not fit, the cache raises ``CacheFullError`` having reserved nothing; the
scheduler then preempts the youngest running request (removes its sequences; it restarts from
scratch later, as vLLM's recompute preemption does) and retries.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

import kvcache

from .model import BoundModel
from .workload import Request, Workload

PREFIX_SEQ_BASE = 1 << 30
MAX_SAMPLES = 8


class SchedulerError(RuntimeError):
    """The workload cannot make progress (a request larger than the whole cache)."""


@dataclass(eq=False)
class Seq:
    sid: int
    local: int                    # index in the owner's log (sample index; prefixes use 0)
    prefill: np.ndarray           # tokens to prefill
    stream: Optional[np.ndarray] = None   # generated tokens (requests only)
    done_prefill: int = 0
    generated: int = 0
    tree_level: int = -1          # >= 0 while a draft tree is being appended
    tree_size: int = 0            # uncommitted tree tokens in the cache
    finished: bool = False
    fork_pending: bool = False    # parallel samples wait for the prompt before forking


@dataclass
class RequestLog:
    """Every cache call that touched one request, for the replay check."""
    ops: list = field(default_factory=list)        # ("add"|"fork_prefix"|"window"|"fork"|"fwd"|"commit", ...)
    outputs: list = field(default_factory=list)    # per "fwd": per layer, the request's output rows


@dataclass(eq=False)
class Running:
    req: Request
    order: int                    # admission order (youngest = largest)
    seqs: list
    log: Optional[RequestLog] = None


@dataclass
class PrefixState:
    key: str
    sid: int
    seq: Optional[Seq] = None
    ready: bool = False
    users: int = 0                # unfinished requests that need it


@dataclass
class StepStats:
    step: int
    batch: int
    tokens: int
    pages_used: int
    preemptions: int
    begin_forward_us: float


class Engine:
    def __init__(self, name: str, cache: kvcache.PagedKVCache, model: BoundModel,
                 workload: Workload, requests: list, *, check_rids=(), max_extra_checks: int = 4,
                 tamper: Optional[Callable] = None, watermark_pages: int = 2):
        self.name, self.cache, self.model, self.workload = name, cache, model, workload
        self.cfg = cache.config
        self.pending = sorted(requests, key=lambda r: (r.arrival, r.rid))   # not yet arrived
        self.waiting: list = []           # arrived, not running
        self.running: list = []           # admitted
        self.finished: list = []
        self.total = len(requests)
        self.check_rids = set(check_rids)
        self.max_extra_checks = max_extra_checks
        self._live: set = set()
        self.tamper = tamper
        self.watermark = watermark_pages
        self.logs: dict = {}              # rid -> RequestLog of its last (successful) run
        self.prefixes: dict = {}
        for r in requests:
            for p in workload.prefix_chain(r.prefix):
                st = self.prefixes.setdefault(p.key, PrefixState(p.key, PREFIX_SEQ_BASE + len(self.prefixes)))
                st.users += 1
        self.order = 0
        self.prefix_evictions = 0
        self.admission_paused = False
        self.preemptions = 0
        self.preempted_rids: set = set()
        self.tokens_prefilled = 0
        self.tokens_decoded = 0
        self.peak_pages = 0
        self.history: list = []
        self.begin_times: list = []
        self.busy_s = 0.0

    # ------------------------------------------------------------------ bookkeeping
    @property
    def done(self) -> bool:
        return len(self.finished) == self.total

    def describe_stuck(self) -> str:
        head = ""
        if self.waiting:
            r = self.waiting[0]
            tokens = self.workload.prefix_length(r.prefix) + len(r.prompt)
            head = (f"; the next request ({r.rid}) needs {self._pages(tokens)} pages for its "
                    f"{tokens}-token prompt{' (with its prefix)' if r.prefix else ''}")
        return (f"[{self.name} cache] {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.cache.num_available_pages} of {self.cache.num_total_pages} pages free{head}: "
                f"a request needs more pages than the cache holds (raise --max-total-tokens)")

    def next_arrival(self) -> Optional[int]:
        return self.pending[0].arrival if self.pending else None

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.cfg.page_size)

    def _log(self, run: Running, *op) -> None:
        if run.log is not None:
            run.log.ops.append(op)

    # ------------------------------------------------------------------ preemption
    def _preempt_youngest(self, why: str) -> Running:
        victims = [r for r in self.running]
        if not victims:
            raise SchedulerError(f"[{self.name}] {why}, and no running request is left to preempt: "
                                 f"a request needs more pages than the cache holds")
        victim = max(victims, key=lambda r: r.order)
        for s in victim.seqs:
            if s.sid in self._live:
                self.cache.remove_sequence(s.sid)
                self._live.discard(s.sid)
        self.running.remove(victim)
        self.waiting.append(victim.req)
        self.waiting.sort(key=lambda r: (r.arrival, r.rid))
        self.preemptions += 1
        self.admission_paused = True
        self.preempted_rids.add(victim.req.rid)
        return victim

    def _with_preemption(self, what: str, fn: Callable[[], object], owner: Optional[Running] = None):
        """Run a cache call; on CacheFullError preempt the youngest request and retry. Returns
        False if ``owner`` itself was preempted."""
        while True:
            try:
                fn()
                return True
            except kvcache.CacheFullError as exc:
                victim = self._preempt_youngest(f"{what} failed ({exc})")
                if victim is owner:
                    return False

    def _record(self, req: Request) -> bool:
        """Log this run of ``req`` for the replay check: the sampled requests, plus (up to a cap)
        requests that were preempted, whose final run is then checked."""
        if req.rid in self.check_rids:
            return True
        if req.rid in self.preempted_rids and self.max_extra_checks > 0:
            self.max_extra_checks -= 1
            self.check_rids.add(req.rid)
            return True
        return False

    # ------------------------------------------------------------------ admission
    def _admit(self, now: int) -> None:
        while self.pending and self.pending[0].arrival <= now:
            self.waiting.append(self.pending.pop(0))
        self.waiting.sort(key=lambda r: (r.arrival, r.rid))
        while self.waiting:
            req = self.waiting[0]
            seqs_now = sum(1 for r in self.running for s in r.seqs if not s.finished)
            building = sum(1 for p in self.prefixes.values() if p.seq is not None and not p.ready)
            if seqs_now + building + req.n_samples > self.cfg.max_batch_size:
                return
            if req.prefix is not None and not self._prefix_ready(req.prefix):
                st = self.prefixes[req.prefix]
                if not self.running and st.seq is None and self._evict_prefixes(keep=req.prefix):
                    continue
                return                        # FIFO: wait for the shared prefix
            # admit while the whole prompt fits in the free pages (as vLLM's v0 scheduler). The
            # pages are taken chunk by chunk, so prompts admitted together, plus the decodes, may
            # not fit later: then the youngest request is preempted, and nothing is admitted
            # until a request finishes (no thrashing)
            if self.admission_paused and self.running:
                return
            need = self._pages(self._prompt_tokens(req, len(req.prompt))) + 1 + self.watermark
            if self.cache.num_available_pages < need:
                if not self.running and self._evict_prefixes(keep=req.prefix):
                    continue
                return
            base = req.rid * MAX_SAMPLES
            main = Seq(base, 0, req.prompt, req.outputs[0])
            seqs = [main] + [Seq(base + j, j, req.prompt[:0], req.outputs[j], fork_pending=True)
                             for j in range(1, req.n_samples)]
            log = RequestLog() if self._record(req) else None
            run = Running(req, self.order, seqs, log)
            try:
                if req.prefix is not None:
                    self.cache.fork_sequence(self.prefixes[req.prefix].sid, main.sid)
                else:
                    self.cache.add_sequence(main.sid)
            except kvcache.CacheFullError:
                return                        # the fork copies a partial page: wait for room
            self._live.add(main.sid)
            self._log(run, "fork_prefix" if req.prefix else "add", 0, req.prefix)
            if req.window is not None:
                self.cache.enable_sliding_window(main.sid, *req.window)
                self._log(run, "window", 0, req.window)
            self.waiting.pop(0)
            self.order += 1
            self.running.append(run)
            if log is not None:
                self.logs[req.rid] = log      # replaces the log of a preempted earlier run

    def _prompt_tokens(self, req: Request, tokens: int) -> int:
        """Tokens of a prompt that will be held at once (a sliding window holds at most its
        window plus one chunk)."""
        if req.window is None:
            return tokens
        return min(tokens, req.window[0] + self.cfg.prefill_chunk_size)

    def _prefix_ready(self, key: str) -> bool:
        """Whether prefix ``key`` is built; starts building it (and its parents) if not."""
        st = self.prefixes[key]
        if st.ready:
            return True
        if st.seq is not None:
            return False
        p = self.workload.prefixes[key]
        if p.parent is not None and not self._prefix_ready(p.parent):
            return False
        if self.cache.num_available_pages < self._pages(len(p.tokens)) + 1 + self.watermark:
            return False
        try:
            if p.parent is None:
                self.cache.add_sequence(st.sid)
            else:
                self.cache.fork_sequence(self.prefixes[p.parent].sid, st.sid)
        except kvcache.CacheFullError:
            return False
        self._live.add(st.sid)
        st.seq = Seq(st.sid, 0, p.tokens)
        return False

    def _evict_prefixes(self, keep) -> bool:
        """Drop built prefixes that no running request uses and ``keep`` does not need (like a
        prefix cache evicting under pressure; they are rebuilt when needed). Whether any was."""
        needed = {p.key for p in self.workload.prefix_chain(keep)}
        for run in self.running:
            needed |= {p.key for p in self.workload.prefix_chain(run.req.prefix)}
        evicted = False
        for st in self.prefixes.values():
            if st.seq is not None and st.ready and st.key not in needed:
                self.cache.remove_sequence(st.sid)
                self._live.discard(st.sid)
                st.seq, st.ready = None, False
                self.prefix_evictions += 1
                evicted = True
        return evicted

    def _release_prefixes(self, req: Request) -> None:
        for p in reversed(self.workload.prefix_chain(req.prefix)):
            st = self.prefixes[p.key]
            st.users -= 1
            if st.users == 0 and st.seq is not None:
                self.cache.remove_sequence(st.sid)
                self._live.discard(st.sid)
                st.seq, st.ready = None, False

    # ------------------------------------------------------------------ one step
    def step(self, now: int) -> bool:
        """Admit, schedule and run one forward. Returns whether a forward ran."""
        t0 = time.perf_counter()
        try:
            return self._step(now)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _pending_forks(self) -> None:
        for run in list(self.running):
            main = run.seqs[0]
            for s in run.seqs[1:]:
                if not s.fork_pending or main.done_prefill < len(main.prefill):
                    continue
                if run not in self.running:
                    break
                def fork(s=s) -> None:
                    self.cache.fork_sequence(main.sid, s.sid)
                ok = self._with_preemption(
                    f"forking sample {s.local} of request {run.req.rid}", fork, owner=run)
                if not ok:
                    break
                self._live.add(s.sid)
                s.fork_pending = False
                s.generated = 1               # the prompt's last chunk sampled its first token
                self._log(run, "fork", 0, s.local)

    def _step(self, now: int) -> bool:
        self._pending_forks()
        self._admit(now)
        entries = self._schedule()
        while not entries and self.running and any(
                s.done_prefill < len(s.prefill) for r in self.running for s in r.seqs):
            # every admitted prompt waits for pages that only a preemption can free
            self._preempt_youngest("no prompt chunk fits in the free pages")
            entries = self._schedule()
        if not entries:
            return False
        # begin_forward; on CacheFullError shrink the prompt chunks or preempt, and retry
        while True:
            ids = [e[0].sid for e in entries]
            lens = [len(e[1]) for e in entries]
            tree = any(e[2] is not None for e in entries)
            ptr: Optional[list] = None
            if tree:
                ptr = []
                for s, toks, p in entries:
                    # a sequence without a draft tree joins as a chain (its tokens in order)
                    ptr.extend(p if p is not None else [-1] + list(range(s.tree_size, s.tree_size + len(toks) - 1)))
            try:
                t0 = time.perf_counter()
                self.cache.begin_forward(ids, lens, ptr)
                self.begin_times.append(time.perf_counter() - t0)
                break
            except kvcache.CacheFullError as exc:
                # prompt chunks are optional work: shrink the last one first (halve it, drop it);
                # preempt only when the decodes themselves do not fit
                prefill = [i for i, e in enumerate(entries) if e[0].done_prefill < len(e[0].prefill)]
                if prefill:
                    i = prefill[-1]
                    s, toks, p = entries[i]
                    if len(toks) > self.cfg.page_size:
                        entries[i] = (s, toks[:len(toks) // 2], p)
                    else:
                        del entries[i]
                    if entries:
                        continue
                victim = self._preempt_youngest(f"begin_forward of {sum(lens)} tokens failed ({exc})")
                entries = [e for e in entries if all(e[0] is not s for s in victim.seqs)] or self._schedule()
                if not entries:
                    return False
        self.peak_pages = max(self.peak_pages, self.cache.num_total_pages - self.cache.num_available_pages)
        owners = self._owners()
        tokens = np.concatenate([e[1] for e in entries])
        handle = self.model.tokens(tokens)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        # rows of each recorded request, in entry order
        rec_rows: dict = {}
        for i, (s, toks, p) in enumerate(entries):
            run = owners.get(s.sid)
            if run is not None and run.log is not None:
                rec_rows.setdefault(id(run), (run, []))[1].append(np.arange(offsets[i], offsets[i + 1]))
        rec_out: dict = {k: [] for k in rec_rows}
        out = None
        for layer in range(self.cfg.num_layers):
            out = self.cache.attention_with_fused_qkv(layer, self.model.qkv(handle, layer))
            if self.tamper is not None:
                out = self.tamper(self, layer, entries, out)
            for key, (run, rows) in rec_rows.items():
                rec_out[key].append(self.model.rows(out, np.concatenate(rows)))
        # "the sampler": read back the last layer's output of each sequence's last new token
        kvcache.to_numpy(self.model.rows(out, offsets[1:] - 1))
        self.cache.end_forward()
        for key, (run, rows) in rec_rows.items():
            run.log.ops.append(("fwd", [(s.local, toks.copy(), None if ptr is None else
                                         list(ptr[offsets[i]:offsets[i + 1]]))
                                        for i, (s, toks, p) in enumerate(entries)
                                        if owners.get(s.sid) is run], ptr is not None))
            run.log.outputs.append(rec_out[key])
        self._advance(entries, owners, ptr is not None)
        pages_used = self.cache.num_total_pages - self.cache.num_available_pages
        self.history.append(StepStats(now, len(entries), int(sum(lens)), pages_used,
                                      self.preemptions, self.begin_times[-1] * 1e6))
        return True

    def _owners(self) -> dict:
        return {s.sid: run for run in self.running for s in run.seqs}

    def _schedule(self) -> list:
        """[(seq, tokens, tree parent ptr or None)] for this step's forward."""
        budget = self.cfg.prefill_chunk_size
        entries: list[tuple[Any, Any, Optional[list]]] = []     # (sequence, tokens, tree parents)
        limit = self.cfg.max_batch_size
        for run in sorted(self.running, key=lambda r: r.order):
            for s in run.seqs:
                if s.finished or s.fork_pending or s.done_prefill < len(s.prefill):
                    continue
                spec = run.req.spec
                if s.local == 0 and spec is not None and (
                        s.tree_level >= 0 or (s.tree_level == -1 and s.generated == spec.at)):
                    level = max(s.tree_level, 0)
                    ptr = spec.levels[level]
                    lo = sum(len(x) for x in spec.levels[:level])
                    toks = spec.node_tokens(s.stream, spec.at)[lo:lo + len(ptr)]
                    entries.append((s, toks, list(ptr)))
                else:
                    entries.append((s, s.stream[s.generated - 1:s.generated], None))
                budget -= len(entries[-1][1])
        # prompt chunks: prefixes being built first, then requests in admission order
        prefill = [st.seq for st in self.prefixes.values() if st.seq is not None and not st.ready]
        prefill += [s for run in sorted(self.running, key=lambda r: r.order) for s in run.seqs
                    if not s.fork_pending and s.done_prefill < len(s.prefill)]
        # pages for prompt chunks: what is free, less a reserve so the decodes can grow
        pages = self.cache.num_available_pages - self.watermark - len(entries)
        for s in prefill:
            if budget <= 0 or len(entries) >= limit or pages < 2:
                break
            n = min(budget, len(s.prefill) - s.done_prefill, (pages - 1) * self.cfg.page_size)
            entries.append((s, s.prefill[s.done_prefill:s.done_prefill + n], None))
            budget -= n
            pages -= self._pages(n) + 1
        return entries[:limit]

    def _advance(self, entries, owners, tree_forward: bool) -> None:
        commits = []
        for s, toks, ptr in entries:
            run = owners.get(s.sid)
            n = len(toks)
            if s.done_prefill < len(s.prefill):
                s.done_prefill += n
                self.tokens_prefilled += n
                if s.done_prefill == len(s.prefill):
                    if run is None:               # a shared prefix is built
                        self.prefixes[self._prefix_key(s.sid)].ready = True
                    else:
                        s.generated = 1           # the last prompt chunk samples the first token
                if tree_forward:
                    s.tree_size += n
                    commits.append((s, s.tree_size - 1, run))
                continue
            self.tokens_decoded += n
            if ptr is not None:                   # a draft tree level
                spec = run.req.spec
                s.tree_level = max(s.tree_level, 0) + 1
                s.tree_size += n
                if s.tree_level == len(spec.levels):
                    commits.append((s, spec.leaf, run))
                continue
            s.generated += 1
            if tree_forward:
                s.tree_size += n
                commits.append((s, s.tree_size - 1, run))
        if commits:
            self.cache.commit_accepted_token_tree_nodes([c[0].sid for c in commits],
                                                        [c[1] for c in commits])
            by_run: dict = {}
            for s, leaf, run in commits:
                if run is not None:
                    by_run.setdefault(id(run), (run, []))[1].append((s.local, leaf))
                if s.tree_level >= 0:             # a finished draft tree: accept the path
                    s.generated += run.req.spec.accepted
                    s.tree_level = -2             # one round per request
                s.tree_size = 0
            for run, items in by_run.values():
                self._log(run, "commit", items)
        for run in list(self.running):
            for s in run.seqs:
                if not s.finished and not s.fork_pending and s.generated >= run.req.output_len:
                    s.finished = True         # free its pages now (shared ones stay for others)
                    self.cache.remove_sequence(s.sid)
                    self._live.discard(s.sid)
            if all(s.finished for s in run.seqs):
                self.running.remove(run)
                self.finished.append(run.req)
                self.admission_paused = False
                self._release_prefixes(run.req)

    def _prefix_key(self, sid: int) -> str:
        return next(k for k, st in self.prefixes.items() if st.sid == sid)
