"""Bad-input catalogue: every public entry point of ``PagedKVCache`` and ``CacheConfig`` with
wrong types, huge, negative, non-integer and boolean values. Each call must raise a typed
kvcache error (a ``KVCacheError``) whose message shows the value, and leave the cache exactly as
it was: sequence ids, lengths, free pages, the stored KV bit for bit, and the next forward's
output bit-identical to that of a twin cache that never saw the bad call."""

import math

import numpy as np
import pytest

import kvcache
from kvcache import (CacheConfig, CacheFullError, InvalidArgumentError, KVCacheError,
                     SequenceNotFoundError)

HUGE = [2**31, 2**63 - 1, 2**63, 2**64, np.uint64(2**64 - 1), np.int64(2**62)]
NEGATIVE = [-2, -2**31 - 1, -2**63, -2**64, np.int64(-2**63)]
NON_INT = [1.0, 1.5, "1", None, [1], (1,), float("nan"), np.float64(1.0), np.float32(2.0),
           1 + 0j, object()]
BOOLS = [True, False, np.True_, np.False_]
OUT_OF_RANGE_IDS = [2**63, 2**64, -2**63 - 1, np.uint64(2**64 - 1)]  # ids are int64
NOT_AN_ID = NON_INT + BOOLS + OUT_OF_RANGE_IDS
NOT_A_COUNT = NON_INT + BOOLS + HUGE + NEGATIVE      # a position / count argument

BACKENDS = ["reference"] + (["example"] if "example" in kvcache.available_backends() else [])
# Every bad value runs on the reference backend. The example backend (the plugin guide's
# third-party numpy plugin) runs every value of the groups whose bad argument is an array the
# backend itself is asked about (attention's q, the fused qkv and its layer id) and one value of
# every other group in CI; `make test-all` runs all of them. Those other values are refused by the
# core's checks before any backend method is called (a spy on every ExampleBackend method sees
# none during any of them), so they take the same code path on every backend; the sampled one
# shows that a refusal leaves a plugin backend's cache exactly as it was.
REACH_THE_BACKEND = ("q", "fused.qkv", "fused.layer_id")


def per_backend(cases):
    """``cases`` x ``BACKENDS`` as pytest params (ids ``<case>-<backend>``), sampled as above."""
    params, seen = [], set()
    for case in cases:
        group = case[0].split("[")[0]
        for backend in BACKENDS:
            sampled = (backend == "reference" or group in REACH_THE_BACKEND
                       or (backend, group) not in seen)
            seen.add((backend, group))
            params.append(pytest.param(backend, *case, id=f"{case[0]}-{backend}",
                                       marks=() if sampled else pytest.mark.slow))
    return params


def config(**kw):
    base = dict(num_layers=2, num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=4,
                max_batch_size=4, max_total_tokens=64, prefill_chunk_size=32, dtype="float32",
                rope_mode="normal")
    base.update(kw)
    return CacheConfig(**base)


def inputs(cache, total, seed):
    c, rng = cache.config, np.random.default_rng(seed)
    return [cache.from_numpy(rng.standard_normal((total, h, c.head_dim)))
            for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]


def run_forward(cache, ids, lens, tree=None, seed=0):
    outs = []
    with cache.forward(ids, lens, tree):
        for layer in range(cache.config.num_layers):
            q, k, v = inputs(cache, sum(lens), seed + layer)
            outs.append(kvcache.to_numpy(cache.attention(layer, q, k, v)))
    return outs


def build(backend, sliding=False):
    """Sequences 1 (10 tokens), 2 (3 tokens) and 3 (forked from 1 at 6); the last call is a
    decode step of [1, 2], so a repeat of it takes the decode fast path."""
    cfg = config(support_sliding_window=True, rope_mode="none") if sliding else config()
    cache = kvcache.PagedKVCache(cfg, backend=backend)
    cache.add_sequence(1)
    cache.add_sequence(2)
    run_forward(cache, [1, 2], [9, 3])
    cache.fork_sequence(1, 3, 6)
    if sliding:
        cache.enable_sliding_window(2, 8, 1)
    run_forward(cache, [1, 2], [1, 1], seed=1)
    return cache


def bits(array):
    a = np.ascontiguousarray(kvcache.to_numpy(array))
    return a.dtype.str, a.shape, a.tobytes()


def snapshot(cache):
    return dict(ids=sorted(cache.sequence_ids), free=cache.num_available_pages,
                empty=cache.is_empty, total=cache.total_sequence_length,
                lengths={s: cache.sequence_length(s) for s in cache.sequence_ids},
                kv={s: [bits(a) for a in cache.get_kv(s)] for s in cache.sequence_ids})


def assert_unchanged(cache, twin):
    assert cache.open_plan is None, "a failed call left a forward open"
    assert snapshot(cache) == snapshot(twin)
    # the next forward (a repeat of the last decode batch, then a wider one) agrees bit for bit
    for ids in ([1, 2], [1, 2, 3]):
        got = run_forward(cache, ids, [1] * len(ids), seed=7)
        want = run_forward(twin, ids, [1] * len(ids), seed=7)
        assert [bits(o) for o in got] == [bits(o) for o in want]
    assert snapshot(cache) == snapshot(twin)


def shows(value):
    """Strings of which one must appear in the message."""
    if isinstance(value, (bool, np.bool_)):
        return [str(value)]
    if isinstance(value, (int, np.integer)):
        return [str(int(value))]
    if isinstance(value, (float, np.floating)) and math.isnan(value):
        return ["nan"]
    if type(value) is object:
        return ["object"]
    return [repr(value), str(value)]


def uniq(values):
    seen, out = set(), []
    for v in values:
        key = (type(v).__name__, repr(v))
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


def label(v):
    return "object()" if type(v) is object else f"{type(v).__name__}:{v!r}"[:40]


# (name, call, value to show in the message or None, needs a sliding-window cache)
CASES = []


def case(group, call, values, show=True, sliding=False):
    for v in uniq(values):
        CASES.append((f"{group}[{label(v)}]", call, v, show, sliding))


case("add_sequence", lambda c, v: c.add_sequence(v), NOT_AN_ID)
case("remove_sequence", lambda c, v: c.remove_sequence(v), NOT_AN_ID + HUGE + NEGATIVE)
case("sequence_length", lambda c, v: c.sequence_length(v), NOT_AN_ID + HUGE + NEGATIVE)
case("get_kv.seq_id", lambda c, v: c.get_kv(v), NOT_AN_ID + HUGE)
case("get_kv.start", lambda c, v: c.get_kv(1, v), NOT_A_COUNT + [-1, 11])
case("get_kv.end", lambda c, v: c.get_kv(1, 0, v), [x for x in NOT_A_COUNT if x is not None] + [-1, 11])
case("fork.parent", lambda c, v: c.fork_sequence(v, 9), NOT_AN_ID + HUGE)
case("fork.child", lambda c, v: c.fork_sequence(1, v), NOT_AN_ID + [2])
case("fork.pos", lambda c, v: c.fork_sequence(1, 9, v), NOT_A_COUNT + [11])
case("popn.seq_id", lambda c, v: c.popn(v, 1), NOT_AN_ID + HUGE)
case("popn.n", lambda c, v: c.popn(1, v), NOT_A_COUNT + [-1, 11])
case("window.seq_id", lambda c, v: c.enable_sliding_window(v, 4, 1), NOT_AN_ID + HUGE, sliding=True)
case("window.size", lambda c, v: c.enable_sliding_window(1, v, 1),
     NOT_A_COUNT + [0, 1, -1], sliding=True)
case("window.sink", lambda c, v: c.enable_sliding_window(1, 4, v), NOT_A_COUNT + [4, -1], sliding=True)
case("window.unsupported", lambda c, v: c.enable_sliding_window(1, v, 1), [4, 2**31], show=False)
case("begin.seq_ids", lambda c, v: c.begin_forward(v, [1]),
     [None, 1, "1", b"1", 1.0, {1: 1}] + [[x] for x in NOT_AN_ID + HUGE], show=False)
case("begin.lengths", lambda c, v: c.begin_forward([1, 2], v),
     [None, 1, "11", [1], [1, 1, 1], np.ones((2, 1), np.int64), np.array([1.0, 1.0]),
      np.array([True, True]), np.array(["1", "1"]), np.array([1, 1], object)], show=False)
case("begin.length", lambda c, v: c.begin_forward([1, 2], [v, 1]),
     NOT_A_COUNT + [0, -1, 33], show=True)
case("begin.decode_fast_path", lambda c, v: c.begin_forward([1, 2], [v, v]),
     [True, np.True_, 1.0, np.float64(1.0), "1", None], show=False)
case("begin.decode_fast_path_ids", lambda c, v: c.begin_forward(v, [1, 1]),
     [[True, 2], [1.0, 2], [1, 2.0], [np.True_, 2], [np.array([1, 2]), 2], [np.array([1]), 2]],
     show=False)
case("begin.decode_fast_path_lengths", lambda c, v: c.begin_forward([1, 2], v),
     [[np.array([1, 1]), 1], [np.array([1]), 1], (1, True), np.array([1, True], object)],
     show=False)
case("begin.total", lambda c, v: c.begin_forward([1, 2], v),
     [[2**63 - 1] * 2, [2**62] * 2, [2**31] * 2, [2**31 - 1] * 2, [17, 16],
      np.array([2**63 - 1] * 2), np.array([2**63, 2**63], np.uint64)], show=False)
case("begin.tree", lambda c, v: c.begin_forward([1], [2], v),
     ["x", 1, [-1], [-1, 0, 0], [-1, 1], [-1, 2**64 - 1], [-1, 2**63], [-1, True], [-1, 0.0],
      [-1, None], [-2, 0], [-2**63, 0], np.array([2**64 - 1, 0], np.uint64),
      np.array([-1.0, 0.0]), np.array([[-1, 0]])], show=False)
case("begin.tree_root", lambda c, v: c.begin_forward([1], [1], v),
     [np.array([2**64 - 1], np.uint64), [2**64 - 1], [np.uint64(2**64 - 1)], [True], [-1.0]],
     show=False)
case("commit.seq_ids", lambda c, v: c.commit_accepted_token_tree_nodes(v, [-1]),
     [None, 1, "1"] + [[x] for x in NOT_AN_ID + HUGE], show=False)
case("commit.leaf", lambda c, v: c.commit_accepted_token_tree_nodes([1], v),
     [None, 1, "1", [], [-1, -1]] + [[x] for x in NOT_A_COUNT + [0]], show=False)
case("from_numpy", lambda c, v: c.from_numpy(v),
     [None, "x", ["a", "b"], object(), np.array([1 + 2j]), np.array(["1"])], show=False)


@pytest.mark.parametrize("backend,name,call,value,show,sliding", per_backend(CASES))
def test_bad_input_is_typed_and_changes_nothing(backend, name, call, value, show, sliding):
    if sliding and backend != "reference":
        pytest.skip("sliding windows: reference backend only")
    cache, twin = build(backend, sliding), build(backend, sliding)
    with pytest.raises(KVCacheError) as info:
        call(cache, value)
    if show:
        message = str(info.value)
        assert any(s in message for s in shows(value)), (shows(value), message)
    assert_unchanged(cache, twin)


def test_huge_lengths_name_the_sequence_and_the_limit():
    cache, twin = build("reference"), build("reference")
    for lengths in ([2**63 - 1] * 2, [2**62] * 2):
        with pytest.raises(InvalidArgumentError) as info:
            cache.begin_forward([1, 2], lengths)
        message = str(info.value)
        assert str(lengths[0]) in message and "32" in message and "sequence 1" in message, message
    assert_unchanged(cache, twin)


def test_window_overflow_is_typed_and_retry_works():
    cache = build("reference", sliding=True)
    with pytest.raises(InvalidArgumentError, match="2147483648"):
        cache.enable_sliding_window(1, 2**31, 4)
    cache.enable_sliding_window(1, 8, 4)        # no half-set window left behind (sinks cover the shared prefix)
    run_forward(cache, [1], [4])
    assert cache.sequence_length(1) == 8


# ------------------------------------------------------------------ attention inside a forward
ATTENTION_CASES = []


def attention_case(group, call, values):
    for v in uniq(values):
        ATTENTION_CASES.append((f"{group}[{label(v)}]", call, v))


attention_case("layer_id", lambda c, q, k, v, x: c.attention(x, q, k, v),
               NON_INT + BOOLS + HUGE + NEGATIVE + [-1, 2])
attention_case("sm_scale", lambda c, q, k, v, x: c.attention(0, q, k, v, sm_scale=x),
               ["x", "1.0", [1.0], float("nan"), float("inf"), -math.inf, True, np.True_,
                1 + 0j, np.float64("nan"), object()])
attention_case("return_lse", lambda c, q, k, v, x: c.attention(0, q, k, v, return_lse=x),
               ["no", "", 1, 0, None, 1.0, [True]])
attention_case("q", lambda c, q, k, v, x: c.attention(0, x, k, v), [None, "q", 1.0, [[1.0]]])
attention_case("fused.layer_id", lambda c, q, k, v, x: c.attention_with_fused_qkv(
    x, c.from_numpy(np.zeros((2, 8, 64)))), [True, 1.0, None, 2**64])
attention_case("fused.qkv", lambda c, q, k, v, x: c.attention_with_fused_qkv(0, x),
               [None, "qkv", 1])


@pytest.mark.parametrize("backend,name,call,value", per_backend(ATTENTION_CASES))
def test_bad_attention_input_changes_nothing(backend, name, call, value):
    cache, twin = build(backend), build(backend)
    outs = {}
    for c in (cache, twin):
        c.begin_forward([1, 3], [1, 1])
        q, k, v = inputs(c, 2, 5)
        if c is cache:
            with pytest.raises(KVCacheError):
                call(c, q, k, v, value)
        outs[id(c)] = [bits(c.attention(layer, q, k, v)) for layer in range(c.config.num_layers)]
        c.end_forward()
    assert outs[id(cache)] == outs[id(twin)]
    assert_unchanged(cache, twin)


# ------------------------------------------------------------------ CacheConfig
CONFIG_INTS = ("num_layers", "num_qo_heads", "num_kv_heads", "head_dim", "page_size",
               "max_batch_size", "max_total_tokens", "prefill_chunk_size")
CONFIG_CASES = []


def config_case(field, values):
    for v in uniq(values):
        CONFIG_CASES.append((f"{field}[{label(v)}]", field, v))


for _field in CONFIG_INTS:
    config_case(_field, NON_INT + BOOLS + [0, -1, 2**31, 2**63 - 1, 2**64, np.uint64(2**64 - 1)])
config_case("dtype", [None, 1, "int8", b"float32", ["float32"]])
config_case("rope_mode", [None, 1, "yarn", ["normal"]])
config_case("rope_theta", [None, "x", "10000", 0, -1.0, float("nan"), float("inf"), True, 1 + 0j,
                           [1.0]])
config_case("rope_scale", [None, "x", float("nan"), -math.inf, True, np.True_, [1.0]])
config_case("rope_rotary_dim", [None, "x", 1.0, True, -2, 3, 66])
config_case("rope_inv_freq", [None, "x", 1.0, (1.0,), (0.5,) * 33, (float("nan"),) * 32,
                              ("1",) * 32])
config_case("support_sliding_window", ["no", "", 1, 0, None, 1.0, [True]])
config_case("static_decode", ["no", 1, 0, None])
config_case("static_decode_batch_sizes", [None, 1, "1", (True,), (1.0,), (0,), (2, 1), (1, 1), (5,),
                                       (2**64,), (np.uint64(2**64 - 1),), ((1,),)])


@pytest.mark.parametrize("name,field,value", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_is_typed_and_named(name, field, value):
    with pytest.raises(InvalidArgumentError) as info:
        config(**{field: value})
    assert field in str(info.value), str(info.value)


def test_config_accepts_numpy_ints_and_stores_python_ints():
    cfg = config(num_layers=np.int64(2), page_size=np.int32(4), max_total_tokens=np.uint16(64),
                 static_decode_batch_sizes=(np.int64(1), 2), support_sliding_window=np.False_,
                 rope_theta=np.float32(500.0), rope_scale=2)
    assert cfg == config(num_layers=2, page_size=4, max_total_tokens=64,
                         static_decode_batch_sizes=(1, 2), rope_theta=500.0, rope_scale=2.0)
    assert type(cfg.num_layers) is int and type(cfg.max_total_tokens) is int
    assert type(cfg.support_sliding_window) is bool and type(cfg.rope_theta) is float
    assert all(type(b) is int for b in cfg.static_decode_batch_sizes)
    kvcache.PagedKVCache(cfg, backend="reference")


def test_config_rope_frequencies_and_rotary_dim():
    """The model's inverse frequencies (any sequence / array of R/2 floats) and partial rotary
    reach the kernels' RopeSpec; rope_scale multiplies positions in both cases."""
    inv = np.linspace(1.0, 1e-4, 16)
    cfg = config(rope_rotary_dim=np.int64(32), rope_inv_freq=inv, rope_scale=0.5)
    assert cfg.rope_inv_freq == tuple(inv.tolist()) and cfg.rope_rotary_dim == 32
    spec = cfg.rope_spec()
    assert spec.rotary(64) == 32 and not spec.default_frequencies
    np.testing.assert_allclose(spec.frequencies(64), 0.5 * inv)
    plain = config(rope_theta=100.0).rope_spec()
    assert plain.default_frequencies and plain.rotary(64) == 64
    np.testing.assert_allclose(plain.frequencies(64), 100.0 ** (-np.arange(32) / 32))
    assert config(rope_rotary_dim=64).rope_spec().default_frequencies     # 64 of 64: every dim


def test_config_index_range_is_checked():
    # page slots are int32: num_pages * page_size must stay below 2**31
    with pytest.raises(InvalidArgumentError) as info:
        config(max_total_tokens=2**31 - 1, page_size=16)
    message = str(info.value)
    assert "2147483647" in message and "bytes" in message, message
    with pytest.raises(InvalidArgumentError, match="bytes"):
        config(max_total_tokens=2**42)


def test_oversized_cache_is_refused_before_allocating():
    cfg = config(max_total_tokens=2**30)               # 2 TiB of float32 pages
    with pytest.raises(CacheFullError) as info:
        kvcache.PagedKVCache(cfg, backend="reference")
    message = str(info.value)
    assert str(cfg.kv_bytes) in message, message
    assert cfg.kv_bytes == (cfg.num_layers * cfg.num_pages * 2 * cfg.num_kv_heads
                            * cfg.page_size * cfg.head_dim * 4)


def test_memory_bound_comes_from_the_backend(monkeypatch):
    from kvcache.reference import ReferenceBackend
    cfg = config()
    monkeypatch.setattr(ReferenceBackend, "memory_capacity", lambda self: cfg.kv_bytes - 1)
    with pytest.raises(CacheFullError, match=f"{cfg.kv_bytes} bytes.*{cfg.kv_bytes - 1}"):
        kvcache.PagedKVCache(cfg, backend="reference")
    monkeypatch.setattr(ReferenceBackend, "memory_capacity", lambda self: cfg.kv_bytes)
    kvcache.PagedKVCache(cfg, backend="reference")


@pytest.mark.parametrize("value", [None, {}, "config", 1])
def test_cache_needs_a_config(value):
    with pytest.raises(InvalidArgumentError, match="CacheConfig"):
        kvcache.PagedKVCache(value, backend="reference")


@pytest.mark.parametrize("backend,device", [(None, None), (1, None), (["reference"], None),
                                            ("nope", None), ("reference", 1), ("reference", "cuda:0")])
def test_cache_backend_and_device_are_checked(backend, device):
    with pytest.raises(kvcache.BackendNotAvailableError):
        kvcache.PagedKVCache(config(), backend=backend, device=device)


# ------------------------------------------------------------------ what stays accepted
def test_ids_and_counts_accept_numpy_ints():
    cache = build("reference")
    cache.add_sequence(np.int64(7))
    assert 7 in cache.sequence_ids and all(type(s) is int for s in cache.sequence_ids)
    cache.fork_sequence(np.int32(1), np.uint8(8), np.int64(4))
    run_forward(cache, np.array([7, 8]), np.array([2, 1], np.int32))
    run_forward(cache, (np.int64(7), 8), (np.int16(1), 1))
    assert cache.sequence_length(np.uint64(8)) == 6
    cache.popn(np.int8(8), np.uint64(1))
    k, _ = cache.get_kv(np.int64(8), np.int32(1), np.uint32(3))
    assert k.shape[1] == 2
    cache.add_sequence(2**63 - 1)
    cache.add_sequence(-2**63)
    run_forward(cache, [2**63 - 1, -2**63], [1, 1])
    cache.remove_sequence(np.int64(-2**63))
    run_forward(cache, [1], [2], [-1, 0])
    cache.commit_accepted_token_tree_nodes(np.array([1]), np.array([1], np.uint8))
