"""``Engine(deterministic=True)``: one request's tokens and log-probabilities are the same bits
however the engine serves it. On the reference backend and on the cuda backend's CPU test mode
(batch-invariant attention; graphs on and off), with a transformers model (its matmuls and row
reductions in fixed row blocks during each step), one greedy request and one sampled request
are served alone, then beside seven other prompts with the prompt cut into 7-token chunks,
from a prefix-cache hit, under preemption with recompute, under preemption through the host
tier, and with the host not running ahead: every run gives the alone run's tokens and
log-probabilities exactly. Without the flag the batched run's log-probabilities differ (the
case is not vacuous). Refusals: an adapter without invariant ops, a backend without the
capability, a model on a GPU (not proven there yet), and compile_step."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from conftest import backend_or_skip, hf_greedy, make_model, make_prompts, torch

from kvcache.errors import UnsupportedFeatureError
from kvcache.integrations import SamplingParams
from kvcache.integrations.transformers import Engine

NEW = 12


BACKENDS = [("reference", {}), ("cuda", {"graphs": False}), ("cuda", {"graphs": True})]


def _serve(model, prompts, *, deterministic=True, warm=None, **kw):
    """Serve the target (prompts[0]) greedy and sampled, beside ``prompts[1:]``; after
    ``warm`` prompts were served (the prefix cache keeps their pages). Returns the target's
    (greedy tokens, greedy logprobs, sampled tokens, sampled logprobs) and the engine's stats."""
    opts = dict(backend="reference", max_total_tokens=4096, max_batch_size=8)
    opts.update(kw)
    engine = Engine(model, deterministic=deterministic, **opts)
    if warm:
        engine.generate(warm, max_new_tokens=2)
    params = [SamplingParams(max_tokens=NEW, logprobs=True, ignore_eos=True),
              SamplingParams(max_tokens=NEW, logprobs=True, ignore_eos=True, temperature=0.9,
                             top_p=0.95, seed=11)]
    params += [SamplingParams(max_tokens=NEW + 6, ignore_eos=True)] * (len(prompts) - 1)
    tokens, lps = engine.generate([prompts[0], prompts[0]] + list(prompts[1:]), params)
    return (tokens[0][0], lps[0][0], tokens[1][0], lps[1][0]), engine.stats


@pytest.mark.parametrize("backend, extra", BACKENDS, ids=["reference", "cuda-eager", "cuda-graphs"])
def test_a_request_gets_the_same_bits_however_it_is_served(backend, extra, monkeypatch):
    model = make_model("llama", seed=3)
    prompts = make_prompts(seed=13)
    target = prompts[3]                              # 128 tokens: eight pages of 16
    others = [p for i, p in enumerate(prompts) if i != 3][:7]
    kw = dict(extra)
    if backend == "cuda":
        kw["backend"], kw["device"] = backend_or_skip("cuda", monkeypatch, 64)
    serve = functools.partial(_serve, model, **kw)
    want, _ = serve([target])
    assert want[0] == hf_greedy(model, target, NEW)     # transformers' own greedy generation
    runs = {
        "beside seven others, in 7-token chunks": serve([target] + others, prefill_chunk_size=7),
        "from a prefix-cache hit": serve([target], warm=[target[:100] + [5, 6]]),
        "preempted and recomputed": serve([target] + others, max_total_tokens=448,
                                          offload=False),
        "preempted through the host tier": serve([target] + others, max_total_tokens=448,
                                                 offload=True),
        "the host not running ahead": serve([target] + others, overlap=False),
    }
    stats = {what: s for what, (_, s) in runs.items()}
    assert stats["from a prefix-cache hit"].prefix_hit_tokens >= 96
    assert stats["preempted and recomputed"].recomputed_tokens > 0
    assert stats["preempted through the host tier"].recompute_tokens_saved > 0
    for what, (got, _) in runs.items():
        for name, a, b in zip(("greedy tokens", "greedy logprobs", "sampled tokens",
                               "sampled logprobs"), got, want):
            assert a == b, f"{what}: {name} differ from the request served alone"
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


def test_a_model_on_a_gpu_is_refused_until_proven_there():
    from kvcache.integrations.transformers.adapter import TransformersAdapter
    adapter = TransformersAdapter.__new__(TransformersAdapter)
    adapter.device = torch.device("cuda", 0)         # (no GPU needed: refused before any work)
    with pytest.raises(UnsupportedFeatureError, match="proven on the CPU only"):
        adapter.batch_invariant_ops()


def test_an_adapter_without_invariant_ops_is_refused():
    from kvcache.demo.model import ToyAdapter
    from kvcache.integrations.engine import Engine as PlainEngine
    with pytest.raises(UnsupportedFeatureError, match="batch-invariant model ops"):
        PlainEngine(ToyAdapter("tiny", 0, "float32"), backend="reference", dtype="float32",
                    deterministic=True, max_total_tokens=256)
