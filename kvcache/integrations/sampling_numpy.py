"""The host sampler in numpy, the torch one's draws bit for bit (``uniforms_numpy``,
``filter_numpy``, ``sample_numpy``), and the engine's calls that pick a path (``draw_rows``,
``top_logprobs``): apart from ``kvcache.integrations.sampling`` (which re-exports them) to keep
each module small. Never imports torch."""

from __future__ import annotations

import numbers
import sys
from typing import Optional, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .sampling_torch import (SamplingRow, _GAMMA, _MASK64, _MIX1, _MIX2, _SEED_LIMIT, _check,
                             _compute_dtype, _seeds_steps, sample)



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


def _filter_row(x, p: SamplingRow):
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


def filter_numpy(table, params: Sequence[SamplingRow]):
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


def sample_numpy(table, params: Sequence[SamplingRow], seeds: Optional[Sequence[int]] = None,
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


def draw_rows(logits, rows: Sequence[int], params: Sequence[SamplingRow],
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
