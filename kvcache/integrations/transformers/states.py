"""The recurrent-state layers of a transformers model on the cache's state slots (issue 56,
docs/hybrid.md "Built: increment 5"): LFM2's short convolutions (``lfm2``, ``lfm2_moe``).

A conv layer of LFM2 (``Lfm2ShortConv``) projects its input to ``B, C, x`` (``in_proj``),
convolves ``B * x`` causally over time with a depthwise kernel of ``conv_L_cache`` taps, and
gates the result with ``C``. Between steps it keeps the last ``conv_L_cache - 1`` inputs of the
convolution (``B * x``) per channel: transformers' cache keeps ``conv_L_cache`` of them
(``LinearAttentionLayer.update_conv_state``; the oldest is never read). On the cache each conv
layer is a ``kvcache.State({"conv": (hidden_size, conv_L_cache - 1)})`` layer (channels first,
the oldest input first, as the model keeps it), and its forward over a packed batch (prefill
chunks and decode tokens of many sequences in one row) runs per sequence from that state
(``route_state_layers``). Anything about a family these functions do not know is refused with
``UnsupportedFeatureError`` naming it (``state_kinds``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Optional

import numpy as np

from ...arrays import to_numpy
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..conv_states import conv_indices as _indices

torch = require("torch", "transformers")

CONV_STATE = "conv"
"""The name of a conv layer's state (``State({"conv": (hidden_size, conv_L_cache - 1)})``)."""

# family (config.model_type) -> (the module, the class) of its short convolution: classes whose
# forward was read line by line (transformers 5.24: the same code in both families); a
# subclass, or another family's convolution, is not assumed to compute the same
_CONV_CLASSES = {
    "lfm2": ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"),
    "lfm2_moe": ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
}
STATE_FAMILIES = tuple(sorted(_CONV_CLASSES))
"""The model types whose recurrent-state layers run on the cache (their short convolutions)."""
_LAYER_TYPES = ("conv", "full_attention")

_ROUTED: "weakref.WeakSet" = weakref.WeakSet()     # conv modules whose forward is routed
# the cache of the forward the adapter is running in this thread (None: none): a decoder layer
# that does not pass its keyword arguments down to its conv (transformers releases differ)
# still reaches the cache's states; outside it the conv is transformers' own
_SERVING: contextvars.ContextVar = contextvars.ContextVar("kvcache_state_cache", default=None)


@contextlib.contextmanager
def serving(cache):
    """The routed convs of any model run on ``cache``'s state slots for the duration, also
    when their decoder layer does not pass ``kvcache=cache`` down (``TransformersAdapter``
    wraps each model call of a forward in it)."""
    token = _SERVING.set(cache)
    try:
        yield
    finally:
        _SERVING.reset(token)


def _family(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "model_type", None) or type(model).__name__)


def conv_layers(model) -> dict:
    """``{layer: (path, module)}``: the short-convolution modules of an LFM2-family ``model``
    (``STATE_FAMILIES``), by decoder layer; empty for any other family (whose state, if it
    keeps one, ``refuse_hybrid`` refuses). Raises ``UnsupportedFeatureError`` naming the layer
    and the value when the model is of such a family but something is not what was read:
    a ``layer_types`` entry other than ``"conv"`` / ``"full_attention"``, a conv module of
    another class (a subclass too), a kernel below 2 taps or not ``conv_L_cache``, a conv that
    is not depthwise, strided or dilated, an ``in_proj`` not of ``3 * hidden_size`` outputs,
    accelerate hooks on the module (offloaded weights: the forward reads ``conv.weight``), or
    conv modules not exactly at the ``"conv"`` layers."""
    family = _family(model)
    known = _CONV_CLASSES.get(family)
    if known is None:
        return {}
    config = model.config
    n = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or ())
    if len(types) < n:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(types)} layer_types for {n} layers: which layers are "
            f"short convolutions is not understood")
    for i, kind in enumerate(types[:n]):
        if kind not in _LAYER_TYPES:
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has layer type {kind!r}: the cache serves "
                f"{' and '.join(map(repr, _LAYER_TYPES))} layers of this family only")
    hidden = int(config.hidden_size)
    found: dict = {}
    for path, m in model.named_modules():
        cls = type(m)
        if not cls.__name__.endswith("ShortConv"):
            continue
        where = f"{path} ({cls.__name__})"
        if (cls.__module__, cls.__name__) != known:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} is not transformers' {known[1]} (a subclass or "
                f"a replacement): its convolution is not understood")
        layer = getattr(m, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < n or types[layer] != "conv":
            raise UnsupportedFeatureError(
                f"the {family} model's {where} has layer_idx={layer!r}, not a 'conv' layer of "
                f"its {n} layers")
        if layer in found:
            raise UnsupportedFeatureError(
                f"the {family} model has two conv modules in layer {layer} "
                f"({found[layer][0]}, {path}); the cache holds one state per layer")
        _check_conv(family, where, m, hidden, int(config.conv_L_cache))
        found[layer] = (path, m)
    want = [i for i in range(n) if types[i] == "conv"]
    if sorted(found) != want:
        raise UnsupportedFeatureError(
            f"the {family} model's layer_types name the conv layers {want}, but conv modules "
            f"were found in layers {sorted(found)}")
    return {i: found[i] for i in want}


def _check_conv(family: str, where: str, m, hidden: int, taps: int) -> None:
    conv = getattr(m, "conv", None)
    weight = getattr(conv, "weight", None)
    if not isinstance(conv, torch.nn.Conv1d) or weight is None:
        raise UnsupportedFeatureError(f"the {family} model's {where} has no Conv1d `conv`")
    k = int(weight.shape[-1])
    if k < 2 or k != taps or int(m.conv_kernel_size) != taps:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} has a kernel of {k} taps (conv_kernel_size="
            f"{m.conv_kernel_size}, config.conv_L_cache={taps}): the cache serves kernels of "
            f">= 2 taps equal to conv_L_cache")
    if (tuple(weight.shape) != (hidden, 1, k) or conv.groups != hidden
            or tuple(conv.stride) != (1,) or tuple(conv.dilation) != (1,)):
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: conv weight {tuple(weight.shape)}, groups="
            f"{conv.groups}, stride={tuple(conv.stride)}, dilation={tuple(conv.dilation)}; the "
            f"cache serves a depthwise causal convolution over hidden_size={hidden} channels "
            f"(weight ({hidden}, 1, {k}), groups={hidden}, stride 1, dilation 1) only")
    proj = getattr(m, "in_proj", None)
    if not isinstance(proj, torch.nn.Linear) or proj.out_features != 3 * hidden:
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: in_proj must be a Linear of 3 * {hidden} outputs "
            f"(B, C, x), got {proj!r:.80}")
    for part in (m, conv):
        if getattr(part, "_hf_hook", None) is not None:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} has accelerate hooks (device_map offloading): the "
                f"cache's convolution reads the weights where they are; load the model whole "
                f"on one device")


def state_kinds(model) -> dict:
    """``{layer: kvcache.State({"conv": (hidden_size, conv_L_cache - 1)})}`` for the short
    convolutions of an LFM2-family ``model`` (``conv_layers``: raises
    ``UnsupportedFeatureError`` for what is not understood); empty for other families. The
    ``CacheConfig.layer_kinds`` entries a cache for the model must have, beside any window
    groups: the model cannot run on the cache without them."""
    from ...config import State
    layers = conv_layers(model)
    if not layers:
        return {}
    hidden, taps = int(model.config.hidden_size), int(model.config.conv_L_cache)
    return {i: State({CONV_STATE: (hidden, taps - 1)}) for i in layers}


def route_state_layers(model) -> list:
    """Route the short convolutions of ``model`` (``conv_layers``) through the cache: each
    conv module's forward, called with ``kvcache=cache`` (the keyword the ``"kvcache"``
    attention reads, passed down by the decoder layers), runs ``conv_forward`` on the cache's
    state slots; called without it (transformers' own ``generate``, a plain forward) it is
    transformers' own, unchanged. Idempotent (a module is wrapped once). Returns the layers
    routed ([] for a family without state layers). ``cache_config`` and
    ``TransformersAdapter`` call it."""
    layers = conv_layers(model)
    for _, (_, module) in layers.items():
        if module in _ROUTED:
            continue
        original = module.forward

        @functools.wraps(original)
        def forward(*args, _module=module, _original=original, **kwargs):
            cache = kwargs.get("kvcache")
            if cache is None:
                cache = _SERVING.get()
            if cache is None:
                return _original(*args, **kwargs)
            return _routed_call(_module, cache, args, kwargs)

        module.forward = forward
        _ROUTED.add(module)
    return sorted(layers)


# keywords a decoder layer passes its conv that change nothing the cache computes: positions
# are the cache's, use_cache / output flags belong to other modules, ``kvcache`` is the cache
_IGNORED = frozenset(("kvcache", "position_ids", "use_cache", "output_attentions",
                      "output_hidden_states", "cache_position", "logits_to_keep",
                      "return_dict"))


def _routed_call(module, cache, args: tuple, kwargs: dict):
    """The conv module's call with ``kvcache=cache``: its arguments checked (transformers'
    ``(hidden_states, cache=None, attention_mask=None, **kwargs)``), then ``conv_forward``."""
    layer = module.layer_idx
    kw = dict(kwargs)
    names = ("hidden_states", "cache", "attention_mask")
    if len(args) > len(names):
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) was called with {len(args)} positional "
            f"arguments; its convolution on the cache takes (hidden_states, cache, "
            f"attention_mask)")
    for name, value in zip(names, args):
        kw[name] = value
    hidden_states = kw.pop("hidden_states", None)
    if hidden_states is None:
        raise InvalidArgumentError(f"layer {layer} ({type(module).__name__}) got no hidden_states")
    own = kw.pop("cache", None)
    if own is None:
        own = kw.pop("past_key_values", None)
    if own is not None:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) got transformers' own cache "
            f"({type(own).__name__}) beside kvcache=...: call the model with use_cache=False")
    mask = kw.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask == 1)):
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) got a padding mask: the cache's batches "
            f"are packed, without padding; pass no attention_mask")
    for name, value in kw.items():
        if value is not None and name not in _IGNORED:
            raise UnsupportedFeatureError(
                f"layer {layer} ({type(module).__name__}) was passed {name}=... ; its "
                f"convolution on the cache does not implement {name!r}")
    return conv_forward(module, cache, hidden_states)


def _state_to_torch(cache, state, device, dtype):
    if torch.is_tensor(state):
        return state.to(device=device, dtype=dtype)
    return torch.from_numpy(np.asarray(to_numpy(state), np.float32)).to(device=device, dtype=dtype)


def _state_to_cache(cache, values):
    if cache.backend.is_native(values):
        return values.to(getattr(torch, cache.config.dtype)).contiguous()
    return cache.from_numpy(values.detach().to("cpu", torch.float32).numpy())


def conv_forward(module, cache, hidden_states):
    """An LFM2 short-convolution layer over the open forward of ``cache``, per sequence.

    ``module``: the layer's conv module (``conv_layers``); ``hidden_states`` (1, T, hidden): the
    T new tokens of the forward's sequences packed in ``begin_forward`` order (prefill chunks
    and decode tokens alike). Each sequence's convolution starts from its state
    (``cache.get_state(layer, "conv")``, (B, hidden, conv_L_cache - 1): zeros for a new
    sequence), never from another sequence's inputs, and its last ``conv_L_cache - 1`` inputs
    become its state (``cache.set_state``, committed at ``end_forward``). Returns the layer's
    output (1, T, hidden) in ``hidden_states``' dtype: what transformers' own forward gives
    token by token (same ops: ``in_proj``, ``B * x``, a depthwise ``conv1d`` in the weights'
    dtype, ``C *``, ``out_proj``). Raises ``InvalidArgumentError`` when ``hidden_states`` is not
    the open forward's packed row."""
    layer = module.layer_idx
    plan = cache.open_plan
    if plan is None:
        cache.get_state(layer, CONV_STATE)          # raises ForwardStateError: no forward
    if cache.static_bucket is not None:
        raise UnsupportedFeatureError(
            f"layer {layer}: a static-shape (captured) step cannot run a short convolution on "
            f"the cache; graphs are off for models with state layers")
    lengths = tuple(int(n) for n in plan.append_lengths)
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 \
            or hidden_states.shape[1] != sum(lengths):
        raise InvalidArgumentError(
            f"layer {layer}: hidden_states {tuple(hidden_states.shape)} is not the forward's "
            f"packed row (1, {sum(lengths)}, hidden) of sequences {plan.seq_ids}")
    conv = module.conv
    weight = conv.weight                                          # (H, 1, K)
    hid, k1 = int(weight.shape[0]), int(weight.shape[-1]) - 1
    device = hidden_states.device
    bcx = module.in_proj(hidden_states).transpose(-1, -2)        # (1, 3H, T)
    b, c, x = bcx.chunk(3, dim=-2)
    bx = (b * x)[0]                                               # (H, T)
    states = _state_to_torch(cache, cache.get_state(layer, CONV_STATE), device, bx.dtype)
    s = len(lengths)
    order, out, keep = (torch.from_numpy(a).to(device) for a in _indices(lengths, k1))
    src = torch.cat([states.permute(1, 0, 2).reshape(hid, s * k1), bx], dim=1)
    laid = src.index_select(1, order)                             # (H, S*k1 + T)
    # one depthwise conv over every block; the windows that cross a block boundary are dropped
    y = torch.nn.functional.conv1d(laid.unsqueeze(0).to(weight.dtype), weight, conv.bias,
                                   groups=hid)[0]
    y = y.index_select(1, out).to(hidden_states.dtype)            # (H, T)
    new = laid.index_select(1, keep).view(hid, s, k1).permute(1, 0, 2)
    cache.set_state(layer, CONV_STATE, _state_to_cache(cache, new))
    y = (c[0] * y).transpose(0, 1).unsqueeze(0).contiguous()      # (1, T, H)
    return module.out_proj(y)
