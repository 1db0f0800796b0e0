"""Per-request sampling settings (``SamplingParams``, after vLLM's) and a batched sampler on the
logits' device that honours them.

The filter applies, per row, what transformers' logits processors apply for the same settings,
in their order and with their tie and boundary rules (``generation/logits_process.py``):

1. temperature: ``scores / temperature`` (``TemperatureLogitsWarper``);
2. top-k: every score below the k-th largest is removed, so ties with the k-th are all kept
   (``TopKLogitsWarper``);
3. top-p: the scores left are sorted ascending (the same ``torch.sort`` call, so tied tokens at
   the boundary fall as there), their softmax is summed up in that order and every token whose
   running sum is ``<= 1 - top_p`` is removed; the last (largest) is always kept
   (``TopPLogitsWarper``);
4. min-p: tokens whose probability is below ``min_p`` times the largest probability are removed
   (``MinPLogitsWarper``).

Removed tokens get ``-inf``. Rows with ``temperature == 0`` are greedy: the first argmax of the
raw logits. The draw is inverse-CDF sampling with one uniform number per row, a splitmix64 hash
of the row's ``(seed, step)``: the same for a request wherever it is in the batch, on every
device and in numpy. Torch logits are sampled on their device (``sample``); others (MLX, numpy)
on the host in numpy, without importing torch (``sample_numpy``: the same tokens on float64
logits; top-p ties: see ``filter_numpy``). ``draw_rows`` picks the path.

``sampling_params_for`` turns ``Engine.generate``'s keyword shorthands (``temperature=``, ``n=``,
``seed=``, ...) into one ``SamplingParams`` per prompt.

The samplers are in the sibling modules ``sampling_torch`` (on torch logits' device) and
``sampling_numpy`` (on the host, no torch); this module re-exports their names.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import random
from collections.abc import Iterable
from typing import Any, Optional, Sequence, Union

from ..errors import InvalidArgumentError
# the samplers' names (their private helpers too) stay importable from here
from .sampling_numpy import (_filter_row, _is_torch, _log_softmax_numpy, _mix_numpy, _probs,
                             draw_rows, filter_numpy, sample_numpy, top_logprobs, uniforms_numpy)
from .sampling_torch import (_GAMMA, _MASK64, _MIX1, _MIX2, _SEED_LIMIT, _check, _column,
                             _compute_dtype, _mix, _seeds_steps, _shr, filter_logits, sample,
                             uniforms)

__all__ = ["GREEDY_TEMPERATURE", "MAX_N", "SamplingParams", "draw_rows", "filter_logits",
           "filter_numpy", "sample", "sample_numpy", "sampling_params_for", "top_logprobs",
           "uniforms", "uniforms_numpy"]

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
    """

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

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1)
        _real("temperature", self.temperature, lambda v: v >= 0, "a finite number >= 0 (0: greedy)")
        _real("top_p", self.top_p, lambda v: 0 < v <= 1, "a number in (0, 1] (1: off)")
        _integer("top_k", self.top_k, -1, allowed="an integer >= 1, or 0 or -1 (off)")
        _real("min_p", self.min_p, lambda v: 0 <= v <= 1, "a number in [0, 1] (0: off)")
        if self.seed is not None:
            _integer("seed", self.seed, 0, _SEED_LIMIT, "None or an integer in [0, 2**63)")
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
            return random.SystemRandom().randrange(_SEED_LIMIT)
        return (self.seed + j) % _SEED_LIMIT


# ---------------------------------------------------------------------------- generate's arguments
_LEGACY_SEED_STRIDE = 1_000_003
"""``generate(seed=s)``: prompt ``i`` draws with ``SamplingParams.seed = s * stride + i * n``."""
_LEGACY_KEYWORDS = ("max_new_tokens", "n", "temperature", "seed", "stop_token_ids", "ignore_eos")


def _whole(value, name: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__") \
            or int(value) < low:
        raise InvalidArgumentError(f"{name}={value!r} must be an integer >= {low}")
    return int(value)


def sampling_params_for(prompts, sampling_params=None, /, **legacy) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt from the arguments of ``Engine.generate`` / ``stream``.

    ``sampling_params``: a ``SamplingParams`` (used for every prompt) or a sequence of one per
    prompt, returned as a list. Without it, the legacy keywords (those that are not None) build
    one per prompt: ``max_new_tokens`` (default 32, ``SamplingParams.max_tokens``), ``n``
    (default 1), ``temperature`` (default 0: greedy), ``seed`` (default 0; prompt ``i`` draws
    with ``SamplingParams.seed = (seed * 1000003 + i * n) % 2**63``), ``stop_token_ids``
    (default none) and ``ignore_eos`` (default False).

    Raises ``InvalidArgumentError`` when ``prompts`` is not a sequence (a string is not),
    ``sampling_params`` and a legacy keyword are both given, ``sampling_params`` is neither a
    ``SamplingParams`` nor one per prompt, a keyword is unknown, or a value is out of range.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidArgumentError(
            f"prompts must be a list of token id lists, got {type(prompts).__name__}")
    given = {k: v for k, v in legacy.items() if v is not None}
    if sampling_params is not None:
        if given:
            raise InvalidArgumentError(
                f"generate takes sampling_params or {', '.join(given)}, not both: put them "
                f"in the SamplingParams")
        params = sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if isinstance(params, (str, bytes)) or not isinstance(params, Sequence) \
                or len(params) != len(prompts) \
                or not all(isinstance(p, SamplingParams) for p in params):
            raise InvalidArgumentError(
                f"sampling_params must be a SamplingParams or a list of {len(prompts)} of "
                f"them (one per prompt), got {sampling_params!r:.80}")
        return list(params)
    unknown = set(given) - set(_LEGACY_KEYWORDS)
    if unknown:
        raise InvalidArgumentError(f"unknown generate arguments: {sorted(unknown)}")
    max_new = _whole(given.get("max_new_tokens", 32), "max_new_tokens", 1)
    n = _whole(given.get("n", 1), "n", 1)
    seed = _whole(given.get("seed", 0), "seed", 0)
    temperature = given.get("temperature", 0.0)
    try:
        temperature = float(temperature)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"temperature={temperature!r} must be a number >= 0") from None
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidArgumentError(f"temperature={temperature!r} must be a finite number >= 0")
    stops = given.get("stop_token_ids", ())
    if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
        raise InvalidArgumentError(
            f"stop_token_ids={stops!r:.80} must be a sequence of integer token ids")
    stops = list(stops)
    for t in stops:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise InvalidArgumentError(f"stop_token_ids must hold integer ids, got {t!r:.80}")
    ignore = given.get("ignore_eos", False)
    if not isinstance(ignore, bool):
        raise InvalidArgumentError(f"ignore_eos={ignore!r} must be True or False")
    return [SamplingParams(max_tokens=max_new, temperature=temperature, n=n,
                           seed=(seed * _LEGACY_SEED_STRIDE + i * n) % 2 ** 63,
                           stop_token_ids=[int(t) for t in stops], ignore_eos=ignore)
            for i in range(len(prompts))]
