"""``Engine(deterministic=True)``: one request's tokens and log-probabilities are the same bits
however the engine serves it. On the reference backend and on the cuda backend's CPU test mode
(batch-invariant attention; graphs on and off), with a transformers model (its matmuls and row
reductions in fixed row blocks during each step), one greedy request and one sampled request
are served alone, then beside seven other prompts with the prompt cut into 7-token chunks,
beside 64 random short prompts, from a prefix-cache hit, under preemption with recompute,
under preemption through the host tier, and with the host not running ahead: every run gives
the alone run's tokens and log-probabilities exactly; so does the greedy one prefilled by
another engine whose KV the decoding one imports. Without the flag the batched run's
log-probabilities differ (the case is not vacuous). Refusals: an adapter without invariant
ops, a backend without the capability, a device where the ops are not proven (or a float64
model on a GPU), and compile_step."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest

from conftest import backend_or_skip, hf_greedy, make_model, make_prompts, torch
from engine_cases import (TARGET_NEW, WAYS, assert_same_bits, prefilled_elsewhere, serve_target,
                          served_every_way)

from kvcache.errors import UnsupportedFeatureError
from kvcache.integrations.transformers import Engine



# The conditions (engine_cases.WAYS) x the backends, sampled: CI serves the request every way on
# the reference backend and, on the cuda backend's CPU test mode (eager), in 7-token chunks
# beside seven others and preempted through the host tier (the backend's own copies), with the
# prefill on another engine and the not-vacuous check; `make test-all` the other conditions on
# cuda too, and the graphs row (29 s on CI's 2 cores). Graphs stay covered in CI by the
# deterministic plans' graph tests of the cache, and on a GPU by the test at the end.
CUDA_IN_CI = ("beside seven others, in 7-token chunks", "preempted through the host tier")
CUDA_SLOW = tuple(w for w in WAYS if w not in CUDA_IN_CI)
BACKENDS = [pytest.param("reference", {}, WAYS, id="reference"),
            pytest.param("cuda", {"graphs": False}, CUDA_IN_CI, id="cuda-eager"),
            pytest.param("cuda", {"graphs": False}, CUDA_SLOW, id="cuda-eager-other-ways",
                         marks=pytest.mark.slow),
            pytest.param("cuda", {"graphs": True}, WAYS, id="cuda-graphs", marks=pytest.mark.slow)]


def _opts(**kw) -> dict:
    """The test engines' options: the reference backend unless ``kw`` says."""
    return {**dict(backend="reference", max_total_tokens=4096, max_batch_size=8), **kw}


def _serve(model, prompts, **kw):
    """``serve_target`` on the transformers Engine."""
    return serve_target(Engine, model, prompts, **_opts(**kw))


@pytest.mark.parametrize("backend, extra, ways", BACKENDS)
def test_a_request_gets_the_same_bits_however_it_is_served(backend, extra, ways, monkeypatch):
    model = make_model("llama", seed=3)
    prompts = make_prompts(seed=13)
    target = prompts[3]                              # 128 tokens: eight pages of 16
    others = [p for i, p in enumerate(prompts) if i != 3][:7]
    kw = dict(extra)
    if backend == "cuda":
        kw["backend"], kw["device"] = backend_or_skip("cuda", monkeypatch, 64)
    serve = functools.partial(_serve, model, **kw)
    want, _ = serve([target])
    assert want[0] == hf_greedy(model, target, TARGET_NEW)     # transformers' own greedy generation
    assert_same_bits(served_every_way(serve, target, others, ways), want)
    assert prefilled_elsewhere(Engine, model, target, **_opts(**kw)) == want[:2]
    # the case is not vacuous: without the flag the batched run parts in the last bits
    plain, _ = serve([target], deterministic=False)
    batched, _ = serve([target] + others, deterministic=False, prefill_chunk_size=7)
    assert plain[1] != batched[1] or plain[3] != batched[3]


def test_deterministic_is_refused_where_it_cannot_hold():
    import kvcache
    from kvcache.plugins import register_plugin, reset_plugins
    from kvcache.reference import ReferenceBackend
    model = make_model("llama", seed=3)
    with pytest.raises(UnsupportedFeatureError, match="compile_step"):
        Engine(model, backend="reference", deterministic=True, compile_step=True,
               max_total_tokens=256)

    class Variant(ReferenceBackend):
        name = "no-invariance-test"
        capabilities = dataclasses.replace(ReferenceBackend.capabilities, batch_invariant=False)

    class Plugin:
        @kvcache.hookimpl
        def kvcache_register_backends(self):
            return [Variant]
    register_plugin(Plugin(), name="no-invariance-test")
    try:
        with pytest.raises(UnsupportedFeatureError, match="batch_invariant"):
            Engine(model, backend="no-invariance-test", deterministic=True, max_total_tokens=256)
    finally:
        reset_plugins()


def test_a_model_where_the_ops_are_not_proven_is_refused():
    from kvcache.integrations.torch_invariant import BatchInvariantMode
    from kvcache.integrations.transformers.adapter import TransformersAdapter
    adapter = TransformersAdapter.__new__(TransformersAdapter)
    adapter.model = make_model("llama", seed=3)
    adapter.device = torch.device("mps")             # (no such device needed: refused first)
    with pytest.raises(UnsupportedFeatureError, match="CPU and on NVIDIA GPUs only"):
        adapter.batch_invariant_ops()
    adapter.device = torch.device("cuda", 0)
    if not torch.version.hip:
        ops = adapter.batch_invariant_ops()          # (no GPU needed: nothing runs yet)
        assert isinstance(ops, BatchInvariantMode) and ops.kernels is None
        adapter.model = adapter.model.to(torch.float64)
        with pytest.raises(UnsupportedFeatureError, match="float64"):
            adapter.batch_invariant_ops()


def test_an_adapter_without_invariant_ops_is_refused():
    from kvcache.demo.model import ToyAdapter
    from kvcache.integrations.engine import Engine as PlainEngine
    with pytest.raises(UnsupportedFeatureError, match="batch-invariant model ops"):
        PlainEngine(ToyAdapter("tiny", 0, "float32"), backend="reference", dtype="float32",
                    deterministic=True, max_total_tokens=256)


GPU_DIMS = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=8,
                num_key_value_heads=2, num_hidden_layers=4)
"""A model whose GEMMs span several of the GPU kernels' K chunks (1,024 and 3,072 columns)."""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_on_a_gpu_in_bfloat16_a_request_gets_the_same_bits(graphs):
    """The conditions of the CPU test above, on a GPU in bfloat16 (the cuda backend's Triton
    kernels, the model's ops through ``invariant_triton``). Greedy tokens are judged against
    transformers by a teacher-forced re-score (bfloat16 near-ties may part from its own
    generation): transformers' forward in float32 (the same weights) over the prompt and the
    engine's tokens must find each token within twice bfloat16's own noise of its best logit
    (the noise: how far transformers' bfloat16 forward of the same tokens is from float32), and
    the greedy log-probabilities within three times it of float32's."""
    model = make_model("llama", seed=3, **GPU_DIMS).to("cuda", torch.bfloat16)
    prompts = make_prompts(seed=13)
    target = prompts[3]
    others = [p for i, p in enumerate(prompts) if i != 3][:7]
    serve = functools.partial(_serve, model, backend="cuda", device="cuda", graphs=graphs)
    want, alone = serve([target])
    if graphs:                      # the steps replay their graphs: no capture fell back
        assert alone.graph_forwards > 0 and alone.graph_fallback_forwards == 0
    ids = torch.tensor([target + want[0]], device="cuda")
    with torch.no_grad():
        wide = copy.deepcopy(model).float()(ids).logits[0, len(target) - 1:-1]
        narrow = model(ids).logits[0, len(target) - 1:-1].float()
    noise = (narrow - wide).abs().max().item()
    tokens = torch.tensor(want[0], device="cuda")[:, None]
    gap = wide.max(-1).values - wide.gather(1, tokens)[:, 0]
    assert bool((gap <= 2 * noise).all()), f"gaps {gap.tolist()}, bfloat16 noise {noise}"
    lp = torch.log_softmax(wide, -1).gather(1, tokens)[:, 0].cpu().double()
    assert float((lp - torch.tensor(want[1], dtype=torch.float64)).abs().max()) <= 3 * noise
    assert_same_bits(served_every_way(serve, target, others), want)
    assert prefilled_elsewhere(Engine, model, target, **_opts(backend="cuda", device="cuda",
                                                              graphs=graphs)) == want[:2]
    plain, _ = serve([target], deterministic=False)
    batched, _ = serve([target] + others, deterministic=False, prefill_chunk_size=7)
    assert plain[1] != batched[1] or plain[3] != batched[3]
