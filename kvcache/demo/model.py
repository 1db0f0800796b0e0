"""A stand-in for a transformer's attention inputs: per layer, q/k/v are a small fixed random
projection of the token ids (embedding table times one fused QKV matrix), computed with the
backend's own arrays. No weights to download; outputs are a deterministic function of the seed.

Because q/k/v depend only on token ids (RoPE adds the position inside the cache), the attention
output of a token depends only on its own sequence's history, which is what the replay check uses.
"""

from __future__ import annotations

import numpy as np

import kvcache

from .workload import VOCAB


class ToyModel:
    def __init__(self, config: kvcache.CacheConfig, seed: int, embed_dim: int = 64):
        c = self.config = config
        rng = np.random.default_rng([seed, 0x3A0DE1])
        self.width = c.num_qo_heads + 2 * c.num_kv_heads
        self.embed = rng.standard_normal((VOCAB, embed_dim)).astype(np.float32)
        scale = embed_dim ** -0.5
        self.weights = [(rng.standard_normal((embed_dim, self.width * c.head_dim)) * scale)
                        .astype(np.float32) for _ in range(c.num_layers)]
        # q a little larger than k/v so that attention is peaked rather than uniform
        for w in self.weights:
            w[:, :c.num_qo_heads * c.head_dim] *= 2.0
        self._rounded = False

    def bind(self, cache: kvcache.PagedKVCache) -> "BoundModel":
        """The model's weights on the cache's device, in the cache dtype."""
        if not self._rounded:
            # round the host copy to the storage dtype once, so host (replay) and device compute
            # from identical weights
            self.embed = kvcache.to_numpy(cache.from_numpy(self.embed)).astype(np.float32)
            self.weights = [kvcache.to_numpy(cache.from_numpy(w)).astype(np.float32) for w in self.weights]
            self._rounded = True
        return BoundModel(self, cache)


class BoundModel:
    def __init__(self, model: ToyModel, cache: kvcache.PagedKVCache):
        self.model, self.cache = model, cache
        probe = cache.from_numpy(np.zeros(1, np.float32))
        # numpy arrays: compute on the host in float32 and convert once (numpy's bfloat16 matmul
        # is emulated and very slow); other array libraries compute on their device
        self.host = isinstance(probe, np.ndarray)
        if not self.host:
            self.embed = cache.from_numpy(model.embed)
            self.weights = [cache.from_numpy(w) for w in model.weights]

    def tokens(self, token_ids: np.ndarray):
        """Token ids as the handle ``qkv`` takes (a device int32 array, or host ids)."""
        ids = np.asarray(token_ids, np.int32)
        return ids if self.host else self.cache.from_numpy(ids)

    def qkv(self, ids, layer: int):
        """Fused (T, Hq + 2*Hkv, D) in the cache dtype, as ``attention_with_fused_qkv`` takes it."""
        m, c = self.model, self.model.config
        if self.host:
            x = m.embed[ids] @ m.weights[layer]
            return self.cache.from_numpy(x.reshape(len(ids), m.width, c.head_dim))
        x = self.embed[ids] @ self.weights[layer]
        return x.reshape(x.shape[0], m.width, c.head_dim)
