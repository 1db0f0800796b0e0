"""``MlxLmAdapter``: an mlx-lm model as the engine's ``ModelAdapter`` (its forward, own-attention
mode included; re-exported by the package)."""

from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import numpy as np

from ...backend import Capabilities
from ...config import CacheConfig
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..engine import ModelAdapter
from .model import _eos_ids, _family, layer_kinds, model_caches
from .protocol import LayerCache, _Forward, _to_cache
from .routing import _run, cache_config, describe, route

mx = require("mlx.core", "mlx-lm")


# ---------------------------------------------------------------------- engine adapter
class MlxLmAdapter(ModelAdapter):
    """An mlx-lm model as the engine's model: any model whose attention reaches the cache
    through mlx-lm's cache protocol (``describe`` checks it at construction) and that keeps no
    other state than LFM2's short convolutions, the Mamba-2 mixers of Granite-4.0-H,
    Nemotron-H, Falcon-H1 and Mamba-2, Mamba-1's mixers or Qwen3-Next's gated DeltaNet
    layers, which run on the cache's state slots (``state_layers``; a Mamba-2 or Mamba has no
    attention: every layer a state layer)."""

    def __init__(self, model, tokenizer=None, eos_token_ids: Optional[Sequence[int]] = None):
        self.model = model
        self.family = _family(model)
        self.description = describe(model)
        self.vocab_size = self.description.vocab_size
        self.windows = dict(self.description.windows)
        self.states = dict(self.description.states)
        """``{layer: State}``: the model's state layers (LFM2's short convolutions,
        the Mamba-2 mixers of Granite-4.0-H, Nemotron-H, Falcon-H1 and Mamba-2, Mamba-1's
        mixers, Qwen3-Next's gated DeltaNet)."""
        self._forward = _Forward(model, self.windows, self.description.num_layers,
                                 own_attention=self.description.own_attention,
                                 states=self.states)
        self._caches = model_caches(model, [LayerCache(i, self._forward)
                                            for i in range(self.description.num_layers)])
        if eos_token_ids is not None:
            ids = [eos_token_ids] if isinstance(eos_token_ids, (int, np.integer)) else eos_token_ids
            self._eos = tuple(sorted({int(t) for t in ids}))
        else:
            self._eos = _eos_ids(model, tokenizer)

    def cache_config(self, *, dtype, page_size, max_total_tokens, max_batch_size,
                     prefill_chunk_size) -> CacheConfig:
        return cache_config(self.model, dtype=dtype, page_size=page_size,
                            max_total_tokens=max_total_tokens, max_batch_size=max_batch_size,
                            prefill_chunk_size=prefill_chunk_size, description=self.description)

    def layer_kinds(self) -> dict:
        return layer_kinds(self.windows)

    def state_layers(self) -> dict:
        return dict(self.states)

    def default_device(self) -> Optional[str]:
        return "gpu" if mx.default_device() == mx.gpu else "cpu"

    def eos_token_ids(self) -> tuple:
        return self._eos

    def check(self, cache) -> None:
        if cache.config.rope_mode != "none":
            raise InvalidArgumentError(
                f"the cache has rope_mode={cache.config.rope_mode!r}, but an mlx-lm model "
                f"applies its own RoPE: the cache would rotate q and k a second time")
        d = self.description
        if d.sinks and not getattr(cache.capabilities, "attention_sinks", False):
            raise UnsupportedFeatureError(
                f"the {self.family} model passes learned attention sinks to "
                f"scaled_dot_product_attention (layers {list(d.sinks)}), and backend "
                f"{cache.backend.name!r} does not support them: "
                f"{Capabilities.reason('attention_sinks')}")
        if cache.config.dtype != d.dtype and cache.backend.is_native(mx.zeros(1)):
            raise UnsupportedFeatureError(
                f"the model computes in {d.dtype} but the cache stores {cache.config.dtype}; the "
                f"{cache.backend.name!r} backend takes the model's arrays as they are, so the "
                f"dtypes must match (pass dtype=None)")

    def batch_invariant_ops(self):
        """``MlxBatchInvariant``: the model's linear layers in fixed row blocks
        (``kvcache.integrations.mlx_lm.invariant``); a model whose products it cannot see
        (own attention, MoE experts, a family not proven) is refused
        (``UnsupportedFeatureError``)."""
        from .invariant import MlxBatchInvariant, unsupported
        why = unsupported(self.model, self.description)
        if why is not None:
            raise UnsupportedFeatureError(f"deterministic=True with this mlx-lm model: {why}; "
                                          f"pass deterministic=False")
        return MlxBatchInvariant(self.model)

    @contextlib.contextmanager
    def session(self, cache):
        """mlx-lm's ``scaled_dot_product_attention`` routes ``LayerCache`` calls (``route``)."""
        route(self.model)
        try:
            yield
        finally:
            self._forward.end()

    def forward(self, cache, tokens, positions, logit_rows):
        f = self._forward
        f.begin(cache, positions)
        inputs = tokens if isinstance(tokens, mx.array) else mx.array(np.asarray(tokens, np.int32))
        inputs = inputs.astype(mx.int32).reshape(-1)
        try:
            if f.own_attention:
                logits, hidden = self._forward_own(cache, inputs, positions, logit_rows)
            else:
                rows = mx.array(np.asarray(logit_rows, np.int32))
                logits, hidden = _run(self.model, inputs.reshape(-1, 1), self._caches, rows)
                f.check_all_attended()
        finally:
            f.end()
        if not len(logit_rows):
            mx.eval(hidden)              # the cache holds this forward's K/V once evaluated
            return None
        mx.eval(logits)
        return logits

    def _forward_own(self, cache, inputs, positions, logit_rows):
        """An own-attention model over the open forward: one model call per sequence (its
        new tokens as one batch row, its history from the pages), then each layer's new K/V
        of all sequences into the cache (``append_kv``). Returns ``(logits of logit_rows,
        hidden states)``."""
        f, plan = self._forward, cache.open_plan
        pos = np.asarray(positions, np.int64).reshape(-1)
        rows = np.asarray(logit_rows, np.int64).reshape(-1)
        picked, hidden, at = [], [], 0
        for seq_id, n in zip(plan.seq_ids, np.asarray(plan.append_lengths).tolist()):
            f.seq_id, f.start = int(seq_id), int(pos[at])
            f.fetched = [0] * len(f.fetched)
            mine = rows[(rows >= at) & (rows < at + n)] - at
            logits, h = _run(self.model, inputs[at:at + n][None], self._caches,
                             mx.array(mine.astype(np.int32)), axis=1)
            f.check_all_fetched()
            picked.append(logits)
            hidden.append(h)
            at += n
        for layer, new in enumerate(f.new):
            k = mx.concatenate([kv[0][0].transpose(1, 0, 2) for kv in new])
            v = mx.concatenate([kv[1][0].transpose(1, 0, 2) for kv in new])
            cache.append_kv(layer, _to_cache(cache, k), _to_cache(cache, v))
        if not len(rows):
            return None, hidden
        logits = mx.concatenate(picked)              # in row order: the sequences' rows sorted
        order = np.searchsorted(np.sort(rows), rows)
        return logits[mx.array(order.astype(np.int32))], hidden

    def to_numpy(self, logits) -> np.ndarray:
        return np.asarray(logits.astype(mx.float32)).astype(np.float64)
