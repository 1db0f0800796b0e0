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
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import random
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np

from ..errors import InvalidArgumentError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["SamplingParams", "draw_rows", "filter_logits", "filter_numpy", "sample", "sample_numpy",
           "sampling_params_for", "top_logprobs", "uniforms", "uniforms_numpy"]

_SEED_LIMIT = 2 ** 63


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
    """Scores are divided by it before the filters; 0: greedy (the first argmax). >= 0."""
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
    """Samples of the prompt (they share its prefill). >= 1."""
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
        _integer("n", self.n, 1)
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
        for name in ("max_tokens", "top_k", "n"):
            object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """``temperature == 0``: the pick is the first argmax, the filters and seed unused (the
        engine may then pipeline the step)."""
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


# ---------------------------------------------------------------------------- the filter
def _check(what: str, shape, params) -> None:
    if len(shape) != 2 or shape[0] != len(params):
        raise InvalidArgumentError(f"{what} needs logits (B, vocab) and B SamplingParams, got "
                                   f"shape {tuple(shape)} and {len(params)}")


def _seeds_steps(what: str, params, seeds, steps) -> tuple[list, list]:
    """``seeds`` (None: each row's ``sample_seed()``) and ``steps`` (None: 0) as B-long lists."""
    batch = len(params)
    seeds = [p.sample_seed() for p in params] if seeds is None else list(seeds)
    steps = [0] * batch if steps is None else list(steps)
    if len(seeds) != batch or len(steps) != batch:
        raise InvalidArgumentError(
            f"{what}: {len(seeds)} seeds and {len(steps)} steps for {batch} rows")
    return seeds, steps


def _compute_dtype(logits: "torch.Tensor") -> "torch.dtype":
    import torch
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _column(values: Sequence[float], dtype, device) -> "torch.Tensor":
    import torch
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)[:, None]


def filter_logits(logits: "torch.Tensor", params: Sequence[SamplingParams]) -> "torch.Tensor":
    """The scores of ``logits`` (B, vocab) after temperature, top-k, top-p and min-p of each
    row's ``params`` (removed tokens: ``-inf``), in float32 (float64 for float64 logits), on the
    logits' device. Greedy rows are filtered as if at temperature 1 (the sampler ignores them)."""
    import torch
    _check("filter_logits", logits.shape, params)
    dtype, device = _compute_dtype(logits), logits.device
    vocab = logits.shape[1]
    scores = logits.to(dtype)
    temps = [p.temperature if p.temperature > 0 else 1.0 for p in params]
    if any(t != 1.0 for t in temps):
        scores = scores / _column(temps, dtype, device)
    ninf = float("-inf")
    use_k = [0 < p.top_k < vocab for p in params]
    use_p = [p.top_p < 1.0 for p in params]
    if any(use_k):
        # the k-th largest of each row (transformers' torch.topk(scores, k)[0][..., -1])
        kmax = max(p.top_k for p, k in zip(params, use_k) if k)
        tops = torch.topk(scores, kmax, dim=-1).values
        kth = tops.gather(1, _column([p.top_k - 1 if k else 0 for p, k in zip(params, use_k)],
                                     torch.int64, device))
        on = _column(use_k, torch.bool, device)
        scores = scores.masked_fill((scores < kth) & on, ninf)
    if any(use_p):
        # transformers' own sort call on the same rows: ties at the boundary fall as they do
        # there (torch.sort's order; not stable on the CPU)
        ordered, index = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        # the rows' thresholds in the scores' dtype, as transformers' python scalar is
        floor = _column([1 - p.top_p if u else -1.0 for p, u in zip(params, use_p)], dtype, device)
        cut = cumulative <= floor
        cut[:, -1] = False
        scores = scores.masked_fill(cut.scatter(1, index, cut), ninf)
    if any(p.min_p > 0 for p in params):
        probs = scores.softmax(dim=-1)
        top = probs.amax(dim=-1, keepdim=True)
        drop = probs < _column([p.min_p for p in params], dtype, device) * top
        drop.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(drop, ninf)
    return scores


# ---------------------------------------------------------------------------- the draw
_MASK64 = (1 << 64) - 1


_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)          # splitmix64's constants as int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(z: "torch.Tensor", s: int) -> "torch.Tensor":
    """Logical right shift of int64 ``z`` viewed as uint64."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: "torch.Tensor") -> "torch.Tensor":
    """splitmix64's output function on int64 (wrapping arithmetic, as uint64)."""
    z = z + _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniforms(seeds: "torch.Tensor", steps: "torch.Tensor", dtype=None) -> "torch.Tensor":
    """One number in [0, 1) per row from int64 ``seeds`` and ``steps`` (B,), on their device:
    ``mix(mix(seed) + step)`` with 53 random bits (24 in float32)."""
    import torch
    dtype = dtype or torch.float64
    h = _mix(_mix(seeds) + steps)
    bits = 53 if dtype == torch.float64 else 24
    return _shr(h, 64 - bits).to(dtype) * (2.0 ** -bits)


def sample(logits: "torch.Tensor", params: Sequence[SamplingParams],
           seeds: Optional[Sequence[int]] = None, steps: Optional[Sequence[int]] = None,
           generators: Optional[Sequence["torch.Generator"]] = None):
    """One token per row of ``logits`` (B, vocab), drawn on their device from the distribution
    that ``filter_logits`` leaves for the row's ``params`` (greedy rows: the first argmax).

    Randomness per row: ``seeds[b]`` (default: ``params[b].sample_seed()``) and ``steps[b]``
    (the request's draws so far, default 0) hashed on the device, or ``generators[b]`` (a
    ``torch.Generator`` on the logits' device or the CPU). Returns ``(tokens, logprobs)``, both
    (B,) on the device (int64; float32, float64 for float64 logits): each token's
    log-probability under ``log_softmax(logits)``, the model's distribution before the filters.
    Nothing waits for the device."""
    import torch
    _check("sample", logits.shape, params)
    batch = logits.shape[0]
    dtype, device = _compute_dtype(logits), logits.device
    raw = logits.to(dtype)
    tokens = raw.argmax(dim=-1)
    drawing = [not p.greedy for p in params]
    if any(drawing):
        probs = filter_logits(logits, params).softmax(dim=-1)
        wide = torch.float32 if device.type == "mps" else torch.float64
        if generators is not None:
            if len(generators) != batch:
                raise InvalidArgumentError(f"sample: {len(generators)} generators for {batch} rows")
            u = torch.stack([torch.rand((), generator=g, dtype=wide, device=g.device).to(device)
                             for g in generators])
        else:
            seeds, steps = _seeds_steps("sample", params, seeds, steps)
            pair = torch.tensor([[int(s) % _SEED_LIMIT for s in seeds],
                                 [int(t) & (_MASK64 >> 1) for t in steps]], dtype=torch.int64)
            pair = pair.to(device, non_blocking=True)
            u = uniforms(pair[0], pair[1], wide)
        cdf = probs.to(wide).cumsum(dim=-1)
        total = cdf[:, -1:]
        # u * total < total strictly: the first entry above the goal has a probability > 0
        goal = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        drawn = torch.searchsorted(cdf, goal, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
        mask = torch.tensor(drawing, dtype=torch.bool).to(device, non_blocking=True)
        tokens = torch.where(mask, drawn, tokens)
    logprobs = raw.log_softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
    return tokens, logprobs


# ---------------------------------------------------------------------------- numpy, no torch
def _mix_numpy(z):
    """splitmix64's output function on a numpy uint64 array (wrapping, as ``_mix``)."""
    u = np.uint64
    z = z + u(_GAMMA & _MASK64)
    z = (z ^ (z >> u(30))) * u(_MIX1 & _MASK64)
    z = (z ^ (z >> u(27))) * u(_MIX2 & _MASK64)
    return z ^ (z >> u(31))


def uniforms_numpy(seeds: Sequence[int], steps: Sequence[int]):
    """``uniforms`` in numpy uint64 arithmetic, bit for bit (float64): one number in [0, 1) per
    ``(seeds[b], steps[b])``, the seed mod 2**63 and the step's low 63 bits, as ``sample``."""
    s = np.array([int(x) % _SEED_LIMIT for x in seeds], np.uint64)
    t = np.array([int(x) & (_MASK64 >> 1) for x in steps], np.uint64)
    with np.errstate(over="ignore"):
        h = _mix_numpy(_mix_numpy(s) + t)
    return (h >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _probs(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _filter_row(x, p: SamplingParams):
    """``filter_logits`` of one float64 row ``x`` (vocab,) in numpy (see ``filter_numpy``)."""
    vocab = x.shape[0]
    if p.temperature > 0 and p.temperature != 1.0:
        x = x / p.temperature
    if 0 < p.top_k < vocab:
        x = np.where(x < np.partition(x, vocab - p.top_k)[vocab - p.top_k], -np.inf, x)
    if p.top_p < 1.0:
        order = np.argsort(x, kind="stable")
        cut = np.cumsum(_probs(x[order])) <= 1 - p.top_p
        cut[-1] = False
        x = x.copy()
        x[order[cut]] = -np.inf
    if p.min_p > 0:
        probs = _probs(x)
        drop = probs < p.min_p * probs.max()
        drop[probs.argmax()] = False
        x = np.where(drop, -np.inf, x)
    return x


def filter_numpy(table, params: Sequence[SamplingParams]):
    """``filter_logits`` in numpy on ``table`` (B, vocab) as float64. One difference: top-p
    orders tied scores by id (a stable sort), ``torch.sort`` its own way (on the CPU stable up
    to 16 columns only): where ties straddle the top-p boundary both keep as many of them (the
    same mass), maybe other ids among them."""
    raw = np.asarray(table, np.float64)
    _check("filter_numpy", raw.shape, params)
    out = raw.copy()
    for b, p in enumerate(params):
        out[b] = _filter_row(raw[b], p)
    return out


def _log_softmax_numpy(raw):
    top = raw.max(axis=-1, keepdims=True)
    return raw - (top + np.log(np.exp(raw - top).sum(axis=-1, keepdims=True)))


def sample_numpy(table, params: Sequence[SamplingParams], seeds: Optional[Sequence[int]] = None,
                 steps: Optional[Sequence[int]] = None):
    """``sample`` on the host in numpy, without torch: ``table`` (B, vocab) as float64, the same
    filter (``filter_numpy``), uniforms (``uniforms_numpy``), draw and defaults, so on float64
    logits the same tokens. Returns host ``(tokens (B,) int64, logprobs (B,) float64)``."""
    raw = np.asarray(table, np.float64)
    _check("sample_numpy", raw.shape, params)
    seeds, steps = _seeds_steps("sample_numpy", params, seeds, steps)
    tokens = raw.argmax(axis=-1).astype(np.int64)
    drawing = [b for b, p in enumerate(params) if not p.greedy]
    u = uniforms_numpy([seeds[b] for b in drawing], [steps[b] for b in drawing])
    for b, ub in zip(drawing, u):
        x = _filter_row(raw[b], params[b])
        cdf = np.cumsum(_probs(x))
        total = cdf[-1]
        # u * total < total strictly: the first entry above the goal has a probability > 0
        goal = min(ub * total, np.nextafter(total, 0.0))
        tokens[b] = min(int(np.searchsorted(cdf, goal, side="right")), raw.shape[1] - 1)
    return tokens, _log_softmax_numpy(raw)[np.arange(len(params)), tokens]


def _is_torch(x) -> bool:
    """Whether ``x`` is a torch tensor, without importing torch (none exists if it was not)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def draw_rows(logits, rows: Sequence[int], params: Sequence[SamplingParams],
              seeds: Sequence[int], steps: Sequence[int], to_numpy=None):
    """The engine's call: draw ``d`` from row ``rows[d]`` of ``logits`` with ``params[d]``,
    ``seeds[d]`` and ``steps[d]``: torch logits on their device (``sample``), others through
    ``to_numpy`` (default ``numpy.asarray``) by ``sample_numpy``, never importing torch.
    Returns host ``(tokens (D,) int64, logprobs (D,) float64)``."""
    if not _is_torch(logits):
        host = np.asarray((to_numpy or np.asarray)(logits))
        return sample_numpy(host[np.asarray(list(rows), np.int64)], params, seeds, steps)
    import torch
    index = torch.tensor(list(rows), dtype=torch.int64).to(logits.device, non_blocking=True)
    tokens, logprobs = sample(logits.index_select(0, index), params, seeds, steps)
    both = torch.stack([tokens.to(torch.float64), logprobs.to(torch.float64)]).cpu().numpy()
    return both[0].astype(np.int64), both[1]


def top_logprobs(logits_rows, k: int, to_numpy=None, rows=None):
    """vLLM's ``logprobs=k`` alternatives: the ``min(k, vocab)`` likeliest tokens of each row
    of ``logits_rows`` (D, vocab) (``rows``: only these rows, in this order), ties by id, and
    their ``log_softmax`` under the raw logits (before any filter); torch logits on their
    device, others through ``to_numpy`` in numpy. Returns host ``(ids (D, k) int64, logprobs
    (D, k) float64)``, best first."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 0:
        raise InvalidArgumentError(f"top_logprobs: k={k!r:.40} must be an integer >= 0")
    if _is_torch(logits_rows):
        import torch
        raw = logits_rows.to(_compute_dtype(logits_rows))
        if rows is not None:
            raw = raw.index_select(0, torch.as_tensor(rows, dtype=torch.long, device=raw.device))
    else:
        raw = np.asarray((to_numpy or np.asarray)(logits_rows), np.float64)
        if rows is not None:
            raw = raw[np.asarray(rows, np.int64)]
    if raw.ndim != 2:
        raise InvalidArgumentError(f"top_logprobs needs logits (D, vocab), got {tuple(raw.shape)}")
    d, k = raw.shape[0], min(int(k), raw.shape[1])
    if k == 0:
        return np.zeros((d, 0), np.int64), np.zeros((d, 0), np.float64)
    if isinstance(raw, np.ndarray):      # a partition, not a sort: O(vocab) a row on the host
        kth = -np.partition(-raw, k - 1, axis=-1)[:, k - 1:k]
        above, tied = raw > kth, raw == kth
        pick = above | tied & (np.cumsum(tied, -1) <= k - above.sum(-1, keepdims=True))
        ids = np.nonzero(pick)[1].reshape(d, k)      # k a row, by increasing id
        order = np.argsort(-np.take_along_axis(raw, ids, -1), -1, kind="stable")
        ids = np.take_along_axis(ids, order, -1).astype(np.int64)
        return ids, np.take_along_axis(_log_softmax_numpy(raw), ids, -1)
    ids = torch.sort(raw, dim=-1, descending=True, stable=True)[1][:, :k]
    lps = raw.log_softmax(dim=-1).gather(1, ids)
    return ids.cpu().numpy().astype(np.int64), lps.to(torch.float64).cpu().numpy()
