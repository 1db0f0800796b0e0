"""What the serving loop needs of the objects it drives, as ``typing.Protocol`` classes: the
model runner ``EngineCore`` calls (``ModelRunner``, and the picks it hands back on their way,
``PicksInFlight``), and the KV cache and host tier as the scheduler sees them
(``SchedulerCache``, ``HostStore``).

They are annotations only: nothing checks them at run time (no ``isinstance``, no cost per
step). ``kvcache.integrations.runner.Runner``, ``kvcache.PagedKVCache`` and
``kvcache.HostTier`` are the implementations; the serving tests drive the loop with a fake
runner over the reference backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ContextManager, Optional, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from ..config import CacheConfig
    from .plan import StepPlan

__all__ = ["HostStore", "ModelRunner", "PicksInFlight", "SchedulerCache"]


class PicksInFlight(Protocol):
    """A greedy step's picks on their way to the host (``ModelRunner.greedy_async``; the
    integrations' ``PendingPicks``)."""

    tokens: Any
    """The picked ids ``(B,)`` where the device has them: a later forward's input as they are."""

    def result(self) -> tuple:
        """Wait for the host's copy; returns ``(tokens (B,) int64, logprobs (B,) float64)``."""
        ...


class ModelRunner(Protocol):
    """What ``EngineCore`` calls on its runner (the model on the device). A runner may also
    have ``step_context()``, a context manager the core enters around each step and leaves
    before ``step`` returns or raises (e.g. torch's inference mode); it is optional, so not a
    member here."""

    def session(self) -> ContextManager:
        """A context manager held while the core has work (e.g. the model's attention switched
        to the cache)."""
        ...

    def forward(self, plan: StepPlan, picks: Any = None) -> Any:
        """Run ``plan`` as one forward of the cache; returns the logits of its ``logit_rows``.
        ``picks``: ``plan.slot_picks``, the step before's picks on their way (what this
        runner's ``greedy_async`` returned), which ``plan.slot_dst`` takes tokens from (None
        when it takes none). Raises ``CacheFullError`` with nothing changed when the forward
        does not fit."""
        ...

    def greedy_async(self, logits: Any, logprobs: bool) -> PicksInFlight:
        """The first argmax of each row of ``logits``, still on its way to the host;
        ``logprobs``: compute their log-probabilities too (else NaN)."""
        ...

    def pick(self, logits: Any, draws: list, logprobs: bool) -> tuple:
        """One host ``(token, logprob)`` pair per ``Draw`` of ``draws`` (row ``draw.row`` of
        ``logits``, with its ``params``, ``seed`` and ``step``), as ``(tokens (D,), logprobs
        (D,))``; ``logprobs``: compute the log-probabilities (else NaN)."""
        ...

    def alternatives(self, logits: Any, rows: list, k: int) -> tuple:
        """The ``k`` likeliest tokens of each of ``rows`` of ``logits`` and their
        log-probabilities, host ``(ids (D, k), logprobs (D, k))``, best first (asked only when
        a request wants them: ``SamplingParams(logprobs=k)``)."""
        ...


class SchedulerCache(Protocol):
    """The KV cache as the scheduler sees it: sequences, prefix admission and room (a
    ``kvcache.PagedKVCache``, whose ``KVManager`` part answers). The scheduler never does page
    arithmetic itself: it asks."""

    @property
    def config(self) -> CacheConfig:
        """The cache's configuration (``page_size``, ``max_batch_size``,
        ``prefill_chunk_size``, ``prefix_cache``, ...)."""
        ...

    @property
    def num_available_pages(self) -> int:
        """Pages a forward or an admission can take now (cached prefix pages included)."""
        ...

    @property
    def num_appendable_pages(self) -> int:
        """Pages a forward or an admission can take now from every page group (with window
        groups, the most constrained group's; else ``num_available_pages``): the scheduler's
        page budget per forward."""
        ...

    @property
    def num_total_pages(self) -> int:
        """Pages the cache holds in all."""
        ...

    @property
    def num_available_state_slots(self) -> int:
        """Sequences the cache can still take (``add_sequence``, ``fork_sequence``) with
        ``State`` layers: its free state slots; 0 without state layers (then unlimited)."""
        ...

    def add_sequence(self, seq_id: int, tokens: Optional[Sequence[int]] = None) -> int:
        """Add empty sequence ``seq_id``; with ``tokens`` (prefix cache) it starts from their
        longest cached prefix. Returns the tokens it starts with."""
        ...

    def fork_sequence(self, parent_id: int, child_id: int, fork_pos: int = -1) -> None:
        """Add ``child_id`` sharing the first ``fork_pos`` tokens of ``parent_id``."""
        ...

    def remove_sequence(self, seq_id: int) -> None:
        """Remove sequence ``seq_id``; its pages come back (or stay cached)."""
        ...

    def sequence_length(self, seq_id: int) -> int:
        """Tokens sequence ``seq_id`` holds (raises ``SequenceNotFoundError`` if absent)."""
        ...

    def extend_tokens(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Record the ids of ``seq_id``'s next ``tokens`` (prefix cache), so that its full
        pages stay cached after it leaves."""
        ...

    @property
    def prefix_miss_tokens_by_reason(self) -> dict:
        """Cached tokens new sequences did not start from, by reason (``{"window": n}``)."""
        ...

    def prefix_admission(self, tokens: Sequence[int]) -> tuple:
        """``(start, pages)``: the cached prefix of ``tokens`` a new sequence would start from,
        and the free pages its admission takes."""
        ...

    def pages_needed(self, seq_ids: Sequence[int], append_lengths: Sequence[int]) -> int:
        """Free pages a forward appending ``append_lengths`` tokens to ``seq_ids`` takes."""
        ...

    def append_room(self, seq_id: int, pages: int, limit: int) -> int:
        """The most tokens, up to ``limit``, that ``seq_id`` can append taking at most
        ``pages`` free pages."""
        ...

    def clear(self) -> None:
        """Remove every sequence."""
        ...


class HostStore(Protocol):
    """Where preempted sequences are parked in host memory (a ``kvcache.HostTier``)."""

    def offload(self, seq_id: int) -> int:
        """Copy ``seq_id`` to the host and remove it from the cache; returns its tokens.
        Raises ``CacheFullError`` (nothing changed) when the store has no room."""
        ...

    def restore(self, seq_id: int, *, parent_id: Optional[int] = None,
                fork_pos: Optional[int] = None) -> int:
        """Bring ``seq_id`` back into the cache (sharing the first ``fork_pos`` tokens of
        ``parent_id`` when given); returns the tokens written."""
        ...

    def drop(self, seq_id: int) -> None:
        """Forget parked ``seq_id``."""
        ...

    def clear(self) -> None:
        """Forget every parked sequence."""
        ...
