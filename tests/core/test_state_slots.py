"""State slots (``CacheConfig(layer_kinds={layer: State(shapes)})``, docs/hybrid.md increment
3) on the reference backend: the config's checks and memory, the slots' lifecycle (zeros at
add, given back at remove, CacheFullError naming the limit), a forward's staged writes (read
back after end_forward, discarded by an abort), fork's copy, and the refusals (popn, a fork
below the length, token trees, exports, files, get_kv of a state layer), each leaving the cache
as it was. The conformance class ``TestStateSlots`` proves the other backends."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import CacheConfig, PagedKVCache, State, Window, to_numpy

PS = 4
MAMBA = State({"conv": (3, 2), "ssm": (2, 2, 3)})
SHORT = State({"conv": (2,)})


def config(**kw):
    base = dict(num_layers=4, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=PS,
                max_batch_size=2, max_total_tokens=128, prefill_chunk_size=16, dtype="float32",
                rope_mode="none", layer_kinds={1: MAMBA, 2: SHORT, 3: MAMBA})
    base.update(kw)
    return CacheConfig(**base)


def cache_of(**kw):
    return PagedKVCache(config(**kw), backend="reference")


def attention_layers(cache):
    return [layer for layer in range(cache.config.num_layers)
            if layer not in cache.config.state_layers]


def attend(cache, total, rng=np.random.default_rng(0)):
    c = cache.config
    for layer in attention_layers(cache):
        q, k, v = (cache.from_numpy(rng.standard_normal((total, h, c.head_dim)))
                   for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
        cache.attention(layer, q, k, v)


def states(cache, ids) -> dict:
    """{(layer, name): (B, *shape) numpy} of ``ids``, read in a forward that is aborted."""
    cache.begin_forward(ids, [1] * len(ids))
    out = {(layer, name): to_numpy(cache.get_state(layer, name)).copy()
           for layer, kind in cache.config.state_layers.items() for name in kind.names}
    cache.abort_forward()
    return out


def step(cache, ids, lens, value):
    """A forward writing ``value(layer, name, old)`` (numpy) into every state."""
    with cache.forward(ids, lens):
        attend(cache, sum(lens))
        for layer, kind in cache.config.state_layers.items():
            for name in kind.names:
                old = to_numpy(cache.get_state(layer, name))
                cache.set_state(layer, name, cache.from_numpy(value(layer, name, old)))


def snapshot(cache):
    return (sorted(cache.sequence_ids), {s: cache.sequence_length(s) for s in cache.sequence_ids},
            cache.num_available_pages, cache.num_available_state_slots)


# ---------------------------------------------------------------------------- the config
@pytest.mark.parametrize("shapes, match", [
    ({}, "non-empty mapping"),
    ((), "non-empty mapping"),
    ({"ssm": (0, 2)}, r"State.shapes\['ssm'\]\[0\]=0 must be in \[1,"),
    ({"ssm": (2, -1)}, r"State.shapes\['ssm'\]\[1\]=-1"),
    ({"ssm": 4}, r"State.shapes\['ssm'\] must be a tuple of ints"),
    ({"ssm": (2.0,)}, "must be an int"),
    ({"": (2,)}, "non-empty string"),
    ({3: (2,)}, "non-empty string"),
    ([("a", (1,)), ("a", (2,))], "names 'a' twice"),
    ("ssm", "mapping"),
])
def test_state_refuses_bad_shapes(shapes, match):
    with pytest.raises(kvcache.InvalidArgumentError, match=match):
        State(shapes)


def test_state_reads_back_sorted_and_groups_equal_kinds():
    a = State({"ssm": [2, 3], "conv": (4,)})
    assert a.shapes == (("conv", (4,)), ("ssm", (2, 3))) and a.names == ("conv", "ssm")
    assert a == State([("conv", (4,)), ("ssm", (2, 3))]) and a.shape("ssm") == (2, 3)
    assert State({"x": ()}).elements() == 1 and a.elements() == 10
    c = config(layer_kinds={0: Window(5), 1: MAMBA, 2: SHORT, 3: MAMBA})
    assert c.state_groups == ((MAMBA, (1, 3)), (SHORT, (2,)))
    assert c.state_layers == {1: MAMBA, 2: SHORT, 3: MAMBA}
    assert c.window_groups == ((Window(5), (0,)),) and c.full_layers == ()


def test_config_memory_and_slots():
    c = config()
    assert c.full_layers == (0,) and c.window_groups == ()
    assert c.num_state_slots == c.max_batch_size == 2
    assert config(max_state_slots=5).num_state_slots == 5
    assert config(layer_kinds={}).num_state_slots == 0 == config(layer_kinds={}).state_bytes
    per_slot = 2 * MAMBA.elements() + SHORT.elements()
    assert c.state_bytes == 2 * per_slot * 4
    assert config(dtype="float16").state_bytes == 2 * per_slot * 2
    # state layers have no pages: the page arrays are those of layer 0 alone
    assert c.kv_bytes == config(num_layers=1, layer_kinds={}).kv_bytes
    assert [c.layer_pages(layer) for layer in range(4)] == [c.num_pages, 0, 0, 0]
    cache = PagedKVCache(c, backend="reference")
    assert cache.pages[0] is not None and cache.pages[1] is None
    arrays = cache.state_arrays.arrays
    assert {layer: {n: a.shape for n, a in d.items()} for layer, d in arrays.items()} == {
        1: {"conv": (2, 3, 2), "ssm": (2, 2, 2, 3)}, 2: {"conv": (2, 2)},
        3: {"conv": (2, 3, 2), "ssm": (2, 2, 2, 3)}}
    assert sum(a.nbytes for d in arrays.values() for a in d.values()) == c.state_bytes
    with pytest.raises(kvcache.InvalidArgumentError, match="max_state_slots=-1"):
        config(max_state_slots=-1)
    with pytest.raises(kvcache.InvalidArgumentError, match="not a kvcache.Window or kvcache.State"):
        config(layer_kinds={1: {"ssm": (2,)}})
    with pytest.raises(kvcache.InvalidArgumentError, match="layer 1 twice"):
        config(layer_kinds=[(1, MAMBA), (1, Window(3))])
    # with the prefix cache the checkpoints (4 per slot by default) are counted and allocated
    warm = config(prefix_cache=True)
    assert warm.num_state_checkpoints == 8 and c.num_state_checkpoints == 0
    assert warm.state_bytes == (2 + 8) * per_slot * 4
    assert config(prefix_cache=True, max_state_checkpoints=3).state_bytes == 5 * per_slot * 4
    cache = PagedKVCache(warm, backend="reference")
    ck = cache.state_arrays.checkpoints
    assert ck[1]["ssm"].shape == (8, 2, 2, 3) and sum(
        a.nbytes for d in (*arrays.values(), *ck.values()) for a in d.values()) == 5 * c.state_bytes
    with pytest.raises(kvcache.InvalidArgumentError, match="state_checkpoint_interval=0"):
        config(state_checkpoint_interval=0)


def test_backend_without_state_slots_is_refused():
    names = {row["name"]: row["class"] for row in kvcache.list_backends()}
    assert names["reference"].capabilities.state_slots
    if "example" not in names or names["example"] is None:
        pytest.skip("the example plugin is not installed")
    assert not names["example"].capabilities.state_slots
    with pytest.raises(kvcache.UnsupportedFeatureError, match="state_slots"):
        PagedKVCache(config(head_dim=64), backend="example")
    PagedKVCache(config(head_dim=64, layer_kinds={}), backend="example")     # without state layers: fine


# ---------------------------------------------------------------------------- slots
def test_new_sequences_start_at_zeros_and_slots_come_back():
    cache = cache_of()
    cache.add_sequence(10)
    cache.add_sequence(11)
    assert cache.num_available_state_slots == 0
    step(cache, [10, 11], [3, 2], lambda layer, name, old: old + 1 + layer)
    before = snapshot(cache)
    with pytest.raises(kvcache.CacheFullError, match=r"all 2 are held \(CacheConfig."
                       r"max_state_slots=2\)"):
        cache.add_sequence(12)
    with pytest.raises(kvcache.CacheFullError, match="max_state_slots=2"):
        cache.fork_sequence(10, 12)
    assert snapshot(cache) == before and 12 not in cache.sequence_ids
    cache.remove_sequence(10)
    assert cache.num_available_state_slots == 1
    cache.add_sequence(12)              # takes 10's slot: its states start at zeros again
    got = states(cache, [12, 11])
    for (layer, name), x in got.items():
        assert not x[0].any(), (layer, name)
        assert (x[1] == 1 + layer).all(), (layer, name)
    cache.state.slots.check_invariants(cache.sequence_ids)
    cache.clear()
    assert cache.num_available_state_slots == 2
    cache.add_sequence(1)
    assert not any(x.any() for x in states(cache, [1]).values())


def test_states_follow_forward_order_and_read_your_writes():
    cache = cache_of(max_state_slots=3, max_batch_size=3)
    for sid in (5, 6, 7):
        cache.add_sequence(sid)
    step(cache, [5, 6, 7], [1, 2, 1], lambda layer, name, old: old + np.arange(3).reshape(
        (3,) + (1,) * (old.ndim - 1)) + 10 * layer)
    got = states(cache, [7, 5])         # another order: the rows follow it
    for (layer, name), x in got.items():
        assert (x[0] == 2 + 10 * layer).all() and (x[1] == 10 * layer).all()
    with cache.forward([6], [1]):
        attend(cache, 1)
        new = cache.from_numpy(np.full((1, 2), 7.0))
        cache.set_state(2, "conv", new)
        assert to_numpy(cache.get_state(2, "conv")).tolist() == [[7.0, 7.0]]
        for layer in (1, 3):
            for name in MAMBA.names:
                cache.set_state(layer, name, cache.get_state(layer, name))
    assert states(cache, [6])[2, "conv"].tolist() == [[7.0, 7.0]]
    assert (states(cache, [6])[1, "ssm"] == 1 + 10).all()


def test_abort_and_exceptions_restore_the_states():
    cache = cache_of()
    cache.add_sequence(0)
    cache.add_sequence(1)
    step(cache, [0, 1], [2, 2], lambda layer, name, old: old + 3)
    before, snap = states(cache, [0, 1]), snapshot(cache)
    cache.begin_forward([1, 0], [1, 1])
    attend(cache, 2)
    cache.set_state(2, "conv", cache.from_numpy(np.full((2, 2), -1.0)))
    cache.abort_forward()
    with pytest.raises(RuntimeError):
        with cache.forward([0], [2]):
            attend(cache, 2)
            for layer, kind in cache.config.state_layers.items():
                for name in kind.names:
                    cache.set_state(layer, name, cache.from_numpy(
                        np.full((1,) + kind.shape(name), 99.0)))
            raise RuntimeError("the model failed")
    after = states(cache, [0, 1])
    assert snapshot(cache) == snap
    assert all(np.array_equal(before[key], after[key]) for key in before)


def test_end_forward_needs_every_state_written():
    cache = cache_of()
    cache.add_sequence(0)
    cache.begin_forward([0], [3])
    attend(cache, 3)
    cache.set_state(2, "conv", cache.from_numpy(np.ones((1, 2))))
    with pytest.raises(kvcache.ForwardStateError, match=r"layer 1 'conv', layer 1 'ssm', "
                       r"layer 3 'conv', layer 3 'ssm'"):
        cache.end_forward()
    for layer in (1, 3):                # the forward stayed open: finish it
        for name in MAMBA.names:
            cache.set_state(layer, name, cache.get_state(layer, name))
    cache.end_forward()
    assert cache.sequence_length(0) == 3
    assert states(cache, [0])[2, "conv"].tolist() == [[1.0, 1.0]]


def test_fork_copies_the_state_and_the_copies_are_independent():
    cache = cache_of(max_state_slots=4, max_batch_size=3)
    cache.add_sequence(0)
    step(cache, [0], [PS + 2], lambda layer, name, old: old + 5)
    cache.fork_sequence(0, 1)
    cache.fork_sequence(1, 2, fork_pos=-1)
    got = states(cache, [0, 1, 2])
    assert all((x == 5).all() for x in got.values())
    step(cache, [1], [1], lambda layer, name, old: old * 2)
    step(cache, [0, 2], [1, 1], lambda layer, name, old: old - np.array([1.0, 2.0]).reshape(
        (2,) + (1,) * (old.ndim - 1)))
    got = states(cache, [0, 1, 2])
    for x in got.values():
        assert (x[0] == 4).all() and (x[1] == 10).all() and (x[2] == 3).all()
    cache.state.slots.check_invariants(cache.sequence_ids)


# ---------------------------------------------------------------------------- refusals
def test_rewinding_calls_are_refused_with_nothing_changed():
    cache = cache_of(max_state_slots=3)
    cache.add_sequence(0)
    step(cache, [0], [PS + 1], lambda layer, name, old: old + 1)
    snap, before = snapshot(cache), states(cache, [0])
    with pytest.raises(kvcache.UnsupportedFeatureError, match=r"popn\(0, 2\) in a cache with "
                       r"state layers \[1, 2, 3\].*no checkpoint"):
        cache.popn(0, 2)
    cache.popn(0, 0)                    # takes nothing back: allowed
    with pytest.raises(kvcache.UnsupportedFeatureError, match="fork_pos=2\\) below the "
                       "parent's length 5"):
        cache.fork_sequence(0, 1, 2)
    with pytest.raises(kvcache.UnsupportedFeatureError, match="token trees"):
        cache.begin_forward([0], [2], [-1, 0])
    with pytest.raises(kvcache.UnsupportedFeatureError, match="token trees"):
        cache.pages_needed([0], [2], [-1, 0])
    with pytest.raises(kvcache.InvalidArgumentError, match="fork_pos 9"):
        cache.fork_sequence(0, 1, 9)    # bad input first: the usual error
    assert snapshot(cache) == snap
    after = states(cache, [0])
    assert all(np.array_equal(before[key], after[key]) for key in before)
    cache.state.slots.check_invariants(cache.sequence_ids)


@pytest.mark.parametrize("call, match", [
    (lambda c: c.export_sequence(0), "state layers"),
    (lambda c: c.export_sequences([0]), "state layers"),
    (lambda c: c.import_sequence(None), "state layers"),
    (lambda c: c.reserve_import(None), "state layers"),
    (lambda c: c.save_sequences("/nonexistent/x.kv", [0]), "state layers"),
    (lambda c: c.load_sequences("/nonexistent/x.kv"), "state layers"),
    (lambda c: kvcache.HostTier(c).offload(0), "state layers"),
    (lambda c: c.get_kv(0), "pass layer="),
])
def test_whole_sequence_calls_are_refused(call, match):
    cache = cache_of()
    cache.add_sequence(0)
    step(cache, [0], [3], lambda layer, name, old: old + 1)
    snap = snapshot(cache)
    with pytest.raises(kvcache.UnsupportedFeatureError, match=match):
        call(cache)
    assert snapshot(cache) == snap


def test_state_layers_have_no_kv():
    cache = cache_of()
    cache.add_sequence(0)
    step(cache, [0], [3], lambda layer, name, old: old + 1)
    k, v = cache.get_kv(0, layer=0)
    assert k.shape == (3, 2, 8)
    with pytest.raises(kvcache.InvalidArgumentError, match="layer 1, a state layer"):
        cache.get_kv(0, layer=1)
    cache.begin_forward([0], [1])
    q, k = cache.from_numpy(np.ones((1, 4, 8))), cache.from_numpy(np.ones((1, 2, 8)))
    with pytest.raises(kvcache.InvalidArgumentError, match="layer 2 is a state layer"):
        cache.attention(2, q, k, k)
    with pytest.raises(kvcache.InvalidArgumentError, match="layer 2 is a state layer"):
        cache.append_kv(2, k, k)
    with pytest.raises(kvcache.InvalidArgumentError, match="layer 0 is not a state layer"):
        cache.get_state(0, "conv")
    with pytest.raises(kvcache.InvalidArgumentError, match=r"has the states \['conv'\], "
                       r"not 'ssm'"):
        cache.set_state(2, "ssm", cache.from_numpy(np.ones((1, 2))))
    with pytest.raises(kvcache.InvalidArgumentError, match=r"shape \(2, 2\), expected \(1, 2\)"):
        cache.set_state(2, "conv", cache.from_numpy(np.ones((2, 2))))
    with pytest.raises(kvcache.InvalidArgumentError, match="dtype int32"):
        cache.set_state(2, "conv", cache.from_numpy(np.ones((1, 2), np.int32)))
    with pytest.raises(kvcache.InvalidArgumentError, match="backend array"):
        cache.set_state(2, "conv", [[1.0, 1.0]])
    with pytest.raises(kvcache.InvalidArgumentError, match=r"layer_id 7 must be in \[0, 4\)"):
        cache.get_state(7, "conv")
    assert cache.layers_run == frozenset()
    cache.abort_forward()
    with pytest.raises(kvcache.ForwardStateError, match="open forward"):
        cache.get_state(1, "conv")


def test_window_groups_and_state_layers_compose():
    kinds = {0: Window(5), 1: MAMBA, 2: SHORT}
    cache = cache_of(layer_kinds=kinds)
    assert cache.config.window_groups == ((Window(5), (0,)),)
    cache.add_sequence(0)
    cache.add_sequence(1)
    for _ in range(4):
        step(cache, [0, 1], [3, 1], lambda layer, name, old: old + 1)
    assert cache.window_pages(0)["window=5"][0] == 4      # keys slid out: pages freed
    assert all((x == 4).all() for x in states(cache, [0, 1]).values())
    with pytest.raises(kvcache.UnsupportedFeatureError, match="window groups"):
        cache.export_sequence(0)


def test_a_state_dtype_of_its_own_keeps_its_bits_in_a_16_bit_cache():
    """``State(..., dtype="float32")`` in a float16 cache: its slots and checkpoints are float32
    arrays (counted so in ``state_bytes``), it takes float32 values only, and reads back a value
    float16 cannot hold bit for bit, restored from a checkpoint too; the other state layer
    stays float16 (the old cache stored every state in the cache dtype)."""
    wide = State({"ssm": (3,)}, dtype="float32")
    assert repr(wide) == "State({'ssm': (3,)}, dtype='float32')"
    with pytest.raises(kvcache.InvalidArgumentError, match="State.dtype='int8'"):
        State({"ssm": (3,)}, dtype="int8")
    c = config(dtype="float16", layer_kinds={1: wide, 2: SHORT}, prefix_cache=True)
    assert c.state_bytes == (2 + 8) * (3 * 4 + 2 * 2)
    cache = PagedKVCache(c, backend="reference")
    arrays, ck = cache.state_arrays.arrays, cache.state_arrays.checkpoints
    assert arrays[1]["ssm"].dtype == ck[1]["ssm"].dtype == np.float32
    assert arrays[2]["conv"].dtype == np.float16
    fine = np.array([[1 + 2.0 ** -20, -3 - 2.0 ** -18, 2.0 ** -30]], np.float32)
    cache.add_sequence(0, list(range(1, 10)))
    with cache.forward([0], [8]):
        attend(cache, 8)
        with pytest.raises(kvcache.InvalidArgumentError, match="stores these states in float32"):
            cache.set_state(1, "ssm", cache.from_numpy(fine))            # float16 values
        cache.set_state(1, "ssm", cache.from_numpy(fine, "float32"))
        cache.set_state(2, "conv", cache.from_numpy(np.zeros((1, 2))))
        assert cache.state_checkpoints() == ((0, 4),)
        cache.set_state_checkpoints(1, "ssm", cache.from_numpy(2 * fine, "float32"))
        cache.set_state_checkpoints(2, "conv", cache.from_numpy(np.ones((1, 2))))
    got = states(cache, [0])
    assert got[1, "ssm"].dtype == np.float32 and np.array_equal(got[1, "ssm"], fine)
    cache.remove_sequence(0)
    assert cache.add_sequence(1, list(range(1, 6)) + [99]) == 4        # the checkpoint at 4
    got = states(cache, [1])
    assert np.array_equal(got[1, "ssm"], 2 * fine) and np.array_equal(got[2, "conv"], [[1, 1]])
