"""The public API on backend="cuda" against the same calls on backend="reference" (the suite's
twin driver, ``kvcache.conformance.CachePair``): prefill, decode, fork, popn, token trees,
sliding windows, fused qkv, get_kv, query_positions."""

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.conformance import CachePair, make_config

E2E_DTYPES = ["float32"] if cc.INTERPRET else cc.DTYPES
# Under the Triton interpreter (spawned by test_cuda_triton_interpreter.py in CI) the token-tree
# and fused-qkv scenarios cost 35-60 s each: slow there (`make test-all` runs them), unmarked in
# the CPU torch mode and on a GPU. The interpreter run keeps what they check: tree masks through
# every Triton attention kernel (test_ragged_attention / test_paged_prefill /
# test_paged_decode_variants [tree], test_paged_masked_nonfinite_tree_keys), the commit's
# compaction (test_compact_kv_overlapping), strided q/k/v views of a fused qkv through the Triton
# append (test_append_strided_views), and the backend choosing Triton for CPU tensors end to end
# (test_graph_mode_decode_equals_with_window_left[20]); both scenarios run in the CPU mode here.
slow_in_interpreter = cc.slow_in_interpreter


def twin(dtype, seed=0, **kw):
    """A cuda cache and a reference cache in lockstep (GQA 8/2, head_dim 64, two layers)."""
    kw.setdefault("rope_mode", "normal")
    pair = CachePair(make_config(dtype=dtype, gqa=4, num_kv_heads=2, **kw), "cuda", cc.DEVICE,
                     seed=seed)
    assert pair.dut.backend.name == "cuda"
    return pair


@pytest.mark.parametrize("dtype", E2E_DTYPES)
@pytest.mark.parametrize("rope_mode", ["none", "normal", "inline"])
def test_prefill_then_decode(dtype, rope_mode):
    p = twin(dtype, rope_mode=rope_mode)
    p.add(0, 1, 2)
    p.forward([0, 1, 2], [5, 17, 33])          # ragged + (empty) paged
    p.forward([0, 1], [20, 3])                 # chunked prefill: ragged + paged history, merged
    p.decode([0, 1, 2], steps=3)               # decode kernel
    p.remove(1)
    p.forward([2, 0], [1, 1])


@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_fork_popn_shared_prefix(dtype):
    p = twin(dtype, seed=1)
    p.add(0)
    p.forward([0], [37])
    p.fork(0, 1, 21)                           # mid-page fork: partial page copied
    p.fork(0, 2)
    p.forward([1, 2, 0], [1, 1, 1])
    p.forward([1, 2], [4, 6])                  # prefill over a shared prefix (block depths)
    p.popn(0, 5)
    p.forward([0, 1, 2], [1, 1, 1])


@slow_in_interpreter
@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_token_tree_and_commit(dtype):
    p = twin(dtype, seed=2)
    p.add(0, 1)
    p.forward([0, 1], [19, 6])
    p.forward([0, 1], [4, 3], tree=[-1, 0, 0, 1, -1, 0, 1])     # self tree (ragged, masked)
    p.forward([0, 1], [2, 1], tree=[3, 2, 1])                   # grow: paged with tree mask
    p.commit([0, 1], [4, 3])
    p.forward([0, 1], [1, 1])


@pytest.mark.parametrize("dtype", E2E_DTYPES)
def test_sliding_window_with_sinks(dtype):
    p = twin(dtype, seed=3, support_sliding_window=True)      # forces inline RoPE
    p.add(0, 1)
    p.enable_sliding_window(0, 24, 4)
    p.forward([0, 1], [20, 9])
    p.decode([0, 1], steps=9)
    p.forward([0, 1], [11, 2])


@slow_in_interpreter
def test_fused_qkv_views():
    p = twin("float32", seed=4)
    p.add(0)
    p.forward([0], [12], fused=True)
    p.forward([0], [1], fused=True)


def test_bad_input_is_rejected():
    p = twin("float32")
    p.add(0)
    p.dut.begin_forward([0], [2])
    q = np.zeros((2, 8, 64), np.float32)
    with pytest.raises(kvcache.InvalidArgumentError):
        p.dut.attention(0, q, q[:, :2], q[:, :2])            # numpy is not a cuda-backend array
    with pytest.raises(kvcache.InvalidArgumentError):
        half = p.dut.backend.from_numpy(q, "float16")
        p.dut.attention(0, half, half[:, :2], half[:, :2])   # wrong dtype
