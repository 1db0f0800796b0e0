"""A batched sampler on the logits' device that honours the per-request sampling settings
(``SamplingParams``, after vLLM's: defined in ``kvcache.serving.sampling_params``, re-exported
here).

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

import math
from collections.abc import Iterable
from typing import Sequence

from ..errors import InvalidArgumentError
# SamplingParams lives with the scheduler that reads it (pure Python); its names (the private
# checks too) stay importable from here
from ..serving.sampling_params import (GREEDY_TEMPERATURE, MAX_N, SamplingParams,  # noqa: F401
                                       _bad, _integer, _real)
# the samplers' names (their private helpers too) stay importable from here
from .sampling_numpy import (_filter_row, _is_torch, _log_softmax_numpy, _mix_numpy, _probs,
                             draw_rows, filter_numpy, sample_numpy, top_logprobs, uniforms_numpy)
from .sampling_torch import (_GAMMA, _MASK64, _MIX1, _MIX2, _SEED_LIMIT, _check, _column,
                             _compute_dtype, _mix, _seeds_steps, _shr, filter_logits, sample,
                             uniforms)

__all__ = ["GREEDY_TEMPERATURE", "MAX_N", "SamplingParams", "draw_rows", "filter_logits",
           "filter_numpy", "sample", "sample_numpy", "sampling_params_for", "top_logprobs",
           "uniforms", "uniforms_numpy"]

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
