"""Every public error type: the right type, a message naming the sequence / value / limit, and
nothing changed (lengths, free pages, stored KV)."""

import numpy as np
import pytest

import kvcache
from kvcache import (CacheFullError, ForwardStateError, InvalidArgumentError,
                     SequenceExistsError, SequenceNotFoundError, UnsupportedFeatureError)


def config(**kw):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                max_batch_size=4, max_total_tokens=32, prefill_chunk_size=32, dtype="float32",
                rope_mode="normal")
    base.update(kw)
    return kvcache.CacheConfig(**base)


def run_forward(cache, ids, lens, tree=None, seed=0):
    rng = np.random.default_rng(seed)
    c = cache.config
    t = sum(lens)
    with cache.forward(ids, lens, tree):
        for layer in range(c.num_layers):
            q = cache.from_numpy(rng.standard_normal((t, c.num_qo_heads, c.head_dim)))
            k = cache.from_numpy(rng.standard_normal((t, c.num_kv_heads, c.head_dim)))
            v = cache.from_numpy(rng.standard_normal((t, c.num_kv_heads, c.head_dim)))
            cache.attention(layer, q, k, v)


@pytest.fixture
def cache():
    cache = kvcache.PagedKVCache(config(), backend="reference")
    cache.add_sequence(1)
    cache.add_sequence(2)
    run_forward(cache, [1, 2], [6, 3])
    return cache


def snapshot(cache):
    return (cache.num_available_pages, cache.num_sequences,
            {s: cache.sequence_length(s) for s in cache.sequence_ids},
            {s: [kvcache.to_numpy(a).copy() for a in cache.get_kv(s)] for s in cache.sequence_ids})


def assert_same(a, b):
    assert a[:3] == b[:3]
    for s in a[3]:
        for x, y in zip(a[3][s], b[3][s]):
            np.testing.assert_array_equal(x, y)


CASES = [
    ("add existing", lambda c: c.add_sequence(1), SequenceExistsError, ["1"]),
    ("add non-int", lambda c: c.add_sequence("x"), InvalidArgumentError, ["seq_id"]),
    ("remove missing", lambda c: c.remove_sequence(9), SequenceNotFoundError, ["9"]),
    ("fork missing parent", lambda c: c.fork_sequence(9, 3), SequenceNotFoundError, ["9"]),
    ("fork onto existing", lambda c: c.fork_sequence(1, 2), SequenceExistsError, ["2"]),
    ("fork past end", lambda c: c.fork_sequence(1, 3, 7), InvalidArgumentError, ["7", "1", "6"]),
    ("fork negative", lambda c: c.fork_sequence(1, 3, -2), InvalidArgumentError, ["-2"]),
    ("popn too many", lambda c: c.popn(2, 4), InvalidArgumentError, ["4", "2", "3"]),
    ("popn missing", lambda c: c.popn(5, 1), SequenceNotFoundError, ["5"]),
    ("window unsupported", lambda c: c.enable_sliding_window(1, 4, 1), InvalidArgumentError,
     ["support_sliding_window"]),
    ("forward missing", lambda c: c.begin_forward([1, 7], [1, 1]), SequenceNotFoundError, ["7"]),
    ("forward duplicate", lambda c: c.begin_forward([1, 1], [1, 1]), InvalidArgumentError, ["1"]),
    ("forward zero length", lambda c: c.begin_forward([1], [0]), InvalidArgumentError, ["0", "1"]),
    ("forward length mismatch", lambda c: c.begin_forward([1, 2], [1]), InvalidArgumentError, ["2"]),
    ("forward float length", lambda c: c.begin_forward([1], [1.5]), InvalidArgumentError, []),
    ("forward over chunk", lambda c: c.begin_forward([1, 2], [17, 16]), InvalidArgumentError, ["33", "32"]),
    ("forward over batch", lambda c: c.begin_forward([1, 2, 3, 4, 5], [1] * 5), InvalidArgumentError, ["4"]),
    ("forward full", lambda c: c.begin_forward([1, 2], [16, 12]), CacheFullError, ["7", "6", "free"]),
    ("tree wrong length", lambda c: c.begin_forward([1], [2], [-1]), InvalidArgumentError, ["2"]),
    ("tree bad parent", lambda c: c.begin_forward([1], [2], [-1, 1]), InvalidArgumentError, ["1", "parent"]),
    ("tree parent < -1", lambda c: c.begin_forward([1], [1], [-3]), InvalidArgumentError, ["-3"]),
    ("get_kv range", lambda c: c.get_kv(1, 2, 9), InvalidArgumentError, ["9", "6"]),
    ("get_kv missing", lambda c: c.get_kv(4), SequenceNotFoundError, ["4"]),
    ("attention outside forward", lambda c: c.attention(0, None, None, None), ForwardStateError,
     ["begin_forward"]),
    ("end outside forward", lambda c: c.end_forward(), ForwardStateError, ["begin_forward"]),
    ("query_positions outside", lambda c: c.query_positions(), ForwardStateError, ["begin_forward"]),
    ("commit bad leaf", lambda c: c.commit_accepted_token_tree_nodes([1], [0]), InvalidArgumentError,
     ["0", "1"]),
    ("commit mismatch", lambda c: c.commit_accepted_token_tree_nodes([1, 2], [-1]), InvalidArgumentError, []),
]


@pytest.mark.parametrize("name,call,error,words", CASES, ids=[c[0] for c in CASES])
def test_error_is_typed_named_and_atomic(cache, name, call, error, words):
    before = snapshot(cache)
    with pytest.raises(error) as info:
        call(cache)
    assert isinstance(info.value, kvcache.KVCacheError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_same(before, snapshot(cache))
    run_forward(cache, [1, 2], [1, 1])      # the cache still works


def test_error_base_classes():
    assert issubclass(SequenceNotFoundError, KeyError)
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(CacheFullError, MemoryError)


def test_attention_input_errors_leave_kv_unchanged(cache):
    before = snapshot(cache)
    c = cache.config
    cache.begin_forward([1], [2])
    good_q = cache.from_numpy(np.zeros((2, 4, 8)))
    good_kv = cache.from_numpy(np.zeros((2, 2, 8)))
    bad = [
        (cache.from_numpy(np.zeros((3, 4, 8))), good_kv, good_kv, "(2, 4, 8)"),
        (good_q, cache.from_numpy(np.zeros((2, 4, 8))), good_kv, "(2, 2, 8)"),
        (good_q, good_kv, np.zeros((2, 2, 8), np.float16), "float16"),
        (good_q, good_kv, [[0.0]], "backend array"),
    ]
    for q, k, v, word in bad:
        with pytest.raises(InvalidArgumentError, match=word.replace("(", r"\(").replace(")", r"\)")):
            cache.attention(0, q, k, v)
    with pytest.raises(InvalidArgumentError, match="layer_id 5"):
        cache.attention(5, good_q, good_kv, good_kv)
    cache.attention(0, good_q, good_kv, good_kv)
    with pytest.raises(ForwardStateError, match="layer 0 already"):
        cache.attention(0, good_q, good_kv, good_kv)
    for call in (lambda: cache.add_sequence(3), lambda: cache.popn(1, 1),
                 lambda: cache.fork_sequence(1, 3), lambda: cache.remove_sequence(2),
                 lambda: cache.begin_forward([2], [1]), lambda: cache.get_kv(1)):
        with pytest.raises(ForwardStateError, match="begin_forward and end_forward"):
            call()
    cache.attention(1, good_q, good_kv, good_kv)
    cache.end_forward()
    assert cache.sequence_length(1) == before[2][1] + 2


def test_uncommitted_tree_blocks_plain_forward_fork_and_popn(cache):
    run_forward(cache, [1], [3], tree=[-1, 0, 0])
    before = (cache.sequence_length(1), cache.num_available_pages)
    for call in (lambda: cache.begin_forward([1], [1]), lambda: cache.fork_sequence(1, 5),
                 lambda: cache.popn(1, 1)):
        with pytest.raises(ForwardStateError, match="1"):
            call()
    assert (cache.sequence_length(1), cache.num_available_pages) == before
    cache.commit_accepted_token_tree_nodes([1], [2])
    assert cache.sequence_length(1) == 6 + 2


def test_cache_full_is_expected_and_recoverable(cache):
    # 32 tokens + 1 spare page of 4: fill, fail, free, succeed
    free = cache.num_available_pages
    with pytest.raises(CacheFullError) as info:
        run_forward(cache, [1, 2], [16, 16])
    assert "free" in str(info.value)
    assert cache.num_available_pages == free
    cache.remove_sequence(2)
    run_forward(cache, [1], [12])


def test_unsupported_features_are_declared():
    from kvcache.reference import ReferenceBackend
    from kvcache.plugins import register_plugin, reset_plugins

    class NoTrees(ReferenceBackend):
        name = "no-trees-test"
        capabilities = kvcache.Capabilities(dtypes=("float32",), head_dims=(8,))

    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [NoTrees]

    register_plugin(Plugin(), name="no-trees-test")
    try:
        with pytest.raises(UnsupportedFeatureError, match="sliding_window"):
            kvcache.PagedKVCache(config(support_sliding_window=True, rope_mode="none"),
                                 backend="no-trees-test")
        with pytest.raises(UnsupportedFeatureError, match="dtypes"):
            kvcache.PagedKVCache(config(dtype="float16"), backend="no-trees-test")
        with pytest.raises(UnsupportedFeatureError, match="inline_rope"):
            kvcache.PagedKVCache(config(rope_mode="inline"), backend="no-trees-test")
        with pytest.raises(UnsupportedFeatureError, match="batch_invariant"):
            kvcache.PagedKVCache(config(batch_invariant=True, rope_mode="none"),
                                 backend="no-trees-test")
        c = kvcache.PagedKVCache(config(rope_mode="none"), backend="no-trees-test")
        c.add_sequence(0)
        with pytest.raises(UnsupportedFeatureError, match="tree_attention"):
            c.begin_forward([0], [2], [-1, 0])
        assert c.sequence_length(0) == 0
    finally:
        reset_plugins()


def test_config_validation_names_the_field():
    with pytest.raises(InvalidArgumentError, match="batch_invariant=True with support_sliding"):
        config(batch_invariant=True, support_sliding_window=True)
    with pytest.raises(InvalidArgumentError, match="batch_invariant"):
        config(batch_invariant="yes")
    with pytest.raises(InvalidArgumentError, match="num_qo_heads=6.*num_kv_heads=4"):
        config(num_qo_heads=6, num_kv_heads=4)
    with pytest.raises(InvalidArgumentError, match="dtype"):
        config(dtype="int8")
    with pytest.raises(InvalidArgumentError, match="page_size"):
        config(page_size=0)
    with pytest.raises(InvalidArgumentError, match="rope_mode"):
        config(rope_mode="yarn")
