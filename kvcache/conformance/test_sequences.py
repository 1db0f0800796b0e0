"""Sequence operations: forks, popn, sliding windows with sinks, token trees and commit."""

from __future__ import annotations

from .base import Conformance

import pytest


class TestFork(Conformance):
    """``fork_sequence``: at a page boundary (pages shared), mid-page (the partial page copied,
    so the child's writes must not reach the parent), at the whole length and at zero, siblings
    decoding side by side, fork chains deeper than four, and removing the parent first."""

    def test_at_page_boundary(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 3)
        p.fork(0, 1, 2 * ps)
        p.forward([0, 1], [1, 1])
        p.forward([1, 0], [ps + 2, 3])

    def test_mid_page(self, make_pair):
        """A partial page is copied: the child's first writes must not leak into the parent."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 3)
        p.fork(0, 1, ps + max(ps // 2, 1) if ps > 1 else 2)
        p.decode([1, 0], steps=3)
        p.forward([0, 1], [ps, 2])

    def test_whole_sequence(self, make_pair):
        """fork_pos=-1 shares everything, including a partly filled last page."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, ps + 1)
        p.fork(0, 1)
        p.fork(0, 2, -1)
        p.decode([0, 1, 2], steps=2)

    def test_at_page_multiple_end(self, make_pair):
        """Forking the whole of a sequence whose length is a page multiple; both keep decoding."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps)
        p.fork(0, 1)
        p.decode([0, 1], steps=2)

    def test_at_zero(self, make_pair):
        p = make_pair()
        p.add(0)
        p.prefill(0, 7)
        p.fork(0, 1, 0)
        p.forward([1, 0], [3, 1])

    def test_siblings_decode(self, make_pair):
        """Many children of one prefix decode together (shared pages read once per entry)."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 3 * ps + 2)
        for child in range(1, 6):
            p.fork(0, child, 3 * ps if child % 2 else 3 * ps + 1)
        p.decode(range(6), steps=2)
        p.forward([1, 2, 3, 4, 5], [2, 1, 4, 1, 1])

    def test_depth_greater_than_four(self, make_pair):
        """A chain of forks six deep (deeper than the block depths the core runs separately)."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, ps + 2)
        for d in range(1, 7):
            p.forward([d - 1], [ps + d])
            p.fork(d - 1, d, p.ref.sequence_length(d - 1) - (d % 3))
        p.decode(range(7), steps=2)
        p.forward([6, 3, 0], [5, 1, ps + 1])

    def test_remove_parent(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 5)
        p.fork(0, 1, ps + 2)
        p.fork(0, 2)
        p.remove(0)
        p.decode([1, 2], steps=2)
        p.remove(2)
        p.forward([1], [ps + 1])


class TestPopn(Conformance):
    """``popn`` (drop the last n tokens, e.g. rejected speculative tokens): within the last
    page, across pages, below a fork point (the popped sequence stops sharing, the other keeps
    its tokens), and n = 0; decoding afterwards writes over the popped slots."""

    def test_within_last_page(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps + 5)
        p.popn(0, 1)
        p.decode([0], steps=2)

    def test_across_pages(self, make_pair):
        p = make_pair()
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [3 * ps + 2, 4])
        p.popn(0, ps + 3)
        p.forward([0, 1], [2, 1])
        p.popn(1, p.ref.sequence_length(1))
        p.forward([1, 0], [3, 1])

    def test_into_shared_prefix(self, make_pair):
        """Popping below a fork point: the child stops sharing (a partial page is copied) and
        the parent is unchanged."""
        p = make_pair()
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 3 * ps + 1)
        p.fork(0, 1, 3 * ps)
        p.forward([1], [2])
        p.popn(1, ps + 3)
        p.decode([1, 0], steps=2)
        p.fork(1, 2)
        p.popn(2, 1)
        p.decode([0, 1, 2], steps=1)

    def test_zero(self, make_pair):
        p = make_pair()
        p.add(0)
        p.prefill(0, 5)
        p.popn(0, 0)
        p.decode([0], steps=1)


def _sliding(make_pair, rope_mode="none", **kw):
    return make_pair(support_sliding_window=True, rope_mode=rope_mode, **kw)


def decode_with_sinks(p) -> None:
    """Two sequences; one gets a window with 4 sink tokens and both decode past it."""
    ps = p.config.page_size
    p.add(0, 1)
    p.forward([0, 1], [ps + 3, 5])
    p.enable_sliding_window(0, max(2 * ps, 8), 4)
    p.decode([0, 1], steps=ps + 4)
    p.forward([0, 1], [ps + 2, 2])
    p.decode([1, 0], steps=2)


class TestSlidingWindow(Conformance):
    """``enable_sliding_window(seq_id, window, sinks)`` (needs the ``sliding_window``
    capability): decode with and without sink tokens, a prefill longer than the window,
    windowed and plain sequences in one batch, and windows next to forks; ``normal`` RoPE is
    applied inline so positions stay those of the window."""

    @pytest.mark.parametrize("rope_mode", ["none", "normal"])
    def test_decode_with_sinks(self, make_pair, rope_mode):
        """'normal' RoPE becomes inline RoPE with sliding windows (positions inside the window)."""
        decode_with_sinks(_sliding(make_pair, rope_mode))

    def test_prefill_longer_than_window(self, make_pair):
        p = _sliding(make_pair, "normal")
        ps = p.config.page_size
        p.add(0)
        p.enable_sliding_window(0, ps + 3, 2)
        p.prefill(0, 3 * ps + 1)
        p.decode([0], steps=3)
        p.prefill(0, 2 * ps)

    def test_no_sinks(self, make_pair):
        p = _sliding(make_pair)
        ps = p.config.page_size
        p.add(0, 1)
        p.enable_sliding_window(1, ps + 1, 0)
        p.forward([0, 1], [2, 2 * ps])
        p.decode([0, 1], steps=ps + 2)

    def test_mixed_with_plain(self, make_pair):
        p = _sliding(make_pair, "normal")
        ps = p.config.page_size
        p.add(0, 1, 2)
        p.enable_sliding_window(2, ps + 2, 1)
        p.forward([0, 1, 2], [ps, 3, ps + 5])
        p.forward([2, 0, 1], [1, 2, 1])
        p.popn(2, 1)
        p.decode([0, 1, 2], steps=2)

    def test_windows_next_to_forks(self, make_pair):
        """A child whose shared prefix lies within its sinks; a windowed parent forked at its
        page-aligned end (within its sinks); popn through the window into the sinks."""
        p = _sliding(make_pair, "normal")
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, 2 * ps)
        p.fork(0, 1, ps + 1)                         # shares ps tokens, copies a partial page
        p.enable_sliding_window(1, ps + 4, ps + 1)
        p.enable_sliding_window(0, 3 * ps + 2, 2 * ps + 1)
        p.fork(0, 2)
        p.forward([0, 1, 2], [ps + 3, 6, 2])
        p.decode([0, 1, 2], steps=ps + 2)
        p.popn(1, ps + 3)
        p.decode([1, 0], steps=3)


def _tree_pair(make_pair, **kw):
    return make_pair(needs=("tree_attention",), **kw)


def several_roots_and_commit(p) -> None:
    """Sequence 0 drafts two roots, sequence 1 a chain; commit one path each, decode on."""
    ps = p.config.page_size
    p.add(0, 1)
    p.forward([0, 1], [ps + 3, 4])
    # sequence 0: roots 0 and 3; sequence 1: a chain
    p.forward([0, 1], [6, 3], tree=[-1, 0, 0, -1, 3, 1, -1, 0, 1])
    p.commit([0, 1], [4, 2])
    p.decode([0, 1], steps=2)


class TestTokenTree(Conformance):
    """Token-tree (speculative decoding) forwards (needs ``tree_attention``): several roots
    per sequence, a draft tree grown one level per forward, trees that cross pages, and
    ``commit_accepted_token_tree_nodes`` keeping one path (or none, or only a root)."""

    @pytest.mark.parametrize("rope_mode", ["none", "normal"])
    def test_several_roots_and_commit(self, make_pair, rope_mode):
        several_roots_and_commit(_tree_pair(make_pair, rope_mode=rope_mode))

    def test_grown_over_forwards(self, make_pair):
        """A draft tree grown one level per forward, then one commit."""
        p = _tree_pair(make_pair, rope_mode="normal")
        ps = p.config.page_size
        p.add(0, 1)
        p.forward([0, 1], [max(ps - 1, 1), 2])
        p.forward([0, 1], [2, 1], tree=[-1, -1, -1])          # level 0
        p.forward([0, 1], [3, 2], tree=[0, 0, 1, 0, 0])       # level 1
        p.forward([0, 1], [2, 1], tree=[2, 4, 2])             # level 2
        p.commit([0, 1], [5, 3])
        p.decode([0, 1], steps=2)

    def test_commit_none_and_root(self, make_pair):
        p = _tree_pair(make_pair)
        p.add(0, 1, 2)
        p.forward([0, 1, 2], [5, 5, 5])
        p.forward([0, 1, 2], [3, 3, 2], tree=[-1, 0, 0, -1, -1, 1, -1, 0])
        p.commit([2, 0, 1], [1, -1, 0])
        p.forward([0, 1, 2], [1, 2, 1])

    def test_tree_crossing_pages(self, make_pair):
        p = _tree_pair(make_pair)
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, max(ps - 2, 1))
        n = ps + 3
        tree = [-1] + [(i - 1) // 2 for i in range(1, n)]     # a binary tree
        p.forward([0], [n], tree=tree)
        p.commit([0], [n - 1])
        p.decode([0], steps=2)

    def test_tree_on_forked_sequence(self, make_pair):
        p = _tree_pair(make_pair)
        ps = p.config.page_size
        p.add(0)
        p.prefill(0, ps + 2)
        p.fork(0, 1, ps + 1)
        p.forward([1, 0], [3, 2], tree=[-1, 0, 0, -1, 0])
        p.commit([0, 1], [1, 2])
        p.decode([0, 1], steps=1)
