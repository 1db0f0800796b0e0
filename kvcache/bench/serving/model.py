"""The serving bench's workload, model and roofline inputs: seeded prompts (``workload``), the
random-weight model (``build_model``), the bytes one decode step must read (``decode_bytes``) and
the device copy rate (``copy_rate``)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

MODELS = ("llama",)

LLAMA3_8B_LAYER: dict[str, Any] = dict(
    hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
    vocab_size=128256)
"""Llama-3-8B's layer shapes (the bench keeps ``--layers`` of them)."""
TINY: dict[str, Any] = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256,
    vocab_size=512)
"""Small dims for a CPU smoke run (``--tiny``)."""


def random_prompt_range(tiny: bool) -> tuple:
    """The random workload's prompt lengths (inclusive): 128-1,024 tokens, 8-32 with --tiny."""
    return (8, 32) if tiny else (128, 1024)


def workload(requests: int, prompt_range: tuple, vocab: int, seed: int) -> list:
    """``requests`` prompts of uniformly random length in ``prompt_range`` (inclusive) and
    uniformly random token ids in ``[1, vocab)``, from ``seed``."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_range[0], prompt_range[1] + 1, size=requests)
    return [rng.integers(1, vocab, size=int(n)).tolist() for n in lengths]


def build_model(model: str, layers: int, tiny: bool, device: str, dtype: str, seed: int):
    """A randomly initialised (``seed``) ``*ForCausalLM`` of ``model``'s family with the
    Llama-3-8B layer shapes (``tiny``: ``TINY``), ``layers`` layers, in ``dtype`` on ``device``;
    no EOS token, so every request produces exactly the tokens it asks for."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    if model not in MODELS:
        raise ValueError(f"--model {model!r}: the serving bench knows {', '.join(MODELS)}")
    dims = TINY if tiny else LLAMA3_8B_LAYER
    cfg = LlamaConfig(**dims, num_hidden_layers=layers, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                      eos_token_id=None, bos_token_id=None, pad_token_id=0,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    before = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        with torch.device(device):
            net = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(before)
    net.generation_config.eos_token_id = None
    net.generation_config.pad_token_id = 0
    return net.eval()


def decode_bytes(net, batch: int, context: float) -> dict:
    """Bytes one decode step of ``batch`` sequences of mean length ``context`` must read: every
    weight once (the input embedding only for the batch's rows) and each sequence's K and V."""
    cfg = net.config
    emb = net.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    weights += batch * emb.shape[1] * emb.element_size() - emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = (batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim
          * emb.element_size())
    return {"weight_bytes": int(weights), "kv_bytes": int(kv)}


def copy_rate(device: str, nbytes: int = 1 << 30, repeat: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting what is read and what is written
    (``2 * nbytes`` per copy), best of ``repeat`` copies of ``nbytes``."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeat + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    import torch
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
