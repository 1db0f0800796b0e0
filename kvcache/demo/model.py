"""A stand-in for a transformer's attention inputs: per layer, q/k/v are a small fixed random
projection of the token ids, i.e. a random (vocab, Hq + 2*Hkv, D) table per layer looked up with
the backend's own arrays. No weights to download; outputs are a deterministic function of the
seed, and the table holds the same values (rounded once to the cache dtype) on every backend.

Because q/k/v depend only on token ids (RoPE adds the position inside the cache), the attention
output of a token depends only on its own sequence's history, which is what the replay check uses.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

import kvcache

from .workload import VOCAB


class ToyModel:
    def __init__(self, config: kvcache.CacheConfig, seed: int):
        c = self.config = config
        self.width = c.num_qo_heads + 2 * c.num_kv_heads
        self.seed = seed
        self._host: Optional[list] = None

    def host_tables(self) -> list:
        """Per layer, the (VOCAB, Hq + 2*Hkv, D) float32 table: q entries have standard deviation
        2, k/v 1, so that attention is peaked rather than uniform."""
        if self._host is None:
            c = self.config
            rng = np.random.default_rng([self.seed, 0x3A0DE1])
            scale = np.ones((1, self.width, 1), np.float32)
            scale[:, :c.num_qo_heads] = 2.0
            self._host = [rng.standard_normal((VOCAB, self.width, c.head_dim), np.float32) * scale
                          for _ in range(c.num_layers)]
        return self._host

    def bind(self, cache: kvcache.PagedKVCache) -> "BoundModel":
        """The model's tables on the cache's device, in the cache dtype."""
        return BoundModel(self, cache)


class BoundModel:
    def __init__(self, model: ToyModel, cache: kvcache.PagedKVCache):
        self.model, self.cache = model, cache
        self.tables = [cache.from_numpy(t) for t in model.host_tables()]

    def tokens(self, token_ids: np.ndarray):
        """Token ids as a device int32 array."""
        return self.cache.from_numpy(np.asarray(token_ids, np.int32))

    def qkv(self, ids, layer: int):
        """Fused (T, Hq + 2*Hkv, D) in the cache dtype, as ``attention_with_fused_qkv`` takes it."""
        return self.tables[layer][ids]

    def rows(self, array, index: np.ndarray):
        """``array[index]`` (a gathered copy) for a host index array."""
        return array[self.cache.from_numpy(np.asarray(index, np.int32))]
