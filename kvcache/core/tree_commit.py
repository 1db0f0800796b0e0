"""Committing sequences' token trees (``TreeCommitOps``): after a speculative forward each
sequence keeps the path to one accepted leaf of its uncommitted tree. ``commit_plan`` says which
KV rows the backend moves so that path follows the committed history contiguously; ``commit``
then drops the rest of the tree's tokens.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError
from .epoch import query
from .pagetable import SeqState
from .sequences import SequenceOps
from .validate import int_arg as as_int
from .validate import int_values, seq_id_list


class TreeCommitOps(SequenceOps):
    """Checking, planning and applying a token-tree commit (see the module docstring)."""

    @query
    def check_commit(self, seq_ids, leaf_indices) -> list[tuple[SeqState, int]]:
        seq_ids = seq_id_list(seq_ids, "seq_ids")
        leaf_indices = int_values(leaf_indices, "leaf_indices")
        if len(seq_ids) != len(leaf_indices):
            raise InvalidArgumentError(
                f"commit got {len(seq_ids)} seq_ids but {len(leaf_indices)} leaf_indices")
        out, seen = [], set()
        for sid, leaf in zip(seq_ids, leaf_indices):
            seq = self.seq(sid)
            if seq.seq_id in seen:
                raise InvalidArgumentError(f"sequence {seq.seq_id} appears twice in the commit")
            seen.add(seq.seq_id)
            leaf = as_int(leaf, "leaf index")
            size = len(seq.tree_parent)
            if not -1 <= leaf < size:
                raise InvalidArgumentError(
                    f"leaf index {leaf} of sequence {seq.seq_id} must be in [-1, {size}) "
                    f"(its uncommitted tree has {size} tokens)")
            out.append((seq, leaf))
        return out

    @query
    def commit_plan(self, items) -> tuple[np.ndarray, np.ndarray]:
        """Source and destination slots of the KV rows that move so each accepted path becomes
        contiguous right after the committed history."""
        src: list[int] = []
        dst: list[int] = []
        for seq, leaf in items:
            if leaf < 0:
                continue
            path = []
            node = leaf
            while node != -1:
                path.append(node)
                node = seq.tree_parent[node]
            path.reverse()
            moves = [(node, p) for p, node in enumerate(path) if node != p]
            if not moves:
                continue
            length = self.pt.length(seq)
            base = length - len(seq.tree_parent)
            slots = self.pt.position_slots(seq, base, length)
            src.extend(int(slots[node]) for node, _ in moves)
            dst.extend(int(slots[p]) for _, p in moves)
        return np.asarray(src, np.int32), np.asarray(dst, np.int32)

    def commit(self, items) -> None:
        for seq, leaf in items:
            size = len(seq.tree_parent)
            keep = seq.tree_depth[leaf] + 1 if leaf >= 0 else 0
            seq.tree_parent, seq.tree_depth = [], []
            self.pt.s_tree[seq.slot] = 0
            self._popn(seq, size - keep)
