"""The recurrent-state layers of an mlx-lm model on the cache's state slots (issue 56,
docs/hybrid.md "Built: increment 6"): LFM2's short convolutions (``lfm2``, ``lfm2_moe``).

A conv layer of mlx-lm's LFM2 (``ShortConv``) projects its input to ``B, C, x``
(``in_proj``), convolves ``B * x`` causally over time with a depthwise ``nn.Conv1d`` of
``conv_L_cache`` taps (weight ``(hidden, taps, 1)``, no padding: the history is prepended) and
gates the result with ``C``. mlx-lm keeps, in the layer's ``ArraysCache(size=1)``, entry 0 of
shape ``(batch, conv_L_cache - 1, hidden)``: the last ``conv_L_cache - 1`` inputs of the
convolution, time first, the oldest first (zeros before the first token). On the cache each
conv layer is ``kvcache.State({"conv": (conv_L_cache - 1, hidden)})``, the same layout
(``state_kinds``), and a call of the conv with a ``LayerCache`` (the forward's tokens as
batch rows) runs per sequence from that state (``conv_forward``; ``route_state_layers``
routes the class's calls). What these functions do not know is refused with
``UnsupportedFeatureError`` naming it."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import numpy as np

from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..conv_states import checkpoint_columns, conv_indices
from .model import _family

mx = require("mlx.core", "mlx-lm")
nn = require("mlx.nn", "mlx-lm")

CONV_STATE = "conv"
"""The name of a conv layer's state (``State({"conv": (conv_L_cache - 1, hidden_size)})``)."""

# family (args.model_type) -> (module, class) of its short convolution: the classes whose
# __call__ was read line by line (mlx-lm 0.32: the same code in both modules); a subclass, or
# another family's convolution, is not assumed to compute the same
_CONV_CLASSES = {
    "lfm2": ("mlx_lm.models.lfm2", "ShortConv"),
    "lfm2_moe": ("mlx_lm.models.lfm2_moe", "ShortConv"),
}
STATE_FAMILIES = tuple(sorted(_CONV_CLASSES))
"""The mlx-lm model types whose recurrent-state layers run on the cache (their short
convolutions)."""
_ROUTED_ATTR = "__kvcache_routed_conv__"     # marks a conv class's wrapped __call__


def conv_layers(model) -> dict:
    """``{layer: module}``: the short-convolution modules of an LFM2-family mlx-lm ``model``
    (``STATE_FAMILIES``), by decoder layer; empty for any other family (whose
    ``ArraysCache`` / ``MambaCache`` layers ``sliding_windows`` refuses). Raises
    ``UnsupportedFeatureError`` naming the layer and the value when the model is of such a
    family but something is not what was read: a ``layer_types`` entry other than ``"conv"``
    / ``"full_attention"``, a decoder layer that is neither attention nor a conv, a conv of
    another class (a subclass too), ``layer_idx`` not its layer, a kernel below 2 taps or not
    ``conv_L_cache``, a conv that is not depthwise over ``hidden_size`` channels, padded,
    strided or dilated, an ``in_proj`` not of ``3 * hidden_size`` outputs, or a
    ``make_cache()`` entry other than ``ArraysCache(size=1)`` at a conv layer."""
    family = _family(model)
    known = _CONV_CLASSES.get(family)
    if known is None:
        return {}
    from mlx_lm.models import cache as mlx_cache
    args = model.args
    layers = list(model.layers)
    n = int(args.num_hidden_layers)
    types = list(getattr(args, "layer_types", None) or ())
    for i, kind in enumerate(types):
        if kind not in ("conv", "full_attention"):
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has layer type {kind!r}: the cache serves "
                f"'conv' and 'full_attention' layers of this family only")
    cls = getattr(importlib.import_module(known[0]), known[1])
    hidden, taps = int(args.hidden_size), int(args.conv_L_cache)
    caches = list(model.make_cache())
    found = {}
    for i, block in enumerate(layers[:n]):
        attention = bool(getattr(block, "is_attention_layer", False))
        conv: Any = getattr(block, "conv", None)
        if attention and conv is None:
            continue
        where = f"layer {i} ({type(conv).__module__}.{type(conv).__name__})"
        if attention or type(conv) is not cls:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} is not mlx-lm's {known[0]}.{known[1]} (a "
                f"subclass or a replacement), or sits beside attention: its convolution is "
                f"not understood")
        if getattr(conv, "layer_idx", None) != i:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} has layer_idx="
                f"{getattr(conv, 'layer_idx', None)!r}, not {i}")
        _check_conv(family, where, conv, hidden, taps)
        c = caches[i] if i < len(caches) else None
        if type(c) is not mlx_cache.ArraysCache or len(c.cache) != 1:
            raise UnsupportedFeatureError(
                f"the {family} model's make_cache() gives {where} a {type(c).__name__}, not "
                f"the ArraysCache(size=1) its convolution keeps its inputs in")
        found[i] = conv
    return found


def _check_conv(family: str, where: str, m, hidden: int, taps: int) -> None:
    conv: Any = getattr(m, "conv", None)
    weight = conv.get("weight") if isinstance(conv, nn.Conv1d) else None
    if weight is None:
        raise UnsupportedFeatureError(f"the {family} model's {where} has no nn.Conv1d `conv`")
    k = int(weight.shape[1])
    if k < 2 or k != taps or int(m.L_cache) != taps:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} has a kernel of {k} taps (L_cache={m.L_cache}, "
            f"args.conv_L_cache={taps}): the cache serves kernels of >= 2 taps equal to "
            f"conv_L_cache")
    if (tuple(weight.shape) != (hidden, k, 1) or conv.groups != hidden or conv.stride != 1
            or conv.padding != 0 or conv.dilation != 1):
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: conv weight {tuple(weight.shape)}, groups="
            f"{conv.groups}, stride={conv.stride}, padding={conv.padding}, dilation="
            f"{conv.dilation}; the cache serves a depthwise causal convolution over "
            f"hidden_size={hidden} channels (weight ({hidden}, {k}, 1), groups={hidden}, "
            f"stride 1, no padding, dilation 1) only")
    proj = getattr(m, "in_proj", None)
    w = proj.get("weight") if isinstance(proj, nn.Module) else None
    if w is None or int(w.shape[0]) != 3 * hidden:
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: in_proj must be a linear layer of 3 * {hidden} "
            f"outputs (B, C, x), got {type(proj).__name__} "
            f"{tuple(w.shape) if w is not None else ''}")


def state_kinds(model) -> dict:
    """``{layer: kvcache.State({"conv": (conv_L_cache - 1, hidden_size)})}`` for the short
    convolutions of an LFM2-family mlx-lm ``model`` (``conv_layers``: raises
    ``UnsupportedFeatureError`` for what is not understood); empty for other families. The
    ``CacheConfig.layer_kinds`` entries a cache for the model must have: the model cannot run
    on the cache without them. The layout is mlx-lm's ``ArraysCache`` entry's (time first,
    the oldest input first)."""
    from ...config import State
    layers = conv_layers(model)
    if not layers:
        return {}
    hidden, taps = int(model.args.hidden_size), int(model.args.conv_L_cache)
    return {i: State({CONV_STATE: (taps - 1, hidden)}) for i in layers}


def route_state_layers(model) -> list:
    """Route the short convolutions of ``model`` (``conv_layers``) through the cache: the conv
    class's ``__call__`` is wrapped (once per class, idempotent) so that a call whose
    ``cache`` is a kvcache ``LayerCache`` runs ``conv_forward`` on the cache's state slots, and
    any other call (mlx-lm's own generation with its ``ArraysCache``) is mlx-lm's own,
    unchanged. Returns the layers routed ([] for a family without state layers).
    ``routing.route`` calls it."""
    layers = conv_layers(model)
    for cls in {type(m) for m in layers.values()}:
        original = cls.__call__
        if getattr(original, _ROUTED_ATTR, False):
            continue
        cls.__call__ = _routed(original)
    return sorted(layers)


def _routed(original):
    from .protocol import LayerCache

    @functools.wraps(original)
    def __call__(self, x, mask=None, cache=None):
        if isinstance(cache, LayerCache):
            return conv_forward(self, cache, x, mask)
        return original(self, x, mask=mask, cache=cache)

    setattr(__call__, _ROUTED_ATTR, True)
    return __call__


def _states(forward, layer: int, s: int, k1: int, hidden: int, dtype):
    """The forward's ``s`` states of ``layer`` as an mx array ``(s, k1, hidden)`` of
    ``dtype`` (zeros while probing)."""
    from .protocol import _from_cache
    if forward.probe is not None:
        return mx.zeros((s, k1, hidden), dtype)
    return _from_cache(forward.cache, forward.cache.get_state(layer, CONV_STATE), dtype)


def conv_forward(module, layer_cache, x, mask=None):
    """An LFM2 short-convolution layer of an mlx-lm model over the open forward of the cache
    behind ``layer_cache`` (a ``LayerCache``), per sequence.

    ``x`` ``(T, 1, hidden)``: the forward's T new tokens as batch rows, the sequences' tokens
    in ``begin_forward`` order (prefill chunks and decode tokens alike). Each sequence's
    convolution starts from its state (``cache.get_state(layer, "conv")``, ``(B,
    conv_L_cache - 1, hidden)``: zeros for a new sequence) and never reads another sequence's
    inputs; its last ``conv_L_cache - 1`` inputs become its state (``cache.set_state``,
    committed at ``end_forward``). The arithmetic is mlx-lm's (``in_proj``, ``B * x``, the
    module's own ``nn.Conv1d`` over the history and the new inputs, ``C *``, ``out_proj``).
    Returns ``(T, 1, hidden)``. While ``describe`` probes, the rows are one sequence from a
    zero state and nothing is written. Raises ``InvalidArgumentError`` when ``x`` is not the
    forward's rows and ``UnsupportedFeatureError`` for a mask array (the cache's batches are
    packed, without padding) or a model that attends itself (one call per sequence)."""
    from .protocol import _to_cache
    f = layer_cache._forward
    layer = layer_cache.layer
    if mask is not None:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) of the {_family(f.model)} model got a "
            f"mask: the cache's batches are packed, without padding")
    if f.own_attention and f.probe is None:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}): a model that attends itself (one call "
            f"per sequence) does not run short convolutions on the cache")
    if f.positions is None:
        raise InvalidArgumentError(
            f"layer {layer}: a kvcache LayerCache is used outside a forward (run the model "
            f"through Engine.generate, or take layer_caches(model, cache) inside "
            f"cache.forward(...))")
    T = int(f.positions.shape[0])
    if f.probe is not None:
        lengths: tuple = (T,)
    else:
        lengths = tuple(int(n) for n in f.cache.open_plan.append_lengths)
    if x.ndim != 3 or x.shape[1] != 1 or x.shape[0] != T or sum(lengths) != T:
        raise InvalidArgumentError(
            f"layer {layer}: the conv's input {tuple(x.shape)} is not the forward's {T} "
            f"tokens as batch rows ({T}, 1, hidden)")
    BCx = module.in_proj(x)
    B, C, xs = mx.split(BCx, 3, axis=-1)
    Bx = (B * xs).reshape(T, -1)                                   # (T, H)
    hidden, k1 = int(Bx.shape[-1]), int(module.L_cache) - 1
    s = len(lengths)
    states = _states(f, layer, s, k1, hidden, Bx.dtype)            # (S, k1, H)
    order, out, keep = (mx.array(a.astype(np.int32)) for a in conv_indices(lengths, k1))
    laid = mx.concatenate([states.reshape(s * k1, hidden), Bx])[order]    # (S*k1 + T, H)
    # one unpadded depthwise conv over every block; the windows that cross a block boundary
    # are dropped (out), so no sequence reads another's inputs
    conv_out = module.conv(laid[None])[0][out]                     # (T, H)
    if f.probe is None:
        new = laid[keep].reshape(s, k1, hidden)
        f.cache.set_state(layer, CONV_STATE, _to_cache(f.cache, new))
        marks = f.cache.state_checkpoints()
        if marks:   # the prefix cache's boundaries inside the appends: the k1 inputs before each
            at = mx.array(checkpoint_columns(lengths, k1, marks).astype(np.int32))
            f.cache.set_state_checkpoints(layer, CONV_STATE, _to_cache(
                f.cache, laid[at].reshape(len(marks), k1, hidden)))
    y = C * conv_out[:, None, :]
    return module.out_proj(y)

