"""mlx-lm models on a ``PagedKVCache`` (extra ``kvcache[mlx-lm]``).

``Engine(model, ...)`` runs continuous-batching generation (see
``kvcache.integrations.engine``) of an mlx-lm model (``mlx_lm.load`` or a model class of
``mlx_lm.models.llama`` / ``qwen2`` / ``phi3`` / ``gemma``; mlx-lm loads Mistral checkpoints as
``llama`` with ``model_type="mistral"``) on the metal backend (Apple GPU, or MLX's CPU device
with ``device="cpu"``), replacing mlx-lm's own KV cache with the paged cache.

How the model reaches the cache: mlx-lm's attention modules rotate q/k with a *scalar* offset
(``cache.offset``), which cannot express the per-token positions of a batch packed into one
row. For the duration of ``generate`` each decoder layer's ``self_attn`` is therefore replaced
by a ``CacheAttention`` that runs the module's own projections (``q_proj``/``k_proj``/
``v_proj`` or the fused ``qkv_proj``), the module's own ``rope`` at per-token positions (each
token as its own batch row with its position as the row's offset: the same RoPE function,
scaling included) and ``o_proj``; attention itself is ``cache.attention(layer, q, k, v)``. The
original modules are put back afterwards. The cache uses ``rope_mode="none"``.

Limits: the attention module must have those projections, ``rope``, ``scale``, ``n_heads`` and
``n_kv_heads`` and nothing else in its attention (no q/k norm, softcap or sinks: such families
are not listed in ``FAMILIES``). Sliding-window layers (``layer_types`` entries
``"sliding_attention"`` with ``sliding_window``, as mlx-lm's llama defines them: a query sees
the previous ``sliding_window`` positions, itself included) need the backend capability
``window_left`` once a sequence outgrows the window. A model without ``layer_types`` (e.g. a
Mistral config with only ``sliding_window``) is full attention in mlx-lm, and here too.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np

from . import require
from .engine import Engine as _Engine
from .engine import ModelAdapter
from ..arrays import to_numpy
from ..config import CacheConfig
from ..errors import InvalidArgumentError, UnsupportedFeatureError

mx = require("mlx.core", "mlx-lm")
mlx_lm = require("mlx_lm", "mlx-lm", "0.32")

__all__ = ["CacheAttention", "Engine", "FAMILIES", "MlxLmAdapter", "cache_config",
           "sliding_windows"]

FAMILIES = {
    "llama": ("mlx_lm.models.llama", "grouped-query attention; layers listed as "
              "'sliding_attention' need the backend capability 'window_left' for sequences "
              "longer than sliding_window"),
    "mistral": ("mlx_lm.models.llama", "as llama (mlx-lm runs Mistral on its llama model)"),
    "qwen2": ("mlx_lm.models.qwen2", "q/k/v projection bias (inside the model)"),
    "phi3": ("mlx_lm.models.phi3", "fused qkv_proj; head_dim 96 in the backend's head_dims"),
    "gemma": ("mlx_lm.models.gemma", "head_dim 256 with one KV head (the backend's head_dims)"),
}
"""``model_type -> (mlx-lm module of the model class, what the family needs of a backend)``."""

_DTYPES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}
_NEEDED = ("rope", "o_proj", "scale", "n_heads", "n_kv_heads")


# ---------------------------------------------------------------------- model description
def _args(model):
    args = getattr(model, "args", None)
    if args is None:
        raise UnsupportedFeatureError(f"{type(model).__name__} has no .args: not an mlx-lm model")
    return args


def _layers(model) -> list:
    return list(model.layers)


def _head_dim(model) -> int:
    attn = _layers(model)[0].self_attn
    if hasattr(attn, "head_dim"):
        return int(attn.head_dim)
    args = _args(model)
    return int(getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads)


def _dtype(model) -> str:
    embed = model.model.embed_tokens
    dtype = embed.scales.dtype if hasattr(embed, "scales") else embed.weight.dtype
    if dtype not in _DTYPES:
        raise UnsupportedFeatureError(f"the cache stores float32, float16 or bfloat16, not {dtype}")
    return _DTYPES[dtype]


def sliding_windows(model) -> dict:
    """``{layer index: sliding_window}`` for the model's sliding-window layers (empty: none):
    the layers mlx-lm builds with ``use_sliding`` (``layer_types`` ``"sliding_attention"``)."""
    window = getattr(_args(model), "sliding_window", None)
    if window is None:
        return {}
    return {i: int(window) for i, layer in enumerate(_layers(model))
            if getattr(layer, "use_sliding", False)}


def cache_config(model, *, dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: int = 65536, max_batch_size: int = 64,
                 prefill_chunk_size: int = 2048) -> CacheConfig:
    """A ``CacheConfig`` for an mlx-lm model: layers, query/KV heads and head_dim from the
    model, ``rope_mode="none"`` (the model rotates q and k itself), ``dtype`` (None: the
    model's embedding dtype) and the given sizes."""
    attn = _layers(model)[0].self_attn
    args = _args(model)
    return CacheConfig(
        num_layers=len(_layers(model)), num_qo_heads=int(attn.n_heads),
        num_kv_heads=int(attn.n_kv_heads), head_dim=_head_dim(model), page_size=page_size,
        max_batch_size=max_batch_size, max_total_tokens=max_total_tokens,
        prefill_chunk_size=prefill_chunk_size,
        dtype=dtype if dtype is not None else _dtype(model), rope_mode="none",
        rope_theta=float(getattr(args, "rope_theta", None) or 10000.0))


# ---------------------------------------------------------------------- attention
class _Context:
    """What every layer's ``CacheAttention`` reads during one forward."""

    def __init__(self):
        self.cache = None
        self.positions = None          # (T,) int32 mx array: each token's position
        self.last_position = -1        # the largest of them
        self.windows: dict = {}


class CacheAttention:
    """Stands in for one mlx-lm attention module during ``generate``: the module's own
    projections and RoPE (at per-token positions), attention through the cache.

    Called as the module is, ``(x, mask=None, cache=None)`` with ``x`` (1, T, hidden); the mask
    and mlx-lm cache are ignored (the paged cache knows each token's sequence). Returns
    (1, T, hidden)."""

    def __init__(self, module, layer: int, context: _Context):
        self.module, self.layer, self.context = module, layer, context

    def _qkv(self, x):
        m = self.module
        if hasattr(m, "qkv_proj"):
            qkv = m.qkv_proj(x)
            q_size = m.n_heads * m.head_dim
            return mx.split(qkv, [q_size, q_size + m.n_kv_heads * m.head_dim], axis=-1)
        return m.q_proj(x), m.k_proj(x), m.v_proj(x)

    def __call__(self, x, mask=None, cache=None):
        m, ctx = self.module, self.context
        kv = ctx.cache
        if kv is None:
            raise InvalidArgumentError(
                f"layer {self.layer}: the model's attention is routed to a kvcache cache, but "
                f"no forward is open (call it through Engine.generate)")
        B, T, _ = x.shape
        if B != 1:
            raise InvalidArgumentError(
                f"the batch must be packed into one row (inputs of shape (1, T)), got {B} rows")
        q, k, v = self._qkv(x)
        # each token is its own batch row so RoPE's per-row offset is the token's position
        q = m.rope(q.reshape(T, m.n_heads, 1, -1), offset=ctx.positions).reshape(T, m.n_heads, -1)
        k = m.rope(k.reshape(T, m.n_kv_heads, 1, -1), offset=ctx.positions).reshape(T, m.n_kv_heads, -1)
        v = v.reshape(T, m.n_kv_heads, -1)
        extra = {}
        window = ctx.windows.get(self.layer)
        if window is not None:
            if getattr(kv.capabilities, "window_left", False):
                extra["window_left"] = window - 1
            elif ctx.last_position >= window:
                raise _window_unsupported(kv, self.layer, window)
        out = kv.attention(self.layer, _to_cache(kv, q), _to_cache(kv, k), _to_cache(kv, v),
                           sm_scale=float(m.scale), **extra)
        if not isinstance(out, mx.array):
            out = mx.array(np.ascontiguousarray(to_numpy(out)))
        return m.o_proj(out.astype(x.dtype).reshape(1, T, -1))


def _to_cache(cache, x):
    """(T, H, D) mx array -> the cache backend's native array in the cache dtype."""
    if cache.backend.is_native(x):
        return x
    return cache.from_numpy(np.asarray(x.astype(mx.float32)))


def _window_unsupported(cache, layer: int, window: int) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"backend {cache.backend.name!r} does not support per-query sliding-window attention "
        f"(capability 'window_left' not declared): layer {layer} of the model attends to the "
        f"previous sliding_window={window} positions only")


# ---------------------------------------------------------------------- engine adapter
class MlxLmAdapter(ModelAdapter):
    """An mlx-lm model (a supported family) as the engine's model."""

    def __init__(self, model):
        args = getattr(model, "args", None)
        family = getattr(args, "model_type", None)
        module = type(model).__module__
        if family not in FAMILIES or FAMILIES[family][0] != module:
            raise UnsupportedFeatureError(
                f"model family {family!r} ({module}.{type(model).__name__}) is not supported by "
                f"the kvcache Engine for mlx-lm; supported: "
                + ", ".join(f"{f} ({m})" for f, (m, _) in sorted(FAMILIES.items()))
                + ". A new family needs an attention module whose q/k/v projections, rope and "
                  "o_proj CacheAttention can run (see docs/integrations.md)")
        for i, layer in enumerate(_layers(model)):
            attn = getattr(layer, "self_attn", None)
            missing = [a for a in _NEEDED if attn is None or not hasattr(attn, a)]
            if attn is not None and not hasattr(attn, "qkv_proj"):
                missing += [a for a in ("q_proj", "k_proj", "v_proj") if not hasattr(attn, a)]
            if missing:
                raise UnsupportedFeatureError(
                    f"layer {i} of the {family} model has no {', '.join(missing)} on its "
                    f"self_attn: CacheAttention cannot run it")
        self.model = model
        self.family = family
        self.vocab_size = int(args.vocab_size)
        self.windows = sliding_windows(model)
        self.context = _Context()
        self.context.windows = self.windows

    def cache_config(self, *, dtype, page_size, max_total_tokens, max_batch_size,
                     prefill_chunk_size) -> CacheConfig:
        return cache_config(self.model, dtype=dtype, page_size=page_size,
                            max_total_tokens=max_total_tokens, max_batch_size=max_batch_size,
                            prefill_chunk_size=prefill_chunk_size)

    def default_device(self) -> Optional[str]:
        return "gpu" if mx.default_device() == mx.gpu else "cpu"

    def check(self, cache) -> None:
        if cache.config.rope_mode != "none":
            raise InvalidArgumentError(
                f"the cache has rope_mode={cache.config.rope_mode!r}, but an mlx-lm model "
                f"applies its own RoPE: the cache would rotate q and k a second time")
        dtype = _dtype(self.model)
        if cache.config.dtype != dtype and cache.backend.is_native(mx.zeros(1)):
            raise UnsupportedFeatureError(
                f"the model computes in {dtype} but the cache stores {cache.config.dtype}; the "
                f"{cache.backend.name!r} backend takes the model's arrays as they are, so the "
                f"dtypes must match (pass dtype=None)")

    @contextlib.contextmanager
    def session(self, cache):
        """Each layer's ``self_attn`` is a ``CacheAttention`` for the duration (restored)."""
        layers = _layers(self.model)
        originals = [layer.self_attn for layer in layers]
        try:
            for i, layer in enumerate(layers):
                layer.self_attn = CacheAttention(originals[i], i, self.context)
            yield
        finally:
            for layer, attn in zip(layers, originals):
                layer.self_attn = attn
            self.context.cache = self.context.positions = None

    def _head(self, hidden):
        model = self.model
        if "lm_head" in model:
            return model.lm_head(hidden)
        return model.model.embed_tokens.as_linear(hidden)

    def forward(self, cache, tokens, positions, logit_rows):
        ctx = self.context
        ctx.cache = cache
        ctx.positions = mx.array(positions.astype(np.int32))
        ctx.last_position = int(positions.max()) if len(positions) else -1
        try:
            hidden = self.model.model(mx.array(tokens.astype(np.int32))[None])
        finally:
            ctx.cache = None
        if not len(logit_rows):
            mx.eval(hidden)              # the cache holds this forward's K/V once evaluated
            return None
        logits = self._head(hidden[0][mx.array(logit_rows.astype(np.int32))])
        mx.eval(logits)
        return logits

    def to_numpy(self, logits) -> np.ndarray:
        return np.asarray(logits.astype(mx.float32)).astype(np.float64)


class Engine(_Engine):
    """Continuous-batching generation of an mlx-lm model on a ``PagedKVCache``.

    ``model``: an mlx-lm model of a family in ``FAMILIES`` (e.g. from ``mlx_lm.load``).
    ``backend``: a backend name or ``"auto"`` (``"metal"`` for MLX); ``device``: ``"gpu"`` or
    ``"cpu"`` (None: MLX's default device); ``dtype``: the cache dtype (None: the model's);
    ``page_size``, ``max_total_tokens`` (None: ``512 * max_batch_size``), ``max_batch_size``,
    ``prefill_chunk_size`` (None: ``min(8192, max_total_tokens)``): as in ``CacheConfig``.
    ``offload`` / ``offload_tokens``: the host tier preempted sequences are parked in (None: on
    for the GPU); ``overlap`` (default True): greedy decode with the host one step ahead of the
    device; both as in ``kvcache.integrations.engine.Engine``. See
    ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, backend: str = "auto", device: Optional[str] = None,
                 dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: Optional[int] = None, max_batch_size: int = 64,
                 prefill_chunk_size: Optional[int] = None, offload: Optional[bool] = None,
                 offload_tokens: Optional[int] = None, overlap: bool = True):
        self.model = model
        super().__init__(MlxLmAdapter(model), backend=backend, device=device, dtype=dtype,
                         page_size=page_size, max_total_tokens=max_total_tokens,
                         max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                         offload=offload, offload_tokens=offload_tokens, overlap=overlap)
