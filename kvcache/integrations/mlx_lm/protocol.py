"""mlx-lm's cache protocol over a ``PagedKVCache``: ``LayerCache`` (one per layer, what the
model's attention calls) and ``_Forward`` (what they read during one forward); re-exported by
the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from ...arrays import to_numpy
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from .model import _DTYPES, _Label, _family, _label

mx = require("mlx.core", "mlx-lm")

from mlx_lm.models import cache as _mlx_cache  # noqa: E402

if TYPE_CHECKING:
    from ...cache import PagedKVCache


# ---------------------------------------------------------------------- the cache protocol
class _Forward:
    """What the ``LayerCache`` objects of one model read during one forward (or the probe)."""

    def __init__(self, model, windows: dict, num_layers: int, own_attention: bool = False,
                 states=()):
        self.model = model
        self.windows = windows
        self.states = frozenset(states)     # state layers (a conv): no K/V, no attention
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
        """Every layer called ``update_and_fetch`` and ``scaled_dot_product_attention`` once
        (state layers: neither)."""
        for layer, (f, a) in enumerate(zip(self.fetched, self.attended)):
            if (f == 1 and a == 1) or (layer in self.states and f == a == 0):
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
