"""mlx-lm models on a ``PagedKVCache`` (extra ``kvcache[mlx-lm]``).

``Engine(model, ...)`` runs continuous-batching generation (see
``kvcache.integrations.engine``) of an mlx-lm model (``mlx_lm.load``, or a model class of
``mlx_lm.models``) on the metal backend (Apple GPU, or MLX's CPU device with
``device="cpu"``), with the paged cache in place of mlx-lm's own KV cache. There is no family
list: the model's own code runs unchanged, and every model whose attention goes through
mlx-lm's cache protocol runs; any other is refused (``UnsupportedFeatureError`` naming why).

How the model reaches the cache (mlx-lm's cache protocol, the model's code unchanged):

* **Layout.** A forward's ``T`` packed tokens (several sequences) go in as ``T`` batch rows of
  one token each: inputs ``(T, 1)``. Everything outside attention is per token, so the rows
  are independent.
* **Positions.** Each layer gets a ``LayerCache`` as its ``cache``; its ``offset`` is an
  ``mx.array`` ``(T,)`` of the tokens' positions, so the model's own
  ``self.rope(x, offset=cache.offset)`` rotates row ``t`` at token ``t``'s position
  (``mx.fast.rope`` takes one offset per batch row; every mlx-lm RoPE class, llama3 / YaRN /
  su-scaled included, passes it on). A RoPE that cannot take per-row offsets (e.g.
  ``DynamicNTKScalingRoPE``) fails in the probe and the model is refused.
* **K/V and attention.** ``cache.update_and_fetch(keys, values)`` hands the new keys and
  values back as they are; mlx-lm's ``scaled_dot_product_attention`` (wrapped, once, in the
  modules of the model's classes: the wrapper is mlx-lm's own function for any other cache)
  sends ``queries``, those keys and values, the model's ``scale`` and ``sinks`` to
  ``PagedKVCache.attention`` of the layer, which appends K/V and attends over each sequence's
  history. Whatever the model does before (q/k norms, biases, partial or scaled RoPE, NoPE
  layers) and after (output projection, logit scaling and soft-capping of the head) is its own.
* **Masks.** ``cache.make_mask`` (what ``create_attention_mask`` calls) returns None: the
  paged cache knows each token's sequence and applies causality itself. A model that hands
  ``scaled_dot_product_attention`` a mask array of its own (e.g. an additive bias) is refused.
* **Windows.** Per layer, from ``model.make_cache()`` as mlx-lm builds it: a
  ``RotatingKVCache(max_size=w)`` layer is a sliding layer (a query sees the previous ``w``
  positions, itself included: ``window_left = w - 1``, capability ``window_left`` once a
  sequence outgrows it); a ``KVCache`` layer is full attention; any other cache type is
  refused.
* **Head.** The model's own ``__call__`` computes the logits; its inner model is wrapped for
  the call so that only the rows whose logits are wanted reach the head.

* **Models that attend themselves.** A model whose layers fetch through ``update_and_fetch``
  but do not hand exactly those keys and values (and no mask array) to
  ``scaled_dot_product_attention`` (mlx-lm's gemma2 soft-caps its scores by hand; its
  deepseek_v3 runs MLA over the latent and rotary keys it fetches, with the rotary scores as
  a mask) runs in *own-attention* mode: one model call per sequence of the forward (its new
  tokens as one batch row, ``offset`` its first new position, ``make_mask`` mlx-lm
  ``KVCache``'s), ``update_and_fetch`` returns the sequence's history in that layer from the
  pages (``PagedKVCache.get_kv(..., layer=)``) followed by the new keys/values, and the new
  ones of all sequences go into the pages after the calls (``PagedKVCache.append_kv``). The
  cache stores what the model fetches: for deepseek_v3 the compressed latent (head dim
  ``kv_lora_rank``) and its rotary key (``head_dim_v`` = ``qk_rope_head_dim``), one KV head.
  Sliding-window layers are refused in this mode (they expect mlx-lm's rotating cache to drop
  old keys).

At construction a probe runs the model once lazily (nothing is computed) on two tokens with
recording layer caches: each layer must call ``update_and_fetch`` once, and either
``scaled_dot_product_attention`` with its cache object, exactly the fetched keys and values
and no mask array (the cache's kernels attend), or attend itself (own-attention mode). The
probe also reads the cache configuration off the calls (query and KV heads, q/k and value
head dims, dtype, sinks). Refused, with the reason: a layer that never uses its cache
object, recurrent or chunked caches, layers of different head shapes, sinks on a backend
without ``attention_sinks``.

For a loop of your own: ``layer_caches(model, cache)`` inside ``cache.forward(...)`` gives the
list to pass as ``model(tokens[:, None], cache=...)``. The cache uses ``rope_mode="none"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import weakref
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from . import require
from ..serving import RequestOutput
from .engine import Engine as _Engine
from .sampling import SamplingParams
from .engine import ModelAdapter
from ..arrays import to_numpy
from ..backend import Capabilities
from ..config import CacheConfig
from ..errors import InvalidArgumentError, KVCacheError, UnsupportedFeatureError

mx = require("mlx.core", "mlx-lm")
mlx_lm = require("mlx_lm", "mlx-lm", "0.32")

from mlx_lm.models import base as _mlx_base  # noqa: E402
from mlx_lm.models import cache as _mlx_cache  # noqa: E402

if TYPE_CHECKING:
    from ..cache import PagedKVCache

__all__ = ["Engine", "LayerCache", "MlxLmAdapter", "ModelDescription", "RequestOutput",
           "SamplingParams", "cache_config",
           "describe", "eos_token_ids", "layer_caches", "sliding_windows"]

_DTYPES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


# ---------------------------------------------------------------------- model description
def _family(model) -> str:
    args = getattr(model, "args", None)
    return str(getattr(args, "model_type", None) or type(model).__module__.rsplit(".", 1)[-1])


def _layers(model) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise UnsupportedFeatureError(
            f"{type(model).__name__} has no .layers: not an mlx-lm language model")
    return list(layers)


def _label(model, layer: int) -> str:
    """'layer i (module.Class)' of the attention module of cache slot ``layer``, for messages."""
    layers = _layers(model)
    if layer < len(layers):
        block = layers[layer]
        attn = next((getattr(block, a) for a in ("self_attn", "attention", "attn")
                     if getattr(block, a, None) is not None), block)
        return f"layer {layer} ({type(attn).__module__}.{type(attn).__name__})"
    return f"layer {layer}"


class _Label:
    """``_label(model, layer)``, built when formatted (the hot path formats none)."""

    def __init__(self, model, layer: int):
        self.model, self.layer = model, layer

    def __str__(self) -> str:
        return _label(self.model, self.layer)


def _mlx_caches(model) -> list:
    """The cache objects mlx-lm's own generation would use (``make_prompt_cache``)."""
    if hasattr(model, "make_cache"):
        return list(model.make_cache())
    return [_mlx_cache.KVCache() for _ in _layers(model)]


def sliding_windows(model) -> dict:
    """``{layer: window}`` of the model's sliding-window layers (empty: none), as mlx-lm's own
    generation builds them (``model.make_cache()``): a ``RotatingKVCache(max_size=w)`` layer
    attends to the previous ``w`` positions, itself included; a ``KVCache`` layer to all of
    them. Any other cache type raises ``UnsupportedFeatureError`` naming it."""
    windows = {}
    for i, c in enumerate(_mlx_caches(model)):
        if type(c) is _mlx_cache.KVCache:
            continue
        if type(c) is _mlx_cache.RotatingKVCache and not getattr(c, "keep", 0):
            windows[i] = int(c.max_size)
            continue
        what = (f"RotatingKVCache with keep={c.keep} (tokens kept at the start beside the "
                f"window)" if isinstance(c, _mlx_cache.RotatingKVCache) else type(c).__name__)
        raise UnsupportedFeatureError(
            f"{_label(model, i)} of the {_family(model)} model uses mlx-lm's {what} (from "
            f"model.make_cache()): the paged cache stands in for KVCache (full attention) and "
            f"RotatingKVCache (a sliding window) only")
    return windows


def eos_token_ids(model, tokenizer=None) -> tuple:
    """The end-of-sequence ids mlx-lm's own generation stops at: the tokenizer's
    ``eos_token_ids`` (``mlx_lm.load`` fills them from the config's ``eos_token_id`` and the
    tokenizer), else ``eos_token_id``, else the model args' ``eos_token_id`` (an int or a list);
    () when none names one."""
    sources = []
    if tokenizer is not None:
        sources += [getattr(tokenizer, "eos_token_ids", None), getattr(tokenizer, "eos_token_id", None)]
    sources.append(getattr(getattr(model, "args", None), "eos_token_id", None))
    for ids in sources:
        if ids is None:
            continue
        ids = [ids] if isinstance(ids, (int, np.integer)) else list(ids)
        if ids:
            return tuple(sorted({int(t) for t in ids}))
    return ()


_eos_ids = eos_token_ids


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """What the probe read off an mlx-lm model's attention calls (``describe``)."""

    num_layers: int
    """Cache slots (one ``LayerCache`` each): ``len(model.make_cache())`` or of the layers."""
    num_qo_heads: int
    """Query heads of an attention call (``queries.shape[1]``)."""
    num_kv_heads: int
    """Key/value heads of an attention call (``keys.shape[1]``; fewer than the query heads
    with GQA)."""
    head_dim: int
    """Head dim of queries and keys."""
    head_dim_v: int
    """Head dim of values and of the attention output."""
    dtype: str
    """The dtype the attention runs in (the cache's)."""
    vocab_size: int
    """The width of the model's logits (the sampler's vocabulary)."""
    windows: dict
    """``{layer: window}`` (``sliding_windows``)."""
    sinks: tuple
    """The layers that pass learned attention sinks (capability ``attention_sinks``)."""
    own_attention: bool = False
    """The model computes attention itself over the keys and values ``update_and_fetch``
    returns (mlx-lm's gemma2: soft-capped scores; deepseek_v3: MLA over the latent and rotary
    keys, which are then what the cache stores): the cache holds K/V, the model attends, one
    sequence per model call. ``num_qo_heads`` is then ``num_kv_heads`` (queries never reach
    the cache)."""


# ---------------------------------------------------------------------- the cache protocol
class _Forward:
    """What the ``LayerCache`` objects of one model read during one forward (or the probe)."""

    def __init__(self, model, windows: dict, num_layers: int, own_attention: bool = False):
        self.model = model
        self.windows = windows
        self.own_attention = own_attention  # the model attends over fetched history itself
        self.cache: Optional[PagedKVCache] = None   # the cache whose forward is open
        self.probe: Optional[dict] = None  # {layer: record} while probing
        self.positions: Optional[Any] = None        # (T,) int32 mx array
        self.last_position = -1
        self.fetched = [0] * num_layers
        self.attended = [0] * num_layers
        # own-attention mode: the sequence the model runs on now, its first new position, and
        # each layer's new (keys, values) of the sequences run so far
        self.seq_id: Optional[int] = None
        self.start = 0
        self.new: list = [[] for _ in range(num_layers)]

    def begin(self, cache, positions) -> None:
        pos = np.asarray(positions, np.int64)
        self.cache = cache
        self.positions = mx.array(pos.astype(np.int32))
        self.last_position = int(pos.max()) if pos.size else -1
        self.fetched = [0] * len(self.fetched)
        self.attended = [0] * len(self.attended)

    def end(self) -> None:
        self.cache = self.positions = self.seq_id = None
        self.new = [[] for _ in self.new]

    def check_all_fetched(self) -> None:
        """Every layer called ``update_and_fetch`` once (own-attention mode)."""
        for layer, f in enumerate(self.fetched):
            if f != 1:
                raise UnsupportedFeatureError(
                    f"{_label(self.model, layer)} of the {_family(self.model)} model calls "
                    f"cache.update_and_fetch {f} times in one forward (once expected); its "
                    f"attention cannot run on the paged cache")

    def check_all_attended(self) -> None:
        """Every layer called ``update_and_fetch`` and ``scaled_dot_product_attention`` once."""
        for layer, (f, a) in enumerate(zip(self.fetched, self.attended)):
            if f == 1 and a == 1:
                continue
            label = _label(self.model, layer)
            if a == 0 and f:
                why = ("calls cache.update_and_fetch but not mlx-lm's "
                       "scaled_dot_product_attention: it computes attention itself (e.g. "
                       "mlx-lm's gemma2 for its logit soft-capping)")
            elif a == 0:
                why = ("never uses the cache object it is given (update_and_fetch and "
                       "scaled_dot_product_attention): e.g. a recurrent layer, or a cache of "
                       "its own")
            else:
                why = (f"calls update_and_fetch {f} times and scaled_dot_product_attention "
                       f"{a} times in one forward (once each expected)")
            raise UnsupportedFeatureError(
                f"{label} of the {_family(self.model)} model {why}; its attention cannot run "
                f"on the paged cache")


class LayerCache:
    """mlx-lm's cache protocol for one layer of a model over the open forward of a
    ``PagedKVCache`` (pass the list from ``layer_caches`` as the model's ``cache``).

    ``offset``: the new tokens' positions, ``(T,)`` int32 (each token is its own batch row);
    ``update_and_fetch(keys, values)`` returns them unchanged (the paged cache appends them when
    the layer attends); ``make_mask`` returns None (the cache is causal by itself). mlx-lm's
    ``scaled_dot_product_attention`` called with this object as ``cache`` runs
    ``PagedKVCache.attention`` of the layer (``attend``).

    For a model that attends itself (own-attention mode, one sequence per model call):
    ``offset`` is the sequence's first new position (an int, as mlx-lm's ``KVCache``),
    ``update_and_fetch`` returns the sequence's whole history in this layer read from the pages
    (``get_kv(layer=...)``) followed by the new keys/values, and ``make_mask`` is
    ``KVCache``'s."""

    def __init__(self, layer: int, forward: _Forward):
        self.layer = layer
        self._forward = forward
        self._fetched: Optional[tuple] = None    # the (keys, values) update_and_fetch returned

    @property
    def own_attention(self) -> bool:
        """The model attends itself over what ``update_and_fetch`` returns (not probing)."""
        return self._forward.own_attention and self._forward.probe is None

    # ---- the protocol mlx-lm's attention uses
    @property
    def offset(self):
        """Where mlx-lm's RoPE starts: the new tokens' positions ``(T,)`` int32 (each token its
        own batch row, so each gets its own position); in own-attention mode the sequence's
        first new position, an int. Raises ``InvalidArgumentError`` outside a forward."""
        f = self._forward
        if f.positions is None:
            raise InvalidArgumentError(
                f"layer {self.layer}: a kvcache LayerCache is used outside a forward (run the "
                f"model through Engine.generate, or take layer_caches(model, cache) inside "
                f"cache.forward(...))")
        return f.start if f.own_attention else f.positions

    def update_and_fetch(self, keys, values):
        """Called by the model's attention with the new ``keys`` ``(T, Hkv, 1, D)`` and
        ``values`` ``(T, Hkv, 1, Dv)``: returns them unchanged (the paged cache stores them
        when the layer attends, ``attend``). In own-attention mode (``keys`` ``(1, Hkv, N,
        D)``): returns the sequence's history in this layer, read from the pages, followed by
        the new ones, ``(1, Hkv, start + N, D)``, the layout of mlx-lm's ``KVCache``."""
        f = self._forward
        f.fetched[self.layer] += 1
        if f.probe is not None:
            f.probe.setdefault(self.layer, {})["fetched"] = dict(
                kv=(keys.shape[1], keys.shape[-1], values.shape[-1]), dtype=keys.dtype)
        if not f.own_attention or f.probe is not None:
            self._fetched = (keys, values)
            return keys, values
        # own attention: this sequence's history in the layer (from the pages), then the new
        f.new[self.layer].append((keys, values))
        if not f.start:
            return keys, values
        if f.cache is None or f.seq_id is None:
            raise InvalidArgumentError(
                f"layer {self.layer}: a kvcache LayerCache is used outside a forward (run the "
                f"model through Engine.generate)")
        k, v = f.cache.get_kv(f.seq_id, 0, f.start, layer=self.layer)
        k, v = (_from_cache(f.cache, a, keys.dtype) for a in (k, v))
        return (mx.concatenate([k.transpose(1, 0, 2)[None], keys], axis=2),
                mx.concatenate([v.transpose(1, 0, 2)[None], values], axis=2))

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """The mask mlx-lm's model passes to attention for ``N`` new tokens: None (the paged
        kernels apply the causal mask and the layer's window themselves); in own-attention
        mode, ``KVCache``'s mask over history plus the new tokens. Raises
        ``UnsupportedFeatureError`` when the model asks for a ``window_size`` that differs from
        the window its ``make_cache()`` declared for this layer (the cache would attend over
        the wrong keys)."""
        f = self._forward
        if f.own_attention:      # the model attends over [history, new]: KVCache's mask
            return _mlx_cache.create_attention_mask(N, offset=f.start, return_array=return_array,
                                                    window_size=window_size)
        if window_size is not None and f.windows.get(self.layer) != int(window_size):
            mine = f.windows.get(self.layer)
            raise UnsupportedFeatureError(
                f"the {_family(f.model)} model builds a sliding-window mask of {window_size} "
                f"positions on {_label(f.model, self.layer)}, whose mlx-lm cache from "
                f"model.make_cache() is "
                + (f"a window of {mine}" if mine is not None else "full attention (KVCache)")
                + ": the layers' windows are not what the cache types declare, so the paged "
                  "cache cannot tell which layers slide")
        return None

    # ---- the rest of mlx-lm's cache interface (nothing is held here)
    @property
    def state(self):
        """Nothing to save (mlx-lm's prompt-cache files): the KV lives in the ``PagedKVCache``."""
        return []

    def is_trimmable(self) -> bool:
        """False: mlx-lm must not trim it (use ``PagedKVCache.popn`` on the sequence instead)."""
        return False

    def size(self) -> int:
        """0: this object holds no tokens (the paged cache does)."""
        return 0

    def empty(self) -> bool:
        """True: this object holds no tokens (the paged cache does)."""
        return True

    @property
    def nbytes(self) -> int:
        """0: the memory is the paged cache's (``PagedKVCache.pages``), not this object's."""
        return 0

    # ---- attention
    def attend(self, queries, keys, values, scale, mask=None, sinks=None, **other):
        """``scaled_dot_product_attention(queries, keys, values, cache=self, scale, mask,
        sinks)`` on the paged cache: ``queries`` ``(T, H, 1, D)``, ``keys`` / ``values`` as
        ``update_and_fetch`` returned them. Returns ``(T, H, 1, Dv)`` in the queries' dtype."""
        f, layer = self._forward, self.layer
        label = _Label(f.model, layer)           # (built only for a message)
        f.attended[layer] += 1
        fetched, self._fetched = self._fetched, None
        why = None
        if fetched is None or keys is not fetched[0] or values is not fetched[1]:
            why = ("hands scaled_dot_product_attention other keys or values than "
                   "cache.update_and_fetch returned (it transforms the cached keys/values "
                   "itself, e.g. mlx-lm's MLA attention of deepseek_v3)")
        elif mask is not None and not (isinstance(mask, str) and mask == "causal"):
            shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
            why = (f"passes a mask of its own {shape} to scaled_dot_product_attention (not the "
                   f"None its cache's make_mask returns: e.g. additive attention scores)")
        elif any(v is not None for v in other.values()):
            extra = sorted(k for k, v in other.items() if v is not None)
            why = (f"passes {', '.join(extra)} to scaled_dot_product_attention, which the "
                   f"kvcache attention does not implement")
        B, H, L, D = queries.shape
        if why is not None:
            if f.probe is None:
                raise UnsupportedFeatureError(
                    f"{label} of the {_family(f.model)} model {why}: its attention cannot run "
                    f"on the paged cache's kernels")
            f.probe.setdefault(layer, {})["attend"] = why
            return mx.zeros((B, H, L, values.shape[-1]), queries.dtype)
        kv, positions = f.cache, f.positions
        if positions is None or (kv is None and f.probe is None):
            raise InvalidArgumentError(
                f"{label}: the model's attention reaches a kvcache LayerCache, but no forward "
                f"is open (run it through Engine.generate, or inside cache.forward(...))")
        T = positions.shape[0]
        if B != T or L != 1 or keys.shape[0] != T or keys.shape[2] != 1:
            raise InvalidArgumentError(
                f"{label}: the {T} new tokens must be {T} batch rows of one token each (inputs "
                f"of shape ({T}, 1)), got queries {tuple(queries.shape)} and keys "
                f"{tuple(keys.shape)}")
        Hkv, Dv = keys.shape[1], values.shape[-1]
        if f.probe is not None:
            f.probe.setdefault(layer, {})["attend"] = dict(
                heads=(H, Hkv, D, Dv), dtype=queries.dtype, sinks=sinks is not None)
            return mx.zeros((B, H, 1, Dv), queries.dtype)
        assert kv is not None                   # checked above: only the probe runs without
        opts = {}
        window = f.windows.get(layer)
        if window is not None:
            if getattr(kv.capabilities, "window_left", False):
                opts["window_left"] = window - 1
            elif f.last_position >= window:
                raise _window_unsupported(kv, label, window)
        if sinks is not None:
            opts["sinks"] = _to_cache(kv, sinks.astype(mx.float32), keep_dtype=True)
        q = _to_cache(kv, queries.reshape(T, H, D))
        k = _to_cache(kv, keys.reshape(T, Hkv, D))
        v = _to_cache(kv, values.reshape(T, Hkv, Dv))
        out = kv.attention(layer, q, k, v, sm_scale=float(scale), **opts)
        if not isinstance(out, mx.array):
            out = mx.array(np.ascontiguousarray(to_numpy(out)))
        return out.astype(queries.dtype).reshape(T, H, 1, -1)


def _to_cache(cache, x, keep_dtype: bool = False):
    """An mx array -> the cache backend's native array (in the cache dtype, unless
    ``keep_dtype`` and the backend takes MLX arrays)."""
    if cache.backend.is_native(x):
        return x if keep_dtype else x.astype(_mx_dtype(cache.config.dtype))
    return cache.from_numpy(np.asarray(x.astype(mx.float32)))


def _from_cache(cache, x, dtype):
    """A cache backend array -> an mx array of ``dtype``."""
    if not isinstance(x, mx.array):
        x = mx.array(np.ascontiguousarray(to_numpy(x)))
    return x.astype(dtype)


def _mx_dtype(name: str):
    return {v: k for k, v in _DTYPES.items()}[name]


def _window_unsupported(cache, label, window: int) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"backend {cache.backend.name!r} does not support per-query sliding-window attention "
        f"(capability 'window_left' not declared): {label} of the model attends to the "
        f"previous sliding_window={window} positions only")


# ---------------------------------------------------------------------- routing
_ROUTED_ATTR = "__kvcache_routed__"


def _routed(original):
    """mlx-lm's ``scaled_dot_product_attention`` that hands a call with a ``LayerCache`` to its
    ``attend`` and any other call to ``original`` unchanged."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def scaled_dot_product_attention(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, LayerCache) and not cache.own_attention:
            arguments = dict(bound.arguments)
            arguments.pop("cache")
            arguments.update(arguments.pop("kwargs", {}))
            return cache.attend(**arguments)
        return original(*args, **kwargs)

    setattr(scaled_dot_product_attention, _ROUTED_ATTR, True)
    return scaled_dot_product_attention


def route(model) -> None:
    """Wrap mlx-lm's ``scaled_dot_product_attention`` where ``model``'s classes call it (the
    modules defining them, and ``mlx_lm.models.base``) so that a call with a ``LayerCache``
    reaches the paged cache. Once per module, idempotent; calls with any other cache run
    mlx-lm's own function, so the wrapper stays installed."""
    modules = {sys.modules.get(type(m).__module__) for m in [model, *model.modules()]}
    modules.add(_mlx_base)
    for module in modules:
        original = getattr(module, "scaled_dot_product_attention", None) if module else None
        if callable(original) and not getattr(original, _ROUTED_ATTR, False):
            setattr(module, "scaled_dot_product_attention", _routed(original))


def layer_caches(model, cache, positions=None) -> list:
    """The mlx-lm cache objects (one ``LayerCache`` per layer) that route ``model``'s
    attention to ``cache``'s open forward. Call the model with the forward's T tokens as T
    batch rows: ``model(tokens.reshape(-1, 1), cache=layer_caches(model, cache))``; logits come
    back ``(T, 1, vocab)``. ``positions``: each token's position (None: the cache's
    ``query_positions()``). Sliding layers follow ``model.make_cache()`` (``sliding_windows``).
    A model that computes attention itself (``describe(model).own_attention``) needs one call
    per sequence: it is refused here (``MlxLmAdapter(model).forward`` runs it)."""
    if cache.config.rope_mode != "none":
        raise InvalidArgumentError(
            f"the cache has rope_mode={cache.config.rope_mode!r}, but an mlx-lm model applies "
            f"its own RoPE: build the cache with cache_config(model) (rope_mode='none')")
    if _described(model).own_attention:
        raise UnsupportedFeatureError(
            f"the {_family(model)} model computes attention itself over the keys and values "
            f"its cache returns, one sequence per call; layer_caches serves one call over "
            f"every sequence's tokens: use MlxLmAdapter(model).forward(cache, tokens, "
            f"positions, logit_rows) inside the forward")
    windows = sliding_windows(model)
    route(model)
    slots = len(_mlx_caches(model))
    forward = _Forward(model, windows, slots)
    forward.begin(cache, to_numpy(cache.query_positions()) if positions is None else positions)
    return [LayerCache(i, forward) for i in range(slots)]


class _RowsOf:
    """Stands in for a model's inner model during one call: runs it and hands the model's head
    only the hidden rows ``rows`` (``(B,)`` int32) of its ``(T, 1, hidden)`` output (``axis``
    1: the tokens ``rows`` of its ``(1, T, hidden)`` output)."""

    def __init__(self, inner, rows, axis: int = 0):
        self.inner, self.rows, self.axis, self.hidden = inner, rows, axis, None

    def __call__(self, *args, **kwargs):
        hidden = self.hidden = self.inner(*args, **kwargs)
        return hidden[:, self.rows] if self.axis else hidden[self.rows]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(model, inputs, caches, rows, axis: int = 0):
    """The model's own ``__call__`` over ``inputs`` (T, 1) with ``caches``: ``(logits (B,
    vocab) of rows ``rows``, hidden states (T, 1, hidden) or the logits of every row)``.
    ``axis`` 1: ``inputs`` (1, T), one sequence's tokens, and ``rows`` its tokens."""
    inner = model.get("model") if isinstance(model, dict) else None
    pick = (lambda out: out[0][rows]) if axis else (lambda out: out[rows][:, -1])
    if inner is None or "model" in vars(model) or not callable(inner):
        out = model(inputs, cache=caches)
        return pick(out), out
    wrapper = _RowsOf(inner, rows, axis)
    object.__setattr__(model, "model", wrapper)
    try:
        out = model(inputs, cache=caches)
    finally:
        object.__delattr__(model, "model")
    if wrapper.hidden is None:               # the model's call did not go through .model
        return pick(out), out
    return (out[0] if axis else out[:, -1]), wrapper.hidden


_DESCRIBED: dict = {}


def _described(model) -> ModelDescription:
    """``describe(model)``, once per model object (``layer_caches`` runs every forward)."""
    entry = _DESCRIBED.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model), describe(model))
        _DESCRIBED[id(model)] = entry
        weakref.finalize(model, _DESCRIBED.pop, id(model), None)
    return entry[1]


def describe(model) -> ModelDescription:
    """Probe ``model``'s attention through the cache protocol (``LayerCache`` objects that
    record, the model run lazily on two tokens: nothing is computed) and read the cache
    configuration off its calls. Raises ``UnsupportedFeatureError`` naming the reason when its
    attention cannot reach the paged cache this way (see the module docstring)."""
    family = _family(model)
    windows = sliding_windows(model)
    route(model)
    slots = len(_mlx_caches(model))
    forward = _Forward(model, windows, slots)
    forward.probe = {}
    forward.positions = mx.array([0, 1], mx.int32)
    caches = [LayerCache(i, forward) for i in range(slots)]
    try:
        logits, _ = _run(model, mx.zeros((2, 1), mx.int32), caches, mx.array([1], mx.int32))
    except KVCacheError:
        raise
    except Exception as exc:
        raise UnsupportedFeatureError(
            f"the {family} model ({type(model).__module__}) fails with kvcache's layer caches "
            f"(each token a batch row, its position in the array cache.offset, no mask): "
            f"{type(exc).__name__}: {exc}") from exc
    records = forward.probe
    try:
        forward.check_all_attended()
        for layer, r in sorted(records.items()):
            if isinstance(r.get("attend"), str):
                raise UnsupportedFeatureError(
                    f"{_label(model, layer)} of the {family} model {r['attend']}")
    except UnsupportedFeatureError as exc:
        return _own_attention(model, forward, windows, int(logits.shape[-1]), exc)
    shapes = {r["attend"]["heads"] for r in records.values()}
    if len(shapes) != 1:
        raise UnsupportedFeatureError(
            f"the layers of the {family} model differ in (query heads, KV heads, head dim, "
            f"value head dim): {sorted(shapes)}; the paged cache has one shape for all layers")
    H, Hkv, D, Dv = shapes.pop()
    return ModelDescription(
        num_layers=slots, num_qo_heads=int(H), num_kv_heads=int(Hkv), head_dim=int(D),
        head_dim_v=int(Dv), dtype=_one_dtype(family, {r["attend"]["dtype"] for r in records.values()}),
        vocab_size=int(logits.shape[-1]), windows=windows,
        sinks=tuple(sorted(i for i, r in records.items() if r["attend"]["sinks"])))


def _one_dtype(family: str, dtypes: set) -> str:
    dtype = dtypes.pop()
    if dtypes or dtype not in _DTYPES:
        raise UnsupportedFeatureError(
            f"the {family} model's attention runs in {dtype}; the cache stores float32, "
            f"float16 or bfloat16 (one dtype for all layers)")
    return _DTYPES[dtype]


def _own_attention(model, forward: _Forward, windows: dict, vocab: int,
                   why: UnsupportedFeatureError) -> ModelDescription:
    """The description of a model whose attention does not run on the cache's kernels
    (``why``) but that fetches each layer's keys and values through ``update_and_fetch``
    once: it attends itself over the history the cache returns. Raises ``why`` (or the
    reason own attention cannot work either) otherwise."""
    family = _family(model)
    records = forward.probe or {}
    if any(f != 1 for f in forward.fetched) or len(records) != len(forward.fetched):
        raise why
    if windows:
        raise UnsupportedFeatureError(
            f"{why}; it could attend itself over the keys and values the cache returns, but "
            f"its sliding-window layers {sorted(windows)} (from model.make_cache()) expect "
            f"mlx-lm's rotating cache to drop old keys, which the paged cache does not do")
    shapes = {r["fetched"]["kv"] for r in records.values()}
    if len(shapes) != 1:
        raise UnsupportedFeatureError(
            f"the layers of the {family} model fetch keys and values of different (KV heads, "
            f"key dim, value dim): {sorted(shapes)}; the paged cache has one shape for all layers")
    Hkv, D, Dv = shapes.pop()
    return ModelDescription(
        num_layers=len(forward.fetched), num_qo_heads=int(Hkv), num_kv_heads=int(Hkv),
        head_dim=int(D), head_dim_v=int(Dv),
        dtype=_one_dtype(family, {r["fetched"]["dtype"] for r in records.values()}),
        vocab_size=vocab, windows={}, sinks=(), own_attention=True)


def cache_config(model, *, dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: int = 65536, max_batch_size: int = 64,
                 prefill_chunk_size: int = 2048,
                 description: Optional[ModelDescription] = None) -> CacheConfig:
    """A ``CacheConfig`` for an mlx-lm model: layers, query/KV heads, head dims (values: their
    own, ``head_dim_v``) as its attention calls show them (``describe``), ``rope_mode="none"``
    (the model rotates q and k itself), ``dtype`` (None: the model's) and the given sizes."""
    d = description if description is not None else describe(model)
    args = getattr(model, "args", None)
    return CacheConfig(
        num_layers=d.num_layers, num_qo_heads=d.num_qo_heads, num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim, head_dim_v=d.head_dim_v,
        page_size=page_size, max_batch_size=max_batch_size, max_total_tokens=max_total_tokens,
        prefill_chunk_size=prefill_chunk_size, dtype=dtype if dtype is not None else d.dtype,
        rope_mode="none", rope_theta=float(getattr(args, "rope_theta", None) or 10000.0))


# ---------------------------------------------------------------------- engine adapter
class MlxLmAdapter(ModelAdapter):
    """An mlx-lm model as the engine's model: any model whose attention reaches the cache
    through mlx-lm's cache protocol (``describe`` checks it at construction)."""

    def __init__(self, model, tokenizer=None, eos_token_ids: Optional[Sequence[int]] = None):
        self.model = model
        self.family = _family(model)
        self.description = describe(model)
        self.vocab_size = self.description.vocab_size
        self.windows = dict(self.description.windows)
        self._forward = _Forward(model, self.windows, self.description.num_layers,
                                 own_attention=self.description.own_attention)
        self._caches = [LayerCache(i, self._forward) for i in range(self.description.num_layers)]
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



class Engine(_Engine):
    """Continuous-batching generation of an mlx-lm model on a ``PagedKVCache``.

    ``model``: an mlx-lm model (e.g. from ``mlx_lm.load``) whose attention goes through
    mlx-lm's cache protocol (refused with the reason otherwise: see the module docstring).
    ``backend``: a backend name or ``"auto"`` (``"metal"`` for MLX); ``device``: ``"gpu"`` or
    ``"cpu"`` (None: MLX's default device); ``dtype``: the cache dtype (None: the model's);
    ``page_size``, ``max_total_tokens`` (None: sized from free device memory, ``memory_fraction`` of it, default 0.9, where the device can be asked; else ``512 * max_batch_size``), ``max_batch_size``,
    ``prefill_chunk_size`` (None: ``min(8192, max_total_tokens)``): as in ``CacheConfig``.
    ``offload`` / ``offload_tokens``: the host tier preempted sequences are parked in (None: on
    for the GPU); ``overlap`` (default True): greedy decode with the host one step ahead of the
    device; both as in ``kvcache.integrations.engine.Engine``. ``tokenizer`` (e.g.
    ``mlx_lm.load``'s) or ``eos_token_ids``: where a sample ends unless ``ignore_eos``
    (``eos_token_ids(model, tokenizer)``; explicit ids win). See
    ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, backend: str = "auto", device: Optional[str] = None,
                 dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: Optional[int] = None, max_batch_size: int = 64,
                 prefill_chunk_size: Optional[int] = None, offload: Optional[bool] = None,
                 offload_tokens: Optional[int] = None, overlap: bool = True,
                 tokenizer=None, eos_token_ids: Optional[Sequence[int]] = None,
                 memory_fraction: float = 0.9):
        self.model = model
        super().__init__(MlxLmAdapter(model, tokenizer=tokenizer, eos_token_ids=eos_token_ids),
                         backend=backend, device=device, dtype=dtype,
                         page_size=page_size, max_total_tokens=max_total_tokens,
                         max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                         offload=offload, offload_tokens=offload_tokens, overlap=overlap,
                         memory_fraction=memory_fraction)
