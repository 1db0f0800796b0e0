"""``SamplingParams(max_new_tokens=...)`` (issue 53 item 5): ``generate``'s name for the knob is an
alias of ``max_tokens``; both given and different is a typed error naming both."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle

import pytest

from kvcache.errors import InvalidArgumentError
from kvcache.serving import SamplingParams


def test_max_new_tokens_is_an_alias_of_max_tokens():
    p = SamplingParams(max_new_tokens=7, temperature=0.5)
    assert p.max_tokens == 7 and p.max_new_tokens == 7
    assert p == SamplingParams(max_tokens=7, temperature=0.5)
    assert "max_new_tokens" not in repr(p)                      # one field, shown once
    assert SamplingParams().max_new_tokens == 32                # reads back as max_tokens
    assert SamplingParams(max_tokens=7, max_new_tokens=7).max_tokens == 7     # same value: fine
    assert SamplingParams(7, max_new_tokens=7).max_tokens == 7
    # the object still copies, pickles and is replaced as a plain dataclass
    assert dataclasses.replace(p, n=2).max_tokens == 7
    assert pickle.loads(pickle.dumps(p)) == p == copy.deepcopy(p)
    assert "max_new_tokens" in inspect.signature(SamplingParams).parameters
    assert list(inspect.signature(SamplingParams).parameters)[0] == "max_tokens"


@pytest.mark.parametrize("args,kwargs", [
    ((), {"max_tokens": 4, "max_new_tokens": 5}),
    ((4,), {"max_new_tokens": 5}),
    ((), {"max_tokens": 32, "max_new_tokens": 5}),              # an explicit default counts
])
def test_both_names_with_different_values_are_a_typed_error_naming_both(args, kwargs):
    with pytest.raises(InvalidArgumentError, match=r"max_tokens=\d+ and max_new_tokens=5"):
        SamplingParams(*args, **kwargs)


@pytest.mark.parametrize("value", [0, -1, 1.5, "8", True])
def test_a_bad_alias_is_refused_under_its_own_name(value):
    with pytest.raises(InvalidArgumentError, match="SamplingParams.max_new_tokens="):
        SamplingParams(max_new_tokens=value)
