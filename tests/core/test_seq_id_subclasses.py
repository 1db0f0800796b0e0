"""Sequence ids are read as plain ints at the API boundary (issue 28, item 9): an int subclass
whose ``__eq__``, ``__hash__``, ``__int__`` or ``__index__`` lies is the id it stores, never
another. The repeat-decode fast path compared ids with ``==`` (the element's own ``__eq__``),
so ``[Liar(6)]`` after a decode of ``[5]`` sent the forward, and its K/V, to sequence 5."""

import numpy as np
import pytest

import kvcache


class EqLiar(int):
    """Equal to everything."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = int.__hash__


class IntLiar(int):
    """Claims to be 5 when converted."""

    def __int__(self):
        return 5

    def __index__(self):
        return 5

    def __eq__(self, other):
        return other == 5

    def __hash__(self):
        return hash(5)


def make_cache():
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_batch_size=4, max_total_tokens=128,
                              prefill_chunk_size=32, dtype="float32", rope_mode="none")
    return kvcache.PagedKVCache(cfg, backend="reference")


def decode(cache, ids, value):
    n = len(ids)
    c = cache.config
    cache.begin_forward(ids, [1] * n)
    q = cache.from_numpy(np.ones((n, c.num_qo_heads, c.head_dim)))
    k = cache.from_numpy(np.full((n, c.num_kv_heads, c.head_dim), float(value)))
    cache.attention(0, q, k, k)
    cache.end_forward()


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_lying_eq_never_sends_a_forward_to_another_sequence(fast_path):
    cache = make_cache()
    cache.planner.fast_path = fast_path
    for sid in (5, 6):
        cache.add_sequence(sid)
    decode(cache, [5], 1.0)
    decode(cache, [5], 1.0)                 # the next decode of [5] would reuse this plan
    decode(cache, [EqLiar(6)], 6.0)
    assert (cache.sequence_length(5), cache.sequence_length(6)) == (2, 1)
    k6 = kvcache.to_numpy(cache.get_kv(6)[0])
    k5 = kvcache.to_numpy(cache.get_kv(5)[0])
    assert (k6 == 6.0).all() and (k5 == 1.0).all()
    # a batch: the liar in second place, after a decode of the same shape
    decode(cache, [5, 6], 1.0)
    decode(cache, [6, EqLiar(5)], 2.0)
    assert (cache.sequence_length(5), cache.sequence_length(6)) == (4, 3)
    cache.state.pt.check_invariants()


def test_an_int_subclass_is_its_stored_value_everywhere():
    cache = make_cache()
    cache.add_sequence(IntLiar(7))           # stored value 7, whatever __int__ says
    assert cache.sequence_ids == [7] and type(cache.sequence_ids[0]) is int
    with pytest.raises(kvcache.SequenceNotFoundError, match="sequence 5 "):
        cache.sequence_length(5)
    decode(cache, [IntLiar(7)], 3.0)
    decode(cache, [IntLiar(7)], 3.0)
    assert cache.sequence_length(7) == 2
    cache.fork_sequence(IntLiar(7), IntLiar(8))
    assert sorted(cache.sequence_ids) == [7, 8]
    assert all(type(s) is int for s in cache.sequence_ids)
    assert cache.open_plan is None
    cache.begin_forward([IntLiar(8)], [1])
    assert cache.open_plan.seq_ids == [8] and type(cache.open_plan.seq_ids[0]) is int
    cache.abort_forward()
    cache.remove_sequence(IntLiar(7))
    assert cache.sequence_ids == [8]
