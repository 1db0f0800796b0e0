"""What the ``kvcache`` commands share (``kvcache.cli`` and the bench, demo and conformance
commands under it): the usage error, its one-line report, the backend lookup, the guard around
a command, argument types. Kept apart from ``kvcache.cli`` so that the commands import it
without importing the command line that imports them."""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .backend import Backend

USAGE_ERROR = 2


class UsageError(Exception):
    """A command-line mistake: printed as ``PROG: error: MESSAGE`` (one line), exit status 2."""


def fail(prog: str, message: object) -> int:
    """Print ``message`` as the one-line error of ``prog``; returns the usage exit status."""
    text = " ".join(str(message).split())   # one line, whatever the message held
    print(f"{prog}: error: {text}", file=sys.stderr)
    return USAGE_ERROR


def backend_for(name: str, device: Optional[str] = None) -> type[Backend]:
    """The backend class ``name`` names ('auto': the best available one), or a ``UsageError``
    naming the fix: the close match for a typo, the backend's unavailability reason otherwise."""
    from .plugins import list_backends, resolve_backend
    from .errors import BackendNotAvailableError
    on = "" if device is None else f" on device {device!r}"
    if name == "auto":
        try:
            return resolve_backend("auto", device)
        except BackendNotAvailableError:
            raise UsageError(f"no backend is available{on}; run `kvcache info` to see why") from None
    try:            # loads only the plugins of that name: no other backend's framework imported
        return resolve_backend(name, device)
    except BackendNotAvailableError:
        pass        # the table says why (a typo's close match, the backend's reason)
    rows = list_backends(device)
    row = next((r for r in rows if r["name"] == name), None)
    if row is None:
        names = [r["name"] for r in rows if r["class"] is not None]
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise UsageError(f"unknown backend {name!r}; {hint}choose one of: {', '.join(names)} "
                         "(`kvcache info` lists them)")
    if not row["available"]:
        raise UsageError(f"backend {name!r} is not available{on}: {row['reason']}")
    return row["class"]


def guarded(prog: str, run: Callable[[list[str]], Optional[int]], argv: Sequence[str]) -> int:
    """``run(argv)`` with the command line's error handling: ``UsageError`` -> one line and 2,
    a closed stdout -> 0 without a traceback, Ctrl-C -> 130."""
    try:
        code = int(run(list(argv)) or 0)
        sys.stdout.flush()       # a pipe closed early fails here, inside the handler
        return code
    except UsageError as exc:
        return fail(prog, exc)
    except BrokenPipeError:
        # the reader went away (``| head``): point stdout at devnull so the interpreter's final
        # flush does not raise again
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


__all__ = ["USAGE_ERROR", "UsageError", "backend_for", "fail", "guarded", "positive_int"]
