"""The prefix cache's page hashes: a 64-bit hash chained over whole pages of token ids (and an
extra key), every page of a prompt in a few numpy calls. A hash only finds a candidate: the index
compares the tokens themselves before it hands out pages."""

from __future__ import annotations

import numpy as np

_MASK = (1 << 64) - 1
_Q = 0x9E3779B97F4A7C15                 # odd: invertible mod 2**64
_R = 0xBF58476D1CE4E5B9
_POWERS: list = []


def _powers(n: int) -> tuple:
    """(Q**i, Q**-i, R**i) mod 2**64 for i in 0..n, as uint64 arrays (cached, grown x2)."""
    if not _POWERS or len(_POWERS[0]) <= n:
        size = max(2 * n, 256)
        qinv = pow(_Q, -1, 1 << 64)
        with np.errstate(over="ignore"):
            out = [np.cumprod(np.concatenate([np.ones(1, np.uint64), np.full(size, b, np.uint64)]),
                              dtype=np.uint64) for b in (_Q, qinv, _R)]
        assert int(out[0][5]) * int(out[1][5]) & _MASK == 1   # exact: no float on the way
        _POWERS[:] = out
    return tuple(_POWERS)


def start_hash(extra) -> int:
    """The chain's value before the first page, for the extra key ``extra``."""
    return hash(("kvcache-prefix", extra)) & _MASK


def page_hashes(buf: bytes, page_size: int, start: int, pages: int, first: int = 0) -> list:
    """Chain hashes of pages ``first .. pages-1`` of the int64 tokens in ``buf``, the chain
    starting from ``start`` (the hash before page ``first``): h_d = h_(d-1) * Q + page hash,
    mod 2**64, computed as Q**d * (start + sum page_i * Q**-i)."""
    k = pages - first
    if k <= 0:
        return []
    ps = page_size
    tok = np.frombuffer(buf, np.int64, k * ps, first * ps * 8).view(np.uint64).reshape(k, ps)
    qpow, qinv, rpow = _powers(max(k, ps))
    # uint64 array arithmetic wraps mod 2**64 without a warning (only scalars warn)
    page = tok @ rpow[:ps]                          # integer matmul: exact, mod 2**64
    acc = (page * qinv[1:k + 1]).cumsum()
    acc += np.uint64(start)
    acc *= qpow[1:k + 1]
    return acc.tolist()
