"""The per-rank work of the tensor-parallel tests: module-level functions that
``kvcache.distributed.tp.spawn`` runs on each rank (float32 random-weight models on the CPU,
gloo); each returns plain data for the test to compare across ranks."""

from __future__ import annotations

import os

import numpy as np

VOCAB = 256
NEW = 12
LLAMA = dict(vocab_size=VOCAB, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=512, initializer_range=0.15, bos_token_id=None,
             eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)


def make_model(seed: int = 0, family: str = "llama", random_bias: bool = False, **overrides):
    """A small float32 model with seeded random weights (the same on every rank);
    ``random_bias``: its linear biases random too (transformers initialises them to zero)."""
    import torch
    import transformers
    names = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "phi3": ("Phi3Config", "Phi3ForCausalLM")}
    config_name, model_name = names[family]
    kw = {**LLAMA, **overrides}
    if family == "phi3":
        kw.pop("head_dim")
    config = getattr(transformers, config_name)(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    if random_bias:
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape) * 0.3)
    return model


def make_prompts(seed: int = 1) -> list:
    """Four prompts; the last shares its first 32 tokens (two pages) with the second."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, VOCAB, n).tolist() for n in (5, 41, 23)]
    prompts.append(prompts[1][:32] + rng.integers(1, VOCAB, 9).tolist())
    return prompts


def hf_greedy(model, prompt, new=NEW) -> list:
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False,
                             min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def _backend(name: str):
    """(backend name, None) when it runs here, else (None, why not)."""
    import kvcache
    if name == "cuda":
        os.environ["KVCACHE_CUDA_CPU"] = "1"           # the cuda backend's CPU test mode
    rows = {r["name"]: r for r in kvcache.list_backends("cpu")}
    row = rows.get(name)
    if row is None or not row["available"]:
        return None, f"backend {name!r} not available: {row['reason'] if row else 'not installed'}"
    return name, None


def _scenarios(engine) -> dict:
    """The same requests on any engine: a shared prefix (the prefix cache), n > 1 forks, a forced preemption,
    seeded sampling; tokens and the counters that show each feature ran."""
    prompts = make_prompts()
    out: dict = {}
    out["greedy"] = engine.generate(prompts, max_new_tokens=NEW)
    out["greedy_stats"] = (engine.stats.prefix_hit_tokens, engine.cache.config.page_size)
    out["fork"] = engine.generate([prompts[2]], max_new_tokens=NEW, n=3)
    out["sampled"] = engine.generate([prompts[1]], max_new_tokens=8, n=2, temperature=1.0, seed=7)
    return out


def _preempting(model, backend, **kw) -> tuple:
    """Six requests in 12 pages of 16 tokens: they do not fit together."""
    from kvcache.integrations.transformers import Engine
    engine = Engine(model, backend=backend, max_total_tokens=192, prefill_chunk_size=32,
                    max_batch_size=8, **kw)
    prompts = make_prompts(seed=2) + make_prompts(seed=3)[:2]
    out = engine.generate(prompts, max_new_tokens=16)
    return out, engine.stats.preemptions, engine.stats.recomputed_tokens, engine.cache.is_empty


def greedy(rank: int, world: int, backend: str, methods: tuple) -> dict:
    """TP=1 (the whole model), then each sharding method on a fresh copy of the same model;
    transformers' own generate as the reference."""
    import torch
    torch.set_num_threads(1)
    backend, why = _backend(backend)
    if backend is None:
        return {"skip": why}
    from kvcache.integrations import tp as kvtp
    from kvcache.integrations.transformers import Engine
    whole = make_model()
    res: dict = {"hf": [hf_greedy(whole, p) for p in make_prompts()],
                 "hf_preempt": [hf_greedy(whole, p, 16)
                                for p in make_prompts(seed=2) + make_prompts(seed=3)[:2]]}
    engine = Engine(whole, backend=backend, max_total_tokens=2048, prefill_chunk_size=32)
    res["tp1"] = _scenarios(engine)
    res["tp1_preempt"] = _preempting(whole, backend)
    for method in methods:
        model = make_model()
        if method == "preloaded":
            # split by transformers itself, as from_pretrained(..., tp_plan="auto") leaves a model
            from transformers.distributed import DistributedConfig
            from transformers.distributed.utils import initialize_distributed_mesh
            config = DistributedConfig(tp_size=world)
            type(model).maybe_distribute_model(model, config, initialize_distributed_mesh(config)[1])
            assert model.tp_size == world
        else:
            kvtp.shard_model(model, method=method)
        engine = Engine(model, backend=backend, max_total_tokens=2048, prefill_chunk_size=32)
        layout = engine.adapter.layout
        got = _scenarios(engine)
        got["layout"] = (layout.tp, layout.rank, layout.method, layout.num_qo_heads,
                         layout.num_kv_heads)
        cfg = engine.cache.config
        got["cache_heads"] = (cfg.num_qo_heads, cfg.num_kv_heads)
        got["kv_shape"] = _kv_shape(engine)
        got["steps"] = engine.adapter.step
        got["preempt"] = _preempting(model, backend)
        res[method] = got
    if backend == "cuda":
        # whole-step graphs under TP (the backend's CPU mode re-runs a captured step on its
        # static buffers): the same tokens, every replayed step checked like an eager one
        model = make_model()
        kvtp.shard_model(model, method="integration")
        engine = Engine(model, backend=backend, max_total_tokens=2048, prefill_chunk_size=32,
                        graphs=True)
        got = {"greedy": engine.generate(make_prompts(), max_new_tokens=NEW),
               "graph_forwards": engine.stats.graph_forwards,
               "forwards": engine.stats.forwards, "checked": engine.adapter.step,
               "overlapped": engine.stats.overlapped_forwards}
        import torch
        picks = engine.adapter.greedy_async(torch.randn(2, VOCAB))
        # the picks stay where the logits are (the next step's input), read by the host later
        got["device_picks"] = torch.is_tensor(picks.tokens)
        got["picks_read"] = [int(t) for t in picks.result()[0]] == [int(t) for t in picks.tokens]
        adapter = engine.adapter
        honest = adapter.plan_digest

        def changed(cache, tokens, positions, rows):
            digest = honest(cache, tokens, positions, rows)
            # one rank's plan differs at a replayed decode step
            return digest + 1 if rank == 1 and cache.static_bucket is not None else digest
        adapter.plan_digest = changed
        got["mismatch"] = _error(lambda: engine.generate(make_prompts(), max_new_tokens=4))
        adapter.plan_digest = honest
        got["after"] = engine.generate(make_prompts(), max_new_tokens=NEW) == got["greedy"]
        res["graphs"] = got
    # biases on every projection: column-split ones are sliced, row-split ones added once
    biased = dict(attention_bias=True, mlp_bias=True, random_bias=True)
    res["hf_bias"] = [hf_greedy(make_model(**biased), p) for p in make_prompts()]
    for method in ("transformers", "integration"):
        model = make_model(**biased)
        kvtp.shard_model(model, method=method)
        engine = Engine(model, backend=backend, max_total_tokens=2048, prefill_chunk_size=32)
        res["bias_" + method] = engine.generate(make_prompts(), max_new_tokens=NEW)
    res["deterministic"] = deterministic(rank, world, backend)
    return res


def _kv_shape(engine) -> tuple:
    """The shape of one sequence's stored K on this rank (in inference mode, as the engine ran:
    the cuda backend's aux buffers were made there)."""
    import torch

    from kvcache import to_numpy
    cache = engine.cache
    cfg = cache.config
    cache.add_sequence(999)
    try:
        with torch.inference_mode():
            x = cache.from_numpy(np.ones((3, cfg.num_kv_heads, cfg.head_dim), np.float32))
            q = cache.from_numpy(np.ones((3, cfg.num_qo_heads, cfg.head_dim), np.float32))
            with cache.forward([999], [3]):
                for layer in range(cfg.num_layers):
                    cache.attention(layer, q, x, x)
            return tuple(to_numpy(cache.get_kv(999)[0]).shape)
    finally:
        cache.remove_sequence(999)


def _error(fn) -> tuple:
    try:
        fn()
    except Exception as exc:                    # the test checks the type by name
        return type(exc).__name__, str(exc)
    return None, ""


def errors(rank: int, world: int) -> dict:
    """Head counts tp does not divide, a family whose plan keeps the heads whole, a tp that
    is not the group's size, and ranks that plan differently (a different prompt token, a
    different max_new_tokens, a digest changed through the adapter's plan_digest, a different
    engine configuration): every rank must raise the same typed error at the same step."""
    import torch
    torch.set_num_threads(1)
    from kvcache.integrations.transformers import Engine
    res: dict = {}
    res["kv_heads"] = _error(lambda: Engine(make_model(num_key_value_heads=1), backend="reference"
                                            , tp=2))
    res["qo_heads"] = _error(lambda: Engine(make_model(num_attention_heads=3, num_key_value_heads=3,
                                                       hidden_size=48), backend="reference", tp=2))
    res["phi3"] = _error(lambda: Engine(make_model(family="phi3", hidden_size=64), backend="reference",
                                        tp=2))
    res["tp_size"] = _error(lambda: Engine(make_model(), backend="reference", tp=4))

    model = make_model()
    engine = Engine(model, backend="reference", max_total_tokens=1024, prefill_chunk_size=16, tp=2)
    prompts = make_prompts()
    want = engine.generate(prompts, max_new_tokens=4)
    mine = [list(p) for p in prompts]
    if rank == 1:
        mine[1][20] = (mine[1][20] + 1) % VOCAB        # second chunk of 16 of the second prompt
    res["prompt"] = _error(lambda: engine.generate(mine, max_new_tokens=4))
    res["prompt_empty"] = engine.cache.is_empty
    res["after_prompt"] = engine.generate(prompts, max_new_tokens=4) == want

    res["max_new"] = _error(lambda: engine.generate([prompts[0]], max_new_tokens=5 + rank))
    res["after_max_new"] = engine.generate(prompts, max_new_tokens=4) == want

    adapter = engine.adapter
    honest = adapter.plan_digest

    def changed(cache, tokens, positions, rows):
        digest = honest(cache, tokens, positions, rows)
        return digest + 1 if adapter.step == 2 else digest

    if rank == 1:
        adapter.plan_digest = changed                  # the test hook: one rank's plan differs
    res["hook"] = _error(lambda: engine.generate(prompts, max_new_tokens=4))
    adapter.plan_digest = honest
    res["after_hook"] = engine.generate(prompts, max_new_tokens=4) == want

    res["config"] = _error(lambda: Engine(model, backend="reference", page_size=16 * (1 + rank)))
    return res


def fail_on(rank: int, world: int, bad: int) -> int:
    """Rank ``bad`` raises; the others return their rank."""
    if rank == bad:
        raise ValueError(f"rank {rank} fails")
    return rank


def deterministic(rank: int, world: int, backend: str) -> dict:
    """``Engine(deterministic=True)`` over a model split by the integration: one prompt's greedy
    tokens and log-probabilities alone, and beside the other prompts with 7-token chunks; the
    same without the flag ("plain ...")."""
    import torch
    torch.set_num_threads(1)
    backend, why = _backend(backend)
    if backend is None:
        return {"skip": why}
    from kvcache.integrations import SamplingParams
    from kvcache.integrations import tp as kvtp
    from kvcache.integrations.transformers import Engine
    model = make_model()
    kvtp.shard_model(model, method="integration")
    prompts = make_prompts()
    params = SamplingParams(max_tokens=NEW, logprobs=True, ignore_eos=True)
    res = {}
    for det in (True, False):
        for what, batch, chunk in (("alone", prompts[1:2], 512), ("batched", prompts, 7)):
            engine = Engine(model, backend=backend, max_total_tokens=2048, deterministic=det,
                            prefill_chunk_size=chunk)
            tokens, lps = engine.generate(batch, params)
            at = batch.index(prompts[1])
            res[what if det else f"plain {what}"] = (tokens[at][0], lps[at][0])
    return res


def greedy_and_errors(rank: int, world: int, backend: str, methods: tuple) -> dict:
    """``greedy`` and then ``errors`` on the same two processes (one spawn: starting two ranks,
    each importing torch and transformers, is most of either's time on CI's 2 cores)."""
    return {"greedy": greedy(rank, world, backend, methods), "errors": errors(rank, world)}
