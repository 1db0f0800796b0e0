"""kvcache.core.validate: the shared argument checks, and the cheap checks of the decode fast
path (which must refuse exactly what the full checks refuse, and still be taken for ints)."""

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError
from kvcache.core import validate as V

EQUAL_TO_ONE_NOT_INT = [True, np.True_, 1.0, np.float64(1.0), np.float32(1.0), 1 + 0j,
                        Fraction(1), Decimal(1)]


@pytest.mark.parametrize("value", [1, np.int8(1), np.uint64(1), np.int64(-5), 2**40])
def test_int_arg_accepts_ints_as_python_ints(value):
    out = V.int_arg(value, "x")
    assert type(out) is int and out == int(value)


@pytest.mark.parametrize("value", EQUAL_TO_ONE_NOT_INT + [False, None, "1", [1], object()])
def test_int_arg_refuses_non_ints(value):
    with pytest.raises(InvalidArgumentError, match="x must be an int"):
        V.int_arg(value, "x")


def test_int_arg_range_in_python_ints():
    assert V.int_arg(np.uint64(2**64 - 1), "x") == 2**64 - 1
    with pytest.raises(InvalidArgumentError, match=r"x=18446744073709551615 must be in \[0, 9\] \(lim\)"):
        V.int_arg(np.uint64(2**64 - 1), "x", 0, 9, limit="lim")
    with pytest.raises(InvalidArgumentError, match="x=-1 must be >= 0"):
        V.int_arg(-1, "x", lo=0)
    assert V.seq_id_arg(-2**63) == -2**63
    with pytest.raises(InvalidArgumentError, match="seq_id=9223372036854775808"):
        V.seq_id_arg(2**63)


def test_bool_and_float_args():
    assert V.bool_arg(np.True_, "b") is True and V.bool_arg(False, "b") is False
    for bad in ("no", "", 0, 1, None, 1.0):
        with pytest.raises(InvalidArgumentError, match="b must be True or False"):
            V.bool_arg(bad, "b")
    assert V.float_arg(np.float32(0.5), "f") == 0.5 and type(V.float_arg(2, "f")) is float
    for bad in ("1.0", True, np.True_, None, 1 + 0j, [1.0]):
        with pytest.raises(InvalidArgumentError, match="f must be a real number"):
            V.float_arg(bad, "f")
    for bad in (float("nan"), float("inf"), 10**400):
        with pytest.raises(InvalidArgumentError, match="f must be finite"):
            V.float_arg(bad, "f")
    assert V.float_arg(float("inf"), "f", finite=False) == float("inf")
    with pytest.raises(InvalidArgumentError, match="f must be positive"):
        V.float_arg(0.0, "f", positive=True)


@pytest.mark.parametrize("values", [[1, 2], (1, 2), range(1, 3), np.array([1, 2], np.uint8),
                                    [np.int64(1), 2], np.array([1, 2], object)[:0].tolist() + [1, 2]])
def test_int_values_accepts_int_sequences(values):
    out = V.int_values(values, "v", 0, 9)
    assert out == [1, 2] and all(type(x) is int for x in out)


@pytest.mark.parametrize("values,words", [
    (None, "v must be a list, tuple or 1-D integer array"),
    ({1, 2}, "v must be a list"),
    ("12", "v must be a list"),
    (iter([1, 2]), "v must be a list"),
    (np.int64(1), "v must be a list"),
    ([1, True], r"v\[1\] of s1 must be an int, got True"),
    ([1, 2.0], r"v\[1\] of s1 must be an int, got 2.0"),
    (np.array([1.0, 2.0]), "1-D integer array"),
    (np.array([True, False]), "1-D integer array"),
    (np.array([[1, 2]]), "1-D integer array"),
    (np.array([1, 2], object), "1-D integer array"),
    ([1, 2, 3], "v must hold 2 ints, got 3"),
    ([1, 10], r"v\[1\] = 10 of s1 must be in \[0, 9\] \(lim\)"),
    (np.array([1, 2**64 - 1], np.uint64), r"v\[1\] = 18446744073709551615 of s1"),
])
def test_int_values_refuses(values, words):
    with pytest.raises(InvalidArgumentError, match=words):
        V.int_values(values, "v", 0, 9, length=2, owner=lambda i: f"s{i}", limit="lim")


def test_int_array_never_wraps():
    a = V.int_array(np.array([2**63 - 1], np.uint64), "v", 0, 2**63 - 1)
    assert a.dtype == np.int64 and int(a[0]) == 2**63 - 1
    with pytest.raises(InvalidArgumentError):
        V.int_array(np.array([2**64 - 1], np.uint64), "v", -1, 2**31 - 1)    # not a -1


# ---------------------------------------------------------------------- decode fast path
@pytest.mark.parametrize("ids", [[0, 1, 2], [2, 1], [5, 0], [7]])
@pytest.mark.parametrize("bad", EQUAL_TO_ONE_NOT_INT + [False, np.False_, 0.0, 5.0, np.float64(7.0)])
def test_same_int_ids_refuses_what_compares_equal(ids, bad):
    checked = list(ids)
    bool_like = V.bool_like_positions(checked)
    assert V.same_int_ids(list(ids), checked, bool_like)
    for i, x in enumerate(ids):
        if bad == x:
            probe = list(ids)
            probe[i] = bad
            assert probe == checked
            assert not V.same_int_ids(probe, checked, bool_like), probe


def test_same_int_ids_accepts_numpy_ints_and_arrays():
    checked = [3, 0, 1]
    bool_like = V.bool_like_positions(checked)
    assert bool_like == (1, 2)
    assert V.same_int_ids([np.int64(3), 0, np.uint8(1)], checked, bool_like)
    assert V.same_int_ids(np.array([3, 0, 1]), checked, bool_like)
    assert V.same_int_ids((3, 0, 1), checked, bool_like)
    assert not V.same_int_ids(np.array([3.0, 0, 1]), checked, bool_like)
    assert not V.same_int_ids([3, 0], checked, bool_like)
    assert not V.same_int_ids(None, checked, bool_like)


@pytest.mark.parametrize("bad", EQUAL_TO_ONE_NOT_INT)
@pytest.mark.parametrize("at", [0, 1, 4])
def test_all_int_ones_refuses_what_compares_equal(bad, at):
    ones = [1] * 5
    assert V.all_int_ones(ones, 5)
    probe = list(ones)
    probe[at] = bad
    assert probe == ones
    assert not V.all_int_ones(probe, 5)
    assert not V.all_int_ones(tuple(probe), 5)


def test_all_int_ones_accepts_int_containers():
    assert V.all_int_ones((1, 1), 2) and V.all_int_ones(np.ones(2, np.uint8), 2)
    assert V.all_int_ones([np.int64(1), 1], 2)
    assert not V.all_int_ones([1, 1], 3) and not V.all_int_ones(np.ones(2, bool), 2)
    assert not V.all_int_ones(np.ones(2), 2) and not V.all_int_ones(None, 2)


@pytest.mark.parametrize("ids,lengths", [
    ([0, 1], [1, 1]), ((0, 1), (1, 1)), (np.array([0, 1]), np.ones(2, np.int32)),
    ([np.int64(0), 1], [1, np.int64(1)])])
def test_repeat_decode_step_still_takes_the_fast_path(monkeypatch, ids, lengths):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                              page_size=4, max_batch_size=4, max_total_tokens=64,
                              prefill_chunk_size=16, dtype="float32", rope_mode="none")
    cache = kvcache.PagedKVCache(cfg, backend="reference")
    for s in (0, 1):
        cache.add_sequence(s)
    cache.begin_forward([0, 1], [3, 3])
    _finish(cache)
    cache.begin_forward([0, 1], [1, 1])
    _finish(cache)
    from kvcache.core.decode import DecodeReuse
    taken = []
    real = DecodeReuse.next_step
    monkeypatch.setattr(DecodeReuse, "next_step",
                        lambda self, *args: taken.append(1) or real(self, *args))
    for _ in range(3):
        cache.begin_forward(ids, lengths)
        _finish(cache)
    assert len(taken) == 3
    with pytest.raises(InvalidArgumentError, match="must be an int, got True"):
        cache.begin_forward([0, 1], [1, True])
    with pytest.raises(InvalidArgumentError, match="must be an int, got True"):
        cache.begin_forward([0, True], [1, 1])
    assert len(taken) == 3 and cache.sequence_length(0) == 3 + 4


def _finish(cache):
    """Run the open forward's one layer (end_forward refuses a forward with layers missing)."""
    n = len(kvcache.to_numpy(cache.query_positions()))
    q = cache.from_numpy(np.zeros((n, 2, 4)))
    kv = cache.from_numpy(np.zeros((n, 1, 4)))
    cache.attention(0, q, kv, kv)
    cache.end_forward()
