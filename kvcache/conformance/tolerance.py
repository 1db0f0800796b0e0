"""Tolerances of the conformance suite and the comparison every backend test uses.

One table (``TOLERANCES``, per cache dtype) and one comparison (``assert_close``) serve the suite,
the backends' own tests and a plugin author's: a backend is held to the same bound everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Tolerance:
    """How far a backend's result may be from the reference's (float64, rounded once).

    ``atol``/``rtol``: attention outputs and stored K/V; ``lse_atol``: the log-sum-exp (absolute,
    since lse grows with the logits)."""

    atol: float
    rtol: float
    lse_atol: float


TOLERANCES = {
    # float32 storage: kernels accumulate in float32 vs the reference's float64.
    "float32": Tolerance(atol=1e-4, rtol=1e-4, lse_atol=1e-4),
    # 16-bit storage: the output is rounded once (half an ulp is ~1e-3 at |o| ~ 2 in fp16,
    # ~8e-3 in bf16) and rotated q/k are rounded once in "normal" RoPE mode.
    "float16": Tolerance(atol=2e-3, rtol=2e-3, lse_atol=4e-3),
    "bfloat16": Tolerance(atol=2e-2, rtol=2e-2, lse_atol=3e-2),
}


class Mismatch(AssertionError):
    """The backend under test disagrees with the reference."""


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 -> cache dtype -> float64 (round to nearest even), as ``from_numpy`` does."""
    from kvcache.reference import NP_DTYPES
    return np.asarray(x, np.float64).astype(NP_DTYPES[dtype]).astype(np.float64)


_SPURIOUS_NAN = (" (NaN where the reference has none: an unwritten output, a read of an "
                 "unwritten/poisoned page slot, or a masked key's NaN K/V let through)")


def assert_close(what: str, expected, actual, tol, *, lse: bool = False,
                 context: str = "", row_label=None) -> None:
    """Raise ``Mismatch`` unless ``actual`` is within ``tol`` of ``expected`` (both host arrays of
    one shape, e.g. from ``kvcache.to_numpy``), with a readable message (first bad element, count,
    max error).

    ``tol``: a ``Tolerance`` or a cache dtype name (looked up in ``TOLERANCES``). ``lse``: compare
    as a log-sum-exp (``lse_atol``, no relative term). Strict about non-finite values both ways:
    NaN and +-inf must sit exactly where the reference has them (a NaN in a K or V that a query
    sees is NaN in its output; a key it must not see adds nothing; ``-inf`` lse: a row that sees
    no key).
    ``context`` is appended to the message; ``row_label(i)`` names row ``i`` in it."""
    if isinstance(tol, str):
        tol = TOLERANCES[tol]
    e = np.asarray(expected, np.float64)
    a = np.asarray(actual, np.float64)
    if e.shape != a.shape:
        raise Mismatch(f"{what}: shape {a.shape}, reference {e.shape}{context}")
    atol = tol.lse_atol if lse else tol.atol
    rtol = 0.0 if lse else tol.rtol
    e_inf, a_inf = np.isinf(e), np.isinf(a)
    bad = np.isnan(a) != np.isnan(e)
    bad |= e_inf != a_inf
    bad |= e_inf & a_inf & (np.sign(e) != np.sign(a))
    finite = np.isfinite(a) & np.isfinite(e)
    diff = np.where(finite, np.abs(np.where(finite, a, 0) - np.where(finite, e, 0)), 0.0)
    bad |= finite & (diff > atol + rtol * np.abs(np.where(finite, e, 0)))
    if not bad.any():
        return
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    where = f"index {idx}"
    if row_label is not None and idx:
        where += f" ({row_label(idx[0])})"
    spurious_nan = int((np.isnan(a) & ~np.isnan(e)).sum())
    maxerr = float(diff.max()) if diff.size else 0.0
    raise Mismatch(
        f"{what}: {int(bad.sum())} of {bad.size} elements differ from the reference "
        f"(atol={atol}, rtol={rtol}); first at {where}: backend {float(a[idx])!r}, reference {float(e[idx])!r}; "
        f"max finite |diff| {maxerr:.3g}; non-finite: backend {int((~np.isfinite(a)).sum())}, "
        f"reference {int((~np.isfinite(e)).sum())}"
        f"{_SPURIOUS_NAN if spurious_nan else ''}"
        f"{context}")
