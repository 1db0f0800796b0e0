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
FAMILY_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                   num_key_value_heads=1)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=64, sliding_window=4096)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(hidden_size=192, intermediate_size=256, num_attention_heads=2,
                  num_key_value_heads=1)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
              dict(hidden_size=128, intermediate_size=192, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=256)),
}
FAMILIES = list(FAMILY_CONFIGS)
BACKENDS = ["reference", "cuda"]


def make_model(family: str, seed: int = 0, **overrides):
    """A float32 CPU model of ``family`` with seeded random weights (2 layers, small)."""
    config_name, model_name, kw = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_name)(**{**COMMON, **kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    return model


def hf_greedy(model, prompt, new_tokens=NEW_TOKENS) -> list:
    """transformers' own greedy generation (its own cache, sdpa attention)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             min_new_tokens=new_tokens)
    return out[0, len(prompt):].tolist()


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
