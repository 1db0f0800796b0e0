"""PagedKVCache(backend='metal', device='cpu') against the same calls on backend='reference':
prefill, decode, fork, popn, token trees with commit, sliding windows, RoPE modes."""

import zlib

import numpy as np
import pytest

import kvcache

from metal_testutil import DEVICE, assert_close, quantize


class Pair:
    """Drives a metal cache and a reference cache with identical inputs; compares every output."""

    def __init__(self, **cfg):
        self.cfg = kvcache.CacheConfig(**cfg)
        self.m = kvcache.PagedKVCache(self.cfg, backend="metal", device=DEVICE)
        self.r = kvcache.PagedKVCache(self.cfg, backend="reference")
        self.rng = np.random.default_rng(zlib.crc32(repr(sorted(cfg.items())).encode()))
        self.checks = 0

    def call(self, name, *args, **kw):
        getattr(self.m, name)(*args, **kw)
        getattr(self.r, name)(*args, **kw)

    def forward(self, seq_ids, lens, tree=None, fused=False):
        c = self.cfg
        t = sum(lens)
        self.call("begin_forward", seq_ids, lens, tree)
        assert np.array_equal(kvcache.to_numpy(self.m.query_positions()),
                              kvcache.to_numpy(self.r.query_positions()))
        for layer in range(c.num_layers):
            q = quantize(self.rng.standard_normal((t, c.num_qo_heads, c.head_dim)), c.dtype)
            k = quantize(self.rng.standard_normal((t, c.num_kv_heads, c.head_dim)), c.dtype)
            v = quantize(self.rng.standard_normal((t, c.num_kv_heads, c.head_dim)), c.dtype)
            outs = []
            for cache in (self.m, self.r):
                if fused:
                    qkv = cache.from_numpy(np.concatenate([q, k, v], axis=1))
                    outs.append((cache.attention_with_fused_qkv(layer, qkv), None))
                else:
                    outs.append(cache.attention(layer, cache.from_numpy(q), cache.from_numpy(k),
                                                cache.from_numpy(v), return_lse=True))
            (om, lm), (orf, lr) = outs
            assert_close(om, orf, c.dtype, f"o layer {layer} lens {lens}")
            if lm is not None:
                # fp16/bf16: q/k rotated before attention are rounded to the dtype on both sides;
                # a 1-ulp rounding difference there moves the lse by ~ulp * |logit|
                assert_close(lm, lr, c.dtype, f"lse layer {layer}", lse=c.dtype == "float32")
            self.checks += 1
        self.call("end_forward")

    def check_state(self):
        m, r = self.m, self.r
        assert m.num_available_pages == r.num_available_pages
        assert m.sequence_ids == r.sequence_ids
        for s in m.sequence_ids:
            assert m.sequence_length(s) == r.sequence_length(s)
            km, vm = m.get_kv(s)
            kr, vr = r.get_kv(s)
            assert_close(km, kr, self.cfg.dtype, f"get_kv k seq {s}")
            assert_close(vm, vr, self.cfg.dtype, f"get_kv v seq {s}")


BASE = dict(num_layers=2, num_qo_heads=4, num_kv_heads=1, head_dim=32, max_total_tokens=1024,
            prefill_chunk_size=512, max_batch_size=8)


@pytest.mark.parametrize("dtype,page_size,group,rope_mode", [
    ("float32", 16, 4, "normal"), ("float32", 1, 1, "none"), ("float16", 16, 2, "inline"),
    ("bfloat16", 16, 4, "normal"), ("float16", 1, 4, "normal"), ("bfloat16", 4, 1, "inline"),
])
def test_prefill_decode_fork_popn(dtype, page_size, group, rope_mode):
    p = Pair(**{**BASE, "num_qo_heads": 2 * group, "num_kv_heads": 2}, page_size=page_size,
             dtype=dtype, rope_mode=rope_mode)
    for s in (0, 1, 2):
        p.call("add_sequence", s)
    p.forward([0, 1, 2], [37, 5, 16])                     # prefill
    for _ in range(3):
        p.forward([0, 1, 2], [1, 1, 1])                   # decode
    p.forward([1, 0], [7, 2], fused=True)                 # chunked prefill + decode, fused qkv
    p.call("fork_sequence", 0, 3, 21)                     # fork mid-page: partial page copied
    p.call("fork_sequence", 0, 4)                         # fork everything
    p.forward([3, 4, 0, 2], [1, 3, 1, 1])                 # shared prefix across block depths
    for _ in range(2):
        p.forward([0, 3, 4, 1, 2], [1] * 5)
    p.call("popn", 4, 5)
    p.call("remove_sequence", 1)
    p.forward([4, 2], [2, 1])
    p.check_state()
    assert p.checks == 2 * 9


@pytest.mark.parametrize("dtype,page_size", [("float32", 16), ("float16", 1), ("bfloat16", 4)])
def test_token_tree_and_commit(dtype, page_size):
    p = Pair(**BASE, page_size=page_size, dtype=dtype, rope_mode="normal")
    for s in (0, 1):
        p.call("add_sequence", s)
    p.forward([0, 1], [19, 6])
    # one-shot tree (ragged tree attention)
    p.forward([0, 1], [4, 3], tree=[-1, 0, 0, 1, -1, 0, 1])
    p.call("commit_accepted_token_tree_nodes", [0, 1], [3, 1])
    p.forward([0, 1], [1, 1])
    # a draft tree growing over several forwards (paged tree masks), then a commit
    p.forward([0, 1], [2, 1], tree=[-1, -1, -1])
    p.forward([0, 1], [2, 1], tree=[0, 1, 0])
    p.forward([0, 1], [1, 2], tree=[2, 1, 1])
    p.call("commit_accepted_token_tree_nodes", [0, 1], [4, -1])
    p.forward([0, 1], [1, 1])
    p.check_state()


@pytest.mark.parametrize("dtype,page_size,rope_mode", [("float32", 16, "normal"),
                                                       ("float16", 4, "none"),
                                                       ("bfloat16", 1, "normal")])
def test_sliding_window(dtype, page_size, rope_mode):
    p = Pair(**BASE, page_size=page_size, dtype=dtype, rope_mode=rope_mode,
             support_sliding_window=True)
    for s in (0, 1, 2):
        p.call("add_sequence", s)
    p.call("enable_sliding_window", 0, 24, 4)
    p.call("enable_sliding_window", 1, 17, 0)
    p.forward([0, 1, 2], [30, 10, 5])
    for _ in range(4):
        p.forward([0, 1, 2], [1, 1, 1])
    p.forward([1, 0, 2], [20, 6, 3])
    for _ in range(3):
        p.forward([0, 1, 2], [1, 1, 1])
    p.check_state()
    assert p.m.sequence_length(0) == 24


def test_clear_and_reuse():
    p = Pair(**BASE, page_size=16, dtype="float32")
    p.call("add_sequence", 0)
    p.forward([0], [40])
    p.call("clear")
    p.call("add_sequence", 5)
    p.forward([5], [3])
    p.forward([5], [1])
    p.check_state()
