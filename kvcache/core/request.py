"""Planner step 1, validate: check a ``begin_forward`` request against the cache and the
configuration, changing nothing. Every refusal is a typed error naming the sequence, the value
and the limit."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Optional

import numpy as np

from ..errors import (ForwardStateError, InvalidArgumentError, SequenceNotFoundError,
                      UnsupportedFeatureError)
from .validate import INT32_MAX, int_array, seq_id_list


_slot_of = attrgetter("slot")


def exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    """``[0, x0, x0+x1, ...]`` as int64 (CSR offsets of counts ``x``)."""
    out = np.zeros(len(x) + 1, np.int64)
    np.cumsum(x, out=out[1:])
    return out


@dataclass(frozen=True)
class ForwardRequest:
    """A checked request: ``B`` sequences appending ``append[i]`` tokens each.

    ``seqs``/``slots``/``last``: each sequence's state, slot and last block.
    ``tree_parents`` (T,) int64: the new tokens' tree parents (None: no token tree).
    ``tree_before`` (B,) int64: each sequence's uncommitted tree size before this forward.
    """

    seq_ids: list
    seqs: list
    slots: np.ndarray
    last: np.ndarray
    append: np.ndarray
    total: int
    tree_parents: Optional[np.ndarray]
    tree_before: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.seq_ids)

    @property
    def is_decode(self) -> bool:
        """One token per sequence."""
        return self.total == len(self.seq_ids)


def check_batch(pt, config, seq_ids, append_lengths) -> tuple[list, list, np.ndarray]:
    """(seq_ids as ints, their states, append lengths as int64) of a valid batch."""
    seq_ids = seq_id_list(seq_ids, "seq_ids")
    batch = len(seq_ids)
    limit = config.prefill_chunk_size
    if not 1 <= batch <= config.max_batch_size:
        raise InvalidArgumentError(
            f"a forward needs 1 to max_batch_size={config.max_batch_size} sequences, got {batch}")
    # each length bounded in Python ints first, so the int64 sum below cannot wrap
    append = int_array(append_lengths, "append_lengths", 1, limit, length=batch,
                       owner=lambda i: f"sequence {seq_ids[i]}", limit=f"prefill_chunk_size={limit}")
    total = int(append.sum())
    if total > limit:
        raise InvalidArgumentError(f"forward of {total} tokens exceeds prefill_chunk_size={limit}")
    try:
        seqs = list(map(pt.seqs.__getitem__, seq_ids))
    except (KeyError, TypeError):
        missing = next(s for s in seq_ids if not isinstance(s, (int, np.integer)) or s not in pt.seqs)
        raise SequenceNotFoundError(
            f"sequence {missing!r} in begin_forward is not in the cache") from None
    if len(set(seq_ids)) != batch:
        dup = next(s for i, s in enumerate(seq_ids) if s in seq_ids[:i])
        raise InvalidArgumentError(f"sequence {dup} appears twice in one forward")
    return seq_ids, seqs, append


def check_forward(pt, config, capabilities, seq_ids, seqs, append,
                  tree_parent_ptr) -> ForwardRequest:
    """The ``ForwardRequest`` of a batch ``check_batch`` accepted, with its token tree checked."""
    slots = np.fromiter(map(_slot_of, seqs), np.int64, len(seqs))
    total = int(append.sum())
    tree_before = pt.s_tree[slots].astype(np.int64)
    if tree_parent_ptr is None and tree_before.any():
        i = int(np.argmax(tree_before > 0))
        raise ForwardStateError(
            f"sequence {seq_ids[i]} has {int(tree_before[i])} uncommitted token-tree tokens; "
            f"call commit_accepted_token_tree_nodes or pass token_tree_parent_ptr")
    parents = None
    if tree_parent_ptr is not None:
        parents = check_tree(config, capabilities, seq_ids, append, tree_before, tree_parent_ptr,
                             total)
    return ForwardRequest(seq_ids=seq_ids, seqs=seqs, slots=slots,
                          last=pt.s_last[slots].astype(np.int64), append=append, total=total,
                          tree_parents=parents, tree_before=tree_before)


def check_tree(config, capabilities, seq_ids, append, tree_before, tree_parent_ptr,
               total) -> np.ndarray:
    """The token tree's parent pointers (T,) int64: -1 (a root) or an earlier node of the same
    sequence's uncommitted tree."""
    if not capabilities.tree_attention:
        from ..backend import Capabilities
        raise UnsupportedFeatureError(Capabilities.reason("tree_attention"))
    if config.support_sliding_window:
        raise InvalidArgumentError(
            "token trees are not supported in a cache built with support_sliding_window=True")
    if config.batch_invariant:
        raise UnsupportedFeatureError(
            "token trees are not supported in a cache built with batch_invariant=True (its one "
            "pass per sequence reads the new tokens as a chain); pass token_tree_parent_ptr=None")
    if config.effective_rope_mode == "inline":
        raise InvalidArgumentError("token trees need rope_mode 'none' or 'normal', not 'inline'")
    qo = exclusive_cumsum(append)
    seq_of_token = np.repeat(np.arange(len(append)), append)
    # int64 without wrapping (a uint64 2**64-1 is not -1); the own-index bound follows
    ptr = int_array(tree_parent_ptr, "token_tree_parent_ptr", -1, INT32_MAX, length=total,
                    owner=lambda t: f"sequence {seq_ids[seq_of_token[t]]}")
    own = tree_before[seq_of_token] + np.arange(total) - qo[seq_of_token]
    bad = np.nonzero((ptr < -1) | (ptr >= own))[0]
    if len(bad):
        t = int(bad[0])
        raise InvalidArgumentError(
            f"token_tree_parent_ptr[{t}] = {int(ptr[t])} for sequence {seq_ids[seq_of_token[t]]}: "
            f"a parent must be -1 or smaller than the token's tree index {int(own[t])}")
    return ptr
