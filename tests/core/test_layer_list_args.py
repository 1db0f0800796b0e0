"""``mark_layers_run`` / ``rerun_layers`` take a list of layer ids; anything else is a typed
``InvalidArgumentError`` that changes nothing (issue 28, item 8: ``mark_layers_run(None)`` raised
``TypeError``). A set (``layers_run`` is a frozenset) is still taken."""

import numpy as np
import pytest

import kvcache
from kvcache import InvalidArgumentError


@pytest.fixture
def cache():
    cfg = kvcache.CacheConfig(num_layers=3, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_total_tokens=64, dtype="float32", rope_mode="none")
    c = kvcache.PagedKVCache(cfg, backend="reference")
    c.add_sequence(0)
    c.begin_forward([0], [1])
    c.mark_layers_run([1])
    return c


BAD = [None, 5, "01", 1.5, [None], [0.0], [True], {0: 1}, [[0]], np.zeros((1, 1), np.int64),
       np.array([0.5]), (x for x in [0])]


@pytest.mark.parametrize("call", ["mark_layers_run", "rerun_layers"])
@pytest.mark.parametrize("layers", BAD, ids=[repr(b)[:20] for b in BAD])
def test_a_bad_layer_list_is_a_typed_error_and_changes_nothing(cache, call, layers):
    if call == "rerun_layers" and layers is None:
        pytest.skip("rerun_layers(None) means every layer")
    with pytest.raises(InvalidArgumentError, match=f"{call}: layer"):
        getattr(cache, call)(layers)
    assert cache.layers_run == frozenset({1})


def test_sets_ranges_and_arrays_of_layers_are_taken(cache):
    cache.mark_layers_run(frozenset({0}))
    cache.mark_layers_run(range(2, 3))
    assert cache.layers_run == frozenset({0, 1, 2})
    cache.rerun_layers(np.array([0, 2]))
    assert cache.layers_run == frozenset({1})
    cache.mark_layers_run(cache.layers_run | {0, 2})
    cache.end_forward()
    assert cache.sequence_length(0) == 1


def test_out_of_range_layers_are_named(cache):
    with pytest.raises(InvalidArgumentError, match=r"layers \[3, -1\] are not in \[0, 3\)"):
        cache.mark_layers_run([0, 3, -1])
    assert cache.layers_run == frozenset({1})
