"""State slots (``CacheConfig.layer_kinds`` with ``State`` layers, docs/hybrid.md increment 4):
which slot of the state arrays each sequence holds, on the host.

Every state array of every state layer has ``num_state_slots`` rows, one per slot; a sequence
holds the same slot in all of them from ``add`` to ``remove``. The device side (the arrays,
zeroing a new slot, a fork's copy, a forward's staged writes) is ``kvcache.state_slots``: this
module knows no array library and hands out slot numbers only.

A recurrence cannot be rewound: a state is the state after the sequence's last token, so
anything that moves a sequence's end backwards (``popn``, a fork below the parent's length,
token trees) is refused by ``refuse_rewind`` (UnsupportedFeatureError), except a ``popn`` to
a position whose states are known: 0 (zeros) or a page boundary whose checkpoint the prefix
cache holds (the slot takes it, through ``restore``).

With the prefix cache, ``StateCheckpoints`` hands out the rows of the checkpoint arrays: the
states of a prefix at a page boundary, each held by the prefix index's node of that boundary
(docs/hybrid.md, increment 6).
"""

from __future__ import annotations

from typing import Optional

from ..errors import CacheFullError, UnsupportedFeatureError


ZEROS = -1
"""``StateSlots.restore``'s value for a slot that goes back to zeros (``popn`` to 0)."""


class StateSlots:
    """The free slots and each sequence's slot (``slot``: {sequence id: slot})."""

    def __init__(self, num_slots: int, layers: tuple, num_checkpoints: int = 0,
                 interval: int = 0):
        self.num_slots = num_slots
        self.layers = layers            # the state layers, for the errors' messages
        # free slots: a stack popped from the end, so slots 0, 1, 2 ... are handed out first
        self.free: list = list(range(num_slots - 1, -1, -1))
        self.slot: dict = {}
        # a sequence attached at a cached prefix, or popped back to a checkpoint: {sequence
        # id: the checkpoint row its slot takes, or ZEROS} (the cache copies it on the device
        # and pops it; absent after add_sequence: the slot starts at zeros)
        self.restore: dict = {}
        self.checkpoints = (StateCheckpoints(num_checkpoints, interval)
                            if num_checkpoints else None)

    def fresh(self) -> StateSlots:
        """Every slot free, no checkpoint held (``clear``)."""
        c = self.checkpoints
        return StateSlots(self.num_slots, self.layers, 0 if c is None else c.num,
                          0 if c is None else c.interval)

    def check_take(self, what: str) -> None:
        """CacheFullError naming the limit when no slot is free (``what``: the call)."""
        if not self.free:
            raise CacheFullError(
                f"{what} needs a state slot (state layers {list(self.layers)}), but all "
                f"{self.num_slots} are held (CacheConfig.max_state_slots={self.num_slots}); "
                f"remove a sequence first")

    def take(self, sid) -> int:
        """Give ``sid`` a free slot (``check_take`` passed); returns it."""
        slot = self.free.pop()
        self.slot[sid] = slot
        return slot

    def release(self, sid) -> None:
        """``sid`` gives its slot back."""
        self.free.append(self.slot.pop(sid))
        self.restore.pop(sid, None)

    def refuse_rewind(self, what: str, at: Optional[int] = None) -> None:
        """UnsupportedFeatureError for ``what``, a call that would move a sequence's end back
        (to position ``at``, where known): a recurrent state holds no earlier position unless
        a checkpoint of it is held."""
        where = "an earlier position" if at is None else f"position {at}"
        raise UnsupportedFeatureError(
            f"{what} in a cache with state layers {list(self.layers)}: a recurrent state is the "
            f"state after the sequence's last token, and no checkpoint of {where} is held "
            f"(popn may go back to a page boundary whose state checkpoint the prefix cache "
            f"holds, or to 0; docs/hybrid.md)")

    def check_invariants(self, sids) -> None:
        """AssertionError if the slots are not one per sequence of ``sids`` plus the free."""
        held = sorted(self.slot.values())
        assert set(self.slot) == set(sids), (
            f"state slots held by {sorted(self.slot)} != the cache's sequences {sorted(sids)}")
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + self.free) == list(range(self.num_slots)), (
            f"state slots: held {held} + free {sorted(self.free)} != 0..{self.num_slots - 1}")


class StateCheckpoints:
    """The rows of the checkpoint arrays (``num``), each held by at most one prefix-index node
    (``held``: {row: node}; the node's ``ck`` names its row), and the boundary spacing in
    tokens (``interval``: ``state_checkpoint_interval`` pages). A row is taken for a new
    checkpoint from the free ones, else from the least recently used node (its boundary is
    then a checkpoint miss)."""

    def __init__(self, num: int, interval: int):
        self.num, self.interval = num, interval
        self.free: list = list(range(num - 1, -1, -1))
        self.held: dict = {}

    def take(self, node, keep: set) -> int:
        """A row for ``node``'s checkpoint: a free one, else the row of the least recently used
        node not in ``keep`` (that node lets go of it); -1 when every row is kept."""
        if self.free:
            row = self.free.pop()
        else:
            cands = [(n.tick, n.id, row) for row, n in self.held.items() if n not in keep]
            if not cands:
                return -1
            row = min(cands)[2]
            self.drop(self.held[row])
            self.free.pop()
        self.held[row] = node
        node.ck = row
        return row

    def drop(self, node) -> None:
        """``node`` lets go of its checkpoint row."""
        row, node.ck = node.ck, -1
        del self.held[row]
        self.free.append(row)

    def check(self, nodes) -> None:
        """AssertionError unless the held rows are exactly those of ``nodes`` (the live index
        nodes with a checkpoint) and every row is held or free once."""
        nodes = list(nodes)
        assert {n.ck: n for n in nodes} == self.held, "checkpoint rows and nodes disagree"
        assert sorted(list(self.held) + self.free) == list(range(self.num)), (
            "checkpoint rows: held + free != 0..num-1")
