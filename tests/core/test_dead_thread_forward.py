"""A forward left open by a thread that has died (issue 28, item 5): the cache is not lost.
Any thread may recover it with ``abort_forward`` (the cache returns to its state before that
forward) or ``clear``; every other call raises ForwardStateError naming the dead thread and the
recovery. A live thread's forward stays its own."""

import threading

import numpy as np
import pytest

import kvcache
from kvcache import ForwardStateError
from thread_cases import run_in_thread


def make_cache():
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_batch_size=4, max_total_tokens=256,
                              prefill_chunk_size=64, dtype="float32", rope_mode="none")
    return kvcache.PagedKVCache(cfg, backend="reference")


def qkv(cache, total, value):
    c = cache.config
    q = cache.from_numpy(np.ones((total, c.num_qo_heads, c.head_dim)))
    k = cache.from_numpy(np.full((total, c.num_kv_heads, c.head_dim), float(value)))
    return q, k, k


def abandoned(cache, layers=1):
    """A forward over sequence 0 opened (and ``layers`` run) by a thread that then ends."""
    def leave_open():
        cache.begin_forward([0], [3])
        for layer in range(layers):
            cache.attention(layer, *qkv(cache, 3, 9.0))
    box, t = run_in_thread(leave_open, "doomed-worker")
    assert box == {"value": None}, box
    return t


def snapshot(cache):
    k, v = cache.get_kv(0)
    return (cache.sequence_length(0), cache.num_available_pages, kvcache.to_numpy(k).copy())


@pytest.fixture
def cache():
    c = make_cache()
    c.add_sequence(0)
    with c.forward([0], [5]):
        for layer in range(2):
            c.attention(layer, *qkv(c, 5, 1.0))
    return c


@pytest.mark.parametrize("caller", ["main", "other"])
def test_abort_forward_from_any_thread_recovers_a_dead_threads_forward(cache, caller):
    before = (5, cache.num_available_pages)
    ref_k = kvcache.to_numpy(cache.get_kv(0)[0]).copy()
    abandoned(cache)
    if caller == "main":
        cache.abort_forward()
    else:
        box, _ = run_in_thread(cache.abort_forward, "rescuer")
        assert box == {"value": None}, box
    assert (cache.sequence_length(0), cache.num_available_pages) == before
    np.testing.assert_array_equal(kvcache.to_numpy(cache.get_kv(0)[0]), ref_k)
    cache.state.pt.check_invariants()
    # usable again, by this thread and by others
    with cache.forward([0], [1]):
        for layer in range(2):
            cache.attention(layer, *qkv(cache, 1, 2.0))
    box, _ = run_in_thread(lambda: (cache.add_sequence(1), cache.sequence_ids)[1], "later")
    assert box == {"value": [0, 1]}


def test_clear_from_another_thread_recovers_a_dead_threads_forward(cache):
    abandoned(cache)
    cache.clear()
    assert cache.is_empty and cache.open_plan is None
    cache.add_sequence(3)
    with cache.forward([3], [2]):
        for layer in range(2):
            cache.attention(layer, *qkv(cache, 2, 1.0))
    assert cache.sequence_length(3) == 2


CALLS = [
    ("end_forward", lambda c: c.end_forward()),
    ("begin_forward", lambda c: c.begin_forward([0], [1])),
    ("add_sequence", lambda c: c.add_sequence(7)),
    ("get_kv", lambda c: c.get_kv(0)),
    ("attention", lambda c: c.attention(1, *qkv(c, 3, 9.0))),
]


@pytest.mark.parametrize("name,call", CALLS, ids=[c[0] for c in CALLS])
def test_other_calls_name_the_dead_thread_and_the_recovery(cache, name, call):
    before = snapshot(cache)
    abandoned(cache)
    with pytest.raises(ForwardStateError) as info:
        call(cache)
    msg = str(info.value)
    assert "doomed-worker" in msg and "died" in msg and "abort_forward" in msg, msg
    cache.abort_forward()                     # nothing the refused call did survives
    after = snapshot(cache)
    assert after[:2] == before[:2]
    np.testing.assert_array_equal(after[2], before[2])


def test_a_new_thread_never_continues_a_dead_threads_forward(cache):
    """Thread ids are reused: a thread started after the owner died often gets its id. It must
    not pass for the owner (its attention would write into the dead thread's forward)."""
    dead = abandoned(cache)
    idents = []
    for _ in range(4):                        # on Linux the id is usually reused at once
        box, t = run_in_thread(lambda: cache.attention(1, *qkv(cache, 3, 9.0)), "newcomer")
        idents.append(t.ident)
        assert isinstance(box.get("error"), ForwardStateError), (box, t.ident, dead.ident)
    cache.abort_forward()
    assert cache.sequence_length(0) == 5


def test_a_live_threads_forward_is_still_its_own():
    cache = make_cache()
    cache.add_sequence(0)
    opened, release = threading.Event(), threading.Event()

    def hold():
        cache.begin_forward([0], [1])
        opened.set()
        release.wait(30)
        cache.abort_forward()

    t = threading.Thread(target=hold, name="holder")
    t.start()
    try:
        assert opened.wait(30)
        for call in (cache.abort_forward, cache.clear):
            with pytest.raises(ForwardStateError, match="holder"):
                call()
    finally:
        release.set()
        t.join(30)
    assert cache.sequence_length(0) == 0 and cache.open_plan is None
