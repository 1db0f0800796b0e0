"""State slots (``CacheConfig.layer_kinds`` with ``State`` layers, docs/hybrid.md increment 4):
which slot of the state arrays each sequence holds, on the host.

Every state array of every state layer has ``num_state_slots`` rows, one per slot; a sequence
holds the same slot in all of them from ``add`` to ``remove``. The device side (the arrays,
zeroing a new slot, a fork's copy, a forward's staged writes) is ``kvcache.state_slots``: this
module knows no array library and hands out slot numbers only.

A recurrence cannot be rewound: a state is the state after the sequence's last token, so
anything that moves a sequence's end backwards (``popn``, a fork below the parent's length,
token trees) is refused by ``refuse_rewind`` (UnsupportedFeatureError) until checkpoints exist.
"""

from __future__ import annotations

from ..errors import CacheFullError, UnsupportedFeatureError


class StateSlots:
    """The free slots and each sequence's slot (``slot``: {sequence id: slot})."""

    def __init__(self, num_slots: int, layers: tuple):
        self.num_slots = num_slots
        self.layers = layers            # the state layers, for the errors' messages
        # free slots: a stack popped from the end, so slots 0, 1, 2 ... are handed out first
        self.free: list = list(range(num_slots - 1, -1, -1))
        self.slot: dict = {}

    def fresh(self) -> StateSlots:
        """Every slot free (``clear``)."""
        return StateSlots(self.num_slots, self.layers)

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
        self.free.append(self.slot.pop(sid))

    def refuse_rewind(self, what: str) -> None:
        """UnsupportedFeatureError for ``what``, a call that would move a sequence's end back
        (a recurrent state holds no earlier position)."""
        raise UnsupportedFeatureError(
            f"{what} in a cache with state layers {list(self.layers)}: a recurrent state is the "
            f"state after the sequence's last token, and no checkpoint of an earlier position "
            f"exists (not built yet, docs/hybrid.md)")

    def check_invariants(self, sids) -> None:
        """AssertionError if the slots are not one per sequence of ``sids`` plus the free."""
        held = sorted(self.slot.values())
        assert set(self.slot) == set(sids), (
            f"state slots held by {sorted(self.slot)} != the cache's sequences {sorted(sids)}")
        assert len(set(held)) == len(held), "a state slot is held twice"
        assert sorted(held + self.free) == list(range(self.num_slots)), (
            f"state slots: held {held} + free {sorted(self.free)} != 0..{self.num_slots - 1}")
