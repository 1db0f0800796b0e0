"""Whole-step decode graphs in the Engine (``graphs=None|True|False``), on the cuda backend's CPU
test mode, where a capture is a stand-in that re-runs the step on the graph's static buffers:
the same tokens as eager execution (llama, qwen2) while the batch bucket changes and under
preemption; pure decode steps go through the graphs and prefill / mixed steps stay eager; the
switch and its refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import backend_or_skip, family_case, hf_greedy, make_model, make_prompts

from kvcache.errors import InvalidArgumentError, UnsupportedFeatureError
from kvcache.integrations.transformers import Engine

GRAPH_FAMILIES = ["llama", "qwen2"]


def spy(engine):
    """Record every forward: ("graph" | "eager", tokens, sequences, static bucket)."""
    log = []
    cache, forward = engine.cache, engine.adapter.forward

    def eager(c, tokens, positions, rows):
        log.append(("eager", len(tokens), len(c.open_plan.seq_ids), c.static_bucket))
        return forward(c, tokens, positions, rows)

    engine.adapter.forward = eager
    if engine.decode_graphs is not None:
        run = engine.decode_graphs.run

        def graph(tokens, positions, rows):
            log.append(("graph", len(tokens), len(cache.open_plan.seq_ids), cache.static_bucket))
            return run(tokens, positions, rows)

        engine.decode_graphs.run = graph
    return log


@pytest.mark.parametrize("family", GRAPH_FAMILIES)
def test_graphs_match_eager_across_buckets(family, monkeypatch):
    model, prompts, greedy, _ = family_case(family)
    backend, device = backend_or_skip("cuda", monkeypatch, 64)     # both families: head_dim 64
    new = 24
    # a small token budget admits the prompts over several steps, so they join and finish at
    # different steps: the decode batch grows and shrinks through several buckets
    kw = dict(backend=backend, device=device, max_batch_size=8, max_total_tokens=8192,
              prefill_chunk_size=96)
    on = Engine(model, graphs=True, **kw)
    off = Engine(model, graphs=False, **kw)
    assert on.graphs and on.cache.config.static_decode
    assert not off.graphs and not off.cache.config.static_decode
    log = spy(on)
    got, lp_on = on.generate(prompts, max_new_tokens=new, return_logprobs=True)
    want, lp_off = off.generate(prompts, max_new_tokens=new, return_logprobs=True)
    assert got == want
    assert [g[0] for g in got] == [g[:new] for g in greedy]          # transformers' own greedy
    np.testing.assert_allclose(np.array(lp_on, dtype=float), np.array(lp_off, dtype=float),
                               rtol=1e-5, atol=1e-5)
    graph_steps = [entry for entry in log if entry[0] == "graph"]
    buckets = {entry[3] for entry in graph_steps}
    sizes = [entry[2] for entry in graph_steps]
    assert len(buckets) >= 3, f"the decode batch should cross buckets, got {sorted(buckets)}"
    assert max(sizes) > min(sizes) and sizes[-1] < max(sizes)        # requests finished
    assert any(s < b for _, _, s, b in graph_steps), "some steps should run padded rows"
    assert on.stats.graph_captures == len(buckets)                   # one capture per bucket
    assert on.stats.graph_forwards == len(graph_steps)
    assert on.decode_graphs.replays == len(graph_steps)
    assert off.stats.graph_forwards == 0 and off.stats.forwards == on.stats.forwards


def test_prefill_and_mixed_steps_are_eager_decode_steps_replay(monkeypatch):
    model, prompts, _, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    # mixed_graphs=False: steps that prefill run eagerly (the default captures them too)
    engine = Engine(model, backend=backend, device=device, graphs=True, max_batch_size=8,
                    max_total_tokens=8192, prefill_chunk_size=64, mixed_graphs=False)
    log = spy(engine)
    engine.generate(prompts[:5], max_new_tokens=10)
    eager = [e for e in log if e[0] == "eager"]
    graph = [e for e in log if e[0] == "graph"]
    assert eager and graph
    # every eager forward carried a prompt chunk (more tokens than sequences): prefill or mixed
    assert all(tokens > seqs and bucket is None for _, tokens, seqs, bucket in eager)
    assert any(seqs > 1 for _, tokens, seqs, _ in eager if tokens > seqs), "no mixed step ran"
    # every pure decode step (one token per sequence) went through its bucket's graph
    assert all(tokens == seqs and bucket is not None and seqs <= bucket
               for _, tokens, seqs, bucket in graph)
    assert len(eager) + len(graph) == engine.stats.forwards
    assert engine.stats.graph_forwards == len(graph)
    # the first step of each bucket captured, the rest replayed the capture
    assert engine.stats.graph_captures == len({e[3] for e in graph}) < len(graph)


def test_graphs_survive_preemption(monkeypatch):
    model = make_model("llama", seed=3)
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    prompts = make_prompts(seed=13)[:6]
    new = 30
    want = [hf_greedy(model, p, new) for p in prompts]
    kw = dict(backend=backend, device=device, max_total_tokens=640, prefill_chunk_size=64,
              max_batch_size=8)
    on = Engine(model, graphs=True, **kw)
    log = spy(on)
    out = on.generate(prompts, max_new_tokens=new)
    assert on.stats.preemptions > 0 and on.stats.recomputed_tokens > 0
    assert [o[0] for o in out] == want
    assert on.stats.graph_forwards > 0 and any(e[0] == "graph" for e in log)
    off = Engine(model, graphs=False, **kw)
    assert off.generate(prompts, max_new_tokens=new) == out
    # the engine is reusable: a second generate replays the graphs captured by the first
    captures = on.stats.graph_captures
    assert on.generate(prompts[:2], max_new_tokens=8) == [[w[:8]] for w in want[:2]]
    assert on.stats.graph_captures == captures


def test_graph_switch(monkeypatch):
    model, prompts, _, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    # None: on only for a GPU model; this model is on the CPU, so off
    auto = Engine(model, backend=backend, device=device, max_batch_size=4, max_total_tokens=2048)
    assert auto.graphs is False and auto.decode_graphs is None
    assert not auto.cache.config.static_decode
    assert auto.adapter.graphs_by_default("cuda:0") is True
    assert auto.adapter.graphs_by_default("cpu") is False
    # True on a backend without static_decode is refused, naming the backend and the capability
    with pytest.raises(UnsupportedFeatureError, match="'reference'.*static_decode"):
        Engine(model, backend="reference", graphs=True)
    with pytest.raises(InvalidArgumentError, match="graphs='yes'"):
        Engine(model, backend=backend, device=device, graphs="yes")
    # with graphs on, steps that prefill are captured too by default
    assert Engine(model, backend=backend, device=device, graphs=True, max_batch_size=4,
                  max_total_tokens=2048).mixed_graphs is True
    assert auto.mixed_graphs is False
    # chosen buckets: every decode graph step pads to one of them; larger batches run eagerly
    engine = Engine(model, backend=backend, device=device, graphs=True, max_batch_size=8,
                    max_total_tokens=8192, prefill_chunk_size=512, graph_batch_sizes=(2, 4),
                    mixed_graphs=False)
    assert engine.cache.config.static_buckets == (2, 4)
    log = spy(engine)
    out = engine.generate(prompts[:6], max_new_tokens=6)
    graph = [e for e in log if e[0] == "graph"]
    eager_decodes = [e for e in log if e[0] == "eager" and e[1] == e[2]]
    assert graph and {e[3] for e in graph} <= {2, 4}
    assert eager_decodes and all(e[2] > 4 for e in eager_decodes)
    ref = Engine(model, backend=backend, device=device, graphs=False, max_batch_size=8,
                 max_total_tokens=8192, prefill_chunk_size=512)
    assert ref.generate(prompts[:6], max_new_tokens=6) == out


@pytest.mark.parametrize("family,rope,overrides", [
    ("qwen2", "cache", {}),                              # the cache's fused RoPE inside the graph
    ("mistral", "model", {"sliding_window": 40}),        # window_left is a captured argument
])
def test_graphs_with_fused_rope_and_windows(family, rope, overrides, monkeypatch):
    model = make_model(family, seed=1, **overrides)
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    prompts = make_prompts()[:4]                         # 5..300 tokens: past the window of 40
    kw = dict(backend=backend, device=device, max_batch_size=8, max_total_tokens=4096, rope=rope)
    on = Engine(model, graphs=True, **kw)
    got = on.generate(prompts, max_new_tokens=10)
    assert on.stats.graph_forwards > 0
    assert got == Engine(model, graphs=False, **kw).generate(prompts, max_new_tokens=10)
    assert [g[0] for g in got] == [hf_greedy(model, p, 10) for p in prompts]


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_on_by_default_and_match_eager():
    # real torch.cuda.CUDAGraph capture of the whole step (the model's forward and the cache)
    import kvcache
    if not any(r["name"] == "cuda" and r["available"] for r in kvcache.list_backends("cuda")):
        pytest.skip("the cuda backend is not available on this GPU")
    model = make_model("llama", seed=3).to("cuda")
    prompts = make_prompts(seed=13)[:6]
    kw = dict(backend="cuda", max_batch_size=8, max_total_tokens=8192, prefill_chunk_size=96)
    on = Engine(model, **kw)
    assert on.graphs and on.decode_graphs is not None             # the default on a GPU
    got, lp_on = on.generate(prompts, max_new_tokens=24, return_logprobs=True)
    # the reference point: eager steps, each step's picks read before the next is launched
    off = Engine(model, graphs=False, overlap=False, **kw)
    want, lp_off = off.generate(prompts, max_new_tokens=24, return_logprobs=True)
    assert on.stats.overlapped_forwards > 0
    assert on.stats.graph_captures >= 2 and on.stats.graph_forwards > on.stats.graph_captures
    assert got == want
    np.testing.assert_allclose(np.array(lp_on, dtype=float), np.array(lp_off, dtype=float),
                               rtol=1e-3, atol=1e-3)


CAPTURE_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"


@pytest.mark.parametrize("fail", ["every", "first"])
def test_a_step_that_cannot_be_captured_runs_eagerly_with_one_warning(fail, monkeypatch):
    """Issue 51 item 5: a float32 MoE's grouped matmul copies between host and device, which a
    CUDA graph cannot hold ("Cannot copy between CPU and CUDA tensors during CUDA graph
    capture"). Such a step runs eagerly on the graph's buffers instead, as do the later steps of
    its kind and bucket: the tokens are the eager engine's, one warning for the engine, never an
    error. ``every``: no capture succeeds (decode and mixed buckets alike); ``first``: only the
    first bucket's fails, the others capture and replay as usual."""
    import warnings

    from kvcache.integrations.torch_graphs import GraphCaptureWarning
    model, prompts, greedy, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    new = 12
    kw = dict(backend=backend, device=device, max_batch_size=8, max_total_tokens=8192,
              prefill_chunk_size=96)
    on = Engine(model, graphs=True, **kw)
    graphs = on.decode_graphs
    record, failed = graphs._record, []

    def capture(slot):
        if fail == "every" or not failed:
            failed.append(slot.size)
            raise RuntimeError(CAPTURE_ERROR)
        record(slot)

    monkeypatch.setattr(graphs, "_record", capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = on.generate(prompts, max_new_tokens=new)
        again = on.generate(prompts[:3], max_new_tokens=new)    # the fallen-back keys stay eager
    want = Engine(model, graphs=False, **kw).generate(prompts, max_new_tokens=new)
    assert got == want and again == want[:3]
    assert [g[0] for g in got] == [g[:new] for g in greedy]
    capture_warnings = [w for w in caught if issubclass(w.category, GraphCaptureWarning)]
    assert len(capture_warnings) == 1, [str(w.message) for w in capture_warnings]
    assert CAPTURE_ERROR in str(capture_warnings[0].message)
    assert "graphs=False" in str(capture_warnings[0].message)
    stats = on.stats
    assert stats.graph_fallback_forwards == graphs.eager_runs > 0
    assert stats.graph_forwards + stats.graph_fallback_forwards == stats.forwards
    assert len(graphs.eager) == len(failed)         # each key tried once, then stays eager
    assert all(CAPTURE_ERROR in why for why in graphs.eager.values())
    if fail == "every":
        assert stats.graph_forwards == stats.graph_captures == 0
    else:
        assert len(failed) == 1 and stats.graph_captures >= 1
        assert stats.graph_forwards > stats.graph_captures
    assert on.cache.is_empty and not on.has_unfinished()


def test_an_error_the_eager_step_raises_too_is_not_a_capture_failure(monkeypatch):
    """A capture that fails because the step itself cannot run (its eager re-run raises as well)
    is the model's error: it reaches the caller, with no capture warning, and the engine is
    usable afterwards."""
    import warnings

    from kvcache.integrations.torch_graphs import GraphCaptureWarning
    model, prompts, greedy, _ = family_case("llama")
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    on = Engine(model, backend=backend, device=device, graphs=True, max_batch_size=8,
                max_total_tokens=8192)
    graphs = on.decode_graphs
    step = graphs.step
    broken = [True]

    def failing(args):
        if broken[0]:
            raise RuntimeError("the model's own error")
        return step(args)

    monkeypatch.setattr(graphs, "step", failing)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="the model's own error"):
            on.generate(prompts[:2], max_new_tokens=4)
    assert not [w for w in caught if issubclass(w.category, GraphCaptureWarning)]
    assert not graphs.eager and on.cache.is_empty
    broken[0] = False
    assert on.generate(prompts[:2], max_new_tokens=4) == [[g[:4]] for g in greedy[:2]]
