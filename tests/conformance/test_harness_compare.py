"""The conformance comparison is strict about non-finite values in both directions: NaN and
+-inf must sit at the same positions in the backend's result and the reference's."""

import numpy as np
import pytest

from kvcache.conformance import TOLERANCES, Mismatch, assert_close

TOL = TOLERANCES["float32"]
NAN, INF = float("nan"), float("inf")


def expected():
    e = np.arange(12, dtype=np.float64).reshape(3, 4) / 7.0
    e[1, 2] = NAN
    e[2, 0] = INF
    e[2, 3] = -INF
    return e


@pytest.mark.parametrize("lse", [False, True])
def test_same_non_finite_positions_pass(lse):
    e = expected()
    a = e + 1e-6
    assert_close("o", e, a.astype(np.float32), TOL, lse=lse)


@pytest.mark.parametrize("where, value, why", [
    ((1, 2), 0.25, "finite where the reference is NaN"),
    ((1, 2), -INF, "-inf where the reference is NaN"),
    ((2, 0), NAN, "NaN where the reference is +inf"),
    ((2, 0), -INF, "-inf where the reference is +inf"),
    ((2, 0), 1e30, "finite where the reference is +inf"),
    ((2, 3), NAN, "NaN where the reference is -inf (an lse of a row that sees no key)"),
    ((2, 3), 0.0, "0 where the reference is -inf"),
    ((0, 1), NAN, "NaN where the reference is finite"),
    ((0, 1), INF, "inf where the reference is finite"),
])
@pytest.mark.parametrize("lse", [False, True])
def test_one_spurious_value_fails(where, value, why, lse):
    e = expected()
    a = e.copy()
    a[where] = value
    with pytest.raises(Mismatch, match="1 of 12 elements differ") as info:
        assert_close("o", e, a, TOL, lse=lse)
    assert f"index {where}" in str(info.value), why


def test_message_counts_non_finite_values_of_both():
    e = expected()
    a = np.zeros_like(e)
    with pytest.raises(Mismatch, match=r"non-finite: backend 0, reference 3"):
        assert_close("o", e, a, TOL)
