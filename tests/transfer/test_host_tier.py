"""HostTier: a sequence parked in host memory frees its pages and comes back bit-exactly (as
itself, under another id, or onto a prefix still in the cache); a tier or cache without room
refuses and nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import CacheFullError, HostTier, SequenceExistsError, SequenceNotFoundError
from transfer_cases import (assert_same_kv, build_workload, config, make_cache, parent_and_child,
                            run_forward, snapshot)


@pytest.mark.parametrize("backend", ["reference", "cuda", "metal"])
def test_offload_frees_the_pages_and_restore_brings_the_sequence_back(backend):
    cache = make_cache(backend, config(4, "bfloat16", "none", sliding=True))
    twin = make_cache(backend, config(4, "bfloat16", "none", sliding=True))
    rng = np.random.default_rng(0)
    wl = build_workload(cache, rng, count=8)
    for sid in wl.ids:
        twin.import_sequence(sid, cache.export_sequence(sid))
    tier = HostTier(cache)
    free = cache.num_available_pages
    for sid in wl.ids[::-1]:           # children first: their parents' pages then free too
        n = cache.sequence_length(sid)
        assert tier.offload(sid) == n and sid in tier and sid not in cache.sequence_ids
    assert cache.is_empty and cache.num_available_pages > free
    assert tier.tokens == sum(twin.sequence_length(s) for s in wl.ids) and len(tier) == len(wl.ids)
    for sid in wl.ids:
        assert tier.restore(sid) == twin.sequence_length(sid)
        assert_same_kv(twin, sid, cache, sid)
        assert cache.state.seq(sid).window == twin.state.seq(sid).window
    assert tier.tokens == 0 and len(tier) == 0
    cache.state.pt.check_invariants()


def test_restore_onto_a_prefix_shares_its_pages_and_under_a_new_id():
    cache = kvcache.PagedKVCache(config(4), backend="reference")
    rng = np.random.default_rng(1)
    parent_and_child(cache, rng, 17, 16, 9)
    want = [kvcache.to_numpy(a) for a in cache.get_kv(2)]
    tier = HostTier(cache, capacity_tokens=100)
    tier.offload(2)
    free = cache.num_available_pages
    assert tier.restore(2, new_id=5, parent_id=1, fork_pos=16) == 9
    assert free - cache.num_available_pages == 3         # 9 tokens of its own; 16 shared
    for w, g in zip(want, cache.get_kv(5)):
        np.testing.assert_array_equal(kvcache.to_numpy(g), w)


def test_a_full_tier_or_cache_refuses_and_nothing_changes():
    cache = kvcache.PagedKVCache(config(4, max_total_tokens=32), backend="reference")
    rng = np.random.default_rng(2)
    cache.add_sequence(1)
    run_forward(cache, [1], [20], rng)
    tier = HostTier(cache, capacity_tokens=19)
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match="sequence 1 has 20 tokens but the host tier holds 0 of 19"):
        tier.offload(1)
    assert snapshot(cache) == before and len(tier) == 0
    with pytest.raises(SequenceNotFoundError, match="sequence 3"):
        tier.offload(3)
    tier = HostTier(cache)
    tier.offload(1)
    with pytest.raises(SequenceNotFoundError, match="sequence 9 is not in the host tier"):
        tier.restore(9)
    # the cache fills up meanwhile: the restore is refused, the sequence stays parked
    cache.add_sequence(2)
    run_forward(cache, [2], [30], rng)
    with pytest.raises(CacheFullError):
        tier.restore(1)
    assert 1 in tier and tier.tokens == 20
    cache.add_sequence(1)
    with pytest.raises(SequenceExistsError):
        tier.offload(1)                # its id is parked already
    cache.remove_sequence(1)
    cache.remove_sequence(2)
    tier.restore(1)
    assert cache.sequence_length(1) == 20
    tier.offload(1)
    tier.drop(1)
    assert len(tier) == 0 and tier.tokens == 0 and cache.is_empty


def test_host_tier_bad_arguments_are_typed():
    """HostTier(None) failed later with an AttributeError, ``[0] in tier`` with an untyped
    TypeError: both are typed errors naming the value now."""
    with pytest.raises(kvcache.InvalidArgumentError, match="PagedKVCache, got NoneType"):
        kvcache.HostTier(None)
    tier = kvcache.HostTier(kvcache.PagedKVCache(config(), backend="reference"))
    with pytest.raises(kvcache.InvalidArgumentError, match="seq_id"):
        [0] in tier
    assert 0 not in tier and len(tier) == 0


def test_host_tier_copies_carry_no_checksum_and_exports_do():
    """The tier's copies never leave the process (no CRC over every offloaded byte); a host
    payload from ``to_numpy()`` carries one, and import checks it."""
    cache = kvcache.PagedKVCache(config(), backend="reference")
    cache.add_sequence(1)
    run_forward(cache, [1], [9], np.random.default_rng(0))
    exported = cache.export_sequence(1).to_numpy()
    assert exported.checksum == kvcache.transfer.checksum(exported.k, exported.v,
                                                          exported.header())
    tier = kvcache.HostTier(cache)
    tier.offload(1)
    assert tier.restore(1) == 9 and cache.sequence_length(1) == 9


@pytest.mark.parametrize("backend", ["reference", "cuda", "metal"])
def test_a_bit_changed_in_host_memory_is_refused_and_the_sequence_stays_parked(backend):
    cache = make_cache(backend, config(4, "bfloat16", "none"))
    rng = np.random.default_rng(5)
    cache.add_sequence(1)
    run_forward(cache, [1], [11], rng)
    twin = make_cache(backend, config(4, "bfloat16", "none"))
    twin.import_sequence(1, cache.export_sequence(1))
    tier = HostTier(cache)
    tier.offload(1)
    k = tier.parked(1).k
    bits = k.view(np.uint8).reshape(-1)
    bits[bits.size // 3] ^= 0x10                       # one bit, in the middle of the rows
    with pytest.raises(kvcache.KVCacheError, match="sequence 1's parked K/V changed"):
        tier.restore(1)
    assert 1 in tier and 1 not in cache.sequence_ids and cache.is_empty
    bits[bits.size // 3] ^= 0x10                       # put back: restored bit for bit
    assert tier.restore(1) == 11
    assert_same_kv(twin, 1, cache, 1)


@pytest.mark.parametrize("nbytes", [8, 512, 4096 + 24, 3 * 512 + 7])
def test_the_device_checksum_is_the_host_one(nbytes):
    # the cuda backend's checksum (torch ops, here on the CPU) against checksum_words (numpy):
    # one definition, whatever computes it; a padded last row, and values that overflow int64
    import torch

    from kvcache.backend import checksum_words
    cache = make_cache("cuda", config(4, "float32", "none"))
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    got = cache.backend.checksum(torch.from_numpy(data.copy()))
    assert got.tolist() == checksum_words(data).tolist()
    flipped = data.copy()
    flipped[nbytes // 2] ^= 1
    assert checksum_words(flipped).tolist() != checksum_words(data).tolist()
    swapped = data.copy()
    if nbytes >= 1024:                                 # two 64-word rows exchanged
        swapped[:512], swapped[512:1024] = data[512:1024].copy(), data[:512].copy()
        assert checksum_words(swapped)[1] != checksum_words(data)[1]


def test_the_hash_chain_is_on_by_default_in_host_memory_and_off_on_an_accelerator():
    """On the H200 pair the chain made offload and restore of 1 GiB 12x a pinned copy (0.08
    of it, issue 50's host tier target is 0.8): the default keeps it for caches in host
    memory only; the device checksums stay everywhere."""
    from kvcache.host_tier import verify_by_default
    assert verify_by_default(None) and verify_by_default("cpu")
    assert not verify_by_default("cuda:0") and not verify_by_default("gpu")
    cache = kvcache.PagedKVCache(config(), backend="reference")
    assert kvcache.HostTier(cache).verify
    assert not kvcache.HostTier(cache, verify=False).verify
