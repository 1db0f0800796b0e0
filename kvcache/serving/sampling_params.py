"""Per-request sampling settings: ``SamplingParams`` (vLLM's fields and defaults), checked when
made. Pure Python, beside the scheduler that reads them (``Request.params``); the sampler that
honours them on the logits' device is ``kvcache.integrations.sampling``, which re-exports these
names (``kvcache.integrations.SamplingParams`` and every integration module's too)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import random
from typing import Any, Optional, Sequence, Union

from ..errors import InvalidArgumentError

__all__ = ["GREEDY_TEMPERATURE", "MAX_N", "SEED_LIMIT", "SamplingParams"]

SEED_LIMIT = 2 ** 63
"""Seeds are int64 on the device: ``SamplingParams.seed`` lies in ``[0, SEED_LIMIT)`` and the
samplers take seeds modulo it."""
MAX_N = 1024
"""The most samples one request may ask for (``SamplingParams.n``): each is a sequence of its
own in the cache and a ``Sample`` on the host, made when the request is queued (a million took
the engine's lock for seconds)."""
GREEDY_TEMPERATURE = 1e-5
"""Temperatures below it are greedy (stored as 0.0), as in vLLM: dividing the logits by a
smaller one overflows, or underflows to 0 in float32 (<= 1e-38, 1e-310 in float64), and would
give a NaN distribution instead of its limit, the argmax."""


def _bad(name: str, value: Any, allowed: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"SamplingParams.{name}={value!r:.80} is not allowed: it must be {allowed}")


def _integer(name: str, value: Any, low: int, high: Optional[int] = None, allowed: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or int(value) < low or (high is not None and int(value) >= high):
        raise _bad(name, value, allowed or f"an integer >= {low}")
    return int(value)


def _real(name: str, value: Any, ok, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _bad(name, value, allowed)
    out = float(value)
    if not math.isfinite(out) or not ok(out):
        raise _bad(name, value, allowed)
    return out


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (the fields and defaults of vLLM's ``SamplingParams``).

    Every field is checked when the object is made: a bad one raises
    ``kvcache.errors.InvalidArgumentError`` naming the field, the value and the allowed range.

    ``max_new_tokens`` (the name ``Engine.generate`` and transformers use) is accepted as an
    alias of ``max_tokens`` when the object is made, and reads back as ``max_tokens``; given
    both with different values, it raises ``InvalidArgumentError`` naming both.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "SamplingParams":
        # Sees the call's arguments as given (the generated __init__ only sees the default
        # max_tokens=32 when it is left out), to tell "both given and different" apart.
        alias = kwargs.get("max_new_tokens")
        if alias is not None and (args or "max_tokens" in kwargs):
            given = args[0] if args else kwargs["max_tokens"]
            if given != alias:
                raise InvalidArgumentError(
                    f"SamplingParams got max_tokens={given!r:.40} and max_new_tokens={alias!r:.40}: "
                    f"they are two names of one setting (new tokens per sample); give one of them")
        return super().__new__(cls)

    max_tokens: int = 32
    """New tokens per sample, at most (fewer when a stop token comes; it is kept). >= 1."""
    temperature: float = 0.0
    """Scores are divided by it before the filters; 0: greedy (the first argmax). >= 0; below
    ``GREEDY_TEMPERATURE`` (1e-5) greedy too, stored as 0.0."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches it. In (0, 1]; 1: off."""
    top_k: int = 0
    """Keep the k most likely tokens (and every token tied with the k-th). >= 1; 0 or -1: off."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one. In [0, 1]; 0: off."""
    seed: Optional[int] = None
    """Seed of the request's draws (sample ``j`` of ``n`` uses ``seed + j``); None: a fresh
    random seed (not reproducible). In [0, 2**63)."""
    n: int = 1
    """Samples of the prompt (they share its prefill). In [1, ``MAX_N``] (1024)."""
    stop_token_ids: Sequence[int] = ()
    """Token ids that end a sample (kept as its last token); stored as a tuple (None: ()).
    Each >= 0."""
    ignore_eos: bool = False
    """Go on past the model's end-of-sequence ids (``stop_token_ids`` still stop)."""
    logprobs: Union[bool, int, None] = False
    """True (or vLLM's integer >= 0): report the log-probability of each chosen token under the
    model's distribution (before the filters); False or None: none. An integer k > 0 asks for
    the k likeliest alternatives too (vLLM's ``logprobs=k``), which ``top_logprobs`` computes."""
    max_new_tokens: dataclasses.InitVar[Optional[int]] = None
    """An alias of ``max_tokens`` (``generate``'s and transformers' name), taken when the object
    is made (not a field: ``repr`` and ``==`` show ``max_tokens``); reads back as ``max_tokens``."""

    def __post_init__(self, max_new_tokens: Optional[int] = None) -> None:
        if max_new_tokens is not None:
            _integer("max_new_tokens", max_new_tokens, 1)
            object.__setattr__(self, "max_tokens", max_new_tokens)
        _integer("max_tokens", self.max_tokens, 1)
        _real("temperature", self.temperature, lambda v: v >= 0, "a finite number >= 0 (0: greedy)")
        _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)")
        _integer("top_k", self.top_k, -1, allowed="an integer >= 1, or 0 or -1 (off)")
        _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)")
        if self.seed is not None:
            _integer("seed", self.seed, 0, SEED_LIMIT, "None or an integer in [0, 2**63)")
        _integer("n", self.n, 1, MAX_N + 1,
                 f"an integer in [1, {MAX_N}] (MAX_N: each sample is a sequence of its own)")
        stops = () if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, (Sequence, set, frozenset)):
            raise _bad("stop_token_ids", stops, "None or a sequence of integer token ids >= 0")
        for t in stops:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
                raise _bad("stop_token_ids", stops,
                           f"None or a sequence of integer token ids >= 0 (holds {t!r:.40})")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "True or False")
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            _integer("logprobs", self.logprobs, 0, allowed="True, False, None or an integer >= 0")
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.temperature < GREEDY_TEMPERATURE:       # greedy: its limit, not a NaN row
            object.__setattr__(self, "temperature", 0.0)
        for name in ("max_tokens", "top_k", "n"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """``temperature == 0`` (any temperature below ``GREEDY_TEMPERATURE``): the pick is the
        first argmax, the filters and seed unused (the engine may then pipeline the step)."""
        return self.temperature == 0.0

    def sample_seed(self, j: int = 0) -> int:
        """The seed of sample ``j``: ``seed + j`` (mod 2**63), or a fresh random one."""
        if self.seed is None:
            return random.SystemRandom().randrange(SEED_LIMIT)
        return (self.seed + j) % SEED_LIMIT


# The alias reads back as the field it names (the InitVar's class default, None, would not), and
# the signature shown (help, inspect, the API reference) is the generated __init__'s, not __new__'s.
setattr(SamplingParams, "__signature__", inspect.signature(SamplingParams.__init__).replace(
    parameters=list(inspect.signature(SamplingParams.__init__).parameters.values())[1:]))
setattr(SamplingParams, "max_new_tokens", property(
    lambda self: self.max_tokens,
    doc="``max_tokens`` under ``generate``'s name (an alias, accepted when the object is made)."))
