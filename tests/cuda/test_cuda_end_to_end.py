"""The public API on backend="cuda" against the same calls on backend="reference": prefill,
decode, fork, popn, token trees, sliding windows, fused qkv, get_kv, query_positions."""

import numpy as np
import pytest

import cuda_cases as cc
import kvcache

E2E_DTYPES = ["float32"] if cc.INTERPRET else cc.DTYPES


class Twin:
    """Two caches driven with identical calls and inputs; every output is compared."""

    def __init__(self, dtype, seed=0, **kw):
        kw.setdefault("rope_mode", "normal")
        self.cfg = cc.config(hq=8, hkv=2, d=64, ps=16, layers=2, dtype=dtype, **kw)
        self.ref = kvcache.PagedKVCache(self.cfg, backend="reference")
        self.dut = kvcache.PagedKVCache(self.cfg, backend="cuda", device=cc.DEVICE)
        assert self.dut.backend.name == "cuda"
        self.rng = np.random.default_rng(seed)
        self.forwards = 0

    def both(self, method, *args, **kw):
        out = [getattr(c, method)(*args, **kw) for c in (self.ref, self.dut)]
        assert self.ref.num_available_pages == self.dut.num_available_pages
        return out

    def forward(self, seq_ids, lengths, tree=None, fused=False):
        self.both("begin_forward", seq_ids, lengths, tree)
        np.testing.assert_array_equal(kvcache.to_numpy(self.dut.query_positions()),
                                      kvcache.to_numpy(self.ref.query_positions()))
        c, t = self.cfg, int(sum(lengths))
        for layer in range(c.num_layers):
            parts = [self.rng.standard_normal((t, h, c.head_dim)).astype(np.float32)
                     for h in (c.num_qo_heads, c.num_kv_heads, c.num_kv_heads)]
            if fused:
                qkv = np.concatenate(parts, axis=1)
                o_r = self.ref.attention_with_fused_qkv(layer, self.ref.from_numpy(qkv))
                o_d = self.dut.attention_with_fused_qkv(layer, self.dut.from_numpy(qkv))
                lse_r = lse_d = None
            else:
                o_r, lse_r = self.ref.attention(layer, *map(self.ref.from_numpy, parts), return_lse=True)
                o_d, lse_d = self.dut.attention(layer, *map(self.dut.from_numpy, parts), return_lse=True)
            self._close(o_d, o_r, f"forward {self.forwards} layer {layer} o")
            if lse_r is not None:
                self._close(lse_d, lse_r, f"forward {self.forwards} layer {layer} lse", lse=True)
        self.both("end_forward")
        self.forwards += 1

    def _close(self, got, want, what, lse=False):
        atol, rtol, latol = cc.TOL[self.cfg.dtype]
        g, w = kvcache.to_numpy(got).astype(np.float64), kvcache.to_numpy(want).astype(np.float64)
        assert g.shape == w.shape, what
        if lse:
            np.testing.assert_allclose(g, w, atol=latol, rtol=latol, err_msg=what)
        else:
            np.testing.assert_allclose(g, w, atol=atol, rtol=rtol, err_msg=what)

    def check_kv(self, seq_id):
        assert self.ref.sequence_length(seq_id) == self.dut.sequence_length(seq_id)
        (kr, vr), (kd, vd) = self.both("get_kv", seq_id)
        self._close(kd, kr, f"get_kv({seq_id}) k")
        self._close(vd, vr, f"get_kv({seq_id}) v")


@pytest.mark.parametrize("dtype", E2E_DTYPES)
@pytest.mark.parametrize("rope_mode", ["none", "normal", "inline"])
def test_prefill_then_decode(dtype, rope_mode):
    tw = Twin(dtype, rope_mode=rope_mode)
    for s in (0, 1, 2):
        tw.both("add_sequence", s)
    tw.forward([0, 1, 2], [5, 17, 33])          # ragged + (empty) paged
    tw.forward([0, 1], [20, 3])                 # chunked prefill: ragged + paged history, merged
    for _ in range(3):
        tw.forward([0, 1, 2], [1, 1, 1])        # decode kernel
    tw.both("remove_sequence", 1)
    tw.forward([2, 0], [1, 1])
    for s in (0, 2):
        tw.check_kv(s)


@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_fork_popn_shared_prefix(dtype):
    tw = Twin(dtype, seed=1)
    tw.both("add_sequence", 0)
    tw.forward([0], [37])
    tw.both("fork_sequence", 0, 1, 21)          # mid-page fork: partial page copied
    tw.both("fork_sequence", 0, 2)
    tw.forward([1, 2, 0], [1, 1, 1])
    tw.forward([1, 2], [4, 6])                  # prefill over a shared prefix (block depths)
    tw.both("popn", 0, 5)
    tw.forward([0, 1, 2], [1, 1, 1])
    for s in (0, 1, 2):
        tw.check_kv(s)


@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_token_tree_and_commit(dtype):
    tw = Twin(dtype, seed=2)
    for s in (0, 1):
        tw.both("add_sequence", s)
    tw.forward([0, 1], [19, 6])
    tw.forward([0, 1], [4, 3], tree=[-1, 0, 0, 1, -1, 0, 1])      # self tree (ragged, masked)
    tw.forward([0, 1], [2, 1], tree=[3, 2, 1])                    # grow: paged with tree mask
    tw.both("commit_accepted_token_tree_nodes", [0, 1], [4, 3])
    tw.forward([0, 1], [1, 1])
    for s in (0, 1):
        tw.check_kv(s)


@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_sliding_window_with_sinks(dtype):
    tw = Twin(dtype, seed=3, support_sliding_window=True)       # forces inline RoPE
    for s in (0, 1):
        tw.both("add_sequence", s)
    tw.both("enable_sliding_window", 0, 24, 4)
    tw.forward([0, 1], [20, 9])
    for _ in range(9):
        tw.forward([0, 1], [1, 1])
    tw.forward([0, 1], [11, 2])
    for s in (0, 1):
        tw.check_kv(s)


def test_fused_qkv_views():
    tw = Twin("float32", seed=4)
    tw.both("add_sequence", 0)
    tw.forward([0], [12], fused=True)
    tw.forward([0], [1], fused=True)
    tw.check_kv(0)


def test_bad_input_is_rejected():
    tw = Twin("float32")
    tw.both("add_sequence", 0)
    tw.dut.begin_forward([0], [2])
    q = np.zeros((2, 8, 64), np.float32)
    with pytest.raises(kvcache.InvalidArgumentError):
        tw.dut.attention(0, q, q[:, :2], q[:, :2])           # numpy is not a cuda-backend array
    with pytest.raises(kvcache.InvalidArgumentError):
        half = tw.dut.backend.from_numpy(q, "float16")
        tw.dut.attention(0, half, half[:, :2], half[:, :2])  # wrong dtype
