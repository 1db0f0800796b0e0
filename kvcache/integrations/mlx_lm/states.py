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
``UnsupportedFeatureError`` naming it.

A mamba layer of mlx-lm's Granite-4.0-H (``granitemoehybrid``: ``GraniteMoeHybridMamba2Mixer``;
Nemotron-H's ``NemotronHMamba2Mixer`` is the same code with a gated norm per group) projects
``gate, xBC, dt`` (``in_proj``), convolves ``xBC`` causally with a depthwise ``nn.Conv1d`` of
``mamba_d_conv`` taps (then SiLU), splits it into ``x, B, C`` and runs the selective SSM
(``mlx_lm.models.ssm.ssm_update``) whose state ``(heads, head_dim, d_state)`` carries from token
to token, then a gated RMS norm and ``out_proj``. mlx-lm keeps, in the layer's
``ArraysCache(size=2)``, entry 0 ``(batch, mamba_d_conv - 1, conv_dim)`` (the conv's last
inputs, time first, as LFM2's) and entry 1 the SSM state, float32. On the cache each such layer
is ``State({"conv": (mamba_d_conv - 1, conv_dim), "ssm": (heads, head_dim, d_state)},
dtype="float32")``, run per sequence by ``mamba_forward`` (docs/hybrid.md "Built: increment
10"). Falcon-H1 (``falcon_h1``: ``FalconH1Mixer``, the same code; without ``mamba_rms_norm``
the gate is SwiGLU alone) runs such a mixer beside attention in every decoder layer, whose
``make_cache()`` entry is a ``CacheList(ArraysCache(size=2), KVCache())``: the mixer is state
layer ``2 i``, the attention the paged layer ``2 i + 1`` (``model.PAIRED_FAMILIES``;
docs/hybrid.md "Built: increment 13"). Mamba-2 (``mamba2``: ``Mamba2Block``, the same code)
has such a mixer in every layer and no attention: every cache layer is a state layer, and the
cache has no pages.

A Mamba (Mamba-1) mixer of mlx-lm's ``mamba`` and ``falcon_mamba`` (``MambaBlock``, every
layer, no attention; Jamba's ``JambaMambaMixer``, the same beside attention layers, its scan
over a call's tokens at once)
projects ``x, z`` (``in_proj``), convolves ``x`` causally with a depthwise ``nn.Conv1d`` of
``conv_kernel`` taps (then SiLU) and runs its own selective scan token by token
(``ssm_step``) from the state ``(intermediate, d_state)``, in the model's dtype, then
``out_proj(swiglu(z, y))``. mlx-lm keeps, in the layer's ``ArraysCache(size=2)``, the conv's
last inputs (time first) and that state: ``State({"conv": (conv_kernel - 1, intermediate),
"ssm": (intermediate, d_state)})`` in the cache dtype, run by ``mamba1_forward``.

A gated DeltaNet layer of mlx-lm's Qwen3-Next (``qwen3_next``: ``Qwen3NextGatedDeltaNet``)
projects ``q, k, v, z`` (``in_proj_qkvz``) and ``b, a`` (``in_proj_ba``), ordered per key head
by the layer's own ``fix_query_key_value_ordering``, convolves ``q, k, v`` causally with a
depthwise ``nn.Conv1d`` of ``linear_conv_kernel_dim`` taps (then SiLU), L2-normalizes ``q``
and ``k`` (``normalize_qk``) and runs the gated delta rule
(``mlx_lm.models.gated_delta.gated_delta_update``, token by token from the state ``(value
heads, head_v_dim, head_k_dim)``, float32), then a gated RMS norm per value head and
``out_proj``. mlx-lm keeps, in the layer's ``ArraysCache(size=2)``, entry 0 ``(batch, kernel -
1, conv_dim)`` (the conv's last inputs, time first) and entry 1 the recurrent state, float32.
On the cache each such layer is ``State({"conv": (kernel - 1, conv_dim), "recurrent":
(value heads, head_v_dim, head_k_dim)}, dtype="float32")``, run per sequence by
``gdn_forward`` (docs/hybrid.md "Built: increment 11")."""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable, NoReturn

import numpy as np

from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..conv_states import check_gdn_dims, check_mamba_dims, checkpoint_columns, conv_indices
from .model import PAIRED_FAMILIES, _family

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
# family -> (module, class) of its Mamba-2 mixer: the class whose __call__ (and the
# module's ssm_update, mlx_lm.models.ssm's) was read line by line (mlx-lm 0.32.2)
# (and the module's gated norm class; mlx-lm 0.32.2: the same mixer code in both modules, the
# norm Granite's over all channels, Nemotron-H's per group)
_MAMBA_CLASSES = {
    "granitemoehybrid": ("mlx_lm.models.granitemoehybrid", "GraniteMoeHybridMamba2Mixer",
                         "GraniteMoeHybridRMSNormGated"),
    "nemotron_h": ("mlx_lm.models.nemotron_h", "NemotronHMamba2Mixer", "MambaRMSNormGated"),
    # the same mixer code beside attention in every layer (mlx-lm 0.32.2); D not cast, and
    # without mamba_rms_norm the gate is swiglu alone
    "falcon_h1": ("mlx_lm.models.falcon_h1", "FalconH1Mixer", "FalconH1RMSNormGated"),
    # the same mixer code in every layer, no attention (mlx-lm 0.32.2); D not cast
    "mamba2": ("mlx_lm.models.mamba2", "Mamba2Block", "MambaRMSNormGated"),
}
# the families whose mixer casts D to the input's dtype before ssm_update (the others pass it
# as it is: a 16-bit model's D then promotes differently)
_D_CAST = frozenset({"granitemoehybrid", "nemotron_h"})
# family -> (module, class) of its gated DeltaNet layer and its gated norm: the class whose
# __call__ (and mlx_lm.models.gated_delta's gated_delta_update and normalize_qk) was read line by
# line (mlx-lm 0.32.2)
_GDN_CLASSES = {
    "qwen3_next": ("mlx_lm.models.qwen3_next", "Qwen3NextGatedDeltaNet", "Qwen3NextRMSNormGated"),
}
# family -> (module, class) of its Mamba (Mamba-1) mixer: the class whose __call__ and
# ssm_step were read line by line (mlx-lm 0.32.2); its state stays in the model's dtype
_MAMBA1_CLASSES = {"mamba": ("mlx_lm.models.mamba", "MambaBlock"),
                   # mlx-lm loads it with mamba.py's classes, its ssm_step norming B, C and the
                   # time step (use_bcdt_rms)
                   "falcon_mamba": ("mlx_lm.models.mamba", "MambaBlock"),
                   # beside attention layers; its ssm_step scans a whole call's tokens (one
                   # sequence) and RMS-norms the time step, B and C
                   "jamba": ("mlx_lm.models.jamba", "JambaMambaMixer")}
STATE_FAMILIES = tuple(sorted({**_CONV_CLASSES, **_MAMBA_CLASSES, **_GDN_CLASSES,
                               **_MAMBA1_CLASSES}))
"""The mlx-lm model types whose recurrent-state layers run on the cache (LFM2's short
convolutions, the Mamba-2 mixers of Granite-4.0-H, Nemotron-H, Falcon-H1 and Mamba-2,
Mamba-1's mixers, Qwen3-Next's gated DeltaNet)."""
SERVED_STATE_LAYERS = (f"the short convolutions of {', '.join(sorted(_CONV_CLASSES))}, the "
                       f"Mamba-2 mixers of {', '.join(sorted(_MAMBA_CLASSES))}, the Mamba-1 "
                       f"mixers of {', '.join(sorted(_MAMBA1_CLASSES))} and the gated "
                       f"DeltaNet layers of {', '.join(sorted(_GDN_CLASSES))}")
"""What the refusal of another recurrent cache names as served (``sliding_windows``)."""
SSM_STATE = "ssm"
"""The name of a Mamba-2 layer's SSM state (``(heads, head_dim, d_state)``, float32)."""
RECURRENT_STATE = "recurrent"
"""The name of a gated DeltaNet layer's recurrent state (``(value heads, head_v_dim,
head_k_dim)``, float32: mlx-lm's layout)."""
WIDE_STATE = "float32"
"""The ``State.dtype`` of the Mamba-2 and gated DeltaNet layers' states: mlx-lm keeps the SSM
and the delta rule's state in float32 (their decays are float32) whatever the model dtype;
the conv's inputs fit float32 exactly."""
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
    found = _known(model, _CONV_CLASSES)
    if found is None:
        return {}
    family, known, _, cls = found
    args = model.args
    layers = list(model.layers)
    n = int(args.num_hidden_layers)
    types = list(getattr(args, "layer_types", None) or ())
    for i, kind in enumerate(types):
        if kind not in ("conv", "full_attention"):
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has layer type {kind!r}: the cache serves "
                f"'conv' and 'full_attention' layers of this family only")
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
        _check_entry(family, where, caches, i, 1, "its convolution keeps its inputs in")
        found[i] = conv
    return found


def _known(model, table: dict):
    """``(family, entry, module, class)`` of ``model``'s family where ``table`` (family ->
    (mlx-lm module, state class name, ...)) has it: the entry, the imported module and its
    state class; None for another family."""
    family = _family(model)
    known = table.get(family)
    if known is None:
        return None
    source = importlib.import_module(known[0])
    return family, known, source, getattr(source, known[1])


def _exactly(family: str, i: int, module, known: tuple, cls, what: str) -> str:
    """``where`` (``"layer i (module.Class)"``) of layer ``i``'s state ``module``, refused
    unless it is exactly mlx-lm's class ``cls`` (``known``: its module and name): a subclass
    or a replacement computes what it likes. ``what`` names it in the message."""
    where = f"layer {i} ({type(module).__module__}.{type(module).__name__})"
    if type(module) is not cls:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} is not mlx-lm's {known[0]}.{known[1]} (a "
            f"subclass or a replacement): {what} is not understood")
    return where


def _check_entry(family: str, where: str, caches: list, i: int, size: int, what: str) -> None:
    """UnsupportedFeatureError unless ``make_cache()``'s entry ``i`` is an
    ``ArraysCache(size=size)`` (``what``: what the layer keeps in it, for the message)."""
    from mlx_lm.models import cache as mlx_cache
    c = caches[i] if i < len(caches) else None
    if type(c) is not mlx_cache.ArraysCache or len(c.cache) != size:
        raise UnsupportedFeatureError(
            f"the {family} model's make_cache() gives {where} a {type(c).__name__}, not "
            f"the ArraysCache(size={size}) {what}")


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


def mamba_layers(model) -> dict:
    """``{slot: module}``: the Mamba-2 mixers of a Granite-4.0-H (``granitemoehybrid``),
    Nemotron-H (``nemotron_h``), Falcon-H1 (``falcon_h1``) or Mamba-2 (``mamba2``) mlx-lm
    ``model``, by cache slot (the index of the layer's entry in ``model.make_cache()``:
    Granite's and Mamba-2's decoder layer; Nemotron-H's MLP and MoE blocks take no slot;
    Falcon-H1's layer ``i`` takes two, its mixer ``2 i`` and its attention ``2 i + 1``); empty
    for any other family. Raises
    ``UnsupportedFeatureError`` naming the layer and the value when the model is of such a
    family but something is not what was read: a layer type other than Granite's
    ``"mamba"`` / ``"attention"`` or Nemotron-H's ``M`` / ``*`` / ``-`` / ``E`` blocks (or not
    one per layer), a decoder layer whose type
    and modules do not match (Falcon-H1: a decoder layer of another class, a subclass too, or
    without attention; Mamba-2: a block of another class, a subclass too), a mixer of another
    class (a subclass too), the module's ``ssm_update`` not mlx-lm's
    ``mlx_lm.models.ssm.ssm_update``, heads that do not tile
    ``intermediate_size`` or groups that do not divide them, ``conv_dim`` other than
    ``intermediate_size + 2 * n_groups * d_state``, a kernel below 2 taps or not
    ``conv_kernel_size``, a conv that is not depthwise, padded, strided or dilated,
    ``in_proj`` / ``A_log`` / ``D`` / ``dt_bias`` / the gated norm of other sizes or classes, a
    ``time_step_limit`` that is not two numbers, or a ``make_cache()`` entry other than
    ``ArraysCache(size=2)`` at a mamba layer (Falcon-H1: ``CacheList(ArraysCache(size=2),
    KVCache())``)."""
    found = _known(model, _MAMBA_CLASSES)
    if found is None:
        return {}
    family, known, source, cls = found
    from mlx_lm.models import ssm as mlx_ssm
    if getattr(source, "ssm_update", None) is not mlx_ssm.ssm_update:
        raise UnsupportedFeatureError(
            f"the {family} model's module {known[0]} calls an ssm_update other than "
            f"mlx_lm.models.ssm.ssm_update: its SSM is not understood")
    hidden = int(model.args.hidden_size)
    caches = list(model.make_cache())
    found = {}
    for slot, i, mixer in _mamba_walk(model, family):
        where = _exactly(family, i, mixer, known, cls, "its mixer")
        _check_mixer(family, where, mixer, hidden, getattr(source, known[2]))
        if family in PAIRED_FAMILIES:
            _check_pair(family, where, caches, i)
        else:
            _check_entry(family, where, caches, slot, 2,
                         "its mixer keeps its conv and SSM states in")
        found[slot] = mixer
    return found


# Nemotron-H's blocks: M a Mamba-2 mixer, * attention (each one cache slot), - an MLP, E MoE
_NEMOTRON_BLOCKS = {"M": True, "*": True, "-": False, "E": False}


def _check_pair(family: str, where: str, caches: list, i: int) -> None:
    """UnsupportedFeatureError unless ``make_cache()``'s entry ``i`` is a ``CacheList`` of an
    ``ArraysCache(size=2)`` and a ``KVCache`` (a Falcon-H1 layer's mixer and attention)."""
    from mlx_lm.models import cache as mlx_cache
    c = caches[i] if i < len(caches) else None
    inner = tuple(c.caches) if type(c) is mlx_cache.CacheList else ()
    if (len(inner) != 2 or type(inner[0]) is not mlx_cache.ArraysCache
            or len(inner[0].cache) != 2 or type(inner[1]) is not mlx_cache.KVCache):
        what = (f"CacheList({', '.join(type(x).__name__ for x in inner)})"
                if type(c) is mlx_cache.CacheList else type(c).__name__)
        raise UnsupportedFeatureError(
            f"the {family} model's make_cache() gives {where} a {what}, not the CacheList("
            f"ArraysCache(size=2), KVCache()) its mixer and attention keep their states and "
            f"keys in")


def _blocks(model, family: str, block: str) -> tuple:
    """``(module, block class, decoder layers)`` of a ``family`` model whose decoder layers
    are its module's class ``block``, one per ``num_hidden_layers`` (raises
    ``UnsupportedFeatureError`` for another count; the caller checks the classes)."""
    module = _MAMBA_CLASSES[family][0]
    block_cls = getattr(importlib.import_module(module), block)
    layers, n = list(model.layers), int(model.args.num_hidden_layers)
    if len(layers) != n:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(layers)} layers for num_hidden_layers={n}: which "
            f"cache slots are its mixers is not understood")
    return module, block_cls, layers


def _falcon_walk(model, family: str) -> list:
    """``[(slot, layer, mixer)]`` of a Falcon-H1: every decoder layer ``i`` runs its mixer
    (cache slot ``2 i``) beside its attention (slot ``2 i + 1``), the decoder layer class's
    own call handing them ``cache[0]`` and ``cache[1]`` (raises ``UnsupportedFeatureError``
    naming the layer for another class or no attention)."""
    module, block_cls, layers = _blocks(model, family, "FalconH1DecoderLayer")
    for i, block in enumerate(layers):
        if type(block) is not block_cls or getattr(block, "self_attn", None) is None:
            raise UnsupportedFeatureError(
                f"layer {i} ({type(block).__module__}.{type(block).__name__}) of the {family} "
                f"model is not mlx-lm's {module}.FalconH1DecoderLayer with attention beside "
                f"its mixer (a subclass or a replacement): which cache its mixer and attention "
                f"are given is not understood")
    return [(2 * i, i, getattr(block, "mamba", None)) for i, block in enumerate(layers)]


def _mamba2_walk(model, family: str) -> list:
    """``[(slot, layer, mixer)]`` of a Mamba-2 (``mamba2``): every decoder layer (a
    ``ResidualBlock``: the mixer over the normed input, plus the input) is a mixer, its cache
    slot its index (raises ``UnsupportedFeatureError`` naming the layer for a block of another
    class, a subclass too)."""
    module, block_cls, layers = _blocks(model, family, "ResidualBlock")
    for i, block in enumerate(layers):
        if type(block) is not block_cls:
            raise UnsupportedFeatureError(
                f"layer {i} ({type(block).__module__}.{type(block).__name__}) of the {family} "
                f"model is not mlx-lm's {module}.ResidualBlock (a subclass or a replacement): "
                f"how it calls its mixer is not understood")
    return [(i, i, getattr(block, "mixer", None)) for i, block in enumerate(layers)]


def _mamba_walk(model, family: str) -> list:
    """``[(slot, layer, mixer)]``: the mamba layers of a ``_MAMBA_CLASSES`` family's
    ``model``, each with its cache slot and decoder layer; the layer stack checked against its
    config (raises ``UnsupportedFeatureError`` naming the layer)."""
    if family in PAIRED_FAMILIES:
        return _falcon_walk(model, family)
    if family == "mamba2":
        return _mamba2_walk(model, family)
    args, layers = model.args, list(model.layers)
    if family == "nemotron_h":
        types = list(getattr(args, "hybrid_override_pattern", None) or ())
        attrs = [("block_type", "mixer")] * len(layers)
        known, mamba = _NEMOTRON_BLOCKS, "M"
    else:
        types = list(getattr(args, "layer_types", None) or ())
        attrs = [("layer_type", "mamba")] * len(layers)
        known, mamba = {"mamba": True, "attention": True}, "mamba"
    n = int(args.num_hidden_layers)
    if len(types) != n or len(layers) != n:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(types)} layer types and {len(layers)} layers for "
            f"num_hidden_layers={n}: which layers are Mamba mixers is not understood")
    out, slot = [], 0
    for i, (kind, block, (kind_attr, mixer_attr)) in enumerate(zip(types, layers, attrs)):
        if kind not in known:
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has layer type {kind!r}: the cache serves "
                f"{', '.join(map(repr, known))} layers of this family only")
        mixer: Any = getattr(block, mixer_attr, None)
        if getattr(block, kind_attr, None) != kind or (
                family != "nemotron_h" and ((mixer is None) == (kind == mamba) or (
                    mixer is not None and getattr(block, "self_attn", None) is not None))):
            raise UnsupportedFeatureError(
                f"layer {i} ({type(block).__name__}) of the {family} model is not a plain "
                f"{kind!r} layer ({kind_attr}={getattr(block, kind_attr, None)!r}, "
                f"{mixer_attr}: {type(mixer).__name__})")
        if kind == mamba:
            out.append((slot, i, mixer))
        slot += known[kind]
    return out


def _check_projections(refuse: Callable[[str], NoReturn], projections: tuple,
                       out_proj) -> None:
    """``refuse(reason)`` unless each ``(name, module, size)`` of ``projections`` is a linear
    layer of ``size`` outputs and ``out_proj`` a module (a quantized linear layer keeps packed
    columns: its rows, the outputs, are what is read)."""
    for name, proj, size in projections:
        w = proj.get("weight") if isinstance(proj, nn.Module) else None
        if w is None or int(w.shape[0]) != size:
            refuse(f"{name} must be a linear layer of {size} outputs, got "
                   f"{type(proj).__name__} {tuple(w.shape) if w is not None else ''}")
    if not isinstance(out_proj, nn.Module):
        refuse(f"out_proj {type(out_proj).__name__} is not a module")


def _check_depthwise(refuse: Callable[[str], NoReturn], conv, conv_dim: int, taps: int,
                     also: tuple = ()) -> None:
    """``refuse(reason)`` unless ``conv`` is an ``nn.Conv1d`` of ``taps`` (>= 2, the config's
    ``conv_kernel_size``; ``also``: (name, value) of the args' own tap count, equal too) taps,
    a depthwise causal convolution over ``conv_dim`` channels without padding (weight
    ``(C, taps, 1)`` in MLX's layout): the Mamba mixers' and the gated DeltaNet layer's conv."""
    weight = conv.get("weight") if isinstance(conv, nn.Conv1d) else None
    if weight is None:
        refuse("no nn.Conv1d conv1d")
    k = int(weight.shape[1])
    if not also and (k < 2 or k != taps):
        refuse(f"a kernel of {k} taps (conv_kernel_size={taps}): the cache serves kernels of "
               f">= 2 taps equal to conv_kernel_size")
    if also and (k < 2 or k != taps or taps != also[1]):
        refuse(f"a kernel of {k} taps (conv_kernel_size={taps}, {also[0]}={also[1]}): the "
               f"cache serves kernels of >= 2 taps equal to both")
    if (tuple(weight.shape) != (conv_dim, k, 1) or conv.groups != conv_dim or conv.stride != 1
            or conv.padding != 0 or conv.dilation != 1):
        refuse(f"conv weight {tuple(weight.shape)}, groups={conv.groups}, stride={conv.stride}, "
               f"padding={conv.padding}, dilation={conv.dilation}: not a depthwise causal "
               f"convolution over conv_dim={conv_dim} channels without padding")


def _refuser(family: str, where: str, what: str, increment: int) -> Callable[[str], NoReturn]:
    """A ``refuse(problem)`` raising ``UnsupportedFeatureError`` that names the family's module
    ``where`` and the problem (``what``: the cache's copy of the module in words,
    ``increment``: its section of docs/hybrid.md); the transformers side words it alike."""
    def refuse(problem: str) -> NoReturn:
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: {problem}; the cache's {what} serves what was read "
            f"(docs/hybrid.md increment {increment}) only")
    return refuse


def _check_gated_norm(refuse, norm, norm_class, size: int, whose: str) -> None:
    """``refuse(reason)`` unless ``norm`` is a ``norm_class`` of weight ``(size,)``: the gated
    RMS norm the cache runs as the model's own module (``whose``: the mixer's or the layer's,
    for the message)."""
    if (type(norm) is not norm_class
            or tuple(getattr(norm.get("weight"), "shape", ())) != (size,)):
        refuse(f"norm {type(norm).__name__}: the cache runs the {whose} gated RMS norm "
               f"({norm_class.__name__} of weight ({size},)) only")


def _check_mixer(family: str, where: str, m, hidden: int, norm_class) -> None:
    refuse = _refuser(family, where, "Mamba-2 mixer", 10)
    try:
        heads, head_dim, d_state = int(m.num_heads), int(m.head_dim), int(m.ssm_state_size)
        groups, inner, conv_dim = int(m.n_groups), int(m.intermediate_size), int(m.conv_dim)
        taps, limit = int(m.conv_kernel_size), tuple(float(v) for v in m.time_step_limit)
        conv, in_proj, out_proj = m.conv1d, m.in_proj, m.out_proj
        gated = _gated_norm(family, m)
        norm = m.norm if gated else None
        params = (m.A_log, m.D, m.dt_bias)
    except (AttributeError, TypeError, ValueError) as e:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} lacks what its mixer was read with ({e})") from None
    check_mamba_dims(refuse, heads, head_dim, groups, inner, conv_dim, d_state)
    _check_depthwise(refuse, conv, conv_dim, taps)
    w = in_proj.get("weight") if isinstance(in_proj, nn.Module) else None
    if w is None or int(w.shape[0]) != inner + conv_dim + heads:
        refuse(f"in_proj must be a linear layer of {inner + conv_dim + heads} outputs (gate, "
               f"x B C, dt), got {type(in_proj).__name__} "
               f"{tuple(w.shape) if w is not None else ''}")
    if not isinstance(out_proj, nn.Module):
        refuse(f"out_proj {type(out_proj).__name__} is not a module")
    if any(tuple(p.shape) != (heads,) for p in params):
        refuse(f"A_log, D, dt_bias of shapes {[tuple(p.shape) for p in params]}, not ({heads},)")
    if len(limit) != 2:
        refuse(f"time_step_limit={m.time_step_limit!r}: not (low, high)")
    if gated:
        _check_gated_norm(refuse, norm, norm_class, inner, "mixer's")     # per token


def _gated_norm(family: str, m) -> bool:
    """Whether mixer ``m`` gates through its gated norm (else by its module's ``swiglu``
    alone: a Falcon-H1 mixer without ``mamba_rms_norm``)."""
    return family != "falcon_h1" or bool(m.mamba_rms_norm)


def gdn_layers(model) -> dict:
    """``{layer: module}``: the gated DeltaNet layers of a Qwen3-Next (``qwen3_next``) mlx-lm
    ``model``, by decoder layer (= cache slot); empty for any other family. Raises
    ``UnsupportedFeatureError`` naming the layer and the value when the model is of that family
    but something is not what was read: the module's ``gated_delta_update`` /
    ``normalize_qk`` not mlx-lm's (``mlx_lm.models.gated_delta``), a model split over a
    pipeline, not one layer per ``num_hidden_layers``, a decoder layer of another class or
    whose ``is_linear`` is not ``full_attention_interval``'s or disagrees with its modules, a
    layer of another class (a subclass too), key heads that do not divide the value heads or
    heads that do not tile ``key_dim`` / ``value_dim``, ``conv_dim`` other than ``2 * key_dim
    + value_dim``, a kernel below 2 taps or not ``linear_conv_kernel_dim``, a conv that is not
    depthwise, padded, strided or dilated, projections of other sizes, ``A_log`` /
    ``dt_bias`` not one per value head, a gated norm of another class or size, or a
    ``make_cache()`` entry other than ``ArraysCache(size=2)`` at a linear layer."""
    found = _known(model, _GDN_CLASSES)
    if found is None:
        return {}
    family, known, source, cls = found
    from mlx_lm.models import gated_delta
    for name in ("gated_delta_update", "normalize_qk"):
        if getattr(source, name, None) is not getattr(gated_delta, name):
            raise UnsupportedFeatureError(
                f"the {family} model's module {known[0]} calls a {name} other than "
                f"mlx_lm.models.gated_delta.{name}: its gated delta rule is not understood")
    args = model.args
    inner = model.get("model") if isinstance(model, dict) else None
    ranks = int(getattr(inner, "pipeline_size", 1) or 1)
    if ranks != 1:      # each rank holds some layers and passes hidden states between ranks
        raise UnsupportedFeatureError(
            f"the {family} model is split over a pipeline of {ranks} ranks: the cache serves "
            f"the whole model on one device")
    layers, n = list(model.layers), int(args.num_hidden_layers)
    interval = int(getattr(args, "full_attention_interval", 0) or 0)
    if len(layers) != n or interval < 1:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(layers)} layers for num_hidden_layers={n} "
            f"(full_attention_interval={interval}): which layers are gated DeltaNet layers is "
            f"not understood")
    block_cls = getattr(source, "Qwen3NextDecoderLayer", None)
    caches = list(model.make_cache())
    found = {}
    for i, block in enumerate(layers):
        linear = (i + 1) % interval != 0
        gdn: Any = getattr(block, "linear_attn", None)
        attn = getattr(block, "self_attn", None)
        if (type(block) is not block_cls or getattr(block, "is_linear", None) is not linear
                or (gdn is None) == linear or (attn is None) != linear):
            raise UnsupportedFeatureError(
                f"layer {i} ({type(block).__module__}.{type(block).__name__}) of the {family} "
                f"model is not a plain {'linear' if linear else 'full'}-attention decoder layer "
                f"of {known[0]} (is_linear={getattr(block, 'is_linear', None)!r}, "
                f"linear_attn: {type(gdn).__name__}, self_attn: {type(attn).__name__}; "
                f"full_attention_interval={interval})")
        if not linear:
            continue
        where = _exactly(family, i, gdn, known, cls, "its gated DeltaNet")
        _check_gdn(family, where, gdn, int(args.linear_conv_kernel_dim),
                   getattr(source, known[2]))
        _check_entry(family, where, caches, i, 2, "its layer keeps its conv and recurrent states in")
        found[i] = gdn
    return found


def _check_gdn(family: str, where: str, m, taps_arg: int, norm_class) -> None:
    refuse = _refuser(family, where, "gated DeltaNet", 11)
    try:
        nv, nk = int(m.num_v_heads), int(m.num_k_heads)
        dk, dv = int(m.head_k_dim), int(m.head_v_dim)
        key_dim, value_dim, conv_dim = int(m.key_dim), int(m.value_dim), int(m.conv_dim)
        taps = int(m.conv_kernel_size)
        conv, norm, qkvz, ba, out_proj = m.conv1d, m.norm, m.in_proj_qkvz, m.in_proj_ba, m.out_proj
        params = (m.A_log, m.dt_bias)
        if not callable(m.fix_query_key_value_ordering):
            raise TypeError("fix_query_key_value_ordering is not a method")
    except (AttributeError, TypeError, ValueError) as e:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} lacks what its layer was read with ({e})") from None
    check_gdn_dims(refuse, nk, nv, dk, dv, key_dim, value_dim, conv_dim)
    _check_depthwise(refuse, conv, conv_dim, taps, ("linear_conv_kernel_dim", taps_arg))
    _check_projections(refuse, (("in_proj_qkvz", qkvz, 2 * key_dim + 2 * value_dim),
                                ("in_proj_ba", ba, 2 * nv)), out_proj)
    if any(tuple(p.shape) != (nv,) for p in params):
        refuse(f"A_log, dt_bias of shapes {[tuple(p.shape) for p in params]}, not ({nv},)")
    _check_gated_norm(refuse, norm, norm_class, dv, "layer's")  # per value head of each token


def mamba1_layers(model) -> dict:
    """``{layer: module}``: the Mamba (Mamba-1) mixers of a ``mamba`` / ``falcon_mamba`` (no
    attention) or ``jamba`` (mixers and attention, as ``layers_block_type`` says) mlx-lm
    ``model``, by decoder layer (= cache slot); empty for any other family. Raises
    ``UnsupportedFeatureError`` naming the layer and the value when the model is of that
    family but something is not what was read: not one layer (and layer type) per
    ``num_hidden_layers``, a layer type other than ``"mamba"`` / Jamba's ``"attention"``, a
    block or a mixer of another class (a subclass too) or a block whose modules disagree with
    its type, a kernel below 2 taps or not ``conv_kernel`` (Jamba: ``mamba_d_conv``), a conv
    that is not depthwise over ``intermediate_size`` channels, padded, strided or dilated,
    ``in_proj`` / ``x_proj`` / ``A_log`` / ``D`` of other sizes, or a
    ``make_cache()`` entry other than ``ArraysCache(size=2)``."""
    found = _known(model, _MAMBA1_CLASSES)
    if found is None:
        return {}
    family, known, source, cls = found
    jamba = family == "jamba"
    block_cls = getattr(source, "JambaDecoderLayer" if jamba else "ResidualBlock")
    args = model.args
    layers, n = list(model.layers), int(args.num_hidden_layers)
    # Jamba: a mixer or attention per layer, as layers_block_type says; Mamba: all mixers
    types = list(args.layers_block_type) if jamba else ["mamba"] * n
    if len(layers) != n or len(types) != n:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(layers)} layers and {len(types)} layer types for "
            f"num_hidden_layers={n}: which cache slots are its mixers is not understood")
    caches = list(model.make_cache())
    found = {}
    for i, (kind, block) in enumerate(zip(types, layers)):
        mixer: Any = getattr(block, "mamba" if jamba else "mixer", None)
        attention = kind == "attention" and jamba
        if (kind != "mamba" and not attention) or type(block) is not block_cls or (
                jamba and (bool(getattr(block, "is_attn", None)) != attention
                           or (mixer is None) != attention)):
            raise UnsupportedFeatureError(
                f"layer {i} ({type(block).__module__}.{type(block).__name__}, type {kind!r}) "
                f"of the {family} model is not a plain {kind!r} layer of mlx-lm's {known[0]} "
                f"(a subclass or a replacement, or its modules disagree with its type)")
        if attention:
            continue
        where = _exactly(family, i, mixer, known, cls, "its mixer")
        _check_mixer1(family, where, mixer,
                      int(args.mamba_d_conv if jamba else args.conv_kernel))
        _check_entry(family, where, caches, i, 2, "its mixer keeps its conv and SSM states in")
        found[i] = mixer
    return found


def _check_mixer1(family: str, where: str, m, taps_arg: int) -> None:
    refuse = _refuser(family, where, "Mamba mixer", 13)
    try:
        inner, d_state = int(m.intermediate_size), int(m.ssm_state_size)
        rank = int(m.time_step_rank)
        taps = int(m.conv_kernel_size)
        conv, in_proj, x_proj, out_proj = m.conv1d, m.in_proj, m.x_proj, m.out_proj
        A_log, D = m.A_log, m.D
        if not callable(m.ssm_step):
            raise TypeError("ssm_step is not a method")
    except (AttributeError, TypeError, ValueError) as e:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} lacks what its mixer was read with ({e})") from None
    _check_depthwise(refuse, conv, inner, taps, ("conv_kernel", taps_arg))
    _check_projections(refuse, (("in_proj", in_proj, 2 * inner),
                                ("x_proj", x_proj, rank + 2 * d_state)), out_proj)
    if tuple(A_log.shape) != (inner, d_state) or tuple(D.shape) != (inner,):
        refuse(f"A_log {tuple(A_log.shape)}, D {tuple(D.shape)}: not ({inner}, {d_state}) and "
               f"({inner},)")


def state_modules(model) -> dict:
    """``{layer: module}``: the modules whose state the cache keeps for ``model``: LFM2's short
    convolutions (``conv_layers``), Granite-4.0-H's / Nemotron-H's / Falcon-H1's Mamba-2
    mixers (``mamba_layers``), Qwen3-Next's gated DeltaNet layers (``gdn_layers``) or
    Mamba-1's mixers (``mamba1_layers``), by cache slot; empty for any other family. Raises
    ``UnsupportedFeatureError`` for what about a served family is not understood."""
    return (conv_layers(model) or mamba_layers(model) or gdn_layers(model)
            or mamba1_layers(model))


def state_kinds(model) -> dict:
    """The ``CacheConfig.layer_kinds`` entries of ``model``'s state layers (the model cannot run
    on the cache without them); empty for other families. An LFM2 short convolution
    (``conv_layers``): ``State({"conv": (conv_L_cache - 1, hidden_size)})`` in the cache dtype;
    a Granite-4.0-H / Nemotron-H / Falcon-H1 Mamba-2 mixer (``mamba_layers``, by cache slot):
    ``State({"conv": (conv_kernel_size - 1, conv_dim), "ssm": (num_heads, head_dim,
    ssm_state_size)}, dtype="float32")`` (mlx-lm keeps the SSM state in float32); a Qwen3-Next
    gated DeltaNet layer (``gdn_layers``): ``State({"conv": (conv_kernel_size - 1, conv_dim),
    "recurrent": (num_v_heads, head_v_dim, head_k_dim)}, dtype="float32")`` (mlx-lm keeps the
    recurrent state in float32); a Mamba-1 mixer (``mamba1_layers``): ``State({"conv":
    (conv_kernel - 1, intermediate_size), "ssm": (intermediate_size, state_size)})`` in the
    cache dtype (mlx-lm keeps the scan's state in the model's). The layouts are mlx-lm's
    ``ArraysCache`` entries' (the conv's inputs time first, the oldest first). Raises
    ``UnsupportedFeatureError`` for what is not understood."""
    from ...config import State
    layers = conv_layers(model)
    if layers:
        hidden, taps = int(model.args.hidden_size), int(model.args.conv_L_cache)
        return {i: State({CONV_STATE: (taps - 1, hidden)}) for i in layers}
    mixers = mamba_layers(model)
    if mixers:
        return {i: State({CONV_STATE: (int(m.conv_kernel_size) - 1, int(m.conv_dim)),
                          SSM_STATE: (int(m.num_heads), int(m.head_dim), int(m.ssm_state_size))},
                         dtype=WIDE_STATE)
                for i, m in mixers.items()}
    mixers = mamba1_layers(model)
    if mixers:      # mlx-lm keeps the scan's state in the model's dtype: the cache's
        return {i: State({CONV_STATE: (int(m.conv_kernel_size) - 1, int(m.intermediate_size)),
                          SSM_STATE: (int(m.intermediate_size), int(m.ssm_state_size))})
                for i, m in mixers.items()}
    return {i: State({CONV_STATE: (int(m.conv_kernel_size) - 1, int(m.conv_dim)),
                      RECURRENT_STATE: (int(m.num_v_heads), int(m.head_v_dim),
                                        int(m.head_k_dim))},
                     dtype=WIDE_STATE)
            for i, m in gdn_layers(model).items()}


def route_state_layers(model) -> list:
    """Route the state modules of ``model`` (``state_modules``: LFM2's short convolutions,
    Granite-4.0-H's, Nemotron-H's and Falcon-H1's Mamba-2 mixers, Qwen3-Next's gated DeltaNet
    layers) through the cache: the module class's ``__call__`` is wrapped (once per class,
    idempotent) so that a call whose ``cache`` is a kvcache ``LayerCache`` runs ``conv_forward`` /
    ``mamba_forward`` / ``gdn_forward`` on the cache's state slots, and any other call (mlx-lm's
    own generation with its ``ArraysCache``) is mlx-lm's own, unchanged. Returns the layers
    routed ([] for a family without state layers). ``routing.route`` calls it."""
    layers = state_modules(model)
    family = _family(model)
    run = (mamba_forward if family in _MAMBA_CLASSES
           else gdn_forward if family in _GDN_CLASSES
           else mamba1_forward if family in _MAMBA1_CLASSES else conv_forward)
    for cls in {type(m) for m in layers.values()}:
        original = cls.__call__
        if getattr(original, _ROUTED_ATTR, False):
            continue
        cls.__call__ = _routed(original, run)
    return sorted(layers)


def _routed(original, run):
    from .protocol import LayerCache
    # the classes name their input and order their arguments differently (Falcon-H1's mixer:
    # (input_states, cache, mask), called by keyword): bind them as the class's call does
    signature = inspect.signature(original)
    first = list(signature.parameters)[1]

    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        cache = bound.get("cache")
        if isinstance(cache, LayerCache):
            return run(self, cache, bound[first], bound.get("mask"))
        return original(self, *args, **kwargs)

    setattr(__call__, _ROUTED_ATTR, True)
    return __call__


def _states(forward, layer: int, name: str, shape: tuple, dtype):
    """The forward's states ``name`` of ``layer`` as an mx array ``(S, *shape)`` of ``dtype``
    (zeros of one sequence while probing)."""
    from .protocol import _from_cache
    if forward.probe is not None:
        return mx.zeros((1, *shape), dtype)
    return _from_cache(forward.cache, forward.cache.get_state(layer, name), dtype)


def _to_state(cache, layer: int, values):
    """``values`` (an mx array) as ``cache`` stores state layer ``layer``'s states (its
    ``State.dtype``, else the cache dtype)."""
    from .protocol import _mx_dtype
    dtype = cache.config.state_layers[layer].storage(cache.config.dtype)
    if cache.backend.is_native(values):
        return values.astype(_mx_dtype(dtype))
    return cache.from_numpy(np.asarray(values.astype(mx.float32)), dtype)


def _open(module, layer_cache, x, mask, what: str) -> tuple:
    """``(forward, layer, T, lengths)`` of a state module's call with a ``LayerCache``, checked:
    no mask array, not an own-attention model, a forward open (or the probe), ``x`` its ``T``
    tokens as batch rows ``(T, 1, hidden)``. ``lengths``: the sequences' new tokens (the
    probe: one sequence)."""
    f = layer_cache._forward
    layer = layer_cache.layer
    if mask is not None:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) of the {_family(f.model)} model got a "
            f"mask: the cache's batches are packed, without padding")
    if f.own_attention and f.probe is None:
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}): a model that attends itself (one call "
            f"per sequence) does not run {what} on the cache")
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
            f"layer {layer}: the input {tuple(x.shape)} of {what} is not the forward's {T} "
            f"tokens as batch rows ({T}, 1, hidden)")
    return f, layer, T, lengths


def _packed_conv(f, layer: int, lengths: tuple, inputs, conv):
    """A depthwise causal ``conv`` (an ``nn.Conv1d``, weight ``(C, K, 1)``, no padding) of
    state layer ``layer`` over ``inputs`` ``(T, C)``, the forward's new inputs in
    ``begin_forward`` order (``lengths`` per sequence): one block per sequence, its conv
    state's ``K - 1`` columns (``"conv"``, ``(S, K - 1, C)``, time first) then its inputs, the
    module's own conv once over every block, the windows that cross a block boundary dropped
    (no sequence reads another's inputs). Writes each sequence's last ``K - 1`` inputs as its
    new state and the ``K - 1`` inputs before each prefix-cache boundary inside the appends
    (``set_state_checkpoints``); nothing while probing. Returns the conv's outputs ``(T,
    C)``, before any activation."""
    c, k1, s = int(inputs.shape[-1]), int(conv.weight.shape[1]) - 1, len(lengths)
    states = _states(f, layer, CONV_STATE, (k1, c), inputs.dtype)          # (S, k1, C)
    order, out, keep = (mx.array(a.astype(np.int32)) for a in conv_indices(lengths, k1))
    laid = mx.concatenate([states.reshape(s * k1, c), inputs])[order]      # (S*k1 + T, C)
    # one unpadded depthwise conv over every block; the windows that cross a block boundary
    # are dropped (out), so no sequence reads another's inputs
    conv_out = conv(laid[None])[0][out]                                    # (T, C)
    if f.probe is None:
        new = laid[keep].reshape(s, k1, c)
        f.cache.set_state(layer, CONV_STATE, _to_state(f.cache, layer, new))
        marks = f.cache.state_checkpoints()
        if marks:   # the prefix cache's boundaries inside the appends: the k1 inputs before each
            at = mx.array(checkpoint_columns(lengths, k1, marks).astype(np.int32))
            f.cache.set_state_checkpoints(layer, CONV_STATE, _to_state(
                f.cache, layer, laid[at].reshape(len(marks), k1, c)))
    return conv_out


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
    f, layer, T, lengths = _open(module, layer_cache, x, mask, "short convolutions")
    BCx = module.in_proj(x)
    B, C, xs = mx.split(BCx, 3, axis=-1)
    Bx = (B * xs).reshape(T, -1)                                   # (T, H)
    conv_out = _packed_conv(f, layer, lengths, Bx, module.conv)    # (T, H)
    y = C * conv_out[:, None, :]
    return module.out_proj(y)


def _past(f, s: int):
    """Each of the forward's ``s`` sequences' committed length, ``(s,)`` int64 (0: a new
    sequence, no recurrent state yet; the probe: one new sequence)."""
    if f.probe is not None:
        return np.zeros(1, np.int64)
    return np.asarray(f.cache.open_plan.tokens.k_rope_offset)[:s]


def _per_sequence(f, layer: int, name: str, lengths: tuple, past, states, call):
    """A recurrence of state layer ``layer`` (its state ``name``) over the forward's tokens,
    per sequence, by the model library's own function ``call``, and its new states written.

    ``lengths``: the sequences' new tokens in ``begin_forward`` order; ``past``: their
    committed lengths (``_past``); ``states``: the states before the forward, ``(S, *shape)``.
    ``call(rows, state, decode)`` runs the library's function over the token rows ``rows``
    (int32, ``(n,)``) and returns ``(outputs (n, ...), new state)``: ``decode`` True, one token
    of each of ``n`` sequences as batch rows from ``state`` ``(n, *shape)`` (the library's
    decode step); False, one sequence's tokens as one batch row from ``state`` ``(1, *shape)``,
    or None for a new sequence (the library's first call). The one-token appends of sequences
    with a past go in one decode call; every other sequence in calls of its own, split at the
    prefix cache's boundaries inside its appends (``cache.state_checkpoints()``), so that the
    state at each boundary is exactly the one a call ending there gives (a warm request that
    starts there computes what the cold one did). Writes the new states (``cache.set_state``,
    committed at ``end_forward``) and the boundaries' (``cache.set_state_checkpoints``);
    nothing while probing. Returns the outputs of every token ``(T, ...)`` in row order."""
    s = len(lengths)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    marks = f.cache.state_checkpoints() if f.probe is None else ()
    wanted: dict = {}
    for row, n in marks:
        wanted.setdefault(row, []).append(n)
    ys, rows_of, finals, seqs_of, kept = [], [], [], [], {}
    step = [i for i in range(s) if lengths[i] == 1 and past[i] > 0]
    if step:    # a batch row of one token per sequence: the library's decode step
        y, st = call(mx.array(starts[step].astype(np.int32)),
                     states[mx.array(np.asarray(step, np.int32))], True)
        ys.append(y)
        rows_of.append(starts[step])
        finals.append(st)
        seqs_of += step
    chosen = set(step)
    for i in range(s):
        if i in chosen:
            continue
        lo, n = int(starts[i]), lengths[i]
        # a new sequence starts from None, as the library's first call
        state = states[i:i + 1] if past[i] > 0 else None
        cuts = sorted({r for r in wanted.get(i, ()) if 0 < r < n})
        a = 0
        for b in cuts + [n]:    # one call per segment: each boundary's state is a call's end
            y, state = call(mx.arange(lo + a, lo + b), state, False)
            ys.append(y)
            if b < n:
                kept[(i, b)] = state[0]
            a = b
        rows_of.append(np.arange(lo, lo + n))
        finals.append(state)
        seqs_of.append(i)
    order = np.argsort(np.concatenate(rows_of)).astype(np.int32)
    out = mx.concatenate(ys)[mx.array(order)]
    if f.probe is None:
        new = mx.concatenate(finals)[mx.array(np.argsort(seqs_of).astype(np.int32))]
        f.cache.set_state(layer, name, _to_state(f.cache, layer, new))
        if marks:
            def at(row, n):     # a boundary's state: inside the row's appends, or an end
                return kept[(row, n)] if 0 < n < lengths[row] else (
                    new[row] if n == lengths[row] else states[row])
            f.cache.set_state_checkpoints(layer, name, _to_state(
                f.cache, layer, mx.stack([at(r, n) for r, n in marks])))
    return out


def mamba_forward(module, layer_cache, x, mask=None):
    """A Granite-4.0-H / Nemotron-H / Falcon-H1 Mamba-2 mixer of an mlx-lm model over the open
    forward of the cache behind ``layer_cache`` (a ``LayerCache``), per sequence.

    ``x`` ``(T, 1, hidden)``: the forward's T new tokens as batch rows in ``begin_forward``
    order (prefill chunks and decode tokens alike). ``in_proj``, the gated norm (a Falcon-H1
    mixer without ``mamba_rms_norm``: its module's ``swiglu``) and ``out_proj`` run on the rows
    (per token); the causal depthwise conv (then SiLU) over one
    block per sequence that starts with its conv state (``"conv"``, ``(B, conv_kernel_size -
    1, conv_dim)``: zeros for a new sequence), as ``conv_forward`` does; the SSM per sequence
    from its state (``"ssm"``, ``(B, heads, head_dim, d_state)`` float32) by mlx-lm's own
    ``ssm_update``: the one-token appends of sequences with a past in one call (batch rows,
    mlx-lm's decode step), every other sequence's tokens in a call of its own (a new sequence
    from no state, as mlx-lm's first call), split at the prefix cache's boundaries inside the
    appends (``cache.state_checkpoints()``) so that the state at each boundary is the one a
    call ending there gives (``cache.set_state_checkpoints``; ``_per_sequence``). The new
    states are written with ``cache.set_state`` (committed at ``end_forward``). Returns ``(T,
    1, hidden)``. While ``describe`` probes, the rows are one new sequence and nothing is
    written. Raises as ``conv_forward`` does."""
    f, layer, T, lengths = _open(module, layer_cache, x, mask, "Mamba-2 mixers")
    family = _family(f.model)
    inner, conv_dim, heads = module.intermediate_size, module.conv_dim, module.num_heads
    hd, groups, ds = module.head_dim, module.n_groups, module.ssm_state_size
    projected = module.in_proj(x)                                          # (T, 1, P)
    gate, conv_input, dt = mx.split(projected, [inner, inner + conv_dim], axis=-1)
    conv_out = nn.silu(_packed_conv(f, layer, lengths, conv_input.reshape(T, conv_dim),
                                    module.conv1d))                        # (T, conv_dim)
    xs, B, C = mx.split(conv_out, [inner, inner + groups * ds], axis=-1)
    xs, B, C = xs.reshape(T, heads, hd), B.reshape(T, groups, ds), C.reshape(T, groups, ds)
    dt = dt.reshape(T, heads)
    D = module.D.astype(xs.dtype) if family in _D_CAST else module.D
    source = importlib.import_module(type(module).__module__)
    update = source.ssm_update

    def call(rows, state, decode):  # mlx-lm's SSM over the rows (batch rows, or one sequence)
        def pick(t):
            return t[rows][:, None] if decode else t[rows][None]
        y, st = update(pick(xs), module.A_log, pick(B), pick(C), D, pick(dt), module.dt_bias,
                       state, module.time_step_limit)
        return (y[:, 0] if decode else y[0]), st

    ssm = _states(f, layer, SSM_STATE, (heads, hd, ds), mx.float32)        # (S, h, hd, ds)
    y = _per_sequence(f, layer, SSM_STATE, lengths, _past(f, len(lengths)), ssm, call)
    y = y.reshape(T, 1, inner)
    gated = module.norm(y, gate) if _gated_norm(family, module) else source.swiglu(gate, y)
    return module.out_proj(gated)


def gdn_forward(module, layer_cache, x, mask=None):
    """A Qwen3-Next gated DeltaNet layer (``Qwen3NextGatedDeltaNet``) of an mlx-lm model over
    the open forward of the cache behind ``layer_cache`` (a ``LayerCache``), per sequence.

    ``x`` ``(T, 1, hidden)``: the forward's T new tokens as batch rows in ``begin_forward``
    order (prefill chunks and decode tokens alike). The projections (the layer's own
    ``fix_query_key_value_ordering``), ``normalize_qk``, the gated norm and ``out_proj`` run on
    the rows (per token); the causal depthwise conv of ``q, k, v`` (then SiLU) over one block
    per sequence that starts with its conv state (``"conv"``, ``(B, conv_kernel_size - 1,
    conv_dim)``: zeros for a new sequence), as ``conv_forward`` does; the gated delta rule per
    sequence from its state (``"recurrent"``, ``(B, num_v_heads, head_v_dim, head_k_dim)``
    float32) by mlx-lm's own ``gated_delta_update`` (``use_kernel`` as the layer passes it):
    the one-token appends of sequences with a past in one call (batch rows, mlx-lm's decode
    step), every other sequence's tokens in calls of its own split at the prefix cache's
    boundaries inside the appends (``_per_sequence``: the states there are written with
    ``cache.set_state_checkpoints``). The new states are written with ``cache.set_state``
    (committed at ``end_forward``). Returns ``(T, 1, hidden)`` in ``x``'s dtype. While
    ``describe`` probes, the rows are one new sequence and nothing is written. Raises as
    ``conv_forward`` does."""
    f, layer, T, lengths = _open(module, layer_cache, x, mask, "gated DeltaNet layers")
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    key_dim = module.key_dim
    source = importlib.import_module(type(module).__module__)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x),
                                                           module.in_proj_ba(x))
    mixed = mx.concatenate([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], axis=-1)
    conv_out = nn.silu(_packed_conv(f, layer, lengths, mixed, module.conv1d))   # (T, conv_dim)
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q, k, v = q.reshape(T, nk, dk), k.reshape(T, nk, dk), v.reshape(T, nv, dv)
    q, k = source.normalize_qk(q, k, inv_scale=dk ** -0.5, eps=1e-6)   # as the layer calls it
    a, b = a.reshape(T, nv), b.reshape(T, nv)

    def call(rows, state, decode):  # mlx-lm's rule over the rows (batch rows, or one sequence)
        def pick(t):
            return t[rows][:, None] if decode else t[rows][None]
        y, st = source.gated_delta_update(pick(q), pick(k), pick(v), pick(a), pick(b),
                                          module.A_log, module.dt_bias, state, None,
                                          use_kernel=not module.training)
        return (y[:, 0] if decode else y[0]), st

    rec = _states(f, layer, RECURRENT_STATE, (nv, dv, dk), mx.float32)     # (S, nv, dv, dk)
    out = _per_sequence(f, layer, RECURRENT_STATE, lengths, _past(f, len(lengths)), rec, call)
    out = module.norm(out.reshape(T, 1, nv, dv), z)                        # per value head
    return module.out_proj(out.reshape(T, 1, -1))


def mamba1_forward(module, layer_cache, x, mask=None):
    """A Mamba (Mamba-1) mixer (``MambaBlock``, Jamba's ``JambaMambaMixer``) of an mlx-lm model
    over the open forward of the cache behind ``layer_cache`` (a ``LayerCache``), per sequence.

    ``x`` ``(T, 1, hidden)``: the forward's T new tokens as batch rows in ``begin_forward``
    order. ``in_proj``, the gate (its module's ``swiglu``) and ``out_proj`` run on the rows;
    the causal depthwise conv (then SiLU) over one block per sequence after its conv state
    (``"conv"``, ``(B, conv_kernel - 1, intermediate)``), as ``conv_forward`` does; the
    selective scan by the module's own ``ssm_step`` (Jamba's: over a call's tokens at once),
    token by token per sequence from its state (``"ssm"``, ``(B, intermediate, d_state)``,
    the model's dtype, as mlx-lm keeps it): the one-token appends of sequences with a past in
    one step (batch rows), every other sequence's tokens one step at a time from its state
    (None for a new sequence, as mlx-lm's first call), split at the prefix cache's boundaries
    (``_per_sequence``; the scan is sequential, so the split changes no bit). The new states
    are written with ``cache.set_state``. Returns ``(T, 1, hidden)``. While ``describe``
    probes, the rows are one new sequence and nothing is written. Raises as ``conv_forward``
    does."""
    f, layer, T, lengths = _open(module, layer_cache, x, mask, "Mamba mixers")
    inner, d_state = module.intermediate_size, module.ssm_state_size
    xs, z = module.in_proj(x).split(2, axis=-1)                          # (T, 1, inner) each
    u = nn.silu(_packed_conv(f, layer, lengths, xs.reshape(T, inner), module.conv1d))
    A = -mx.exp(module.A_log)
    whole = _family(f.model) == "jamba"

    def call(rows, state, decode):  # mlx-lm's scan over the rows (batch rows, or one sequence)
        if whole:   # Jamba's ssm_step takes (batch, tokens, channels): one call, as mlx-lm's
            y, st = module.ssm_step(u[rows][:, None] if decode else u[rows][None], A, state)
            return (y[:, 0] if decode else y[0]), st
        if decode:
            return module.ssm_step(u[rows], A, state)
        ys = []
        for t in range(int(rows.shape[0])):     # mlx-lm's loop, one token at a time
            y, state = module.ssm_step(u[rows[t:t + 1]], A, state)
            ys.append(y)
        return mx.concatenate(ys), state

    ssm = _states(f, layer, SSM_STATE, (inner, d_state), x.dtype)          # (S, inner, N)
    y = _per_sequence(f, layer, SSM_STATE, lengths, _past(f, len(lengths)), ssm, call)
    source = importlib.import_module(type(module).__module__)
    return module.out_proj(source.swiglu(z, y.reshape(T, 1, inner)))
