"""Run-ahead: the host queues many forwards and sequence operations without waiting for the
device, as a serving loop does, and reads every output only at the end.

Each test keeps the device busy with a long prefill on a second cache (the ballast), queues a
serving pattern behind it, and compares every kept output and the final ``get_kv`` of every
sequence with the reference. A backend that rewrites a buffer (index arrays, staging memory,
scratch, pages) while queued work may still read it gives wrong outputs here, where the other
classes, which read each output at once and so wait for the device, see nothing."""

from __future__ import annotations

from .base import Conformance


class TestRunAhead(Conformance):
    """Many forwards and sequence operations queued behind a busy device, every output read
    only at the end (the ``run_ahead`` fixture): catches a backend that rewrites an index
    array, staging buffer, scratch space or page while queued work may still read it."""

    def test_serving_mix(self, run_ahead):
        """Prefill, decode, forks mid-page and at page ends, popn into a shared prefix, removes
        and adds (freed pages handed out again), all queued behind a busy device."""
        r = run_ahead()
        ps = r.config.page_size
        r.ballast()
        r.add(0)
        r.forward([0], [3 * ps + 5])
        r.decode([0], steps=3)
        r.fork(0, 1)
        r.fork(0, 2, ps + 1)
        r.ballast()
        r.decode([0, 1, 2], steps=4)
        r.popn(1, 5)              # into the prefix shared with 0
        r.forward([1, 2], [ps + 2, 3])
        r.remove(0)
        r.add(3)
        r.ballast()
        r.forward([3, 1], [2 * ps + 1, 1])
        r.decode([2, 3, 1], steps=6)
        r.remove(2)
        r.add(4, 5)
        r.forward([4, 5, 3], [ps, 7, 1])
        r.decode([1, 3, 4, 5], steps=4)
        r.finish()

    def test_index_arrays_outgrow_their_buffer(self, run_ahead):
        """Small forwards, then a batch whose index arrays need a larger device buffer than any
        forward before it, right behind the ballast; then small ones again."""
        r = run_ahead(max_total_tokens=2048, prefill_chunk_size=1024)
        r.add(0, 1, 2, 3)
        r.decode([0, 1, 2, 3], steps=2)
        r.ballast()
        r.forward([0, 1, 2, 3], [300, 200, 250, 150])
        r.decode([3, 2, 1, 0], steps=3)
        r.ballast()
        r.forward([1, 3], [40, 60])
        r.decode([0, 1, 2, 3], steps=3)
        r.finish()

    def test_token_trees(self, run_ahead):
        """Draft trees grown over forwards and committed (KV compaction), queued."""
        r = run_ahead(needs=("tree_attention",), rope_mode="normal")
        ps = r.config.page_size
        r.ballast()
        r.add(0, 1)
        r.forward([0, 1], [ps + 3, 4])
        r.forward([0, 1], [2, 1], tree=[-1, -1, -1])
        r.forward([0, 1], [3, 2], tree=[0, 0, 1, 0, 0])
        r.commit([0, 1], [3, 2])
        r.decode([0, 1], steps=2)
        r.ballast()
        r.forward([1, 0], [3, 2], tree=[-1, 0, 0, -1, 0])
        r.commit([0, 1], [1, 2])
        r.decode([0, 1], steps=2)
        r.finish()

    def test_sliding_windows(self, run_ahead):
        """Windows slide (pages freed and reused inside the run) while the device is behind."""
        r = run_ahead(support_sliding_window=True)
        ps = r.config.page_size
        r.ballast()
        r.add(0, 1)
        r.forward([0, 1], [ps + 3, 5])
        r.enable_sliding_window(0, max(2 * ps, 8), 4)
        r.enable_sliding_window(1, ps + 1, 0)
        r.decode([0, 1], steps=ps + 4)
        r.ballast()
        r.forward([0, 1], [ps + 2, 2 * ps])
        r.decode([1, 0], steps=3)
        r.finish()

    def test_graph_mode_buffers(self, run_ahead):
        """Graph mode's fixed index buffer, refilled every decode step, with eager prefills
        between steps."""
        r = run_ahead(needs=("static_decode",), static_decode=True)
        ps = r.config.page_size
        r.ballast()
        r.add(0, 1)
        r.forward([0, 1], [2 * ps + 3, 5])
        r.decode([0, 1], steps=4)
        r.fork(0, 2, ps + 2)
        r.ballast()
        r.decode([2, 0, 1], steps=ps + 2)
        r.forward([2, 1], [ps, 3])
        r.decode([0, 1, 2], steps=3)
        r.finish()
