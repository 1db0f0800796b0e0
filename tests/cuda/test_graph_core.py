"""One capture/replay core (issue 52 item 4): ``kvcache_cuda.DecodeGraphs`` (the caller's step)
and the engine's ``kvcache.integrations.torch_graphs.StepGraphs`` (a model's whole step over its
token buffers) both drive ``kvcache_cuda.graph_core.GraphCore``. On CPU the capture is the
stand-in that re-runs the step eagerly; a replay gives the eager cache's result, and a forward
that no bucket fits is refused with a typed error."""

import numpy as np
import pytest

import cuda_cases as cc
import kvcache
from kvcache.errors import ForwardStateError, InvalidArgumentError

LAYERS, HQ, HKV, D, VOCAB = 2, 4, 2, 32, 11


def make(graph, buckets=(2, 4)):
    cfg = kvcache.CacheConfig(num_layers=LAYERS, num_qo_heads=HQ, num_kv_heads=HKV, head_dim=D,
                              page_size=16, max_batch_size=4, max_total_tokens=1024,
                              prefill_chunk_size=256, dtype="float32", rope_mode="normal",
                              static_decode=graph, static_decode_batch_sizes=buckets)
    return kvcache.PagedKVCache(cfg, backend="cuda", device=cc.DEVICE)


class ToyModel:
    """A torch 'model' whose step reads only its token ids and positions: per layer q/k/v from
    a fixed embedding (scaled by the position), the cache's attention, then a fixed head."""

    def __init__(self, torch, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.torch = torch
        self.embed = torch.randn((VOCAB, LAYERS, HQ + 2 * HKV, D), generator=g).to(cc.DEVICE)
        self.head = torch.randn((HQ * D, VOCAB), generator=g).to(cc.DEVICE)

    def step(self, cache, inputs):
        ids, positions, rows = inputs
        x = self.embed[ids] * (1 + positions.float() / 100)[:, None, None, None]
        out = None
        for layer in range(LAYERS):
            q, k, v = x[:, layer].split([HQ, HKV, HKV], dim=1)
            o = cache.attention(layer, q.contiguous(), k.contiguous(), v.contiguous())
            out = o if out is None else out + o
        return out.reshape(len(ids), HQ * D)[rows] @ self.head


def test_both_graph_helpers_drive_the_one_core():
    torch = pytest.importorskip("torch")
    from kvcache.integrations.torch_graphs import StepGraphs
    from kvcache_cuda import DecodeGraphs
    from kvcache_cuda.graph_core import GraphCore, HostGraph
    cache = make(True)
    decode, steps = DecodeGraphs(cache), StepGraphs(cache, lambda inputs: None, cc.DEVICE)
    assert type(decode.core) is GraphCore and type(steps.core) is GraphCore
    assert steps.buckets is steps.core.slots           # the engine's buckets are the core's slots
    # the same refusal of a cache without static-shape steps, named for each owner
    for owner in (DecodeGraphs, lambda c: StepGraphs(c, lambda inputs: None, cc.DEVICE)):
        with pytest.raises(InvalidArgumentError, match="static_decode=True"):
            owner(make(False))
    with pytest.raises(InvalidArgumentError, match="warmup must be at least 1"):
        GraphCore(cache, warmup=0)
    # capture + replay through the core on the CPU stand-in
    cache.add_sequence(0)
    cache.add_sequence(1)
    with cache.forward([0, 1], [3, 2]):
        for layer in range(LAYERS):
            z = (torch.zeros((5, HQ, D), device=cc.DEVICE),
                 torch.zeros((5, HKV, D), device=cc.DEVICE))
            cache.attention(layer, z[0], z[1], z[1])
    if not cc.ON_GPU:
        core = decode.core
        cache.begin_forward([0, 1], [1, 1])
        decode.capture(lambda: [cache.attention(layer, torch.ones((2, HQ, D)), torch.ones((2, HKV, D)),
                                                torch.ones((2, HKV, D))) for layer in range(LAYERS)])
        assert isinstance(core.slots[2].graph, HostGraph) and core.captures == 1
        cache.end_forward()


def test_step_graphs_replay_equals_the_eager_step():
    """StepGraphs through the core: captured at the first decode step of a bucket, replayed at
    later ones; every step's logits equal the same toy model run eagerly on a non-graph cache."""
    torch = pytest.importorskip("torch")
    from kvcache.integrations.torch_graphs import StepGraphs
    graph, eager = make(True), make(False)
    model = ToyModel(torch)
    graphs = StepGraphs(graph, lambda inputs: model.step(graph, inputs), cc.DEVICE)
    rng = np.random.default_rng(0)
    lens = {}
    for sid, n in ((0, 5), (1, 9), (2, 3)):
        prompt = rng.integers(0, VOCAB, n)
        for c in (graph, eager):
            c.add_sequence(sid)
            with c.forward([sid], [n]):
                model.step(c, (torch.as_tensor(prompt, device=cc.DEVICE),
                               torch.arange(n, device=cc.DEVICE),
                               torch.tensor([n - 1], device=cc.DEVICE)))
        lens[sid] = n
    for batch in ([0, 1], [1, 0], [0, 1, 2], [2, 0], [2, 1, 0]):
        tokens = rng.integers(0, VOCAB, len(batch)).astype(np.int64)
        positions = np.array([lens[s] for s in batch], np.int64)
        rows = np.arange(len(batch), dtype=np.int64)
        with graph.forward(batch, [1] * len(batch)):
            got = kvcache.to_numpy(graphs.run(tokens, positions, rows).clone())
        with eager.forward(batch, [1] * len(batch)):
            want = kvcache.to_numpy(model.step(eager, tuple(
                torch.as_tensor(a, device=cc.DEVICE) for a in (tokens, positions, rows))))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        for s in batch:
            lens[s] += 1
    # buckets 2 and 4 (3 rows pad to 4): one capture each, every other step a replay
    assert sorted(b for _, b in graphs.buckets) == [2, 4]
    assert graphs.captures == 2 and graphs.replays == 5 and not graphs.eager


def test_a_forward_no_bucket_fits_is_refused_with_a_typed_error():
    torch = pytest.importorskip("torch")
    from kvcache.integrations.torch_graphs import StepGraphs
    from kvcache_cuda.graph_core import GraphCore
    cache = make(True, buckets=(2,))
    core = GraphCore(cache)
    with pytest.raises(ForwardStateError, match="needs an open forward"):
        core.open_bucket("replay")
    for sid in range(3):
        cache.add_sequence(sid)
        with cache.forward([sid], [2]):
            z = torch.zeros((2, HQ, D), device=cc.DEVICE), torch.zeros((2, HKV, D), device=cc.DEVICE)
            for layer in range(LAYERS):
                cache.attention(layer, z[0], z[1], z[1])
        cache.begin_forward([sid], [2])          # a prefill: no static-shape bucket
        with pytest.raises(InvalidArgumentError, match="not a static-shape"):
            core.open_bucket("replay", decode_only=True)
        with pytest.raises(InvalidArgumentError, match="StepGraphs.run: .* not a static-shape"):
            StepGraphs(cache, lambda inputs: None, cc.DEVICE).run(
                np.zeros(2, np.int64), np.arange(2), np.array([1]))
        cache.abort_forward()
    cache.begin_forward([0, 1, 2], [1, 1, 1])     # beyond the largest bucket (2)
    with pytest.raises(InvalidArgumentError, match="not a static-shape decode step"):
        core.open_bucket("replay", decode_only=True)
    assert not core.slots and core.captures == core.replays == 0
    cache.abort_forward()
