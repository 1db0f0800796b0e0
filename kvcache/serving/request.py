"""A request's state in the engine, and what a step reports about it (``RequestOutput``).

Pure Python: no array library, no model library.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["FINISH_REASONS", "Request", "RequestOutput", "Sample"]

FINISH_REASONS = ("stop", "length", "abort")
"""Why a sample ended: a stop token or the model's EOS (kept as its last token), ``max_tokens``
reached, or ``abort``."""


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sample of a request (``EngineCore.step``).

    ``request_id``: the id ``add_request`` returned; ``index``: the sample (0 .. n-1);
    ``new_token_ids``: the tokens this sample got since its last output (may be empty on the
    output that reports an abort); ``finished``: the sample is done; ``finish_reason``: one of
    ``"stop"``, ``"length"``, ``"abort"`` when finished, else None; ``logprobs``: the model's
    log-probability of each new token (before temperature and filters) when the request's
    ``SamplingParams.logprobs`` asked for them, else None; ``top_logprobs``: when
    ``SamplingParams.logprobs`` is an integer ``k > 0``, one list per new token of the ``k``
    likeliest tokens as ``(token_id, logprob)`` pairs, best first, else None; ``seq_id``: on the last output of a
    request added with ``hold_kv=True``, the cache sequence that still holds its prompt's KV
    (until ``release``), else None."""

    request_id: int
    index: int
    new_token_ids: list
    finished: bool
    finish_reason: Optional[str] = None
    logprobs: Optional[list] = None
    seq_id: Optional[int] = None
    top_logprobs: Optional[list] = None


@dataclasses.dataclass(eq=False)
class Sample:
    """One of a request's ``n`` samples: its new tokens so far and where it stands."""

    seed: int
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    top: list = dataclasses.field(default_factory=list)     # per token: [(id, logprob)] (logprobs=k)
    finish_reason: Optional[str] = None
    emitted: int = 0            # tokens already reported in a RequestOutput

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass(eq=False)
class Request:
    """A request as the scheduler holds it. ``params`` is a ``SamplingParams``; ``stops`` the
    token ids that end a sample (``params.stop_token_ids`` plus the model's EOS unless
    ``ignore_eos``); ``order`` its arrival number (smaller is older)."""

    request_id: int
    """The id ``EngineCore.add_request`` returned (``RequestOutput.request_id``)."""
    prompt: list
    """The prompt's token ids (ints), as admitted."""
    params: Any
    stops: frozenset
    order: int
    samples: list = dataclasses.field(default_factory=list)
    """Its ``params.n`` ``Sample`` objects, in index order (``RequestOutput.index``)."""
    seqs: list = dataclasses.field(default_factory=list)
    """Every scheduler sequence made for it (its prompt's, its samples'), so that an abort can
    drop them all."""
    hold_kv: bool = False
    """Its sequence stays in the cache when it finishes (disaggregated prefill:
    ``add_request(..., hold_kv=True)``)."""
    kv_seq_id: Optional[int] = None
    """A sequence already in the cache (imported) holding the KV of the prompt's first tokens:
    the request starts from it instead of prefilling them; None: prefill from scratch."""
    drawn: int = 0
    """Picks its samples drew before this request (a resumed conversation's generated
    tokens): each draw's step counts from there, so a seeded sample goes on as the request
    that drew them would have (``Engine.resume(..., drawn=)``)."""
    held: Optional[int] = None
    """The cache sequence kept for it once finished (``hold_kv``) until ``release``; None
    before then, or without ``hold_kv``."""

    @property
    def finished(self) -> bool:
        """Every sample has a finish reason."""
        return all(s.done for s in self.samples)

    @property
    def max_tokens(self) -> int:
        """The most new tokens a sample may get (``params.max_tokens``)."""
        return self.params.max_tokens

    @property
    def greedy(self) -> bool:
        """Temperature 0: each pick is the first argmax, so the step may be pipelined."""
        return self.params.temperature == 0.0

    @property
    def wants_logprobs(self) -> bool:
        """The step must compute the picked tokens' log-probabilities (``logprobs`` True or an
        integer, 0 included); computing them costs a log-sum-exp over the vocabulary."""
        return self.params.logprobs is not None and self.params.logprobs is not False

    @property
    def top_logprobs(self) -> int:
        """How many likeliest alternatives each token reports (``logprobs=k``); 0: none."""
        k = self.params.logprobs
        return 0 if k is None or isinstance(k, bool) else int(k)
