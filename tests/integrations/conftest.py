"""Small random-weight transformers models of each supported family, and the reference tokens
of transformers' own generation (computed once per family)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvcache  # noqa: E402
from kvcache.backend import Capabilities  # noqa: E402

from engine_cases import LENGTHS, NEW_TOKENS, VOCAB, make_prompts  # noqa: E402,F401

COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=1024,
              initializer_range=0.15, bos_token_id=None, eos_token_id=None, pad_token_id=0,
              tie_word_embeddings=False)
_GQA = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# name -> (model_type, config keywords): every family of issue 27, each as small as it goes,
# with what makes its attention its own switched on hard enough to move the logits
FAMILY_CONFIGS = {
    "llama": ("llama", dict(_GQA, head_dim=64)),
    "llama3": ("llama", dict(_GQA, head_dim=32, rope_theta=500000.0, rope_scaling=LLAMA3)),
    "qwen2": ("qwen2", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1)),
    "qwen3": ("qwen3", dict(_GQA, head_dim=32)),                       # q/k RMSNorm
    "qwen3_moe": ("qwen3_moe", dict(_GQA, head_dim=32, moe_intermediate_size=64, num_experts=4,
                                    num_experts_per_tok=2)),
    "mistral": ("mistral", dict(_GQA, head_dim=64, sliding_window=4096)),
    "mixtral": ("mixtral", dict(_GQA, head_dim=32, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("phi3", dict(hidden_size=192, intermediate_size=256, num_attention_heads=2,
                          num_key_value_heads=1)),                     # head_dim 96
    "gemma": ("gemma", dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=256)),
    # logit soft-capping, query_pre_attn_scalar, sliding and full layers
    "gemma2": ("gemma2", dict(_GQA, head_dim=32, sliding_window=32, attn_logit_softcapping=3.0,
                              query_pre_attn_scalar=24)),
    "gemma3_text": ("gemma3_text", dict(_GQA, head_dim=32, sliding_window=32,
                                        layer_types=["sliding_attention", "full_attention"])),
    "granite": ("granite", dict(_GQA, attention_multiplier=0.05)),     # its own sm_scale
    "olmo2": ("olmo2", dict(_GQA)),                                    # q/k RMSNorm over heads
    "cohere": ("cohere", dict(_GQA)),                                  # interleaved RoPE
    "glm4": ("glm4", dict(_GQA, head_dim=32, eos_token_id=None)),      # partial interleaved RoPE
    "starcoder2": ("starcoder2", dict(_GQA)),
    "smollm3": ("smollm3", dict(_GQA)),                                # layers without RoPE
    # learned sinks, sliding and full layers, YaRN
    "gpt_oss": ("gpt_oss", dict(_GQA, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                                sliding_window=32)),
    # MLA in expanded form: q/k head dim 48 (32 + 16 rotary), values 32
    "deepseek_v3": ("deepseek_v3", dict(_GQA, num_key_value_heads=4, moe_intermediate_size=64,
                                        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
                                        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4,
                                        num_experts_per_tok=2, n_group=1, topk_group=1,
                                        first_k_dense_replace=1)),
}
FAMILIES = list(FAMILY_CONFIGS)
BACKENDS = ["reference", "cuda"]


def make_model(family: str, seed: int = 0, **overrides):
    """A float32 CPU model of ``family`` (a ``FAMILY_CONFIGS`` name) with seeded random weights
    (2 layers, small), its attention the exact "eager" one (transformers' sdpa path refuses
    soft-capping)."""
    model_type, kw = FAMILY_CONFIGS[family]
    config = transformers.AutoConfig.for_model(model_type, **{**COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family == "gpt_oss":     # learned sinks large enough to take a share of every row
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.to(torch.float32).eval()


def hf_greedy(model, prompt, new_tokens=NEW_TOKENS) -> list:
    """transformers' own greedy generation (its own cache, sdpa attention)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


def random_hybrid(model_type: str, config: dict, seed: int = 0, draw_d: bool = True):
    """A float32 CPU ``model_type`` model of ``config`` (``AutoConfig.for_model``'s keywords)
    with seeded random weights and eager attention. Its mixers' ``dt_bias`` (and ``D`` where
    ``draw_d``), which transformers initializes to ones, are drawn from N(0, 1), so that every
    head's step size (and skip) differ."""
    cfg = transformers.AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "A_log"):
                m.dt_bias.normal_(0.0, 1.0)
                if draw_d:
                    m.D.normal_(0.0, 1.0)
    return model.to(torch.float32).eval()


def chunked_logits(model, prompt: np.ndarray, chunks, page_size: int = 4) -> np.ndarray:
    """The ``TransformersAdapter``'s logits for every position of ``prompt`` prefilled in
    ``chunks`` (their sizes, in order) as one sequence on the reference backend."""
    from kvcache.integrations.transformers import TransformersAdapter, cache_config
    adapter = TransformersAdapter(model)
    cache = kvcache.PagedKVCache(cache_config(model, page_size=page_size, max_total_tokens=64,
                                              max_batch_size=1), backend="reference")
    cache.add_sequence(0)
    rows, at = [], 0
    with adapter.session(cache):
        for n in chunks:
            with adapter.step_context(cache), cache.forward([0], [n]):
                logits = adapter.forward(cache, prompt[at:at + n].astype(np.int64),
                                         np.arange(at, at + n, dtype=np.int64),
                                         np.arange(n, dtype=np.int64))
            rows.append(logits.numpy())
            at += n
    return np.concatenate(rows)


def assert_state_engine_refusals(model, family: str) -> dict:
    """An Engine on ``model`` (a ``family`` model with state layers) is refused by name with
    ``graphs``, ``offload`` or ``deterministic`` on; returns the Engine options that were
    accepted (reference backend, page 4, 256 tokens) for the caller's further checks."""
    from kvcache.integrations.transformers import Engine
    kw = dict(backend="reference", page_size=4, max_total_tokens=256)
    for bad in ("graphs", "offload", "deterministic"):
        with pytest.raises(kvcache.UnsupportedFeatureError,
                           match=f"{bad}=True with the {family} model's state layers"):
            Engine(model, **{**kw, bad: True})
    return kw


def assert_mixer_call_refusals(model, mixer, *bad_keywords, own_cache: bool = True) -> None:
    """``mixer`` (a state layer's module of ``model``, hidden size 64) called inside a forward
    of the cache with a padding mask, with transformers' own cache beside the cache's (its
    second positional parameter; ``own_cache``), or with each of ``bad_keywords`` (name,
    value) is refused by name, and the sequence stays empty."""
    from kvcache.integrations.transformers import TransformersAdapter, cache_config
    cache = kvcache.PagedKVCache(cache_config(model, page_size=4, max_total_tokens=64,
                                              max_batch_size=1), backend="reference")
    cache.add_sequence(0)
    adapter = TransformersAdapter(model)
    x = torch.zeros(1, 3, 64)
    calls = [("padding mask", lambda: mixer(hidden_states=x, kvcache=cache,
                                            attention_mask=torch.tensor([[0, 1, 1]]))),
             ("own cache", lambda: mixer(x, transformers.DynamicCache(config=model.config),
                                         kvcache=cache))][:2 if own_cache else 1]
    calls += [(f"not implement '{name}'", lambda kw={name: value}: mixer(x, kvcache=cache, **kw))
              for name, value in bad_keywords]
    with adapter.session(cache), adapter.step_context(cache):
        for match, call in calls:
            with pytest.raises(kvcache.UnsupportedFeatureError, match=match):
                with cache.forward([0], [3]):
                    call()
    assert cache.sequence_length(0) == 0


def hf_logits(model, tokens) -> np.ndarray:
    """transformers' own forward (no cache) logits, (len(tokens), vocab) float64."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


@functools.lru_cache(maxsize=None)
def family_case(family: str):
    """(model, prompts, greedy tokens per prompt, first-step logits per prompt), once."""
    model = make_model(family, seed=FAMILIES.index(family))
    prompts = make_prompts()
    greedy = [hf_greedy(model, p) for p in prompts]
    first = [hf_logits(model, p)[-1] for p in prompts]
    return model, prompts, greedy, first


def own_loop_greedy(adapter, cache, prompts, new: int, chunk: int = 16, each_step=None) -> list:
    """Greedy tokens of ``prompts`` through ``adapter.forward`` in a loop of one's own (a user
    driving the cache without the Engine): every prompt added as sequence ``i`` of ``cache``,
    prefilled in chunks of ``chunk`` tokens together, then decoded together until each has
    ``new`` tokens; ``each_step(cache)`` after every forward. Returns each prompt's tokens
    (at least ``new``)."""
    seqs = list(range(len(prompts)))
    tokens = [list(p) for p in prompts]
    done = [0] * len(prompts)                # tokens of each in the cache
    for s in seqs:
        cache.add_sequence(s)
    out: list = [[] for _ in seqs]
    with adapter.session(cache):
        while min(len(o) for o in out) < new:
            lens = [min(chunk, len(t) - d) for t, d in zip(tokens, done)]
            batch = [s for s in seqs if lens[s] > 0]
            sizes = [lens[s] for s in batch]
            flat = np.concatenate([tokens[s][done[s]:done[s] + lens[s]] for s in batch])
            pos = np.concatenate([np.arange(done[s], done[s] + lens[s]) for s in batch])
            ends = np.cumsum(sizes) - 1
            rows = [e for s, e in zip(batch, ends) if done[s] + lens[s] == len(tokens[s])]
            with adapter.step_context(cache), cache.forward(batch, sizes):
                logits = adapter.forward(cache, flat.astype(np.int64), pos.astype(np.int64),
                                         np.asarray(rows, np.int64))
            picks = adapter.greedy(logits, logprobs=False)[0] if rows else []
            wanting = [s for s, e in zip(batch, ends) if e in rows]
            for s in batch:
                done[s] += lens[s]
            for s, t in zip(wanting, picks):
                out[s].append(int(t))
                tokens[s].append(int(t))
            if each_step is not None:
                each_step(cache)
    return out


def backend_or_skip(name: str, monkeypatch, head_dim: int):
    """The (backend, device) to run ``name`` on here, or skip: not installed / unavailable, or
    lacking the head_dim (by capability)."""
    if name == "cuda":
        monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")     # the cuda backend's CPU test mode
    rows = {r["name"]: r for r in kvcache.list_backends("cpu")}
    row = rows.get(name)
    if row is None or not row["available"]:
        pytest.skip(f"backend {name!r} not available: {row['reason'] if row else 'not installed'}")
    caps = row["class"].capabilities
    if head_dim not in caps.head_dims:
        pytest.skip(f"{name}: {Capabilities.reason('head_dims')}")
    return name, "cpu"


def model_needs_or_skip(name: str, model):
    """Skip, naming the capability, when backend ``name`` lacks what ``model``'s attention needs
    (soft-capping, sinks, a value head dim of its own, windows)."""
    from kvcache.integrations.transformers import cache_config, sliding_windows
    caps = {r["name"]: r["class"] for r in kvcache.list_backends("cpu")}[name].capabilities
    cfg = cache_config(model)
    needs = []
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        needs.append("logit_softcap")
    if model.config.model_type == "gpt_oss":
        needs.append("attention_sinks")
    if sliding_windows(model.config):
        needs.append("window_left")
    for cap in needs:
        if not getattr(caps, cap, False):
            pytest.skip(f"{name}: {Capabilities.reason(cap)}")
    if cfg.head_dim_v != cfg.head_dim and cfg.head_dim_v not in caps.head_dims_v:
        pytest.skip(f"{name}: {Capabilities.reason('head_dims_v')}")


def window_left_reason() -> str:
    """The skip reason of a backend without per-query sliding windows."""
    fields = {f.name for f in __import__('dataclasses').fields(Capabilities)}
    if "window_left" in fields:
        return Capabilities.reason("window_left")
    return ("capability 'window_left' not declared (per-query sliding-window attention, "
            "FlashInfer's window_left)")


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # these models are tiny: torch's thread pool only adds contention (several times slower on
    # a loaded machine); restored afterwards for the other test folders
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
