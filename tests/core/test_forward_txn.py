"""A forward is all-or-nothing: an exception inside ``with cache.forward(...)`` or
``abort_forward()`` puts the cache back exactly as it was before ``begin_forward``, and
``end_forward()`` before every layer ran refuses and leaves the forward open.

Most tests drive two caches in lockstep, one of which also runs (and aborts) extra forwards; the
two must then agree bit for bit: lengths, free pages, token trees, windows, ``get_kv`` and the
outputs of every later forward (which also covers the decode plan reused step to step)."""

import numpy as np
import pytest

import kvcache
from kvcache import ForwardStateError


def config(**kw):
    base = dict(num_layers=3, num_qo_heads=4, num_kv_heads=2, head_dim=8, page_size=4,
                max_batch_size=4, max_total_tokens=96, prefill_chunk_size=32, dtype="float32",
                rope_mode="normal")
    base.update(kw)
    return kvcache.PagedKVCache(kvcache.CacheConfig(**base), backend="reference")


def inputs(cache, rng, total):
    c = cache.config
    return [tuple(rng.standard_normal((total, h, c.head_dim))
                  for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            for _ in range(c.num_layers)]


def run_layers(cache, qkv, layers):
    return [kvcache.to_numpy(cache.attention(layer, *(cache.from_numpy(x) for x in qkv[layer])))
            for layer in layers]


def state(cache):
    """Everything an abort must restore (the page table's view and the stored KV)."""
    pt = cache.state.pt
    seqs = {}
    for sid in cache.sequence_ids:
        seq = pt.seqs[sid]
        k, v = (kvcache.to_numpy(a) for a in cache.get_kv(sid))
        seqs[sid] = (cache.sequence_length(sid), list(seq.tree_parent), list(seq.tree_depth),
                     seq.window, seq.sink_request, k, v)
    return cache.num_available_pages, cache.total_sequence_length, seqs


def assert_same_state(a, b):
    assert a[:2] == b[:2]
    assert a[2].keys() == b[2].keys()
    for sid in a[2]:
        x, y = a[2][sid], b[2][sid]
        assert x[:5] == y[:5], sid
        np.testing.assert_array_equal(x[5], y[5], err_msg=f"K of sequence {sid}")
        np.testing.assert_array_equal(x[6], y[6], err_msg=f"V of sequence {sid}")


class Twins:
    """``a`` and ``b`` run the same program; ``a`` also runs forwards that are then undone."""

    def __init__(self, **kw):
        self.a, self.b = config(**kw), config(**kw)
        self.rng = np.random.default_rng(0)
        self.junk = np.random.default_rng(1)

    def call(self, method, *args):
        for cache in (self.a, self.b):
            getattr(cache, method)(*args)
        self.check()

    def forward(self, ids, lens, tree=None):
        qkv = inputs(self.a, self.rng, sum(lens))
        outs = []
        for cache in (self.a, self.b):
            with cache.forward(ids, lens, tree):
                outs.append(run_layers(cache, qkv, range(cache.config.num_layers)))
        for x, y in zip(*outs):
            np.testing.assert_array_equal(x, y)
        self.check()

    def decode(self, ids, steps):
        for _ in range(steps):
            self.forward(ids, [1] * len(ids))

    def aborted(self, ids, lens, tree=None, layers=1, how="abort"):
        """A forward on ``a`` alone that runs ``layers`` layers and is then undone ``how``."""
        cache = self.a
        before = state(cache)
        qkv = inputs(cache, self.junk, sum(lens))
        if how == "raise":
            with pytest.raises(RuntimeError, match="model failed"):
                with cache.forward(ids, lens, tree):
                    run_layers(cache, qkv, range(layers))
                    raise RuntimeError("model failed")
        elif how == "early_end":
            cache.begin_forward(ids, lens, tree)
            run_layers(cache, qkv, range(layers))
            with pytest.raises(ForwardStateError, match="not run") as info:
                cache.end_forward()
            missing = [str(x) for x in range(layers, cache.config.num_layers)]
            assert all(m in str(info.value) for m in missing), str(info.value)
            assert cache.static_bucket is None and cache.open_plan is not None   # still open
            cache.abort_forward()
        else:
            cache.begin_forward(ids, lens, tree)
            run_layers(cache, qkv, range(layers))
            cache.abort_forward()
        cache.state.pt.check_invariants()
        assert_same_state(before, state(cache))
        self.check()

    def check(self):
        for cache in (self.a, self.b):
            cache.state.pt.check_invariants()
        assert_same_state(state(self.a), state(self.b))


def test_exception_inside_forward_rolls_back_the_reservation():
    """The reported case: a forward interrupted after layer 0 used to stay committed, and the
    new sequence's layer-1 K/V were the removed sequence's rows."""
    cache = config(num_layers=2)
    rng = np.random.default_rng(0)
    cache.add_sequence(0)
    with cache.forward([0], [8]):
        run_layers(cache, inputs(cache, rng, 8), range(2))
    cache.remove_sequence(0)
    cache.add_sequence(1)
    free = cache.num_available_pages
    with pytest.raises(RuntimeError):
        with cache.forward([1], [8]):
            run_layers(cache, inputs(cache, rng, 8), range(1))
            raise RuntimeError("model failed")
    assert cache.sequence_length(1) == 0
    assert cache.num_available_pages == free
    qkv = inputs(cache, rng, 8)
    with cache.forward([1], [8]):
        run_layers(cache, qkv, range(2))
    k, v = (kvcache.to_numpy(a) for a in cache.get_kv(1))
    np.testing.assert_allclose(v[1], qkv[1][2].astype(np.float32))


HOWS = ["abort", "raise", "early_end"]


@pytest.mark.parametrize("how", HOWS)
def test_prefill_and_decode_abort(how):
    t = Twins()
    t.call("add_sequence", 0)
    t.call("add_sequence", 1)
    t.aborted([0], [7], how=how)                  # the first forward of an empty sequence
    t.forward([0, 1], [5, 3])
    t.aborted([1, 0], [6, 2], layers=2, how=how)
    t.decode([0, 1], steps=3)                     # the decode plan is now reused step to step
    t.aborted([0, 1], [1, 1], how=how)            # sequence 1 needs a new page here
    t.decode([0, 1], steps=2)
    t.aborted([0, 1], [1, 1], layers=0, how=how)
    t.aborted([0, 1], [1, 1], layers=2, how=how)
    t.decode([0, 1], steps=5)                     # crosses page boundaries after the aborts
    t.aborted([1], [1], how=how)
    t.decode([0, 1], steps=2)


def test_abort_after_every_layer_ran():
    """abort_forward also undoes a forward whose every layer ran (nothing is committed before
    end_forward)."""
    t = Twins()
    t.call("add_sequence", 0)
    t.forward([0], [6])
    t.aborted([0], [3], layers=3)
    t.decode([0], steps=3)
    t.aborted([0], [1], layers=3)
    t.decode([0], steps=3)


@pytest.mark.parametrize("how", HOWS)
def test_forked_sequences_abort(how):
    t = Twins()
    t.call("add_sequence", 0)
    t.forward([0], [9])
    t.call("fork_sequence", 0, 1, 6)
    t.call("fork_sequence", 0, 2)
    t.aborted([0, 1, 2], [2, 3, 1], how=how)
    t.decode([2, 1, 0], steps=2)
    t.aborted([2, 1, 0], [1, 1, 1], how=how)
    t.decode([2, 1, 0], steps=4)


@pytest.mark.parametrize("how", HOWS)
def test_token_tree_abort_keeps_earlier_tree_tokens(how):
    t = Twins()
    t.call("add_sequence", 0)
    t.call("add_sequence", 1)
    t.forward([0, 1], [5, 2])
    t.forward([0, 1], [3, 1], tree=[-1, 0, 0, -1])
    t.aborted([0, 1], [2, 2], tree=[1, 3, 0, 1], how=how)      # grows the uncommitted trees
    assert len(t.a.state.pt.seqs[0].tree_parent) == 3
    t.forward([0, 1], [2, 1], tree=[1, 2, 0])
    t.call("commit_accepted_token_tree_nodes", [0, 1], [4, 1])
    t.decode([0, 1], steps=2)


@pytest.mark.parametrize("how", HOWS)
def test_sliding_window_abort_restores_slid_pages(how):
    """A sliding forward frees the pages that slide out: the aborted forward must not have
    written into them (they hold tokens the window keeps again after the abort)."""
    t = Twins(support_sliding_window=True, rope_mode="none")
    t.call("add_sequence", 0)
    t.call("add_sequence", 1)
    t.call("add_sequence", 2)
    t.call("enable_sliding_window", 0, 6, 2)
    t.call("enable_sliding_window", 1, 9, 0)
    t.forward([0, 1, 2], [5, 3, 4])
    for step in range(10):                        # each step slides; pages free on the way
        t.aborted([0, 1, 2], [1, 1, 1], layers=step % 3, how=how)
        t.decode([0, 1, 2], steps=1)
    t.aborted([0, 2], [13, 9], layers=2, how=how)   # longer than the window: slides within
    t.forward([0, 2], [13, 2])
    t.aborted([1, 0], [10, 1], how=how)
    t.decode([1, 0, 2], steps=3)


def test_end_forward_too_early_leaves_the_forward_open_to_finish():
    t = Twins()
    t.call("add_sequence", 0)
    t.forward([0], [5])
    qkv = inputs(t.a, t.rng, 2)
    outs = []
    for cache in (t.a, t.b):
        cache.begin_forward([0], [2])
        outs.append(run_layers(cache, qkv, [2, 0]))
        if cache is t.a:
            with pytest.raises(ForwardStateError, match=r"layers \[1\]"):
                cache.end_forward()
            with pytest.raises(ForwardStateError, match="begin_forward and end_forward"):
                cache.add_sequence(5)                       # still open
        outs[-1] += run_layers(cache, qkv, [1])
        cache.end_forward()
    for x, y in zip(*outs):
        np.testing.assert_array_equal(x, y)
    t.check()
    assert t.a.sequence_length(0) == 7


def test_with_block_that_skips_a_layer_aborts_and_raises():
    cache = config()
    cache.add_sequence(0)
    free = cache.num_available_pages
    with pytest.raises(ForwardStateError, match=r"layers \[1, 2\].*aborted"):
        with cache.forward([0], [3]):
            run_layers(cache, inputs(cache, np.random.default_rng(0), 3), [0])
    assert cache.sequence_length(0) == 0 and cache.num_available_pages == free
    with pytest.raises(ForwardStateError, match="abort_forward needs an open forward"):
        cache.abort_forward()


def test_abort_releases_the_aux_buffer():
    """An aborted forward's aux buffer is released like an ended one's (merged managers then
    make the next copy into it wait for kernels that may still read it)."""
    cache = config()
    released = []
    cache.aux_manager.release = lambda: released.append(1)
    cache.add_sequence(0)
    cache.begin_forward([0], [2])
    cache.abort_forward()                         # no aux uploaded yet: nothing to release
    assert released == []
    cache.begin_forward([0], [2])
    cache.query_positions()
    cache.abort_forward()
    assert released == [1]


def test_decode_plan_of_an_aborted_step_is_not_reused():
    t = Twins()
    t.call("add_sequence", 0)
    t.call("add_sequence", 1)
    t.forward([0, 1], [3, 4])
    t.decode([0, 1], steps=2)
    epoch = t.a.state.epoch
    t.aborted([0, 1], [1, 1])
    assert t.a.planner.decode_reuse is None and t.a.state.epoch != epoch
    t.decode([0, 1], steps=3)
