"""A cache is used by one thread at a time: a call from a second thread while another thread is
inside a call or holds an open forward raises ForwardStateError naming that thread; never a
silent mix-up of two threads' tokens."""

import sys
import threading
import time

import numpy as np
import pytest

import kvcache
from kvcache import ForwardStateError
from thread_cases import run_in_thread


def make_cache(backend="reference", device=None, **kw):
    base = dict(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=8, page_size=4,
                max_batch_size=4, max_total_tokens=4096, prefill_chunk_size=64, dtype="float32",
                rope_mode="none")
    base.update(kw)
    return kvcache.PagedKVCache(kvcache.CacheConfig(**base), backend=backend, device=device)


def in_thread(fn, name="worker"):
    """Run ``fn`` in a new thread; return what it returned or raised."""
    return run_in_thread(fn, name)[0]


def qkv(cache, total, value):
    c = cache.config
    q = cache.from_numpy(np.ones((total, c.num_qo_heads, c.head_dim)))
    k = cache.from_numpy(np.full((total, c.num_kv_heads, c.head_dim), float(value)))
    return q, k, k


CALLS = [
    ("begin_forward", lambda c: c.begin_forward([1], [1])),
    ("add_sequence", lambda c: c.add_sequence(7)),
    ("remove_sequence", lambda c: c.remove_sequence(1)),
    ("fork_sequence", lambda c: c.fork_sequence(1, 7)),
    ("popn", lambda c: c.popn(1, 1)),
    ("clear", lambda c: c.clear()),
    ("commit_accepted_token_tree_nodes", lambda c: c.commit_accepted_token_tree_nodes([1], [-1])),
    ("get_kv", lambda c: c.get_kv(1)),
    ("sequence_length", lambda c: c.sequence_length(1)),
    ("num_available_pages", lambda c: c.num_available_pages),
    ("attention", lambda c: c.attention(1, *qkv(c, 2, 5.0))),
    ("end_forward", lambda c: c.end_forward()),
    ("abort_forward", lambda c: c.abort_forward()),
    ("query_positions", lambda c: c.query_positions()),
]


@pytest.mark.parametrize("name,call", CALLS, ids=[c[0] for c in CALLS])
def test_a_call_from_another_thread_during_a_forward_raises_naming_the_owner(name, call):
    cache = make_cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.begin_forward([0], [2])
    cache.attention(0, *qkv(cache, 2, 1.0))
    free = cache.num_available_pages
    box = in_thread(lambda: call(cache), name="intruder")
    assert isinstance(box.get("error"), ForwardStateError), box
    msg = str(box["error"])
    assert threading.current_thread().name in msg and str(threading.get_ident()) in msg, msg
    # the owner's forward is untouched and finishes
    assert cache.num_available_pages == free and cache.open_plan is not None
    cache.attention(1, *qkv(cache, 2, 1.0))
    cache.end_forward()
    assert cache.sequence_length(0) == 2 and cache.sequence_length(1) == 0
    # afterwards the other thread may use the cache
    box = in_thread(lambda: (cache.add_sequence(7), cache.sequence_length(7))[1])
    assert box == {"value": 0}


def test_a_call_while_another_thread_is_inside_a_mutating_call_raises():
    cache = make_cache()
    cache.add_sequence(0)
    inside, go_on = threading.Event(), threading.Event()
    original = cache.state.add_sequence

    def slow_add(seq_id):
        inside.set()
        go_on.wait(30)
        original(seq_id)

    cache.state.add_sequence = slow_add
    owner = threading.Thread(target=lambda: cache.add_sequence(1), name="slow-adder")
    owner.start()
    assert inside.wait(30)
    try:
        for call in (lambda: cache.add_sequence(2), lambda: cache.begin_forward([0], [1]),
                     lambda: cache.sequence_length(0), lambda: cache.get_kv(0)):
            with pytest.raises(ForwardStateError, match="slow-adder"):
                call()
    finally:
        go_on.set()
        owner.join(30)
    assert cache.sequence_ids == [0, 1]


def test_racing_threads_never_mix_their_tokens():
    """Two threads each decode their own sequence on one cache, as fast as they can, until each
    has run 300 steps. Every attempt either runs whole or is refused at begin_forward with
    ForwardStateError; the K rows of each sequence are its own thread's."""
    cache = make_cache()
    rounds = 300
    for sid in (0, 1):
        cache.add_sequence(sid)
    done = {0: 0, 1: 0}
    refused = {0: 0, 1: 0}
    errors = []
    start = threading.Barrier(2)

    def worker(sid):
        value = float(sid + 1)
        start.wait()
        while done[sid] < rounds and refused[sid] < 100 * rounds:
            try:
                cache.begin_forward([sid], [1])
            except ForwardStateError as exc:
                if "thread" not in str(exc):
                    errors.append(exc)
                refused[sid] += 1
                time.sleep(0)
                continue
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return
            try:
                for layer in range(cache.config.num_layers):
                    cache.attention(layer, *qkv(cache, 1, value))
                cache.end_forward()
                done[sid] += 1
            except Exception as exc:  # noqa: BLE001 - an owner's own calls must never fail
                errors.append(exc)
                return

    threads = [threading.Thread(target=worker, args=(sid,)) for sid in (0, 1)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                   # switch threads often: mid-call, mid-forward
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert done == {0: rounds, 1: rounds}, (done, refused)
    for sid in (0, 1):
        assert cache.sequence_length(sid) == done[sid]
        k, v = (kvcache.to_numpy(a) for a in cache.get_kv(sid))
        assert (k == sid + 1).all(), f"sequence {sid} holds rows of the other thread"
    cache.state.pt.check_invariants()
