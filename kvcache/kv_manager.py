"""``KVManager``: the host-only part of a cache that a scheduler talks to: sequences (add,
fork, pop, remove, windows, tree commits), the prefix cache's index, and the page questions
("is there room": ``pages_needed``, ``append_room``, ``num_available_pages``).

It knows no array and no device: where a call must move K/V (a fork's or a pop's partial page,
a tree commit's compaction) it returns the copies, or takes the device step as an argument,
and ``PagedKVCache`` runs it on the backend. Validation first, then changes: a call that
raises has changed nothing."""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Optional, Union

import numpy as np

from .core.prefix import Ghost, PrefixIndex, Prompt
from .core.slots import ZEROS
from .core.validate import bool_arg, int_arg, int_values, seq_id_arg
from .errors import (CacheFullError, InvalidArgumentError, SequenceExistsError,
                     UnsupportedFeatureError)
from .errors import pages as n_pages


class KVManager:
    """Sequences and pages of one cache, on the host.

    ``config``: the ``CacheConfig``; ``state``: the core's ``CacheState`` (sequences and page
    table); ``planner``: the ``Planner`` whose page counts ``begin_forward`` reserves with.
    ``prefix``: the prefix cache with ``CacheConfig(prefix_cache=True)`` (a ``PrefixIndex``,
    used through ``BasePrefixCache``'s ``match`` / ``insert`` / ``release`` / ``evict`` and the
    sequence hooks ``attach`` / ``extend`` / ``forked`` / ``detach`` / ``truncated`` /
    ``retire``), else None."""

    def __init__(self, config, state, planner) -> None:
        self.config, self.state, self.planner = config, state, planner
        self.prefix: Optional[PrefixIndex] = PrefixIndex(state) if config.prefix_cache else None

    # ------------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: int, tokens: Optional[Sequence[int]] = None, *,
                     extra_key: Any = None) -> int:
        """Add sequence ``seq_id`` (an int in the int64 range, numpy ints too); returns its
        length: 0, or with the prefix cache the cached prefix it starts from.

        ``tokens``: the token ids of the sequence's positions as far as known (e.g. the
        prompt), ints >= 0. With ``CacheConfig(prefix_cache=True)`` the sequence starts holding
        the longest cached prefix of ``tokens`` in whole pages, at most ``len(tokens) - 1``
        tokens (the last one is left for the model to compute: its logits are the next pick),
        shared with the sequences that hold it; the ids are recorded, and each full page whose
        KV the sequence then computes joins the index. Without the prefix cache they are
        checked and ignored. ``extra_key``: any hashable value that must also match (e.g. a
        LoRA adapter id); None: none. A new sequence without a cached prefix takes no page
        until a forward appends to it.
        In a cache with ``State`` layers the sequence takes a state slot, its states zeros
        (``get_state``), until ``remove_sequence``.
        Raises SequenceExistsError if the id is in the cache, InvalidArgumentError for an id
        that is not such an int (a bool or a float neither), bad token ids or an unhashable
        ``extra_key``, ForwardStateError inside a forward, CacheFullError naming
        ``CacheConfig.max_state_slots`` when every state slot is held; nothing changes then."""
        if tokens is None:
            if extra_key is not None:
                raise InvalidArgumentError(
                    f"add_sequence({seq_id!r:.40}): extra_key is matched with tokens; pass tokens too")
            self.state.add_sequence(seq_id)
            return 0
        sid = seq_id_arg(seq_id)
        ids = token_ids(tokens, f"add_sequence: sequence {sid}: tokens")
        if extra_key is not None:
            _hashable(extra_key, f"add_sequence: sequence {sid}: extra_key")
        if sid in self.state.pt.seqs:
            raise SequenceExistsError(f"sequence {sid} is already in the cache")
        if self.prefix is None:
            self.state.add_sequence(sid)
            return 0
        if self.state.slots is not None:
            self.state.slots.check_take(f"add_sequence({sid})")
        return self.prefix.attach(sid, ids, extra_key)

    def match_prefix(self, tokens: Sequence[int], extra_key: Any = None) -> int:
        """The length ``add_sequence(seq_id, tokens, extra_key=extra_key)`` would start from
        now: the longest cached prefix of ``tokens`` in whole pages, at most ``len(tokens) -
        1`` (0 without ``CacheConfig(prefix_cache=True)``). Changes nothing (not even the
        least-recently-used order). Raises InvalidArgumentError for bad ids or key."""
        return self._admission(tokens, extra_key, "match_prefix")[0]

    def prefix_admission(self, tokens: Sequence[int], extra_key: Any = None) -> tuple[int, int]:
        """``(start, pages)``: the length ``add_sequence(seq_id, tokens, extra_key=extra_key)``
        would start from now (``match_prefix``), and how many of ``num_available_pages`` that
        takes (cached pages the new sequence would hold; pages other sequences hold already
        are not available anyway). A scheduler admits a request with it: its first chunk then
        needs ``pages_needed`` after those. ``(0, 0)`` without the prefix cache. Changes
        nothing."""
        return self._admission(tokens, extra_key, "prefix_admission")

    def _admission(self, tokens, extra_key, what: str) -> tuple[int, int]:
        ids = token_ids(tokens, f"{what}: tokens")
        if extra_key is not None:
            _hashable(extra_key, f"{what}: extra_key")
        if self.prefix is None:
            return 0, 0
        return self.prefix.match(ids, extra_key)

    def extend_tokens(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Record the token ids of sequence ``seq_id``'s next positions, after the ones already
        recorded (``add_sequence``'s ``tokens``, earlier calls): e.g. the tokens a request
        generated, before removing it, so that a next turn of the conversation finds them
        cached. Full pages whose ids and KV are both there join the index (at once, and after
        each forward). Ids of positions a sequence pops (``popn``) are forgotten; a sequence
        with a sliding window or an uncommitted token tree is indexed only once committed
        and unwindowed (never, for a window). No-op without ``CacheConfig(prefix_cache=True)``
        (the ids are still checked). Raises SequenceNotFoundError, InvalidArgumentError for bad
        ids, ForwardStateError inside a forward; nothing changes then."""
        seq = self.state.seq(seq_id)
        ids = token_ids(tokens, f"extend_tokens: sequence {seq.seq_id}: tokens")
        if self.prefix is not None and len(ids):
            self.prefix.extend(seq, ids)

    def remove_sequence(self, seq_id: int) -> None:
        """Drop sequence ``seq_id`` and free the pages only it holds (pages shared with a fork
        stay with the other sequences). Raises SequenceNotFoundError for an id not in the cache,
        ForwardStateError inside a forward; nothing changes then."""
        seq = self.state.seq(seq_id)
        if self.prefix is not None and self.prefix.retire(seq):
            return                  # its indexed pages stay cached, held by a ghost
        self.state.remove_sequence(seq_id)

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> list:
        """Add sequence ``child_id`` holding the first ``fork_pos`` tokens of ``parent_id``
        (-1: all of them). Whole pages are shared, not copied; a partial last page is copied.
        Raises SequenceNotFoundError / SequenceExistsError for the ids, InvalidArgumentError
        for ``fork_pos`` outside [0, length] (or beyond a windowed parent's sinks),
        ForwardStateError inside a forward or on an uncommitted token tree, CacheFullError
        when a partial page must be copied and no page is free; nothing changes then.
        In a cache with ``State`` layers the child takes a state slot holding a copy of the
        parent's states (CacheFullError when none is free), and a ``fork_pos`` below the
        parent's length is refused (UnsupportedFeatureError: a state holds no earlier
        position). Returns the page copies for the device (``PagedKVCache`` runs them)."""
        copies = self.with_room(lambda: self.state.fork_sequence(parent_id, child_id, fork_pos),
                                lambda: 1 - self.state.pt.num_free)
        if self.prefix is not None:
            child = self.state.seq(child_id)
            self.prefix.forked(self.state.seq(parent_id), child, self.state.length(child_id))
        return copies

    def popn(self, seq_id: int, n: int) -> list:
        """Remove the last ``n`` tokens of sequence ``seq_id`` (``0 <= n <= length``; sinks of
        a sliding window included): pages left empty are freed; when the new end lies in a
        page shared with a fork, that partial page is copied first, so the other sequence keeps
        its tokens. Raises SequenceNotFoundError, InvalidArgumentError for ``n`` outside
        [0, length], ForwardStateError inside a forward or on an uncommitted token tree,
        CacheFullError when a partial page must be copied and no page is free; nothing
        changes then. Returns the page copies for the device.
        In a cache with ``State`` layers the sequence's states must be known at the new end:
        at 0 (the slot goes back to zeros) or at a page boundary whose state checkpoint the
        prefix cache holds on the sequence's own prefix (the slot takes it); any other ``n >
        0`` raises UnsupportedFeatureError naming the position (a state cannot be rewound)."""
        slots = self.state.slots
        rewind = None
        if slots is not None and n:                # refused before the ghost is made
            try:                                   # the arguments' errors first
                seq, count = self.state.check_popn(seq_id, n)
            except CacheFullError:                 # eviction may make room: popn says
                seq, count = self.state.seq(seq_id), int(n)
            if count:
                rewind = self._rewind_to(seq, self.state.pt.length(seq) - count,
                                         f"popn({seq.seq_id}, {count})")
        if self.prefix is not None:                # the pages it pops stay cached
            try:
                seq, count = self.state.check_popn(seq_id, n)
            except CacheFullError:              # eviction may make room: popn says
                seq, count = self.state.seq(seq_id), int(n)
            if self.state.pt.groups is not None:    # a popn below a window is refused
                try:                                # before the ghost is made
                    self.state.pt.groups.check_popn(seq.seq_id, self.state.pt.length(seq), count)
                except CacheFullError:
                    pass
            self.prefix.detach(seq, (int(self.state.pt.s_len[seq.slot]) - count) // self.config.page_size)
        copies = self.with_room(lambda: self.state.popn(seq_id, n, rewind is not None),
                                lambda: 1 - self.state.pt.num_free)
        if self.prefix is not None:
            self.prefix.truncated(self.state.seq(seq_id))
        if rewind is not None:                     # the cache copies it into the slot
            slots.restore[self.state.seq(seq_id).seq_id] = rewind
        return copies

    def _rewind_to(self, seq, at: int, what: str) -> int:
        """The states of ``seq`` at position ``at``: ``slots.ZEROS`` at 0, else the checkpoint
        row the prefix cache holds at that page boundary of its prefix; UnsupportedFeatureError
        (``refuse_rewind``) where there is none."""
        if at == 0:
            return ZEROS
        ps = self.config.page_size
        ck = -1 if self.prefix is None or at % ps else self.prefix.checkpoint_at(seq, at // ps)
        if ck < 0:
            self.state.slots.refuse_rewind(what, at)
        return ck

    def enable_sliding_window(self, seq_id: int, window_size: int, sink_size: int) -> None:
        """Give sequence ``seq_id`` a sliding window (eviction): after each forward it keeps its
        first ``sink_size`` tokens (the attention sinks) and its last ``window_size -
        sink_size``; whole pages between the two are freed, and RoPE is applied inside attention
        at the positions within the kept tokens. Needs ``CacheConfig(support_sliding_window=True)``.

        ``window_size``: an int > 0, the tokens kept; ``sink_size``: an int in
        [0, window_size). Pages shared with another sequence never slide out, so ``sink_size``
        must cover the prefix the sequence shares with a fork. Raises SequenceNotFoundError,
        InvalidArgumentError (a cache without sliding-window support, bad sizes, a window
        already set, a shared prefix longer than ``sink_size``), ForwardStateError inside a
        forward or on an uncommitted token tree, UnsupportedFeatureError in a cache with
        window groups (not composed with them yet); nothing changes then."""
        if self.state.pt.groups is not None:
            raise UnsupportedFeatureError(
                f"enable_sliding_window on sequence {seq_id!r:.40} in a cache with window groups "
                f"(CacheConfig.layer_kinds): not composed with window groups yet (docs/hybrid.md)")
        self.state.enable_sliding_window(seq_id, window_size, sink_size)
        if self.prefix is not None:            # its pages will slide: their entries go
            self.prefix.release(self.state.seq(seq_id))

    def commit_accepted_token_tree_nodes(self, seq_ids: Sequence[int],
                                         leaf_indices: Sequence[int],
                                         compact: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Accept one path of each sequence's uncommitted token tree (speculative decoding):
        the accepted nodes' K/V rows move right after the committed history (``compact(src,
        dst)``, host int32 slot arrays, when any row moves: the cache's one
        ``Backend.compact_kv`` launch), every other tree token is dropped, and the sequences
        are committed (they can be forked, popped, exported and windowed again).

        ``seq_ids``: B distinct ids of sequences in the cache; ``leaf_indices``: B ints, the
        accepted leaf of each as an index into that sequence's uncommitted tree (all tree
        tokens appended since its last commit, in ``token_tree_parent_ptr`` order): the path
        from the root to that node is kept; -1 keeps none of the tree. Raises
        SequenceNotFoundError, InvalidArgumentError (lengths differ, a sequence listed twice,
        a leaf outside [-1, tree size)), ForwardStateError inside a forward; nothing changes
        then."""
        items = self.state.check_commit(seq_ids, leaf_indices)
        src, dst = self.state.commit_plan(items)
        bases = [self.state.pt.length(seq) - len(seq.tree_parent) for seq, _ in items]
        if len(src):
            compact(src, dst)
        self.state.commit(items)
        if self.prefix is not None:
            for (seq, _), base in zip(items, bases):    # ids recorded past the tree's
                self.prefix.truncated(seq, base)           # root are not the accepted ones
                self.prefix.insert(seq)

    def forward_committed(self, plan) -> None:
        """After ``end_forward`` of ``plan``: full pages whose ids are recorded join the prefix
        index, then each window group frees the pages of the forward's sequences that fell
        below its window (in that order: the new nodes first take the window pages a later
        sequence attached at their boundaries reads, so sliding does not free them)."""
        pt = self.state.pt
        if self.prefix is not None:
            seqs, ps = pt.seqs, self.config.page_size
            for sid in plan.seq_ids:
                seq = seqs[int(sid)]
                t = seq.prefix              # most decode steps complete no recorded page
                if t is not None and len(t.tokens) >= (len(t.chain) + 1) * ps:
                    self.prefix.insert(seq)
        if pt.groups is not None:
            seqs = pt.seqs
            pt.groups.commit(plan.seq_ids, [int(pt.s_len[seqs[int(s)].slot])
                                            for s in plan.seq_ids])

    def checkpoint_positions(self, plan) -> list:
        """With state checkpoints (``CacheConfig.num_state_checkpoints``): the boundaries the
        open forward ``plan`` passes whose states would be kept, ``(row, position)`` pairs
        (``row``: the sequence's index in ``plan.seq_ids``; the states after ``position``
        tokens); empty otherwise. Changes nothing."""
        if self.prefix is None or self.prefix.ckpts is None:
            return []
        pt = self.state.pt
        seqs = [pt.seqs[int(s)] for s in plan.seq_ids]
        lengths = pt.s_len[[s.slot for s in seqs]]
        return self.prefix.checkpoint_positions(seqs, lengths, plan.append_lengths)

    def keep_checkpoints(self, plan, wanted: list) -> list:
        """After ``forward_committed(plan)``: the index nodes of the boundaries ``wanted``
        (``checkpoint_positions(plan)``) that hold no checkpoint take a checkpoint row;
        returns ``(index into wanted, row)`` of each, for the device to write."""
        if not wanted:
            return []
        pt = self.state.pt
        assert self.prefix is not None          # (wanted only with the prefix cache)
        return self.prefix.keep_checkpoints([pt.seqs[int(s)] for s in plan.seq_ids], wanted)

    def drop_checkpoints(self, rows: list) -> None:
        """Checkpoint rows ``keep_checkpoints`` gave that will not be written: their nodes let
        go of them."""
        ckpts = None if self.prefix is None else self.prefix.ckpts
        assert ckpts is not None
        for row in rows:
            ckpts.drop(ckpts.held[row])

    def clear(self) -> None:
        """Drop every sequence, free every page and forget the prefix index."""
        self.state.clear()
        if self.prefix is not None:
            self.prefix = PrefixIndex(self.state)

    # ------------------------------------------------------------------ prefix cache
    @property
    def num_cached_pages(self) -> int:
        """Pages that only the prefix cache holds (no sequence reads them): part of
        ``num_available_pages``, evicted least recently used when a call needs pages. 0
        without ``CacheConfig(prefix_cache=True)``."""
        return 0 if self.prefix is None else self.prefix.evictable()

    @property
    def prefix_miss_tokens_by_reason(self) -> dict:
        """Tokens of cached full pages that sequences added with ``tokens`` did not start
        from, by reason, since the cache was built or cleared: ``{"window": n}`` in a cache
        with window groups and the prefix cache (a window group's pages for that boundary
        were reclaimed, docs/hybrid.md), ``"checkpoint": n`` with ``State`` layers and the
        prefix cache (no state checkpoint held at a boundary past the match: none was saved
        there, or it was dropped for room), else ``{}``. A hit rate that reads low says why."""
        if self.prefix is None:
            return {}
        out = {}
        if self.state.pt.groups is not None:
            out["window"] = self.prefix.window_miss_tokens
        if self.prefix.ckpts is not None:
            out["checkpoint"] = self.prefix.checkpoint_miss_tokens
        return out

    def clear_prefix_cache(self) -> int:
        """Evict every cached page that no sequence reads (e.g. after the model's weights
        changed: cached KV would be stale) and forget it; returns the pages freed, all of
        ``num_cached_pages``. Raises ForwardStateError inside a forward."""
        return 0 if self.prefix is None else self.prefix.clear()

    def prefix_chains(self, prefixes: Optional[Sequence] = None, extra_key: Any = None) -> list:
        """What saving the prefix cache writes (``kvcache.prefix_files``): the indexed
        prefixes as chains, parents first, each a ``PrefixChain``. ``prefixes``: None for every
        cached prefix, or token id lists (conversations: a prompt and what followed it) whose
        longest cached prefixes, whole pages, under ``extra_key`` are wanted. Raises
        InvalidArgumentError without the prefix cache or for bad ids; changes nothing."""
        prefix = self._prefix_on("saving the prefix cache")
        tips = None
        if prefixes is not None:
            if isinstance(prefixes, (str, bytes)) or not isinstance(prefixes, Sequence):
                raise InvalidArgumentError(
                    f"prefixes must be None or a list of token id lists, got "
                    f"{type(prefixes).__name__}")
            if extra_key is not None:
                _hashable(extra_key, "extra_key")
            tips = []
            for i, tokens in enumerate(prefixes):
                ids = token_ids(tokens, f"prefixes[{i}]")
                # one id more: find leaves one token uncached, and every full page is wanted
                node = prefix.find(Prompt(ids.raw + bytes(8)), extra_key)
                if node is not None:
                    tips.append(node)
        ps = self.config.page_size
        out = []
        for tip, base, parent in prefix.chains(tips):
            out.append(PrefixChain(prefix.holder_key(tip), base * ps, tip.depth * ps,
                                   tip.src[:tip.depth * ps * 8], tip.extra, parent))
        return out

    def cache_imported(self, seq_ids: Sequence[int], tokens: Sequence, extra_keys: Sequence) -> int:
        """Sequences ``seq_ids`` (imported, with no ids recorded; a later one may be a fork of
        an earlier one) become cached pages: each records ``tokens[i]``, the ids of all its
        positions, under ``extra_keys[i]``, its full pages join the prefix index, and it is
        removed (its indexed pages stay cached, evictable, least recently used last; pages the
        index held already are freed). Checks every argument first (InvalidArgumentError,
        SequenceNotFoundError); returns the pages the index gained."""
        prefix = self._prefix_on("loading the prefix cache")
        seqs = [self.state.seq(s) for s in seq_ids]
        if len(tokens) != len(seqs) or len(extra_keys) != len(seqs):
            raise InvalidArgumentError(
                f"cache_imported: {len(seqs)} sequences, {len(tokens)} token lists, "
                f"{len(extra_keys)} extra keys")
        ids = [token_ids(t, f"cache_imported: sequence {s.seq_id}: tokens")
               for s, t in zip(seqs, tokens)]
        for s, key in zip(seqs, extra_keys):
            if key is not None:
                _hashable(key, f"cache_imported: sequence {s.seq_id}: extra_key")
            if s.prefix is not None or s.window != -1 or not s.committed:
                raise InvalidArgumentError(
                    f"cache_imported: sequence {s.seq_id} has ids recorded, a window or an "
                    f"uncommitted tree: only a freshly imported sequence can be cached")
        before = prefix.count
        for s, prompt, key in zip(seqs, ids, extra_keys):       # parents first: their nodes
            prefix.adopt(s, prompt, key)                        # are the forks' ancestors
        for sid in seq_ids:
            self.remove_sequence(sid)
        return prefix.count - before

    def cached_run(self, tokens: Sequence[int], extra_key: Any = None) -> tuple:
        """``(length, holder)``: the longest cached prefix of ``tokens`` under ``extra_key`` in
        whole pages, all of them (``match_prefix`` leaves one token for the model), and the
        page-table key of the sequence whose first ``length`` tokens hold it (a sequence id
        or a hidden ``Ghost``; None when nothing is cached). What a prefix cache file's load
        need not import. Changes nothing. Raises InvalidArgumentError without the prefix
        cache or for bad ids."""
        prefix = self._prefix_on("loading the prefix cache")
        ids = token_ids(tokens, "cached_run: tokens")
        node = prefix.find(Prompt(ids.raw + bytes(8)), extra_key)    # (one id more: every
        if node is None:                                              # full page counts)
            return 0, None
        return node.depth * self.config.page_size, prefix.holder_key(node)

    def hold_prefix(self, seq_id: int, holder: Any, length: int) -> None:
        """Add sequence ``seq_id`` (a new id) holding the first ``length`` tokens (whole
        pages) of ``holder`` (``cached_run``'s), their pages shared: no ids recorded, the
        least-recently-used order untouched. While it lives, eviction cannot free those
        pages: a prefix cache file's load forks the rest of a chain from it, then removes it
        (``remove_sequence``). Raises SequenceExistsError for an id in the cache."""
        sid = seq_id_arg(seq_id)
        if sid in self.state.pt.seqs:
            raise SequenceExistsError(f"sequence {sid} is already in the cache")
        ps = self.config.page_size
        pt = self.state.pt
        if holder not in pt.seqs or length % ps or not 0 < length <= pt.length(pt.seqs[holder]):
            raise InvalidArgumentError(
                f"hold_prefix: length {length} must be whole pages of {ps} that the holder "
                f"{holder!r:.40} has")
        self.state._fork(pt.seqs[holder], sid, length)   # page-aligned: no copy
        self.state.epoch += 1

    def _prefix_on(self, what: str) -> PrefixIndex:
        if self.prefix is None:
            raise InvalidArgumentError(
                f"{what}: the cache has no prefix cache (CacheConfig(prefix_cache=False))")
        return self.prefix

    def with_room(self, call, shortfall):
        """``call()``; when it raises CacheFullError and evicting cached pages covers the
        ``shortfall()`` (pages missing), evict them and call again. The call changed nothing
        when it raised, so a refusal that eviction cannot fix leaves the index as it was."""
        try:
            return call()
        except CacheFullError as exc:
            prefix = self.prefix
            if prefix is None:
                raise
            short = shortfall()
            cached = prefix.evictable()
            if short <= 0 or cached < short:
                if not cached or short <= 0:
                    raise
                # the refusal counts free pages only: name the cached ones too, so that its
                # numbers add up to what num_available_pages reports
                free = int(self.state.pt.num_free)
                raise CacheFullError(
                    f"{exc}; the prefix cache holds {n_pages(cached)} more that eviction would "
                    f"free (num_available_pages={free + cached}), short of the "
                    f"{n_pages(short)} missing") from None
            # a few pages more than this call lacks: the next calls then find free pages
            # instead of failing and planning again (a 32nd of the cache, at most 64 pages)
            prefix.evict(max(short, min(cached, 64, self.state.pt.num_pages // 32)))
        return call()

    # ------------------------------------------------------------------ queries
    @property
    def num_available_pages(self) -> int:
        """Free pages now (of ``num_total_pages``), counting the cached pages that eviction
        frees when needed (``num_cached_pages``); ``begin_forward`` raises CacheFullError when a
        forward needs more (``pages_needed``)."""
        free = int(self.state.pt.num_free)
        return free if self.prefix is None else free + self.prefix.evictable()

    @property
    def num_total_pages(self) -> int:
        """Pages per layer, ``config.num_pages``: the capacity in tokens is about
        ``num_total_pages * page_size`` (one page is spare; see ``CacheConfig.num_pages``)."""
        return int(self.state.pt.num_pages)

    @property
    def total_sequence_length(self) -> int:
        """The tokens of every sequence added up (a token shared by forks counts once per
        sequence; a sliding window counts the tokens it keeps)."""
        pt = self.state.pt
        return int(sum(int(pt.s_len[s.slot]) for k, s in pt.seqs.items() if not isinstance(k, Ghost)))

    def sequence_length(self, seq_id: int) -> int:
        """The tokens sequence ``seq_id`` holds (committed ones and its uncommitted token tree;
        with a sliding window, the tokens it keeps). Raises SequenceNotFoundError."""
        return self.state.length(seq_id)

    @property
    def num_sequences(self) -> int:
        """The number of sequences in the cache."""
        return len(self.sequence_ids)

    @property
    def sequence_ids(self) -> list[int]:
        """The ids of the sequences in the cache (a new list; no particular order)."""
        seqs = self.state.pt.seqs
        if self.prefix is None:
            return list(seqs)
        return [k for k in seqs if not isinstance(k, Ghost)]

    @property
    def is_empty(self) -> bool:
        """Whether the cache holds no sequence and every page is free (or only cached: see
        ``num_cached_pages``)."""
        return not self.sequence_ids and self.num_available_pages == self.state.pt.num_pages

    def pages_needed(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                     token_tree_parent_ptr: Optional[Sequence[int]] = None, *,
                     net: bool = False, by_group: bool = False) -> Union[int, dict]:
        """The free pages that ``begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)``
        would take now: a scheduler's "is there room" question (vLLM's ``allocate_slots``),
        answered by the code ``begin_forward`` reserves with, so the two cannot disagree.

        ``seq_ids``: B distinct ids of sequences in the cache (1 <= B <= max_batch_size);
        ``append_lengths``: B ints >= 1, the new tokens of each, summing to at most
        ``prefill_chunk_size``; ``token_tree_parent_ptr``: None, or one int per new token, as
        for ``begin_forward`` (a tree does not change the count, only what is valid).
        Each sequence counts the pages its new tokens need beyond the room left in its last
        page (a partial last page is filled first; a page shared with a fork never is: the
        fork already copied the partial page, so a sequence's last page is its own).
        ``net``: False (default) counts every page taken off the free list, the number
        ``begin_forward`` compares with ``num_available_pages`` (CacheFullError above it);
        a sliding window frees the pages that slide out only after every new page is taken, so
        they do not make room for the same forward. True: that count minus the pages the
        forward's sliding windows free, i.e. how far ``num_available_pages`` drops from now to
        after the forward (negative when windows free more than the forward takes); the two
        counts differ only for sequences with a sliding window.
        ``by_group``: the count of every group instead, ``{"full": n, "window=<w>": n, ...}``:
        the full pool's (as above) and each window group's (``CacheConfig.layer_kinds``; its
        pages are freed at ``end_forward``, never by the same forward), each to compare with
        that group's entry of ``num_available_pages_by_group``. Without ``by_group`` the count
        is the full pool's, and ``can_append`` checks every group.
        Validates like ``begin_forward`` (SequenceNotFoundError, InvalidArgumentError,
        ForwardStateError for an uncommitted tree, naming the sequence, value and limit) but
        never raises CacheFullError, and changes nothing. Inside an open forward it counts
        against the pages that forward leaves (``end_forward`` changes no page)."""
        net = bool_arg(net, "net")
        by_group = bool_arg(by_group, "by_group")
        if by_group:
            return self._pages_by_group(seq_ids, append_lengths, token_tree_parent_ptr, net)
        taken, freed = self.planner.pages_needed(seq_ids, append_lengths, token_tree_parent_ptr)
        return taken - freed if net else taken

    def _pages_by_group(self, seq_ids, append_lengths, token_tree_parent_ptr,
                        net: bool = False) -> dict:
        """``pages_needed(..., by_group=True)``."""
        taken, freed = self.planner.pages_needed(seq_ids, append_lengths, token_tree_parent_ptr)
        out = {"full": taken - freed if net else taken}
        groups = self.state.pt.groups
        if groups is not None:
            need = self.planner.group_pages_needed(seq_ids, append_lengths, token_tree_parent_ptr)
            out.update((spec.name, n) for spec, n in zip(groups.specs, need))
        return out

    def append_room(self, seq_id: int, pages: int, limit: int) -> int:
        """The most new tokens, at most ``limit``, that ``seq_id`` can append in one forward of
        its own taking at most ``pages`` free pages: the inverse of ``pages_needed`` (the room
        in its own last page first, then whole pages; a sliding window counted as
        ``pages_needed`` counts it), so a scheduler sizes a prompt chunk without page maths.

        ``seq_id``: a sequence in the cache; ``pages``: an int (below 1: the room in its last
        page only); ``limit``: an int in [1, prefill_chunk_size]. Raises what ``pages_needed``
        raises for ``([seq_id], [limit])``; changes nothing."""
        pages = int_arg(pages, "pages")
        return self.planner.append_room(seq_id, pages, limit)

    def can_append(self, seq_ids: Sequence[int], append_lengths: Sequence[int],
                   token_tree_parent_ptr: Optional[Sequence[int]] = None) -> bool:
        """Whether ``begin_forward(seq_ids, append_lengths, token_tree_parent_ptr)`` has the
        pages it needs now: ``pages_needed(...) <= num_available_pages`` (False exactly when
        it would raise CacheFullError), and in a cache with window groups the same for each
        group (the most constrained group decides). Same arguments and input errors as
        ``pages_needed``; changes nothing."""
        if self.state.pt.groups is None:
            return self.planner.pages_needed(seq_ids, append_lengths,
                                             token_tree_parent_ptr)[0] <= self.num_available_pages
        need = self._pages_by_group(seq_ids, append_lengths, token_tree_parent_ptr)
        free = self.num_available_pages_by_group
        return all(n <= free[name] for name, n in need.items())

    @property
    def num_available_pages_by_group(self) -> dict:
        """``{"full": num_available_pages, "window=<w>": free pages of that window group,
        ...}`` (one entry per window group of ``CacheConfig.layer_kinds``; only "full"
        without)."""
        out = {"full": self.num_available_pages}
        if self.state.pt.groups is not None:
            out.update(self.state.pt.groups.free_pages())
        return out

    @property
    def num_appendable_pages(self) -> int:
        """The free pages a forward can take now in every group: ``num_available_pages``, and
        in a cache with window groups the fewest of ``num_available_pages_by_group`` (the most
        constrained group decides). A scheduler's page budget for its next forward: a forward,
        an admission or a fork takes as many new pages from each window group as from the full
        pool (every group stores a sequence's positions in pages numbered alike; a group frees
        its pages only at ``end_forward``), so ``pages_needed`` and ``append_room`` counted
        against this number hold for every group."""
        free = self.num_available_pages
        groups = self.state.pt.groups
        if groups is None:
            return free
        return min(free, *groups.free_pages().values())

    @property
    def num_available_state_slots(self) -> int:
        """State slots no sequence holds (``CacheConfig.num_state_slots`` in all): the
        sequences ``add_sequence`` / ``fork_sequence`` can still add before CacheFullError;
        0 without ``State`` layers."""
        slots = self.state.slots
        return 0 if slots is None else len(slots.free)

    @property
    def num_total_pages_by_group(self) -> dict:
        """``{"full": num_total_pages, "window=<w>": that window group's pool, ...}``: pages
        per layer of each group (``CacheConfig.window_group_pages``)."""
        out = {"full": self.num_total_pages}
        if self.state.pt.groups is not None:
            out.update((s.name, s.num_pages) for s in self.state.pt.groups.specs)
        return out

    def window_pages(self, seq_id: int) -> dict:
        """``{"window=<w>": (start, pages)}`` of sequence ``seq_id`` in each window group: the
        first position whose K/V the group still holds (keys below it were freed) and the
        pages it holds, at most ``ceil(w / page_size) + 1`` between forwards. Empty without
        window groups. Raises SequenceNotFoundError."""
        seq = self.state.seq(seq_id)
        groups = self.state.pt.groups
        return {} if groups is None else groups.held(seq.seq_id)


class PrefixChain(NamedTuple):
    """One chain of the prefix index as a file writes it (``KVManager.prefix_chains``)."""

    holder: Any
    """The page-table key of the sequence whose first ``end`` tokens are the chain's prefix
    (a sequence id, or the prefix cache's hidden ``Ghost``)."""
    start: int
    """The first token of the chain's own pages (0, or where it leaves ``parent``'s)."""
    end: int
    """One past its last token (whole pages)."""
    ids: bytes
    """The ids of tokens ``0 .. end-1``, int64 bytes."""
    extra: Any
    """Its extra key (None: none)."""
    parent: Optional[int]
    """The index of the chain whose first ``start`` tokens it continues (None: from 0)."""


_SIGN = 7 if sys.byteorder == "little" else 0     # the byte of an int64 that holds its sign bit


def token_ids(tokens, what: str) -> Prompt:
    """``tokens`` (a list or tuple of ints, a 1-D integer array or an ``array('q')``) as a
    ``Prompt``: a copy of the ids, checked (ints >= 0). The common cases are converted and
    checked at C speed: the index's host cost is a few microseconds per 1,000 tokens, and a
    Python loop here would be ten times it; anything else, or a bad id, goes through
    ``int_values`` (the precise error)."""
    buf = None
    if isinstance(tokens, array.array) and tokens.typecode == "q":     # int64 already
        buf = tokens.tobytes()
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        # uint64 past 2**63 wraps negative: refused below
        buf = tokens.astype(np.int64, copy=False).tobytes()
    elif isinstance(tokens, (list, tuple)) and list(map(type, tokens)).count(int) == len(tokens):
        try:        # exact ints only (checked above): fromiter is the fastest conversion
            buf = np.fromiter(tokens, np.int64, len(tokens)).tobytes()
        except OverflowError:
            pass
    # no negative int64: no sign byte >= 0x80 (one C pass over a byte string, no numpy call)
    if buf is not None and buf[_SIGN::8].isascii():
        return Prompt(buf)
    return Prompt(np.array(int_values(tokens, what, 0, 2**63 - 1), np.int64).tobytes())


def _hashable(value, what: str) -> None:
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be hashable, got {type(value).__name__}") from None
