"""Structural changes bump the plan epoch in one place: every public ``CacheState`` method not
marked ``@query`` does, so a new sequence operation cannot leave a stale decode plan in use."""

import copy

import numpy as np

import kvcache
from kvcache.core.plan import walk
from kvcache.core.planner import Planner
from kvcache.core.state import CacheState


class StateWithNewOperation(CacheState):
    """A new sequence operation, written without any thought of the planner: it starts a fresh
    last block for a sequence (what a fork at a page boundary does to its parent)."""

    def start_new_block(self, seq_id):
        pt = self.pt
        seq = self.seq(seq_id)
        last = int(pt.s_last[seq.slot])
        new = pt.new_block()
        pt.b_start[new] = int(pt.s_len[seq.slot])
        pt.b_parent[new] = last
        pt.s_last[seq.slot] = new


def _planner(state_cls):
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=1, head_dim=4,
                              page_size=4, max_batch_size=8, max_total_tokens=512,
                              prefill_chunk_size=64, dtype="float32", rope_mode="none")
    state = state_cls(cfg.num_pages, cfg.page_size, False)
    return Planner(state, cfg, kvcache.Capabilities(tree_attention=True))


def _arrays(plan):
    return [(d, name, a.tolist()) for d, name, a in walk(plan)]


def _two_decoding(state_cls):
    """A planner whose sequences 0 and 1 hold 6 tokens each and ran two decode steps (the second
    reused the first's plan: both are now two full pages)."""
    planner = _planner(state_cls)
    for sid in (0, 1):
        planner.state.add_sequence(sid)
        planner.begin([sid], [6])
    planner.begin([0, 1], [1, 1])
    planner.begin([0, 1], [1, 1])
    return planner, planner.state


def test_a_new_operation_bumps_the_epoch_and_the_stale_plan_is_not_reused():
    planner, state = _two_decoding(StateWithNewOperation)
    reuse = planner.decode_reuse
    assert reuse is not None and reuse.epoch == state.epoch
    epoch = state.epoch
    state.start_new_block(0)
    assert state.epoch > epoch, "the new operation did not bump the plan epoch"
    slow = copy.deepcopy(planner)
    slow.fast_path = False
    plan = planner.begin([0, 1], [1, 1])
    assert planner.decode_reuse is not reuse, "the stale decode plan was reused"
    # sequence 0's new token lives in its new block: the plan equals a rebuild from scratch
    # (one depth: the batch shares nothing, so sequence 0's two blocks are one entry)
    assert len(plan.depths) == 1 and plan.depths[0].page_indptr.tolist() == [0, 3, 6]
    assert _arrays(plan) == _arrays(slow.begin([0, 1], [1, 1]))
    state.pt.check_invariants()


def test_stale_plan_would_be_wrong():
    """The same change hidden from the epoch makes the reused plan differ from a rebuild: the
    epoch, not luck, keeps the test above honest."""
    planner, state = _two_decoding(CacheState)
    slow = copy.deepcopy(planner)
    slow.fast_path = False
    for p in (planner, slow):                          # a change bypassing CacheState:
        pt = p.state.pt                                # sequence 0 loses its last token
        seq = pt.seqs[0]
        last = int(pt.s_last[seq.slot])
        pt.b_len[last] -= 1
        pt.s_len[seq.slot] -= 1
    assert _arrays(planner.begin([0, 1], [1, 1])) != _arrays(slow.begin([0, 1], [1, 1]))


def test_queries_leave_the_epoch_alone_and_mutators_bump_it():
    state = CacheState(64, 4, False)
    state.add_sequence(0)
    epoch = state.epoch
    state.seq(0), state.length(0), state.check_popn(0, 0)
    assert state.epoch == epoch
    state.fork_sequence(0, 1)
    assert state.epoch > epoch
    public = [n for n in dir(CacheState) if not n.startswith("_") and callable(getattr(CacheState, n))]
    assert all(hasattr(getattr(CacheState, n), "is_query") for n in public), public
    assert np.all(state.pt.s_len[:2] == 0)
