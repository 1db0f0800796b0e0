"""export_sequence / import_sequence: sequences move bit-exactly between backends and page
sizes (forks imported as shared prefixes, sliding windows with their sinks, partial pages,
every RoPE mode), attention over an imported sequence equals attention over the source, and
every refused import names the problem and changes nothing."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvcache
from kvcache import (CacheFullError, ForwardStateError, InvalidArgumentError, SequenceExistsError,
                     SequenceNotFoundError, SequencePayload, UnsupportedFeatureError)
from kvcache.conformance import assert_close
from kvcache.plugins import backend_classes
from transfer_cases import (assert_same_kv, build_workload, config, host, make_cache,
                            parent_and_child, run_forward, same, snapshot)

BACKENDS = ["reference", "cuda", "metal", "example"]
PAGE_SIZES = [(4, 16), (16, 3), (5, 5)]
DTYPES = ["float32", "bfloat16", "float16"]
ROPES = ["none", "normal", "inline"]


def _pair_case(src, dst):
    """A deterministic spread of page sizes, dtypes and RoPE modes over the backend pairs."""
    i = BACKENDS.index(src) * len(BACKENDS) + BACKENDS.index(dst)
    return PAGE_SIZES[i % 3], DTYPES[(i // 3) % 3], ROPES[i % 3]


def _can(backend, feature):
    cls = backend_classes().get(backend)
    return cls is not None and bool(getattr(cls.capabilities, feature))


def _configs(src, dst, ps, dtype, rope):
    """Configs for both caches that both backends can run (windows and inline RoPE only where
    both declare them)."""
    sliding = _can(src, "sliding_window") and _can(dst, "sliding_window")
    if rope == "inline" and not (_can(src, "inline_rope") and _can(dst, "inline_rope")):
        rope = "normal"
    if sliding and rope == "normal":
        sliding = False          # keep "normal" (post-RoPE K) covered on this pair
    return (config(ps[0], dtype, rope, sliding), config(ps[1], dtype, rope, sliding))


def _move_all(src, dst, wl, rng, suffix_exports=True):
    """Import every workload sequence of ``src`` into ``dst`` (same ids): forks onto their
    imported parent, as a suffix payload or as a whole payload with ``fork_pos``."""
    for sid in wl.ids:
        if sid in wl.forks:
            parent, pos = wl.forks[sid]
            if suffix_exports and rng.random() < 0.5:
                dst.import_sequence(sid, src.export_sequence(sid, pos), parent_id=parent)
            else:
                dst.import_sequence(sid, src.export_sequence(sid), parent_id=parent, fork_pos=pos)
        else:
            dst.import_sequence(sid, src.export_sequence(sid))


@pytest.mark.parametrize("src,dst", list(itertools.product(BACKENDS, BACKENDS)))
def test_round_trip_is_bit_exact_across_backends_and_page_sizes(src, dst):
    ps, dtype, rope = _pair_case(src, dst)
    cfg_a, cfg_b = _configs(src, dst, ps, dtype, rope)
    a = make_cache(src, cfg_a)
    b = make_cache(dst, cfg_b)
    rng = np.random.default_rng(BACKENDS.index(src) * 7 + BACKENDS.index(dst))
    wl = build_workload(a, rng, count=10)
    assert wl.forks, "the workload should hold forks"
    _move_all(a, b, wl, rng)
    b.state.pt.check_invariants()
    for sid in wl.ids:
        assert_same_kv(a, sid, b, sid)
        assert b.state.seq(sid).window == a.state.seq(sid).window
    # and back, into a fresh cache of the source's backend and page size
    back = make_cache(src, cfg_a)
    _move_all(b, back, wl, rng)
    for sid in wl.ids:
        assert_same_kv(a, sid, back, sid)
    # the forks share their parent's pages: fewer pages than whole copies
    whole = make_cache(dst, cfg_b)
    for sid in wl.ids:
        whole.import_sequence(sid, a.export_sequence(sid))
    assert b.num_available_pages >= whole.num_available_pages
    if any(pos >= ps[1] for _, pos in wl.forks.values()):     # a whole page to share
        assert b.num_available_pages > whole.num_available_pages


@pytest.mark.parametrize("src,dst", [("reference", "reference"), ("cuda", "reference"),
                                     ("reference", "cuda"), ("metal", "reference"),
                                     ("example", "reference")])
@pytest.mark.parametrize("rope", ROPES)
def test_attention_after_import_equals_attention_on_the_source(src, dst, rope):
    ps = (4, 16) if rope != "inline" else (16, 3)
    cfg_a, cfg_b = _configs(src, dst, ps, "float32", rope)
    a = make_cache(src, cfg_a)
    b = make_cache(dst, cfg_b)
    rng = np.random.default_rng(5)
    wl = build_workload(a, rng, count=8)
    _move_all(a, b, wl, rng)
    # one decode step for every sequence, the same q/k/v on both caches
    c = a.config
    n = len(wl.ids)
    qkv = [tuple(rng.standard_normal(s).astype(np.float32)
                 for s in ((n, c.num_qo_heads, c.head_dim), (n, c.num_kv_heads, c.head_dim),
                           (n, c.num_kv_heads, c.head_dim))) for _ in range(c.num_layers)]
    want = run_forward(a, wl.ids, [1] * n, rng, return_output=True, qkv=qkv)
    got = run_forward(b, wl.ids, [1] * n, rng, return_output=True, qkv=qkv)
    for layer, (w, g) in enumerate(zip(want, got)):
        assert_close(f"layer {layer} attention", w, g, "float32")
    for sid in wl.ids:       # windows slid alike
        assert b.sequence_length(sid) == a.sequence_length(sid)
        for w, g in zip(a.get_kv(sid), b.get_kv(sid)):
            assert_close(f"sequence {sid} kv", kvcache.to_numpy(w), kvcache.to_numpy(g), "float32")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), ps_a=st.integers(1, 9), ps_b=st.integers(1, 9),
       sliding=st.booleans(), rope=st.sampled_from(ROPES))
def test_reference_round_trips_any_page_sizes(seed, ps_a, ps_b, sliding, rope):
    if sliding and rope == "normal":
        rope = "inline"
    cfg = dict(dtype="float32", rope_mode=rope, sliding=sliding, layers=1)
    a = kvcache.PagedKVCache(config(ps_a, **cfg), backend="reference")
    b = kvcache.PagedKVCache(config(ps_b, **cfg), backend="reference")
    rng = np.random.default_rng(seed)
    wl = build_workload(a, rng, count=6, max_len=24)
    _move_all(a, b, wl, rng)
    b.state.pt.check_invariants()
    for sid in wl.ids:
        assert_same_kv(a, sid, b, sid)
        # partial ranges too
        n = a.sequence_length(sid)
        lo = int(rng.integers(0, n + 1))
        hi = int(rng.integers(lo, n + 1))
        p = a.export_sequence(sid, lo, hi)
        assert p.num_tokens == hi - lo and p.positions.tolist() == list(range(lo, hi))
        assert all(same(x, y, "float32") for x, y in zip((p.k, p.v), b.get_kv(sid, lo, hi)))


def test_a_child_imported_onto_its_parent_shares_the_parent_pages():
    a = kvcache.PagedKVCache(config(4), backend="reference")
    b = kvcache.PagedKVCache(config(8), backend="reference")
    rng = np.random.default_rng(0)
    parent_and_child(a, rng, 30, 21, 6)
    b.import_sequence(1, a.export_sequence(1))
    free = b.num_available_pages
    b.import_sequence(2, a.export_sequence(2, 21), parent_id=1)
    # 21 shared tokens: 2 whole pages shared, 5 rows copied into the child's first page, +6
    assert free - b.num_available_pages == 2
    assert_same_kv(a, 2, b, 2)
    assert_same_kv(a, 1, b, 1)
    b.state.pt.check_invariants()
    # a whole payload with fork_pos skips the shared tokens: the same result
    b.import_sequence(3, a.export_sequence(2), parent_id=1, fork_pos=21)
    assert_same_kv(a, 2, b, 3)
    assert free - b.num_available_pages == 4


def test_a_batch_of_imports_may_fork_from_an_earlier_item():
    a = kvcache.PagedKVCache(config(4), backend="reference")
    b = kvcache.PagedKVCache(config(3), backend="reference")
    rng = np.random.default_rng(1)
    parent_and_child(a, rng, 10, 7, 3)
    p1, p2 = a.export_sequence(1), a.export_sequence(2, 7)
    res = b.reserve_import([(1, p1.without_arrays(), None, None), (2, p2.without_arrays(), 1, 7)])
    assert b.sequence_ids == [] and b.num_available_pages == b.num_total_pages - res.num_pages
    b.state.pt.check_invariants()                 # reserved pages count as used
    k = np.concatenate([p1.k, p2.k], axis=1)
    v = np.concatenate([p1.v, p2.v], axis=1)
    b.write_import(res, k, v)
    assert b.sequence_ids == []                   # written, not yet there
    b.commit_import(res)
    assert b.sequence_ids == [1, 2]
    assert_same_kv(a, 1, b, 1)
    assert_same_kv(a, 2, b, 2)
    b.state.pt.check_invariants()


def test_convert_dtype_rounds_to_the_cache_dtype():
    a = kvcache.PagedKVCache(config(4, "float32"), backend="reference")
    b = kvcache.PagedKVCache(config(4, "bfloat16"), backend="reference")
    rng = np.random.default_rng(2)
    a.add_sequence(1)
    run_forward(a, [1], [9], rng)
    p = a.export_sequence(1)
    with pytest.raises(InvalidArgumentError, match="stores float32, this cache bfloat16.*convert_dtype=True"):
        b.import_sequence(1, p)
    b.import_sequence(1, p, convert_dtype=True)
    k, _ = b.get_kv(1)
    np.testing.assert_array_equal(host(k, "bfloat16"), host(p.k, "float32").astype(host(k, "bfloat16").dtype))


@pytest.mark.parametrize("backend", ["cuda", "metal", "reference"])
def test_payload_to_numpy_keeps_the_stored_bits(backend):
    a = make_cache(backend, config(4, "bfloat16", "none"))
    rng = np.random.default_rng(3)
    a.add_sequence(1)
    run_forward(a, [1], [7], rng)
    p = a.export_sequence(1)
    h = p.to_numpy()
    assert type(h.k) is np.ndarray and h.k.dtype.name == "bfloat16" and h.backend is None
    assert h.k.tobytes() == host(a.get_kv(1)[0], "bfloat16").tobytes()
    again = SequencePayload.from_header(h.header(), h.k, h.v)
    assert again.header() == h.header()
    ref = kvcache.PagedKVCache(config(16, "bfloat16", "none"), backend="reference")
    ref.import_sequence(5, again)
    assert_same_kv(a, 1, ref, 5)


def test_an_empty_sequence_and_an_empty_range_move_too():
    a = kvcache.PagedKVCache(config(4), backend="reference")
    b = kvcache.PagedKVCache(config(4), backend="reference")
    a.add_sequence(1)
    b.import_sequence(1, a.export_sequence(1))
    assert b.sequence_length(1) == 0 and b.num_available_pages == b.num_total_pages
    run_forward(a, [1], [8], np.random.default_rng(0))
    p = a.export_sequence(1, 8, 8)
    assert p.num_tokens == 0 and p.k.shape == (2, 0, 2, 64)
    b.remove_sequence(1)
    b.import_sequence(1, a.export_sequence(1))
    b.import_sequence(2, p, parent_id=1)           # a fork at the end, nothing of its own
    assert_same_kv(a, 1, b, 2)


# ---------------------------------------------------------------------- errors
@pytest.fixture
def pair():
    """A source cache with sequences 1 (22 tokens), 2 (forked from 1 at 10, +17) and a
    windowed 3, and a destination holding an import of 1 as 7."""
    a = kvcache.PagedKVCache(config(4, sliding=True, rope_mode="inline"), backend="reference")
    b = kvcache.PagedKVCache(config(8, sliding=True, rope_mode="inline", max_total_tokens=64),
                             backend="reference")
    rng = np.random.default_rng(4)
    parent_and_child(a, rng, 22, 10, 17)
    a.add_sequence(3)
    a.enable_sliding_window(3, 8, 2)
    run_forward(a, [3], [12], rng)
    b.import_sequence(7, a.export_sequence(1))
    return a, b


def _other(**kw):
    return kvcache.PagedKVCache(config(8, **{"sliding": True, "rope_mode": "inline", **kw}),
                                backend="reference")


BAD = [
    # (what, dst factory or None for the fixture's, call(a, b) -> None, error, message)
    ("kv heads", lambda: kvcache.PagedKVCache(dataclasses.replace(
        config(8, sliding=True, rope_mode="inline"), num_kv_heads=1, num_qo_heads=4),
        backend="reference"), lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "sequence 9.*num_kv_heads=2, this cache num_kv_heads=1"),
    ("head_dim", lambda: kvcache.PagedKVCache(dataclasses.replace(
        config(8, sliding=True, rope_mode="inline"), head_dim=128, head_dim_v=128), backend="reference"),
     lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "head_dim=64, this cache head_dim=128"),
    ("layers", lambda: _other(layers=3), lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "num_layers=2, this cache num_layers=3"),
    ("rope theta", lambda: _other(rope_theta=500000.0),
     lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "rope_theta=10000.0, this cache uses rope_theta=500000.0"),
    ("rope mode", lambda: _other(sliding=False, rope_mode="normal"),
     lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "rope_mode='inline', this cache rope_mode='normal'"),
    ("dtype", lambda: _other(dtype="float16"), lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     InvalidArgumentError, "stores float32, this cache float16"),
    ("window unsupported", lambda: _other(sliding=False),
     lambda a, b: b.import_sequence(9, a.export_sequence(3)),
     InvalidArgumentError, "rope_mode='inline', this cache rope_mode='normal'|support_sliding_window=False"),
    ("version", None, lambda a, b: b.import_sequence(9, dataclasses.replace(a.export_sequence(1), version=2)),
     UnsupportedFeatureError, "format version 2"),
    ("shape", None, lambda a, b: b.import_sequence(
        9, dataclasses.replace(a.export_sequence(1), num_tokens=21)),
     InvalidArgumentError, r"k has shape \(2, 22, 2, 64\), expected \(2, 21, 2, 64\)"),
    ("not a payload", None, lambda a, b: b.import_sequence(9, a.get_kv(1)),
     InvalidArgumentError, "must be a kvcache.SequencePayload"),
    ("header only", None, lambda a, b: b.import_sequence(9, a.export_sequence(1).without_arrays()),
     InvalidArgumentError, "has no arrays"),
    ("exists", None, lambda a, b: b.import_sequence(7, a.export_sequence(1)),
     SequenceExistsError, "sequence 7"),
    ("no parent", None, lambda a, b: b.import_sequence(9, a.export_sequence(2, 10), parent_id=8),
     SequenceNotFoundError, "sequence 8"),
    ("fork_pos beyond the parent", None,
     lambda a, b: b.import_sequence(9, a.export_sequence(1, 10), parent_id=7, fork_pos=23),
     InvalidArgumentError, "fork_pos 23 must lie in the payload's tokens \\[10, 22\\]"),
    ("fork_pos beyond the parent length", None,
     lambda a, b: b.import_sequence(9, a.export_sequence(2), parent_id=7, fork_pos=23),
     InvalidArgumentError, "fork_pos 23 must be in \\[0, 22\\]"),
    ("suffix without parent", None, lambda a, b: b.import_sequence(9, a.export_sequence(2, 10)),
     InvalidArgumentError, "starts at token 10"),
    ("full", lambda: kvcache.PagedKVCache(config(8, rope_mode="inline", max_total_tokens=8),
                                          backend="reference"),
     lambda a, b: b.import_sequence(9, a.export_sequence(1)),
     CacheFullError, r"sequences \[9\] needs 3 pages but 2 of 2 are free"),
    ("inside a forward", None, lambda a, b: _in_forward(b, lambda: b.import_sequence(9, a.export_sequence(1))),
     ForwardStateError, "import_sequence is not allowed between begin_forward and end_forward"),
    ("bad convert flag", None, lambda a, b: b.import_sequence(9, a.export_sequence(1), convert_dtype=1),
     InvalidArgumentError, "convert_dtype must be True or False"),
]


def _in_forward(cache, call):
    cache.begin_forward([7], [1])
    try:
        call()
    finally:
        cache.abort_forward()


@pytest.mark.parametrize("what,make,call,error,message", BAD, ids=[b[0] for b in BAD])
def test_a_refused_import_names_the_problem_and_changes_nothing(pair, what, make, call, error, message):
    a, b = pair
    if make is not None:
        b = make()
    before, source = snapshot(b), snapshot(a)
    with pytest.raises(error, match=message):
        call(a, b)
    assert snapshot(b) == before
    assert snapshot(a) == source
    b.state.pt.check_invariants()


def test_export_refuses_bad_ranges_open_forwards_and_uncommitted_trees(pair):
    a, _ = pair
    before = snapshot(a)
    with pytest.raises(InvalidArgumentError, match=r"export range \[3, 30\) of sequence 1 must lie in \[0, 22\]"):
        a.export_sequence(1, 3, 30)
    with pytest.raises(SequenceNotFoundError, match="sequence 99"):
        a.export_sequence(99)
    a.begin_forward([1], [1])
    with pytest.raises(ForwardStateError, match="export_sequence is not allowed"):
        a.export_sequence(1)
    a.abort_forward()
    t = kvcache.PagedKVCache(config(4, rope_mode="none"), backend="reference")
    t.add_sequence(1)
    rng = np.random.default_rng(0)
    run_forward(t, [1], [5], rng)
    c = t.config
    with t.forward([1], [2], token_tree_parent_ptr=[-1, 0]):
        for layer in range(c.num_layers):
            t.attention(layer, *(t.from_numpy(rng.standard_normal((2, h, c.head_dim)))
                                 for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)))
    with pytest.raises(ForwardStateError, match="sequence 1 has 2 uncommitted token-tree tokens"):
        t.export_sequence(1)
    t.commit_accepted_token_tree_nodes([1], [1])
    assert t.export_sequence(1).num_tokens == 7
    assert snapshot(a) == before


def test_a_reservation_survives_nothing_it_should_not(pair):
    a, b = pair
    p = a.export_sequence(1)
    before = snapshot(b)
    res = b.reserve_import([(9, p, None, None)])
    b.cancel_import(res)
    assert snapshot(b) == before
    with pytest.raises(ForwardStateError, match="already committed or cancelled"):
        b.commit_import(res)
    # the id taken while the import was in flight: the commit is refused, the pages stay held
    res = b.reserve_import([(9, p, None, None)])
    b.import_sequence(9, p)
    with pytest.raises(SequenceExistsError, match="sequence 9"):
        b.commit_import(res)
    b.state.pt.check_invariants()
    b.remove_sequence(9)
    b.write_import(res, p.k, p.v)
    b.commit_import(res)
    assert_same_kv(a, 1, b, 9)
    # a forward can run (and abort) while a reservation is held
    res = b.reserve_import([(10, p, None, None)])
    b.begin_forward([7], [1])
    with pytest.raises(ForwardStateError, match="commit_import is not allowed"):
        b.commit_import(res)
    b.abort_forward()
    b.state.pt.check_invariants()
    # clear drops it
    b.clear()
    with pytest.raises(ForwardStateError, match="cleared"):
        b.commit_import(res)
    assert b.is_empty
    with pytest.raises(InvalidArgumentError, match=r"k must be a reference array \(2, 22, 2, 64\)"):
        b.write_import(b.reserve_import([(1, p, None, None)]), p.k[:, :3], p.v)


@pytest.mark.parametrize("backend", ["reference", "cuda", "metal"])
def test_export_sequences_gathers_many_tails_at_once(backend):
    a = make_cache(backend, config(4, "float16", "none"))
    rng = np.random.default_rng(6)
    wl = build_workload(a, rng, count=6, windows=False)
    starts = [int(rng.integers(0, a.sequence_length(s) + 1)) for s in wl.ids]
    headers, k, v = a.export_sequences(wl.ids, starts)
    assert [h.k for h in headers] == [None] * len(wl.ids)
    off = 0
    for sid, st, h in zip(wl.ids, starts, headers):
        one = a.export_sequence(sid, st)
        assert h.header() == one.header()
        n = one.num_tokens
        assert same(k[:, off:off + n], one.k, "float16") and same(v[:, off:off + n], one.v, "float16")
        off += n
    assert k.shape[1] == off
    headers, k, v = a.export_sequences([])
    assert headers == [] and k.shape[1] == 0
    with pytest.raises(InvalidArgumentError, match="repeat a sequence"):
        a.export_sequences([wl.ids[0], wl.ids[0]])
    with pytest.raises(InvalidArgumentError, match="2 seq_ids but 1 starts"):
        a.export_sequences(wl.ids[:2], [0])


def test_windowed_forks_share_only_sink_tokens():
    """A windowed child shares its parent's sinks; past its own sinks its kept tokens may have
    slid, so an import onto the parent there is refused (imported whole it is exact)."""
    a = kvcache.PagedKVCache(config(4, sliding=True, rope_mode="none"), backend="reference")
    b = kvcache.PagedKVCache(config(3, sliding=True, rope_mode="none"), backend="reference")
    rng = np.random.default_rng(7)
    a.add_sequence(1)
    a.enable_sliding_window(1, 10, 6)
    run_forward(a, [1], [20], rng)
    a.fork_sequence(1, 2, 5)                  # its window keeps 4 sinks: token 4 slides out
    run_forward(a, [2], [7], rng)
    a.enable_sliding_window(2, 8, 4)
    run_forward(a, [2], [6], rng)
    a.fork_sequence(1, 3, 6)                  # 6 sinks: the shared tokens stay
    a.enable_sliding_window(3, 9, 6)
    run_forward(a, [3], [17], rng)
    b.import_sequence(1, a.export_sequence(1))
    before = snapshot(b)
    with pytest.raises(InvalidArgumentError, match="sequence 2 has a sliding window with 4 sink "
                                                   "tokens; it can share only sink tokens with parent 1, not 5"):
        b.import_sequence(2, a.export_sequence(2, 5), parent_id=1)
    with pytest.raises(InvalidArgumentError, match="sequence 1 has a sliding window; it can be "
                                                   "forked only within its 6 sink tokens, not at 7"):
        b.import_sequence(4, a.export_sequence(1, 7), parent_id=1)
    assert snapshot(b) == before
    b.import_sequence(2, a.export_sequence(2))
    free = b.num_available_pages
    b.import_sequence(3, a.export_sequence(3, 6), parent_id=1)
    assert b.sequence_length(3) == 9 and free - b.num_available_pages == 1   # 6 shared, 3 own
    for sid in (1, 2, 3):
        assert_same_kv(a, sid, b, sid)
        c = a.config
        qkv = [tuple(rng.standard_normal(s).astype(np.float32)
                     for s in ((1, c.num_qo_heads, 64), (1, 2, 64), (1, 2, 64))) for _ in range(2)]
        run_forward(a, [sid], [1], rng, qkv=qkv)
        run_forward(b, [sid], [1], rng, qkv=qkv)
        assert_same_kv(a, sid, b, sid)           # the windows slide alike
    b.state.pt.check_invariants()


def test_a_cache_with_its_own_value_head_dim_refuses_payloads():
    """Payloads carry one head dim: a cache with head_dim_v != head_dim refuses to export or
    import (typed, naming both dims) instead of writing a payload another cache misreads."""
    from kvcache import UnsupportedFeatureError
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=48,
                              head_dim_v=32, page_size=4, max_total_tokens=64, dtype="float32",
                              rope_mode="none")
    c = kvcache.PagedKVCache(cfg, backend="reference")
    c.add_sequence(0)
    with c.forward([0], [3]):
        rng = np.random.default_rng(0)
        o = c.attention(0, *(c.from_numpy(rng.standard_normal((3, h, d)))
                             for h, d in ((2, 48), (1, 48), (1, 32))))
    assert o.shape == (3, 2, 32)
    k, v = c.get_kv(0)
    assert k.shape == (1, 3, 1, 48) and v.shape == (1, 3, 1, 32)
    before = snapshot(c)
    with pytest.raises(UnsupportedFeatureError, match="head_dim=48 and head_dim_v=32"):
        c.export_sequence(0)
    other = kvcache.PagedKVCache(dataclasses.replace(cfg, head_dim_v=48), backend="reference")
    other.add_sequence(0)
    with other.forward([0], [2]):
        other.attention(0, *(other.from_numpy(np.ones((2, h, 48))) for h in (2, 1, 1)))
    with pytest.raises(UnsupportedFeatureError, match="import of sequence 5"):
        c.import_sequence(5, other.export_sequence(0))
    assert snapshot(c) == before
