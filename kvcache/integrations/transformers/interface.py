"""The ``"kvcache"`` attention implementation that transformers' attention interface calls
(``attention``, ``register``): a layer's call checked and handed to ``cache.attention``
(re-exported by the package)."""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np

from ...arrays import to_numpy
from ...backend import Capabilities
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from .rope import _FUSED
from .states import layer_of

torch = require("torch", "transformers")
transformers = require("transformers", "transformers", "5.17")

ATTN_IMPLEMENTATION = "kvcache"
"""The name ``register()`` gives the attention implementation."""

# attention-function keywords that change nothing the cache computes: positions are the
# cache's (query_positions), the cache is the KV store, and routing / output flags belong to
# other modules of the layer. Every other keyword is honoured (``attention``) or refused.
_IGNORED = frozenset(("position_ids", "use_cache", "output_router_logits", "output_attentions",
                      "cache_position", "kvcache", "past_key_values", "past_key_value",
                      "layer_idx", "is_causal"))
# keywords with a meaning the cache implements, and the capability each needs
_HONOURED = {"sliding_window": "window_left", "softcap": "logit_softcap",
             "s_aux": "attention_sinks", "sinks": "attention_sinks"}


def _to_cache(cache, x):
    """(T, H, D) torch tensor -> the cache backend's native array in the cache dtype."""
    if cache.backend.is_native(x):
        return x.contiguous()
    return cache.from_numpy(x.detach().to("cpu", torch.float32).numpy())


def _window_unsupported(cache, layer: int, window: int) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"backend {cache.backend.name!r} does not support per-query sliding-window attention "
        f"(capability 'window_left' not declared): layer {layer} of the model attends to the "
        f"previous sliding_window={window} positions only, and this forward has queries past "
        f"that window")


def _attention_options(cache, module, layer: int, dropout, sliding_window, kwargs) -> dict:
    """The ``cache.attention`` keywords for what a layer passes to its attention function:
    ``sliding_window`` -> ``window_left``, ``softcap`` -> ``logit_softcap``, ``s_aux`` /
    ``sinks`` -> ``sinks``; anything else that would change the result (dropout, a keyword the
    cache does not implement, non-causal attention) raises ``UnsupportedFeatureError`` naming
    it, and so does a keyword whose capability the backend lacks."""
    if dropout:
        raise UnsupportedFeatureError(
            f"layer {layer} asks for attention dropout={dropout} (a model in training mode?); "
            f"the kvcache attention has no dropout: call model.eval()")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedFeatureError(f"layer {layer} asks for non-causal attention; the cache's "
                                      f"attention is causal")
    for name, value in kwargs.items():
        if value is not None and name not in _IGNORED and name not in _HONOURED:
            raise UnsupportedFeatureError(
                f"layer {layer} ({type(module).__name__}) passes {name}={_show(value)} to "
                f"attention; the kvcache attention does not implement {name!r}, so the model "
                f"cannot run on the cache")
    caps, extra = cache.capabilities, {}
    for name, value in (("softcap", kwargs.get("softcap")), ("s_aux", kwargs.get("s_aux")),
                        ("sinks", kwargs.get("sinks"))):
        if value is None:
            continue
        cap = _HONOURED[name]
        if not getattr(caps, cap, False):
            raise UnsupportedFeatureError(
                f"layer {layer} ({type(module).__name__}) passes {name}={_show(value)} to "
                f"attention, and backend {cache.backend.name!r} does not support it: "
                f"{Capabilities.reason(cap)}")
        extra["logit_softcap" if name == "softcap" else "sinks"] = value
    if cache.config.layer_kinds:
        _check_group_window(cache, module, layer, sliding_window)
    if sliding_window is not None:
        if getattr(caps, "window_left", False):
            extra["window_left"] = int(sliding_window) - 1
        else:
            # fine while no query is as far as the window from the start of its sequence
            positions = to_numpy(cache.query_positions())
            if positions.size and int(positions.max()) >= int(sliding_window):
                raise _window_unsupported(cache, layer, int(sliding_window))
    return extra


def _check_group_window(cache, module, layer: int, sliding_window) -> None:
    """A cache with window groups frees the pages a windowed layer's window left behind: the
    layer must attend with exactly the window its group was built for (``layer_kinds``), or
    the keys it reads are not the model's. UnsupportedFeatureError naming the layer, raised
    before the layer's first attention call (the forward then changes nothing)."""
    g = cache.config.layer_group(layer)
    if g < 0:
        return                  # a full layer keeps every page: any window reads held keys
    w = cache.config.window_groups[g][0].size
    if sliding_window is None or int(sliding_window) - 1 != w:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) passes sliding_window={sliding_window!r} "
            f"to attention, but the cache keeps only the pages of its window group "
            f"Window({w}) (sliding_window={w + 1}): the model's windowing is not what "
            f"layer_kinds says; build the cache with window_groups=False (every page kept)")


def _show(value) -> str:
    if torch.is_tensor(value):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}>"
    return repr(value)[:60]


# ---------------------------------------------------------------- the compiled step's boundary
_COMPILED_CACHES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
"""The caches a compiled model may reach, by ``id``: the custom op below takes the cache as
an int (an op's arguments are tensors and numbers), looked up here when it runs."""


def expose(cache) -> int:
    """Make ``cache`` reachable from compiled code (``torch.compile`` of a model whose attention
    is ``"kvcache"``); returns the id the compiled graph carries."""
    _COMPILED_CACHES[id(cache)] = cache
    return id(cache)


@torch.library.custom_op("kvcache::attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor,  # type: ignore[name-defined]
                  value: torch.Tensor, cache_id: int,  # type: ignore[name-defined]
                  layer: int, scaling: float, window_left: int, softcap: float,
                  sinks: Optional[torch.Tensor]) -> torch.Tensor:  # type: ignore[name-defined]
    """``cache.attention`` as one opaque op of a compiled graph (the compiler neither traces
    into the cache's Python nor fuses across it); shapes as ``attention``'s."""
    cache = _COMPILED_CACHES[cache_id]
    extra: dict = {}
    if window_left >= 0:
        extra["window_left"] = window_left
    if softcap:
        extra["logit_softcap"] = softcap
    if sinks is not None:
        extra["sinks"] = _to_cache(cache, sinks)
    q, k, v = (_to_cache(cache, x[0].transpose(0, 1)) for x in (query, key, value))
    out = cache.attention(layer, q, k, v, sm_scale=scaling, **extra)
    return out.to(device=query.device, dtype=query.dtype).unsqueeze(0).clone()


@_attention_op.register_fake
def _(query, key, value, cache_id, layer, scaling, window_left, softcap, sinks):
    return query.new_empty((1, query.shape[2], query.shape[1], value.shape[3]))


def _compiled_attention(module, query, key, value, scaling, sliding_window, kwargs):
    """What ``attention`` is inside ``torch.compile``: the layer's options read here (traced
    once), the cache call as ``kvcache::attention``. The eager path has checked the same model
    and cache already (a compiled step only runs decode steps after eager prefills)."""
    cache = kwargs["kvcache"]
    window = -1 if sliding_window is None else int(sliding_window) - 1
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    out = _attention_op(query, key, value, id(cache), int(layer_of(module)),
                        float(scaling), window, float(softcap or 0.0), sinks)
    return out, None


def attention(module, query, key, value, attention_mask, scaling: Optional[float] = None,
              dropout: float = 0.0, sliding_window: Optional[int] = None, **kwargs):
    """The ``"kvcache"`` attention implementation (transformers' attention-function signature).

    ``query`` (1, num_qo_heads, T, head_dim), ``key`` (1, num_kv_heads, T, head_dim), ``value``
    (1, num_kv_heads, T, head_dim_v): the T new tokens of the open forward of
    ``kwargs["kvcache"]``, already rotated by the model (unrotated inside ``fused_rope(model,
    cache)``, where the cache rotates them). ``scaling``: the model's softmax scale;
    ``sliding_window`` (this layer's, None: full attention), ``softcap`` (gemma2's logit
    soft-capping) and ``s_aux`` / ``sinks`` (gpt-oss's learned sinks, one logit per query head)
    are passed on to ``cache.attention``; any other keyword that changes attention is refused
    (``UnsupportedFeatureError`` naming it). Returns ``(output (1, T, num_qo_heads, head_dim_v)
    in query's dtype, None)``. Inside ``torch.compile`` (the Engine's ``torch_compile``) the
    cache call is the custom op ``kvcache::attention``, opaque to the compiler.
    """
    if torch.compiler.is_compiling():
        return _compiled_attention(module, query, key, value, scaling, sliding_window, kwargs)
    cache = kwargs.get("kvcache")
    if cache is None:
        raise InvalidArgumentError(
            f"attention implementation {ATTN_IMPLEMENTATION!r} needs the cache: call the model "
            f"with kvcache=cache (and use_cache=False) inside `with cache.forward(seq_ids, "
            f"lengths):`, or switch back with model.set_attn_implementation('sdpa')")
    if cache.config.rope_mode != "none" and _FUSED.get(module) is not cache:
        raise InvalidArgumentError(
            f"the cache has rope_mode={cache.config.rope_mode!r}, but a transformers model "
            f"applies its own RoPE before attention: the cache would rotate q and k a second "
            f"time. Create the cache with rope_mode='none' (kvcache.integrations.transformers."
            f"cache_config(model) does), or let the cache rotate with cache_config(model, "
            f"rope='cache') and run the model inside fused_rope(model, cache)")
    if getattr(module, "layer_idx", None) is None:
        raise InvalidArgumentError(f"{type(module).__name__} has no layer_idx: cannot tell which "
                                   f"cache layer its attention uses")
    layer = layer_of(module)
    if query.shape[0] != 1:
        raise InvalidArgumentError(
            f"the batch must be packed into one row (input_ids of shape (1, T)), got a batch "
            f"of {query.shape[0]} rows")
    extra = _attention_options(cache, module, layer, dropout, sliding_window, kwargs)
    q = _to_cache(cache, query[0].transpose(0, 1))
    k = _to_cache(cache, key[0].transpose(0, 1))
    v = _to_cache(cache, value[0].transpose(0, 1))
    sinks = extra.get("sinks")
    if sinks is not None:
        extra["sinks"] = _to_cache(cache, sinks.detach()) if cache.backend.is_native(sinks) \
            else cache.from_numpy(sinks.detach().to("cpu", torch.float32).numpy())
    out = cache.attention(layer, q, k, v, sm_scale=scaling, **extra)
    if not isinstance(out, torch.Tensor):
        out = torch.from_numpy(np.ascontiguousarray(to_numpy(out)))
    return out.to(device=query.device, dtype=query.dtype).unsqueeze(0), None


def register() -> str:
    """Register the ``"kvcache"`` attention implementation with transformers (idempotent); no
    mask function is registered, so the model builds no (T, T) attention mask for it.
    Returns the name to pass to ``model.set_attn_implementation``."""
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    return ATTN_IMPLEMENTATION
