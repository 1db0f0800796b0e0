"""The engine's counters (``EngineStats``)."""

from __future__ import annotations

import dataclasses

__all__ = ["EngineStats"]


@dataclasses.dataclass
class EngineStats:
    """Counters over the engine's life (``generate`` adds to them)."""

    forwards: int = 0
    """Model forwards run (one per scheduler step that ran)."""
    prefill_tokens: int = 0
    """Tokens run as prompt chunks (including recomputation after preemption)."""
    decode_tokens: int = 0
    """Tokens run as one-token decode steps."""
    forks: int = 0
    """Sequences started by forking (parallel samples, ``n > 1``, from their prompt)."""
    shared_prefix_tokens: int = 0
    """Prompt tokens not computed because a fork shared them."""
    prefix_hit_tokens: int = 0
    """Tokens not computed because the prefix cache held them (``CacheConfig.prefix_cache``:
    earlier requests, earlier calls, or a preempted sequence's own pages)."""
    prefix_miss_tokens_by_reason: dict = dataclasses.field(default_factory=dict)
    """Tokens the prefix cache held full pages for that requests did not start from, by
    reason: ``"window"``, a sliding-window layer's pages for that boundary were no longer held
    (window groups, docs/hybrid.md); empty where nothing was missed so."""
    preemptions: int = 0
    """Sequences removed to make room (recomputed later, or parked in the host tier)."""
    recomputed_tokens: int = 0
    """Tokens computed again after preemption."""
    offloaded_tokens: int = 0
    """Tokens parked in the host tier by preemptions."""
    recompute_tokens_saved: int = 0
    """Tokens restored from the host tier instead of being computed again."""
    graph_forwards: int = 0
    """Forwards run through a captured whole-step graph (decode steps; captures included)."""
    graph_captures: int = 0
    """Whole-step graphs captured (one per batch bucket, again if the cache's buffers moved)."""
    graph_fallback_forwards: int = 0
    """Forwards of a kind of step whose graph capture failed, run eagerly on the graph's
    buffers instead (``kvcache.integrations.torch_graphs``; one warning per engine)."""
    overlapped_forwards: int = 0
    """Greedy steps launched before the host had the previous step's picks (decode runs, and
    pipelined steps with prompt chunks)."""

    @property
    def prefix_hit_rate(self) -> float:
        """``prefix_hit_tokens`` over every token a sequence started with or ran as a prompt
        chunk (hits, forks' shared prefixes and prefill): the share the prefix cache saved."""
        total = self.prefix_hit_tokens + self.shared_prefix_tokens + self.prefill_tokens
        return self.prefix_hit_tokens / total if total else 0.0

    @property
    def forward_tokens(self) -> int:
        """Tokens run through the model: ``prefill_tokens + decode_tokens``."""
        return self.prefill_tokens + self.decode_tokens
