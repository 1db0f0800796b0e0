"""How ``PagedKVCache``'s public calls run: under the cache's thread lock (one thread uses a
cache at a time; a forward keeps the lock from begin to end), refused inside a forward where
they must be, and delegated to the part that owns them (``KVManager``, ``Payloads``, the open
``ForwardRun``) with that part's signature and docstring."""

from __future__ import annotations

import functools
import threading
from typing import Any

from .errors import ForwardStateError

_current_thread = threading.current_thread

# calls that may take over a forward left open by a thread that has died (see exclusive)
_RECOVERS = frozenset({"abort_forward", "clear"})


def exclusive(method):
    """A public call that runs only while no other thread uses the cache: the calling thread
    takes the cache's lock without waiting (else ForwardStateError naming the holder) and gives
    it back on return, except that a forward keeps it from begin_forward to end / abort.

    The owner is a ``Thread`` object, not a thread id: ids are reused, so a new thread must not
    pass for a dead one. A forward left open by a thread that has died can be taken over by
    ``abort_forward`` or ``clear`` from any thread (the only recovery: the dead thread cannot
    finish it); every other call raises ForwardStateError saying so."""
    what = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        me = _current_thread()
        if self._owner is me:                   # inside its own forward (or call)
            took = False
        elif self._lock.acquire(False):
            self._owner, took = me, True
        elif what in _RECOVERS and self._run is not None and owner_died(self):
            self._owner, took = me, True        # the lock is held for the dead thread: take it
        else:
            raise busy_error(self, what)
        held = self._run is not None
        try:
            return method(self, *args, **kwargs)
        finally:
            if self._run is None and (took or held):
                self._owner = None
                self._lock.release()
    return call


def part_call(part: str, method, between_forwards: bool = False,
              whole_sequences: bool = False):
    """A cache call that runs ``method`` of the part the attribute ``part`` holds, under the
    lock; ``between_forwards``: refused inside a forward (ForwardStateError), checked first;
    ``whole_sequences``: moves whole sequences' K/V (exports, imports), refused in a cache
    with window groups (UnsupportedFeatureError)."""
    name = method.__name__

    def call(self, *args, **kwargs):
        if between_forwards:
            self._no_forward(name)
        if whole_sequences and self.config.layer_kinds:
            from .layer_groups import refuse
            refuse(self.config, name)
        return getattr(getattr(self, part), name)(*args, **kwargs)
    return exclusive(functools.update_wrapper(call, method))


def part_view(part: str, prop: Any, locked: bool = True) -> property:
    """A read-only property of the cache that reads the property ``prop`` of part ``part``."""
    name = prop.fget.__name__                           # type: ignore[union-attr]

    def get(self):
        return getattr(getattr(self, part), name)
    get = functools.update_wrapper(get, prop.fget)      # type: ignore[arg-type]
    return property(exclusive(get) if locked else get)


def run_call(method):
    """A call of the open forward (``ForwardRun``), which checks the thread (no lock taken:
    an identity compare per layer)."""
    name = method.__name__

    def call(self, *args, **kwargs):
        run = self._run
        if run is None:
            self._checked_run(name)                     # raises the error that says why
        return getattr(run, name)(*args, **kwargs)
    return functools.update_wrapper(call, method)


def doc_of(source):
    """Give the decorated facade method ``source``'s docstring."""
    def take(method):
        method.__doc__ = source.__doc__
        return method
    return take


def owner_died(cache) -> bool:
    """The lock's holder is a thread that has ended (it left its forward open)."""
    owner = cache._owner
    return owner is not None and not owner.is_alive()

def busy_error(cache, what: str) -> ForwardStateError:
    """The error for a call from a thread while another one uses the cache."""
    owner, run = cache._owner, cache._run
    doing = (f"holds an open forward over sequences {run.plan.seq_ids}" if run is not None
             else "is inside a call")
    who = (f"thread {owner.name!r} (id {owner.ident})" if owner is not None
           else "another thread")
    me = threading.current_thread()
    if run is not None and owner_died(cache):
        return ForwardStateError(
            f"{what} from thread {me.name!r} (id {me.ident}) while {who}, which has died, "
            f"{doing}: call abort_forward() or clear() from any thread to recover")
    return ForwardStateError(
        f"{what} from thread {me.name!r} (id {me.ident}) while {who} {doing}: a cache is "
        f"used by one thread at a time")
