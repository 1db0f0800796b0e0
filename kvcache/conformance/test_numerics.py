"""Non-finite K/V: a key a query must not see (a later token, a sibling branch of a token tree, a
token the sliding window evicted) adds nothing to that query's output and lse, even when its K
or V holds NaN or inf; a key the query does see propagates the NaN / inf."""

from __future__ import annotations

import dataclasses

import numpy as np

import kvcache

from .base import Conformance
from .tolerance import assert_close

NAN, INF = float("nan"), float("inf")


class _Twin:
    """The pair (backend vs reference, compared NaN- and inf-strictly) is fed K/V with non-finite
    values in some new tokens; a clean reference cache runs the same forwards with the finite K/V.
    Rows that must not see a bad token must be finite and equal the clean output; rows that see
    one must be non-finite."""

    def __init__(self, make_pair, **config):
        self.p = make_pair(num_layers=1, **config)
        self.clean = kvcache.PagedKVCache(dataclasses.replace(self.p.config, static_decode=False),
                                          backend="reference")

    def add(self, *sids):
        self.p.add(*sids)
        for sid in sids:
            self.clean.add_sequence(sid)

    def enable_sliding_window(self, sid, window, sink):
        self.p.enable_sliding_window(sid, window, sink)
        self.clean.enable_sliding_window(sid, window, sink)

    def commit(self, sids, leaves):
        self.p.commit(sids, leaves)
        self.clean.commit_accepted_token_tree_nodes(list(sids), list(leaves))

    def forward(self, sids, lens, tree=None, *, bad=None, sees=()):
        """``bad``: {row: ("k" or "v", value)} written into that new token's K or V (every head,
        every layer); ``sees``: the rows that see a bad token (new or cached)."""
        p, c = self.p, self.p.config
        total = sum(lens)
        p.begin(sids, lens, tree)
        self.clean.begin_forward(list(sids), list(lens), tree)
        sees = sorted(sees)
        blind = np.setdiff1d(np.arange(total), sees)
        for layer in range(c.num_layers):
            q, k, v = (p.random(total, h, c.head_dim)
                       for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            kb, vb = k.copy(), v.copy()
            for row, (which, value) in (bad or {}).items():
                (kb if which == "k" else vb)[row] = value
            o, lse = p.attend(layer, inputs=(q, kb, vb))
            qc, kc, vc = map(self.clean.from_numpy, (q, k, v))
            o_c, lse_c = (kvcache.to_numpy(x) for x in self.clean.attention(
                layer, qc, kc, vc, return_lse=True))
            what = f"(layer {layer}, a row that sees no bad token) vs the clean reference"
            label = lambda i: p.row_label(int(blind[i]))   # noqa: E731
            assert_close(f"attention output {what}", o_c[blind], o[blind], p.tol,
                         context=p.context(), row_label=label)
            assert_close(f"lse {what}", lse_c[blind], lse[blind], p.tol, lse=True,
                         context=p.context(), row_label=label)
            assert np.isfinite(o[blind]).all() and np.isfinite(lse[blind]).all()
            assert not np.isfinite(o[sees]).any(), (
                f"rows {sees} see a NaN/inf K or V but their output is (partly) finite{p.context()}")
        p.end()
        self.clean.end_forward()


class TestMaskedNonFinite(Conformance):
    """NaN / inf in a K or V row that a query must not see (a later token of its
    prefill, a sibling branch of a token tree, a token the sliding window evicted) leaves that
    query's output and lse finite; rows that do see it are non-finite. A kernel that multiplies
    masked scores by zero instead of skipping them (0 * NaN = NaN) fails here."""

    def test_later_tokens_of_a_prefill(self, make_pair):
        """NaN / inf in the K or V of a token: the earlier tokens of its prefill (masked by the
        causal mask, also inside one kernel tile) stay finite, the later ones and every later
        decode step of that sequence are NaN / inf; other sequences are untouched."""
        t = _Twin(make_pair)
        ps = t.p.config.page_size
        t.add(0, 1, 2, 3)
        t.forward([0, 3], [ps + 3, 4])                            # a clean history for 0 and 3
        n0 = 37
        bad = {20: ("v", NAN),                                   # sequence 0: rows 20..36 see it
               n0 + 8: ("k", NAN),                               # sequence 1: its last token
               n0 + 9 + 3: ("v", INF),                           # sequence 2: rows 3..5 see it
               n0 + 9 + 6 + 1: ("k", INF)}                       # sequence 3: rows 1.. see it
        sees = [*range(20, n0), n0 + 8, *range(n0 + 12, n0 + 15), *range(n0 + 16, n0 + 19)]
        t.forward([0, 1, 2, 3], [n0, 9, 6, 4], bad=bad, sees=sees)
        t.add(4)
        t.forward([4, 0, 1, 2], [2, 1, 1, 1], sees=[2, 3, 4])    # decode reads the bad history

    def test_token_tree_siblings(self, make_pair):
        """A NaN in one tree node reaches its descendants only: siblings, cousins (also read
        from pages in later forwards, and in one-token decode steps) and the committed path stay
        finite."""
        t = _Twin(make_pair, needs=("tree_attention",))
        ps = t.p.config.page_size
        t.add(0, 1)
        t.forward([0, 1], [ps + 3, 4])
        # sequence 0: roots 0, 1 (1 has NaN V); sequence 1: root 0, children 1, 2 (2 has NaN K)
        t.forward([0, 1], [2, 3], tree=[-1, -1, -1, 0, 0], bad={1: ("v", NAN), 4: ("k", NAN)},
                  sees=[1, 4])
        # sequence 0: nodes 2, 3 under root 0, node 4 under bad root 1; sequence 1: node 3 under
        # node 1, node 4 under bad node 2
        t.forward([0, 1], [3, 2], tree=[0, 0, 1, 1, 2], sees=[2, 4])
        t.forward([0, 1], [1, 1], tree=[2, 3])                    # one node each: decode kernels
        t.commit([0, 1], [5, 5])
        t.forward([1, 0], [1, 2])

    def test_evicted_window_token(self, make_pair):
        """A NaN token the sliding window evicts: seen inside its forward, never again."""
        t = _Twin(make_pair, support_sliding_window=True)
        ps = t.p.config.page_size
        t.add(0, 1)
        t.forward([0, 1], [4, 3])
        t.enable_sliding_window(0, ps + 3, 2)
        n = 2 * ps + 5
        t.forward([0, 1], [n, 2], bad={3: ("k", NAN), 4: ("v", NAN)}, sees=range(3, n))
        t.forward([1, 0], [1, 2])
