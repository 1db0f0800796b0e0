"""PagedKVCache(backend='metal', device='cpu') against the same calls on backend='reference'
(``kvcache.conformance.CachePair``): prefill, decode, fork, popn, token trees with commit,
sliding windows, RoPE modes."""

import zlib

import numpy as np
import pytest

import kvcache
from kvcache.conformance import CachePair

from metal_testutil import DEVICE


def pair(**cfg):
    """A metal cache and a reference cache in lockstep (the suite's twin driver)."""
    config = kvcache.CacheConfig(**{"rope_mode": "normal", **cfg})
    return CachePair(config, "metal", DEVICE, seed=zlib.crc32(repr(sorted(cfg.items())).encode()))


BASE = dict(num_layers=2, num_qo_heads=4, num_kv_heads=1, head_dim=32, max_total_tokens=1024,
            prefill_chunk_size=512, max_batch_size=8)


@pytest.mark.parametrize("dtype,page_size,group,rope_mode", [
    ("float32", 16, 4, "normal"), ("float32", 1, 1, "none"), ("float16", 16, 2, "inline"),
    ("bfloat16", 16, 4, "normal"), ("float16", 1, 4, "normal"), ("bfloat16", 4, 1, "inline"),
])
def test_prefill_decode_fork_popn(dtype, page_size, group, rope_mode):
    p = pair(**{**BASE, "num_qo_heads": 2 * group, "num_kv_heads": 2}, page_size=page_size,
             dtype=dtype, rope_mode=rope_mode)
    p.add(0, 1, 2)
    p.forward([0, 1, 2], [37, 5, 16])                     # prefill
    for _ in range(3):
        p.forward([0, 1, 2], [1, 1, 1])                   # decode
    p.forward([1, 0], [7, 2], fused=True)                 # chunked prefill + decode, fused qkv
    p.fork(0, 3, 21)                                      # fork mid-page: partial page copied
    p.fork(0, 4)                                          # fork everything
    p.forward([3, 4, 0, 2], [1, 3, 1, 1])                 # shared prefix across block depths
    for _ in range(2):
        p.forward([0, 3, 4, 1, 2], [1] * 5)
    p.popn(4, 5)
    p.remove(1)
    p.forward([4, 2], [2, 1])


@pytest.mark.parametrize("dtype,page_size", [("float32", 16), ("float16", 1), ("bfloat16", 4)])
def test_token_tree_and_commit(dtype, page_size):
    p = pair(**BASE, page_size=page_size, dtype=dtype, rope_mode="normal")
    p.add(0, 1)
    p.forward([0, 1], [19, 6])
    # one-shot tree (ragged tree attention)
    p.forward([0, 1], [4, 3], tree=[-1, 0, 0, 1, -1, 0, 1])
    p.commit([0, 1], [3, 1])
    p.forward([0, 1], [1, 1])
    # a draft tree growing over several forwards (paged tree masks), then a commit
    p.forward([0, 1], [2, 1], tree=[-1, -1, -1])
    p.forward([0, 1], [2, 1], tree=[0, 1, 0])
    p.forward([0, 1], [1, 2], tree=[2, 1, 1])
    p.commit([0, 1], [4, -1])
    p.forward([0, 1], [1, 1])


@pytest.mark.parametrize("dtype,page_size,rope_mode", [("float32", 16, "normal"),
                                                       ("float16", 4, "none"),
                                                       ("bfloat16", 1, "normal")])
def test_sliding_window(dtype, page_size, rope_mode):
    p = pair(**BASE, page_size=page_size, dtype=dtype, rope_mode=rope_mode,
             support_sliding_window=True)
    p.add(0, 1, 2)
    p.enable_sliding_window(0, 24, 4)
    p.enable_sliding_window(1, 17, 0)
    p.forward([0, 1, 2], [30, 10, 5])
    for _ in range(4):
        p.forward([0, 1, 2], [1, 1, 1])
    p.forward([1, 0, 2], [20, 6, 3])
    for _ in range(3):
        p.forward([0, 1, 2], [1, 1, 1])
    assert p.dut.sequence_length(0) == 24


def test_clear_and_reuse():
    p = pair(**BASE, page_size=16, dtype="float32")
    p.add(0)
    p.forward([0], [40])
    p.clear()
    p.add(5)
    p.forward([5], [3])
    p.forward([5], [1])
