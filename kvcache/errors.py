"""Typed errors. Every public call validates before it mutates, so any of these leaves the cache
exactly as it was."""


class KVCacheError(Exception):
    """Base class of every error the cache raises on purpose."""


class SequenceNotFoundError(KVCacheError, KeyError):
    """A sequence id that the cache does not hold."""

    def __str__(self):  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class SequenceExistsError(KVCacheError):
    """A sequence id that the cache already holds."""


class InvalidArgumentError(KVCacheError, ValueError):
    """Wrong shapes, dtypes, lengths, positions or tree pointers."""


def pages(n: int, what: str = "page") -> str:
    """``"1 page"``, ``"2 pages"`` (``what``: the noun): the counts in the errors' messages."""
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class CacheFullError(KVCacheError, MemoryError):
    """Not enough free pages for the request; nothing was reserved."""


class ForwardStateError(KVCacheError):
    """A call out of order: attention outside begin/end, a sequence changed mid-forward, an
    uncommitted token tree."""


class BackendNotAvailableError(KVCacheError):
    """The requested backend is unknown or cannot run here; the message lists every backend."""


class UnsupportedFeatureError(KVCacheError):
    """The backend does not declare the capability the call needs."""
