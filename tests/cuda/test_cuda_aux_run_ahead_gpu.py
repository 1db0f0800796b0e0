"""GPU run-ahead of the merged aux staging buffers (issue 28, item 10): the host must wait for the
copy that last read a pinned staging buffer before it writes the next forward's index arrays
into it (``MergedAuxManager.upload``'s ``event_synchronize``). Without that wait the CPU suite
passes; on a GPU a copy still queued behind busy compute work reads the later forward's arrays,
and the earlier forward attends over the wrong pages.

The compute stream is held up (``torch.cuda._sleep``), so every copy of the next forwards waits
on the copy stream for compute work that is still queued; the host meanwhile queues forwards
whose index arrays differ step to step. Outputs are read only at the end and compared with the
reference backend. GPU only:

    KVCACHE_CUDA_TEST_DEVICE=cuda python -m pytest -q tests/cuda/test_cuda_aux_run_ahead_gpu.py

(CPU mode has no asynchronous copies: ``tests/core/test_aux_staging_reuse.py`` is its twin.)"""

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.conformance import assert_close

pytestmark = pytest.mark.skipif(not cc.ON_GPU, reason="needs a GPU (KVCACHE_CUDA_TEST_DEVICE=cuda)")


def schedule():
    """(seq_ids, lens) per forward: the batch, its order and its lengths change every step, so
    every forward's index arrays differ from those two forwards before it."""
    steps = [([0, 1, 2, 3], [37, 5, 64, 17])]
    rng = np.random.default_rng(7)
    for i in range(40):
        ids = [int(s) for s in rng.permutation(4)[: 1 + i % 4]]
        lens = [1] * len(ids) if i % 3 else [int(n) for n in rng.integers(1, 20, len(ids))]
        steps.append((ids, lens))
    return steps


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_forwards_queued_behind_a_busy_device_read_their_own_index_arrays(impl):
    import torch
    cfg = kvcache.CacheConfig(num_layers=2, num_qo_heads=8, num_kv_heads=2, head_dim=64,
                              page_size=16, max_batch_size=8, max_total_tokens=4096,
                              prefill_chunk_size=256, dtype="float16", rope_mode="normal")
    gpu = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
    gpu.backend.impl = impl
    ref = kvcache.PagedKVCache(cfg, backend="reference")
    steps = schedule()
    rng = np.random.default_rng(0)
    inputs = []
    for ids, lens in steps:
        t = sum(lens)
        inputs.append([[rng.standard_normal((t, h, 64)).astype(np.float32)
                        for h in (8, 2, 2)] for _ in range(cfg.num_layers)])
    for c in (gpu, ref):
        for s in range(4):
            c.add_sequence(s)
    # every input on the device first: nothing but the aux copies moves host->device below
    dev_inputs = [[[gpu.from_numpy(a) for a in layer] for layer in step] for step in inputs]
    # compile every kernel variant first (a throwaway cache, the same schedule), so that the
    # host runs ahead below instead of compiling
    warm = kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)
    warm.backend.impl = impl
    for s in range(4):
        warm.add_sequence(s)
    for (ids, lens), step in zip(steps, dev_inputs):
        with warm.forward(ids, lens):
            for layer in range(cfg.num_layers):
                warm.attention(layer, *step[layer])
    del warm
    torch.cuda.synchronize()
    outs = []
    for n, ((ids, lens), step) in enumerate(zip(steps, dev_inputs)):
        if n % 10 == 0:
            torch.cuda._sleep(200_000_000)         # ~0.1 s of the compute stream
        with gpu.forward(ids, lens):
            outs.append([gpu.attention(layer, *step[layer]) for layer in range(cfg.num_layers)])
    torch.cuda.synchronize()
    for n, ((ids, lens), step) in enumerate(zip(steps, inputs)):
        with ref.forward(ids, lens):
            for layer in range(cfg.num_layers):
                want = ref.attention(layer, *(ref.from_numpy(a) for a in step[layer]))
                assert_close(f"forward {n} ({ids}, {lens}) layer {layer}",
                             kvcache.to_numpy(want), kvcache.to_numpy(outs[n][layer]), "float16")
    for s in range(4):
        for a, b in zip(ref.get_kv(s), gpu.get_kv(s)):
            assert_close(f"get_kv({s})", kvcache.to_numpy(a), kvcache.to_numpy(b), "float16")
