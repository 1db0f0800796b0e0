"""The sampler on torch logits' device (``filter_logits``, ``uniforms``, ``sample``), and the
row checks and seed range the numpy sampler shares: apart from ``kvcache.integrations.sampling``
(which re-exports it and gives the rules) to keep each module small. torch is imported inside
the functions only."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from ..errors import InvalidArgumentError
# seeds are int64 on the device, SamplingParams.seed's range
from ..serving.sampling_params import SEED_LIMIT as _SEED_LIMIT

if TYPE_CHECKING:  # pragma: no cover
    import torch


class SamplingRow(Protocol):
    """What the samplers read of one row's ``SamplingParams`` (declared here, below
    ``sampling``, which imports the samplers)."""

    @property
    def temperature(self) -> float: ...

    @property
    def top_k(self) -> int: ...

    @property
    def top_p(self) -> float: ...

    @property
    def min_p(self) -> float: ...

    @property
    def greedy(self) -> bool: ...

    def sample_seed(self, j: int = 0) -> int: ...


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


def token_logprobs(logits: "torch.Tensor", tokens: "torch.Tensor") -> "torch.Tensor":
    """The log-probability of ``tokens`` (B,) under ``log_softmax`` of ``logits`` (B, vocab),
    in ``_compute_dtype``: the one formula of every pick (greedy on the device, drawn), so a
    token's log-probability does not depend on which picks share its step."""
    import torch
    raw = logits.to(_compute_dtype(logits))
    return raw.gather(1, tokens[:, None])[:, 0] - torch.logsumexp(raw, dim=-1)


def _column(values: Sequence[float], dtype, device) -> "torch.Tensor":
    import torch
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)[:, None]


def filter_logits(logits: "torch.Tensor", params: Sequence[SamplingRow]) -> "torch.Tensor":
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


def sample(logits: "torch.Tensor", params: Sequence[SamplingRow],
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
    return tokens, token_logprobs(raw, tokens)
