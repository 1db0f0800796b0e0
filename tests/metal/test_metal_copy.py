"""A metal cache copies (``copy.deepcopy``, ``pickle``) like any other (issue 28, item 8: it
raised ``TypeError: cannot pickle 'module' object``): the copy holds the same sequences and K/V,
is independent of the original, and runs forwards."""

import copy
import pickle

import numpy as np
import pytest

import kvcache
from metal_testutil import DEVICE


def make_cache():
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=2, num_kv_heads=1, head_dim=8,
                              page_size=4, max_batch_size=4, max_total_tokens=64,
                              prefill_chunk_size=32, dtype="float32", rope_mode="normal")
    return kvcache.PagedKVCache(cfg, backend="metal", device=DEVICE)


def forward(cache, seq_ids, lens, seed):
    rng = np.random.default_rng(seed)
    c, t = cache.config, sum(lens)
    outs = []
    with cache.forward(seq_ids, lens):
        for layer in range(c.num_layers):
            q, k, v = (cache.from_numpy(rng.standard_normal((t, h, c.head_dim)).astype(np.float32))
                       for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads))
            outs.append(kvcache.to_numpy(cache.attention(layer, q, k, v)))
    return outs


def kv(cache, seq_id):
    return [kvcache.to_numpy(a) for a in cache.get_kv(seq_id)]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_metal_cache_copies_and_the_copy_is_independent(how):
    cache = make_cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    forward(cache, [0, 1], [6, 3], seed=0)
    twin = copy.deepcopy(cache) if how == "deepcopy" else pickle.loads(pickle.dumps(cache))
    assert twin.backend.name == "metal" and twin.sequence_ids == [0, 1]
    for sid in (0, 1):
        for a, b in zip(kv(cache, sid), kv(twin, sid)):
            np.testing.assert_array_equal(a, b)
    before = kv(cache, 0)
    # the same forward on both gives the same output; the copy's pages are its own
    out_a = forward(cache, [0], [2], seed=1)
    out_b = forward(twin, [0], [2], seed=1)
    for a, b in zip(out_a, out_b):
        np.testing.assert_array_equal(a, b)
    forward(twin, [1], [5], seed=2)
    assert cache.sequence_length(1) == 3 and twin.sequence_length(1) == 8
    twin.clear()
    assert cache.sequence_length(0) == 8
    after = kv(cache, 0)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a[:, :6], b[:, :6])
    cache.state.pt.check_invariants()
