"""The device side of state slots (``CacheConfig.layer_kinds`` with ``State`` layers,
docs/hybrid.md increment 4): the state arrays, a new sequence's zeroed slot and a fork's copy.
The host side (which slot each sequence holds) is ``core.slots``; a forward's reads and staged
writes are ``ForwardRun.get_state`` / ``set_state``.

Each state layer has one array per state name, ``(num_state_slots, *shape)`` in the cache
dtype, allocated by ``Backend.allocate_state``; row ``s`` is the state of the sequence holding
slot ``s``. The backend moves rows by slot index arrays (``gather_state`` /
``scatter_state``) and knows nothing about sequences."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = Any


class StateArrays:
    """``arrays``: ``{layer: {name: array (num_state_slots, *shape)}}`` of every state layer
    of ``config`` on ``backend`` (empty without state layers); ``checkpoints``: the same with
    ``num_state_checkpoints`` rows (the prefix cache's checkpoints; empty without them)."""

    def __init__(self, backend, config):
        self.backend = backend
        n, c = config.num_state_slots, config.num_state_checkpoints

        def allocate(rows: int, shape: tuple, kind) -> Array:
            # a dtype is passed only where it differs (backends written before State.dtype)
            if kind.storage(config.dtype) == config.dtype:
                return backend.allocate_state(rows, shape)
            return backend.allocate_state(rows, shape, kind.dtype)
        self.arrays: dict = {layer: {name: allocate(n, shape, kind) for name, shape in kind.shapes}
                             for layer, kind in config.state_layers.items()}
        self.checkpoints: dict = {layer: {name: allocate(c, shape, kind)
                                          for name, shape in kind.shapes}
                                  for layer, kind in config.state_layers.items()} if c else {}
        self._zeros: dict = {}      # shape -> a (1, *shape) zero array (a new slot's state)

    def _slot(self, slot: int) -> Array:
        return self.backend.aux_to_device(np.array([slot], np.int32))

    def restore(self, ck: int, slot: int) -> None:
        """A sequence attached at a cached prefix: every state of checkpoint row ``ck`` into
        slot ``slot`` (queued device copies)."""
        b = self.backend
        s, d = self._slot(ck), self._slot(slot)
        for layer, states in self.arrays.items():
            for name, array in states.items():
                b.scatter_state(array, d, b.gather_state(self.checkpoints[layer][name], s))

    def save(self, rows: np.ndarray, source: dict, picks: np.ndarray) -> None:
        """Checkpoint rows ``rows`` (host int32) take rows ``picks`` (host int32) of
        ``source[layer][name]`` (arrays ``(n, *shape)``) for every state (queued)."""
        b = self.backend
        dst, pick = b.aux_to_device(rows), b.aux_to_device(picks)
        for layer, states in self.checkpoints.items():
            for name, array in states.items():
                b.scatter_state(array, dst, b.gather_state(source[layer][name], pick))

    def zero(self, slot: int) -> None:
        """A new sequence's slot: every state zero (queued device writes)."""
        b = self.backend
        index = self._slot(slot)
        for states in self.arrays.values():
            for name, array in states.items():
                shape = b.shape_of(array)[1:]
                if shape not in self._zeros:
                    self._zeros[shape] = b.from_numpy(np.zeros((1,) + shape, np.float32))
                b.scatter_state(array, index, self._zeros[shape])

    def copy(self, src: int, dst: int) -> None:
        """A fork: every state of slot ``src`` into slot ``dst`` (queued device copies)."""
        b = self.backend
        s, d = self._slot(src), self._slot(dst)
        for states in self.arrays.values():
            for array in states.values():
                b.scatter_state(array, d, b.gather_state(array, s))

    def describe(self) -> str:
        """The state arrays in words (the memory refusal's message)."""
        return ", ".join(f"layer {layer}: " + ", ".join(
            f"{name} {self.backend.shape_of(a)}" for name, a in states.items())
            for layer, states in self.arrays.items())
