"""Argument checks shared by every public entry point (``CacheConfig``, ``PagedKVCache``).

Every public argument is checked here before the cache changes anything, in Python ints (no
numpy arithmetic that could wrap), and a bad one raises ``InvalidArgumentError`` naming the
argument, the value and the limit. What is accepted:

* an int: a Python ``int`` or a numpy integer scalar; never a ``bool`` / ``numpy.bool_``, a
  float (not even ``1.0``), a string or None. Returned as a plain Python int (an int
  subclass as its stored value: its own ``__int__``, ``__eq__`` or ``__hash__`` never reach
  the cache).
* a sequence id: such an int in the int64 range.
* a list of ints (sequence ids, append lengths, tree parents, leaf indices): a list, tuple or
  range of such ints, or a 1-D numpy integer array (or an object numpy converts to one, e.g. a
  CPU torch tensor); not a set, dict, string or generator.
* a bool: ``bool`` or ``numpy.bool_`` only (``'no'``, 0 and 1 are refused).
* a float: an int or a real float (Python or numpy), not a bool; finite unless stated.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from ..errors import InvalidArgumentError

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1

_INT_TYPES = frozenset({int, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                        np.uint32, np.uint64, np.intc, np.uintc, np.intp, np.uintp,
                        np.longlong, np.ulonglong})
"""Exact types of int scalars (``bool`` is not among them): a cheap test for hot paths."""


def show(value) -> str:
    """A value for an error message, with its type where the repr hides it."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    if type(value) in (int, list, tuple) or value is None or isinstance(value, np.generic):
        return text
    return f"{text} ({type(value).__name__})"


def _span(lo, hi, limit: str = "") -> str:
    if lo is not None and hi is not None:
        text = f"in [{lo}, {hi}]"
    elif lo is not None:
        text = f">= {lo}"
    else:
        text = f"<= {hi}"
    return f"{text} ({limit})" if limit else text


def is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _plain(value) -> int:
    """An int's value as a plain Python int. An int subclass's own ``__int__`` / ``__index__``
    is not called (it may lie): ``int.__index__`` reads the stored value."""
    return int.__index__(value) if isinstance(value, int) else int(value)


def int_arg(value, name: str, lo: Optional[int] = None, hi: Optional[int] = None,
            limit: str = "") -> int:
    """``value`` as a Python int in ``[lo, hi]`` (either bound may be None)."""
    if not is_int(value):
        raise InvalidArgumentError(f"{name} must be an int, got {show(value)}")
    v = _plain(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(f"{name}={v} must be {_span(lo, hi, limit)}")
    return v


def seq_id_arg(value, name: str = "seq_id") -> int:
    """A sequence id: an int (not a bool) in the int64 range, as a Python int."""
    return int_arg(value, name, INT64_MIN, INT64_MAX)


def bool_arg(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be True or False, got {show(value)}")
    return bool(value)


def float_arg(value, name: str, *, finite: bool = True, positive: bool = False) -> float:
    """``value`` as a Python float: an int or real float (not a bool, string or complex)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"{name} must be a real number, got {show(value)}")
    try:
        f = float(value)
    except OverflowError:           # an int beyond the float range
        f = math.inf
    if finite and not math.isfinite(f):
        raise InvalidArgumentError(f"{name} must be finite, got {show(value)}")
    if positive and not f > 0:
        raise InvalidArgumentError(f"{name} must be positive, got {show(value)}")
    return f


def _items(values, name: str):
    """A list/tuple/range as is, anything else as a numpy array (or a typed error)."""
    if isinstance(values, (list, tuple, range, np.ndarray)):
        return values
    if hasattr(values, "__array__") and not isinstance(values, np.generic):
        try:
            return np.asarray(values)
        except Exception:       # e.g. a device tensor
            pass
    raise InvalidArgumentError(
        f"{name} must be a list, tuple or 1-D integer array, got {show(values)}")


def int_values(values, name: str, lo: Optional[int] = None, hi: Optional[int] = None, *,
               length: Optional[int] = None, owner: Optional[Callable[[int], str]] = None,
               limit: str = "") -> list:
    """``values`` as a list of Python ints, each in ``[lo, hi]``; ``length``: the number
    expected; ``owner(i)`` names what entry ``i`` belongs to (e.g. ``'sequence 3'``)."""
    items = _items(values, name)
    if isinstance(items, np.ndarray):
        if items.ndim != 1 or items.dtype.kind not in "iu":
            raise InvalidArgumentError(
                f"{name} must be a 1-D integer array, got shape {items.shape} dtype {items.dtype}")
        items = items.tolist()          # exact Python ints, whatever the dtype
    else:
        types = set(map(type, items))
        if not types <= _INT_TYPES:
            i = next((i for i, x in enumerate(items) if not is_int(x)), None)
            if i is not None:
                of = f" of {owner(i)}" if owner else ""
                raise InvalidArgumentError(f"{name}[{i}]{of} must be an int, got {show(items[i])}")
        items = list(items) if types <= {int} else [_plain(x) for x in items]
    if length is not None and len(items) != length:
        raise InvalidArgumentError(f"{name} must hold {length} ints, got {len(items)}: {show(values)}")
    if items and ((lo is not None and min(items) < lo) or (hi is not None and max(items) > hi)):
        i = next(i for i, x in enumerate(items) if (lo is not None and x < lo) or (hi is not None and x > hi))
        of = f" of {owner(i)}" if owner else ""
        raise InvalidArgumentError(f"{name}[{i}] = {items[i]}{of} must be {_span(lo, hi, limit)}")
    return items


def int_array(values, name: str, lo: int, hi: int, **kw) -> np.ndarray:
    """``int_values`` as an int64 array (the bounds must lie in the int64 range)."""
    return np.array(int_values(values, name, lo, hi, **kw), dtype=np.int64)


def seq_id_list(values, name: str = "seq_ids") -> list:
    return int_values(values, name, INT64_MIN, INT64_MAX)


def plain_ints(values) -> Optional[list]:
    """A list of int scalars (no bools) when ``values`` is a list/tuple of them or a 1-D integer
    array, else None. One type pass, no per-element Python."""
    if isinstance(values, np.ndarray):
        return values.tolist() if values.ndim == 1 and values.dtype.kind in "iu" else None
    if isinstance(values, tuple):
        values = list(values)
    elif not isinstance(values, list):
        return None
    return values if _INT_TYPES.issuperset(map(type, values)) else None


# ---------------------------------------------------------------------- decode fast path
# A repeat decode step compares its ids and lengths with the last step's checked ones; these
# keep that comparison cheap while refusing what compares equal but is not an int (True == 1,
# 1.0 == 1).

def bool_like_positions(checked_ids: list) -> tuple:
    """Where checked (int) ids are 0 or 1: the only places a bool can equal one of them."""
    return tuple(i for i in (_find(checked_ids, 0), _find(checked_ids, 1)) if i is not None)


def _find(values: list, x) -> Optional[int]:
    try:
        return values.index(x)
    except ValueError:
        return None


def same_int_ids(ids, checked_ids: list, bool_like: tuple = ()) -> bool:
    """``ids`` equals ``checked_ids`` and holds only ints of exact int types. The types are
    checked before any compare, in one C-level pass: ``==`` is the element's own ``__eq__``,
    and a bool, a float, or an int subclass whose ``__eq__`` lies would compare equal to
    another sequence's id (and its forward would write into that sequence). ``bool_like`` is
    unused (the type pass covers bools); kept for callers."""
    if type(ids) is not list:
        ids = plain_ints(ids)
        return ids is not None and ids == checked_ids
    if [*map(type, ids)].count(int) != len(ids) and plain_ints(ids) is None:
        return False                        # not all plain ints (numpy int scalars pass)
    return ids == checked_ids


def all_int_ones(lengths, batch: int) -> bool:
    """``lengths`` is ``batch`` int ones (a list, tuple or 1-D integer array), not bools."""
    if isinstance(lengths, np.ndarray):
        return lengths.shape == (batch,) and lengths.dtype.kind in "iu" and bool((lengths == 1).all())
    if not isinstance(lengths, (list, tuple)) or len(lengths) != batch:
        return False
    try:                                    # an array element compares element-wise
        if lengths.count(1) != batch:
            return False
    except Exception:
        return False
    # every value is 1, only the type is left: one C-level pass (numpy int scalars: a full check)
    return [*map(type, lengths)].count(int) == batch or plain_ints(lengths) is not None
