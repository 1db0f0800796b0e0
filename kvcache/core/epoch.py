"""The plan epoch of ``CacheState``: ``query``, which marks a method that changes nothing, and
``EpochCounted``, the base whose subclasses' other public methods bump ``epoch`` before they run.

The planner reuses a decode batch's plan only while the epoch is unchanged; bumping it in every
unmarked public method of every subclass (a mixin of ``CacheState`` or a user's subclass) means
an operation added anywhere cannot forget to invalidate that plan.
"""

from __future__ import annotations

import functools


def query(method):
    """Mark a ``CacheState`` method that changes no state: it leaves the plan epoch alone."""
    method.is_query = True
    return method


def _bumps_epoch(method):
    @functools.wraps(method)
    def mutator(self, *args, **kwargs):
        self.epoch += 1
        return method(self, *args, **kwargs)
    setattr(mutator, "is_query", False)     # (a function attribute mypy does not know)
    return mutator


def _bump_epoch_in_mutators(cls) -> None:
    """Wrap every public method of ``cls`` not marked ``@query`` so it bumps the epoch."""
    for name, member in list(vars(cls).items()):
        if name.startswith("_") or not callable(member) or hasattr(member, "is_query"):
            continue
        setattr(cls, name, _bumps_epoch(member))


class EpochCounted:
    """A class whose subclasses' public methods not marked ``@query`` bump ``epoch`` before
    they run (each subclass's own methods, wrapped as the subclass is defined)."""

    epoch: int

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _bump_epoch_in_mutators(cls)
