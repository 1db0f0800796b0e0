"""The demo's synthetic model: a ``ModelAdapter`` without weights or torch (``ToyAdapter``).

Per layer, q/k/v of a token are a row of a fixed random ``(vocab, Hq + 2*Hkv, D)`` table looked
up by its token id with the backend's own arrays and passed to ``attention_with_fused_qkv`` (the
cache applies RoPE). The logits of a token are the sum over layers of its attention outputs,
flattened to ``Hq * D`` and multiplied on the host, in float64, by a fixed random ``(Hq * D,
vocab)`` projection. So the next token depends on the attention over the token's whole
sequence, every layer, and nothing else: a request's tokens do not depend on what else ran in
its batches, which is what the replay check uses. The tables and the projection are a
deterministic function of the seed, rounded once to the cache dtype, the same on every backend.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from ..arrays import to_numpy
from ..config import CacheConfig
from ..integrations.adapter import ModelAdapter

SHAPES = {
    # name: (num_layers, num_qo_heads, num_kv_heads, head_dim)
    "tiny": (2, 4, 2, 32),
    "small": (4, 8, 2, 128),
    "llama-8b-heads": (4, 32, 8, 128),
}
VOCAB = 2048

__all__ = ["SHAPES", "VOCAB", "ToyAdapter"]


class ToyAdapter(ModelAdapter):
    """The toy model (see the module docstring) for ``kvcache.integrations.engine.Engine``.

    ``shape``: a key of ``SHAPES``; ``seed``: the tables' seed; ``dtype``: the cache dtype when
    the engine is given none. ``tamper(layer, out, tokens, positions) -> out``: a hook on every
    layer's attention output (tests plant a wrong value with it)."""

    family = "synthetic"

    def __init__(self, shape: str = "tiny", seed: int = 0, dtype: str = "float32",
                 vocab: int = VOCAB, tamper: Optional[Callable] = None):
        self.shape = shape
        self.num_layers, self.num_qo_heads, self.num_kv_heads, self.head_dim = SHAPES[shape]
        self.seed = seed
        self.dtype = dtype
        self.vocab_size = vocab
        self.tamper = tamper
        self.forwards = 0
        width = self.num_qo_heads + 2 * self.num_kv_heads
        rng = np.random.default_rng([seed, 0x3A0DE2])
        scale = np.ones((1, width, 1), np.float32)
        scale[:, :self.num_qo_heads] = 2.0          # peaked attention rather than uniform
        self.host_tables = [rng.standard_normal((vocab, width, self.head_dim), np.float32) * scale
                            for _ in range(self.num_layers)]
        k = self.num_qo_heads * self.head_dim
        # logits of about unit scale: a sampled request draws from several likely tokens
        self.host_proj = rng.standard_normal((k, vocab), np.float32) * np.float32(2.0 / np.sqrt(k))
        self._bound: dict = {}

    def describe(self, dtype: str) -> str:
        return (f"synthetic toy model ({self.shape}: {self.num_layers} layers, "
                f"{self.num_qo_heads}/{self.num_kv_heads} heads x {self.head_dim}, {dtype}), "
                f"no weights")

    def cache_config(self, *, dtype: Optional[str], page_size: int, max_total_tokens: int,
                     max_batch_size: int, prefill_chunk_size: int) -> CacheConfig:
        return CacheConfig(num_layers=self.num_layers, num_qo_heads=self.num_qo_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           page_size=page_size, max_total_tokens=max_total_tokens,
                           max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                           dtype=dtype or self.dtype, rope_mode="normal")

    def bind(self, cache) -> tuple:
        """``(tables on the cache's device in its dtype, the projection as float64 holding the
        values rounded to that dtype)``, made once per backend, device and dtype."""
        key = (cache.backend.name, str(cache.backend.device), cache.config.dtype)
        if key not in self._bound:
            tables = [cache.from_numpy(t) for t in self.host_tables]
            proj = np.asarray(to_numpy(cache.from_numpy(self.host_proj)), np.float64)
            self._bound[key] = (tables, proj)
        return self._bound[key]

    def check(self, cache) -> None:
        self.bind(cache)

    def forward(self, cache, tokens, positions, logit_rows):
        tables, proj = self.bind(cache)
        tokens = np.asarray(tokens, np.int64)
        rows = np.asarray(logit_rows, np.int64)
        ids = cache.from_numpy(tokens.astype(np.int32))
        index = cache.from_numpy(rows.astype(np.int32)) if len(rows) else None
        hidden = np.zeros((len(rows), self.num_qo_heads * self.head_dim), np.float64)
        for layer in range(self.num_layers):
            out = cache.attention_with_fused_qkv(layer, tables[layer][ids])
            if self.tamper is not None:
                out = self.tamper(layer, out, tokens, positions)
            if index is not None:
                hidden += np.asarray(to_numpy(out[index]), np.float64).reshape(len(rows), -1)
        self.forwards += 1
        return hidden @ proj

    def to_numpy(self, logits) -> np.ndarray:
        return np.asarray(logits, np.float64)
