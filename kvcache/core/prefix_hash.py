"""The prefix cache's keys: a 64-bit hash of a whole prefix of token ids (and an extra key),
computed for every page boundary of a prompt in two numpy calls (a product and a cumulative
sum).

The key of the first ``n`` tokens is ``start + sum(tokens[p] * W[p] for p < n)`` mod 2**64, with
``W`` 64-bit weights drawn at random once per process (from the OS's entropy) and ``start`` a
hash of the extra key. So the keys of a prompt's page boundaries are one product and one
cumulative sum, and the key of a longer prefix follows from a shorter one's by adding the new
positions' terms (``first``, ``start``: the chain's key there). A key only finds a candidate: the
index compares the tokens themselves (and the extra key) before it hands out pages, so two
prefixes with one key (chance, or crafted) cost a cache hit, never a wrong page; the weights
being secret and random per process makes crafting one impractical too."""

from __future__ import annotations

import os
import threading

import numpy as np

_MASK = (1 << 64) - 1
_weights_lock = threading.Lock()
_W: list = [np.zeros(0, np.uint64)]     # the weights by token position (grown, never changed)


def weights(n: int) -> np.ndarray:
    """``W``, at least ``n`` long: positions past the current end get fresh random weights,
    those there keep theirs (keys already in an index stay valid)."""
    w = _W[0]
    if len(w) >= n:
        return w
    with _weights_lock:
        w = _W[0]
        if len(w) < n:
            more = max(n, 2 * len(w), 4096) - len(w)
            w = np.concatenate([w, np.frombuffer(os.urandom(8 * more), np.uint64)])
            _W[0] = w
    return w


def start_hash(extra) -> int:
    """The key of the empty prefix under the extra key ``extra``."""
    return hash(("kvcache-prefix", extra)) & _MASK


_accumulate = np.add.accumulate


def prefix_sums(buf, page_size: int, pages: int, first: int = 0) -> np.ndarray:
    """The keys of the first ``first + 1 .. pages`` pages of the ids in ``buf`` (int64 bytes, at
    least ``pages * page_size`` ids; none negative) less the key of the first ``first`` pages
    (add it, mod 2**64: ``start_hash(extra)`` for ``first == 0``), as uint64, each at the
    position of its page's last token: page ``first + i``'s at ``(i + 1) * page_size - 1``
    (``.item`` reads one as a Python int; reading only the probed ones is cheaper than
    listing them all)."""
    lo, hi = first * page_size, pages * page_size
    w = _W[0]
    if len(w) < hi:
        w = weights(hi)
    # uint64 array arithmetic wraps mod 2**64 without a warning (only scalars warn)
    acc = np.frombuffer(buf, np.uint64, hi - lo, lo * 8) * w[lo:hi]
    _accumulate(acc, out=acc)
    return acc


def prefix_hashes(buf, page_size: int, start: int, pages: int, first: int = 0) -> list:
    """The keys of the first ``first + 1 .. pages`` pages of the ids in ``buf`` (as
    ``prefix_sums``); ``start``: the key of the first ``first`` pages."""
    if pages <= first:
        return []
    sums = prefix_sums(buf, page_size, pages, first)[page_size - 1::page_size].tolist()
    return [(s + start) & _MASK for s in sums]
