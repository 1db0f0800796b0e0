"""The model runner: one ``StepPlan`` through the model and the cache, and the picks.

It holds the ``ModelAdapter``, the whole-step decode graphs and the sampler; the
``EngineCore`` calls it (the calls: ``kvcache.serving.protocols.ModelRunner``).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from ..cache import PagedKVCache
from ..serving.stats import EngineStats
from .adapter import ModelAdapter, PendingPicks
from .sampling import draw_rows, top_logprobs

__all__ = ["Runner"]


class Runner:
    """Runs plans on ``cache`` with ``adapter``; ``graphs``: replay a captured whole-step graph
    for pure decode steps (``adapter.step_graphs``; ``compiled``: of the compiled step); counts
    graph use in ``stats``."""

    def __init__(self, adapter: ModelAdapter, cache: PagedKVCache, stats: EngineStats,
                 graphs: bool = False, compiled: bool = False, invariant_ops=None):
        self.adapter = adapter
        self.cache = cache
        self.stats = stats
        self.decode_graphs = adapter.step_graphs(cache, compiled) if graphs else None
        self.invariant_ops = invariant_ops
        """The adapter's ``batch_invariant_ops`` (None: none), entered around the model's code
        and the picks only: under a torch dispatch mode every torch op of the host's step work
        (plans, the cache's index arrays) would pay a Python call too, several ms a step."""

    def session(self):
        """The adapter's context manager for this cache (``ModelAdapter.session``), held by
        ``EngineCore`` while it has work: e.g. the model's attention routed to the cache."""
        return self.adapter.session(self.cache)

    def step_context(self):
        """The adapter's context manager around one step (``ModelAdapter.step_context``),
        entered by ``EngineCore`` per step: e.g. torch's inference mode."""
        return self.adapter.step_context(self.cache)

    def _invariant(self):
        """The batch-invariant ops where the engine is deterministic, else nothing."""
        return self.invariant_ops or contextlib.nullcontext()

    def forward(self, plan, picks: Optional[PendingPicks] = None):
        """Run ``plan`` as one forward; returns the logits of ``plan.logit_rows``. Raises
        ``CacheFullError`` (nothing changed) when it does not fit."""
        adapter, cache, stats = self.adapter, self.cache, self.stats
        n = len(plan.tokens)
        if plan.slot_dst:
            assert picks is not None, "a plan with placeholders needs the step before's picks"
        if picks is not None and plan.slot_dst and len(plan.slot_dst) == n and plan.slot_src == plan.slot_dst \
                and plan.slot_dst == list(range(n)) and len(picks.tokens) == n:
            tokens = picks.tokens           # the step before's picks, in order: as they are
        else:
            tokens = np.asarray(plan.tokens, np.int64)
            if picks is not None and plan.slot_dst:
                tokens = adapter.step_tokens(tokens, picks, np.asarray(plan.slot_dst, np.int64),
                                             np.asarray(plan.slot_src, np.int64))
        positions = np.asarray(plan.positions, np.int64)
        rows = np.asarray(plan.logit_rows, np.int64)
        with cache.forward(plan.seq_ids, plan.lens):
            if self.decode_graphs is not None and cache.static_bucket is not None:
                graphs = self.decode_graphs
                before, eager = graphs.captures, graphs.eager_runs
                with self._invariant():         # (a capture runs the model's code)
                    logits = graphs.run(tokens, positions, rows)
                if graphs.eager_runs == eager:
                    stats.graph_forwards += 1
                else:                       # its capture failed: it ran eagerly
                    stats.graph_fallback_forwards += 1
                stats.graph_captures += graphs.captures - before
            else:
                with self._invariant():
                    logits = adapter.forward(cache, tokens, positions, rows)
        return logits

    def greedy_async(self, logits, logprobs: bool) -> PendingPicks:
        """The first argmax of each row of ``logits`` ``(B, vocab_size)``, left on the device
        for the next step's input while it is copied to the host (``ModelAdapter.greedy_async``);
        ``logprobs``: compute their log-probabilities too (else NaN)."""
        with self._invariant():
            return self.adapter.greedy_async(logits, logprobs)

    def pick(self, logits, draws: list, logprobs: bool) -> tuple:
        """One ``(token, logprob)`` per ``Draw``, on the host: greedy rows as the argmax, the
        others drawn with their ``SamplingParams`` and seeds on the logits' device."""
        rows = [d.row for d in draws]
        with self._invariant():
            if all(d.params.temperature == 0.0 for d in draws):
                tokens, lps = self.adapter.greedy(logits, logprobs)
                return tokens[rows], lps[rows]
            return draw_rows(logits, rows, [d.params for d in draws], [d.seed for d in draws],
                             [d.step for d in draws], self.adapter.to_numpy)

    def alternatives(self, logits, rows: list, k: int) -> tuple:
        """The ``k`` likeliest tokens of each of ``rows`` and their log-probabilities (under the
        raw logits), host ``(ids (D, k), logprobs (D, k))``, best first."""
        with self._invariant():
            return top_logprobs(logits, k, self.adapter.to_numpy, rows=rows)
