"""Static-shape mixed steps (``CacheConfig(static_mixed=True)``): a forward that prefills (alone
or beside decode rows) is planned as one paged pass over history and new tokens (chain trees),
padded to its token bucket and to max_batch_size entries, its arrays in a second fixed buffer.
Judged against the eager cuda cache and the reference, with forks, prefix-cache hits, padded
inputs and outputs read only after every forward is queued; the plan's shapes stay fixed per
bucket; what stays eager (trees, sliding windows, oversized steps, fp8 before its scales)."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.conformance import assert_close
from kvcache.errors import InvalidArgumentError

H, HKV, D = 8, 2, 64
DTYPES = ["float32"] if cc.INTERPRET else cc.DTYPES
# under Triton's interpreter (the spawned run of test_cuda_triton_interpreter.py) the five-step
# scenario takes about a minute: `make test` keeps the prefix-hit scenario (the same kernels:
# a padded chain-tree paged pass beside a decode row), `make test-all` runs both
SLOW_IN_INTERPRETER = cc.SLOW_IN_INTERPRETER


def make(dtype, static, backend="cuda", **kw):
    kw.setdefault("rope_mode", "normal")
    kw.setdefault("prefill_chunk_size", 256)
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=H, num_kv_heads=HKV, head_dim=D,
                              page_size=16, max_batch_size=8, max_total_tokens=4096,
                              dtype=dtype, static_decode=static,
                              static_mixed=static, **kw)
    return kvcache.PagedKVCache(cfg, backend=backend, device="cpu" if backend == "reference" else cc.DEVICE)


class Trio:
    def __init__(self, dtype, seed=0, **kw):
        self.static = make(dtype, True, **kw)
        self.eager = make(dtype, False, **kw)
        self.ref = make(dtype, False, backend="reference", **kw)
        self.caches = (self.static, self.eager, self.ref)
        self.rng = np.random.default_rng(seed)
        self.kept = []            # (rows, outputs per cache) read after every step is queued

    def each(self, method, *args, **kw):
        return [getattr(c, method)(*args, **kw) for c in self.caches]

    def step(self, ids, lens, padded=False, window_left=-1, nan_rows=()):
        self.each("begin_forward", ids, lens)
        plan = self.static.open_plan
        total = sum(lens)
        rows = plan.static_bucket if padded and plan.static_bucket else total
        outs = []
        for layer in range(2):
            parts = [self.rng.standard_normal((rows, h, D)).astype(np.float32) for h in (H, HKV, HKV)]
            parts[2][list(nan_rows)] = np.nan          # V rows a later token of a chunk holds
            per = []
            for c in self.caches:
                use = parts if c is self.static else [p[:total] for p in parts]
                # a per-layer window (Gemma-style): layer 0 slides, layer 1 sees everything
                per.append(c.attention(layer, *map(c.from_numpy, use), return_lse=True,
                                       window_left=window_left if layer == 0 else -1))
            outs.append(per)
        self.each("end_forward")
        self.kept.append((total, rows, outs))
        return plan

    def check(self, dtype):
        for total, rows, outs in self.kept:
            for (o_s, l_s), (o_e, l_e), (o_r, l_r) in outs:
                s, ls = kvcache.to_numpy(o_s).astype(np.float64), kvcache.to_numpy(l_s)
                assert_close("static vs eager o", kvcache.to_numpy(o_e).astype(np.float64), s[:total], dtype)
                assert_close("static vs reference o", kvcache.to_numpy(o_r).astype(np.float64), s[:total], dtype)
                assert_close("static vs reference lse", kvcache.to_numpy(l_r).astype(np.float64),
                             ls[:total].astype(np.float64), dtype, lse=True)
                if rows > total:          # padded rows see no key
                    assert (s[total:] == 0).all() and (ls[total:] == -np.inf).all()


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_IN_INTERPRETER) for d in DTYPES])
def test_mixed_steps_equal_eager_and_reference(dtype):
    t = Trio(dtype)
    t.each("add_sequence", 0)
    t.each("add_sequence", 1)
    p = t.step([0, 1], [20, 7])                       # two prefills
    assert p.static_mixed and p.static_bucket == 32 and p.paged_only
    p = t.step([0, 1], [1, 40], padded=True)          # a decode row beside a prefill chunk
    assert p.static_mixed and p.static_bucket == 64
    p = t.step([0, 1], [1, 1])                        # pure decode: the decode buckets
    assert not p.static_mixed and p.static_bucket == 2
    t.each("fork_sequence", 1, 2, 30)                 # mid-page fork: shared pages
    t.each("add_sequence", 3)
    p = t.step([2, 0, 3, 1], [5, 1, 17, 1], padded=True)
    assert p.static_mixed and p.static_bucket == 32
    p = t.step([3], [200])                            # one long chunk: the 256 bucket
    assert p.static_bucket == 256
    t.check(dtype)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_IN_INTERPRETER) for d in DTYPES])
def test_nan_v_of_later_tokens_stays_masked(dtype):
    t = Trio(dtype)
    t.each("add_sequence", 0)
    t.each("add_sequence", 1)
    t.step([0, 1], [20, 3])
    # a NaN in the V of sequence 0's last new token: only that token sees it, and the decode
    # row beside it never does (the diagonal tile of the one paged pass masks it)
    t.step([1, 0], [1, 40], padded=True, nan_rows=(40,))
    total, _, outs = t.kept[-1]
    o = kvcache.to_numpy(outs[0][0][0]).astype(np.float64)[:total]
    assert np.isnan(o[40]).all() and np.isfinite(o[:40]).all()
    t.check(dtype)


@pytest.mark.parametrize("dtype", [pytest.param(d, marks=SLOW_IN_INTERPRETER) for d in DTYPES])
def test_per_layer_window_in_mixed_steps(dtype):
    t = Trio(dtype)
    t.each("add_sequence", 0)
    t.each("add_sequence", 1)
    t.step([0, 1], [40, 9], window_left=12)
    p = t.step([0, 1], [1, 30], padded=True, window_left=12)
    assert p.static_mixed and p.depths[0].tree.chains
    t.check(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hit_then_mixed_step(dtype):
    t = Trio(dtype, prefix_cache=True)
    prompt = np.arange(1, 70, dtype=np.int64)
    t.each("add_sequence", 0, tokens=prompt)
    t.step([0], [len(prompt)])
    hits = t.each("add_sequence", 1, tokens=np.concatenate([prompt[:64], [7, 8, 9]]))
    assert hits[0] == hits[1] == 64                  # four pages from the cache
    p = t.step([1], [3], padded=True)
    # alone in its batch a warm sequence reads its whole page list as one entry, as the cold
    # sequence that computed those pages does (warm equals cold)
    assert p.static_kind == (True, 1) and p.depths[0].kv_len[0] == 67
    t.each("add_sequence", 2, tokens=np.concatenate([prompt[:66], [5, 4]]))
    p = t.step([0, 1, 2], [1, 1, 4], padded=True)
    # three sequences under the four cached pages: read once for all (depth 0), merged with
    # each sequence's own pages and new tokens (depth 1)
    assert p.static_kind == (True, 2)
    d0, d1 = p.depths
    assert list(d0.qo_indptr[:2]) == [0, 6] and d0.kv_len[0] == 64 and (d0.kv_len[1:] == 0).all()
    assert list(d1.kv_len[:3]) == [70 - 64, 68 - 64, 68 - 64] and (d1.kv_len[3:] == 0).all()
    assert d0.num_entries == d1.num_entries == 8 and len(d1.tree.mask) == 2 * p.static_bucket
    assert d0.shared and not d1.shared          # the kernel may split the shared entry's keys
    # a decode step of the three: a static mixed step over the shared prefix too (a static
    # decode step would read the four pages once per sequence)
    p = t.step([2, 0, 1], [1, 1, 1], padded=True)
    assert p.static_kind == (True, 2) and p.static_bucket == 16 and p.depths[0].kv_len[0] == 64
    t.check(dtype)


def test_plan_shapes_and_buffer_fixed_per_bucket():
    cache = make("float32", True)
    mgr = cache.aux_manager
    for sid in range(5):
        cache.add_sequence(sid)
    seen = {}
    for ids, lens in (([0], [9]), ([1, 2], [5, 6]), ([0, 3, 4], [1, 3, 2]), ([1, 2, 3], [2, 1, 1])):
        cache.begin_forward(ids, lens)
        plan = cache.open_plan
        assert plan.static_mixed and plan.static_bucket == 16
        t, d = plan.tokens, plan.depths[0]
        shapes = (len(t.qo_indptr), len(t.q_positions), len(t.append_slots), len(t.k_rope_offset),
                  len(d.qo_indptr), len(d.kv_len), len(d.tree.indptr), len(d.tree.mask),
                  d.num_entries, d.use_decode, d.max_kv_len)
        assert shapes == (9, 16, 16, 8, 9, 8, 9, 32, 8, False, cache.config.num_pages * 16)
        n = sum(lens)
        assert (t.append_slots[n:] == -1).all() and (d.kv_len[len(ids):] == 0).all()
        # rows n..15 pad the bucket: no entry covers them, so the kernel's fill must run
        assert not d.covers_rows
        aux = cache.forward_aux()
        assert not aux.depths[0].covers_rows
        ptrs = tuple(a.data_ptr() for a in (aux.tokens.q_positions, aux.depths[0].page_indices,
                                             aux.depths[0].tree.mask))
        seen.setdefault("ptrs", ptrs)
        assert ptrs == seen["ptrs"], "the mixed steps' arrays moved"
        for layer in range(2):
            z = [cache.from_numpy(np.zeros((16, h, D), np.float32)) for h in (H, HKV, HKV)]
            cache.attention(layer, *z)
        cache.end_forward()
    assert mgr.static_buffer(mixed=True) is not mgr.static_buffer(mixed=False)


def test_what_stays_eager():
    cache = make("float32", True, prefill_chunk_size=64, static_mixed_token_sizes=(8, 32))
    cache.add_sequence(0)
    cache.begin_forward([0], [40])                    # beyond the largest token bucket
    assert cache.static_bucket is None
    cache.abort_forward()
    cache.begin_forward([0], [3], token_tree_parent_ptr=[-1, 0, 0])     # a token tree
    assert cache.static_bucket is None
    cache.abort_forward()
    cache.begin_forward([0], [30])
    assert cache.static_bucket == 32 and cache.open_plan.static_mixed
    cache.abort_forward()
    win = make("float32", True, support_sliding_window=True, rope_mode="inline")
    win.add_sequence(0)
    win.begin_forward([0], [5])                       # sliding windows write after attention
    assert win.static_bucket is None


def test_fp8_mixed_steps_wait_for_scales():
    cache = make("float32", True, kv_dtype="float8_e4m3")
    cache.add_sequence(0)
    cache.begin_forward([0], [5])
    assert cache.static_bucket is None                # the first forward calibrates the scales
    for layer in range(2):
        x = [cache.from_numpy(np.ones((5, h, D), np.float32)) for h in (H, HKV, HKV)]
        cache.attention(layer, *x)
    cache.end_forward()
    cache.add_sequence(1)
    cache.begin_forward([1], [5])
    assert cache.open_plan.static_mixed
    cache.abort_forward()


def test_config_checks():
    with pytest.raises(InvalidArgumentError, match="static_mixed=True needs static_decode"):
        kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=2, head_dim=64,
                            rope_mode="none", static_mixed=True)
    with pytest.raises(InvalidArgumentError, match="static_mixed_token_sizes"):
        kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=2, head_dim=64,
                            rope_mode="none", static_decode=True, static_mixed=True,
                            prefill_chunk_size=64, static_mixed_token_sizes=(32, 16))
    cfg = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=2, head_dim=64,
                              rope_mode="none", prefill_chunk_size=100)
    assert cfg.static_mixed_buckets == (16, 32, 64, 100)
    assert cfg.static_mixed_bucket(65) == 100 and cfg.static_mixed_bucket(101) is None
    big = kvcache.CacheConfig(num_layers=1, num_qo_heads=2, num_kv_heads=2, head_dim=64,
                              rope_mode="none", prefill_chunk_size=5000)
    assert big.static_mixed_buckets == (16, 32, 64, 128, 256) + tuple(range(512, 5000, 256)) + (5000,)
    assert big.static_mixed_bucket(2100) == 2304 and big.static_mixed_bucket(4900) == 5000


def test_decode_graphs_refuse_mixed_steps():
    from kvcache_cuda import DecodeGraphs
    cache = make("float32", True)
    cache.add_sequence(0)
    cache.begin_forward([0], [5])
    assert cache.open_plan.static_mixed
    with pytest.raises(InvalidArgumentError, match="not a static-shape decode"):
        DecodeGraphs(cache).capture(lambda: None)
    cache.abort_forward()
