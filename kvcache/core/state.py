"""``CacheState``: the cache's sequences, blocks and pages, and every operation on them, each
validate-then-mutate. The operations live with their kind, one mixin a module:

* ``sequences``: lookups, add / remove, fork, popn (``SequenceOps``, the root);
* ``window``: enabling and sliding a sequence's window (``WindowOps``);
* ``tree_commit``: committing token trees (``TreeCommitOps``);
* ``import_ops``: an import's check, reservation, commit and cancel (``ImportOps``);
* ``forward_ops``: a forward's reservation, tree extension and rollback (``ForwardOps``).

Operations that need device work (copying a partial page on fork, compacting a token tree on
commit) return the work as plain data; ``PagedKVCache`` hands it to the backend.

Every public method of ``CacheState`` (of a mixin, and of a subclass) bumps ``epoch`` before
it runs unless it is marked ``@query`` (module ``epoch``): the planner reuses a decode batch's
plan only while the epoch is unchanged, so an operation added anywhere cannot forget to
invalidate it.
"""

from __future__ import annotations

from typing import Optional

from .forward_ops import ForwardOps
from .groups import WindowGroups
from .import_ops import ImportOps
from .pagetable import PageTable
from .slots import StateSlots
from .tree_commit import TreeCommitOps
from .validate import int_arg as as_int     # the shared int check, under its old name here

__all__ = ["CacheState", "as_int"]


class CacheState(ImportOps, ForwardOps, TreeCommitOps):
    """The cache's sequences, blocks and pages (``pt``) and the operations on them.

    ``epoch`` counts structural changes: every public method not marked ``@query`` bumps it
    (see the module docstring). Only a decode step changes the page table without a bump: it
    grows each sequence's last block by one token, which the reused plan accounts for.
    """

    def __init__(self, num_pages: int, page_size: int, support_sliding_window: bool,
                 groups: Optional[tuple] = None, slots: Optional[StateSlots] = None):
        self.page_size = page_size
        self.support_sliding_window = support_sliding_window
        # slots: each sequence's state slot (``core.slots``; None: no state layers)
        self.slots = slots
        # groups: the ``core.groups.GroupSpec`` of each window group (None: none)
        self.pt = PageTable(num_pages, page_size,
                            None if groups is None else WindowGroups(groups, page_size))
        self.epoch = 0

    def clear(self) -> None:
        groups = self.pt.groups
        self.pt = PageTable(self.pt.num_pages, self.page_size,
                            None if groups is None else groups.fresh())
        if self.slots is not None:
            self.slots = self.slots.fresh()
