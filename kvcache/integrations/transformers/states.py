"""The recurrent-state layers of a transformers model on the cache's state slots (issue 56,
docs/hybrid.md "Built: increment 5" and "Built: increment 7"): LFM2's short convolutions
(``lfm2``, ``lfm2_moe``) and the Mamba-2 mixers of Bamba, Granite-4.0-H, Nemotron-H and
Falcon-H1 (``bamba``, ``granitemoehybrid``, ``nemotron_h``, ``falcon_h1``; ``mamba_layers``,
``mamba_forward``).

A conv layer of LFM2 (``Lfm2ShortConv``) projects its input to ``B, C, x`` (``in_proj``),
convolves ``B * x`` causally over time with a depthwise kernel of ``conv_L_cache`` taps, and
gates the result with ``C``. Between steps it keeps the last ``conv_L_cache - 1`` inputs of the
convolution (``B * x``) per channel: transformers' cache keeps ``conv_L_cache`` of them
(``LinearAttentionLayer.update_conv_state``; the oldest is never read). On the cache each conv
layer is a ``kvcache.State({"conv": (hidden_size, conv_L_cache - 1)})`` layer (channels first,
the oldest input first, as the model keeps it), and its forward over a packed batch (prefill
chunks and decode tokens of many sequences in one row) runs per sequence from that state
(``route_state_layers``).

A mamba layer of Bamba (``BambaMixer``; Granite-4.0-H's ``GraniteMoeHybridMambaLayer`` is the
same code) convolves ``x, B, C`` like that (``conv_kernel_size`` taps, then SiLU) and runs a
selective SSM over them, whose state ``(heads, head_dim, d_state)`` carries from token to
token: on the cache ``State({"conv": (conv_dim, conv_kernel_size - 1), "ssm": (heads,
head_dim, d_state)})``, run per sequence by ``mamba_forward``. Nemotron-H's mixer
(``NemotronHMamba2Mixer``) is the same arithmetic with a lower time-step limit; its MLP and MoE
blocks hold nothing and get no cache layer (``cache_layers``). Falcon-H1's (``FalconH1Mixer``)
adds muP multipliers and an optional norm, and runs beside attention in every layer: two cache
layers a layer, the mixer's state then the attention's pages. Anything about a family these
functions do not know is refused with ``UnsupportedFeatureError`` naming it
(``state_kinds``).

A gated DeltaNet layer of Qwen3-Next (``Qwen3NextGatedDeltaNet``, ``qwen3_next``) convolves its
``q, k, v`` the same way (``linear_conv_kernel_dim`` taps, then the activation) and runs the
gated delta rule, a linear attention whose state ``(value heads, key head dim, value head dim)``
carries from token to token: on the cache ``State({"conv": (conv_dim, kernel - 1),
"recurrent": (value heads, key head dim, value head dim)})``, run per sequence by
``gdn_forward`` (docs/hybrid.md "Built: increment 9")."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from typing import Callable, NoReturn, Optional

import numpy as np

from ...arrays import to_numpy
from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from ..conv_states import (check_gdn_dims, check_mamba_dims, checkpoint_columns,
                           conv_indices as _indices)

torch = require("torch", "transformers")

WIDE_STATE = "float32"
"""The ``State.dtype`` of the Mamba-2 and gated DeltaNet layers' states (their models keep the
recurrent state in float32)."""
CONV_STATE = "conv"
"""The name of a conv layer's state (``State({"conv": (hidden_size, conv_L_cache - 1)})``)."""

# family (config.model_type) -> (the module, the class) of its short convolution: classes whose
# forward was read line by line (transformers 5.24: the same code in both families); a
# subclass, or another family's convolution, is not assumed to compute the same
_CONV_CLASSES = {
    "lfm2": ("transformers.models.lfm2.modeling_lfm2", "Lfm2ShortConv"),
    "lfm2_moe": ("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeShortConv"),
}
# family -> (the module, the class) of its Mamba-2 mixer: read line by line (transformers 5.24:
# the same code in both families, conv then chunked / recurrent SSM then gated norm)
_MAMBA_CLASSES = {
    "bamba": ("transformers.models.bamba.modeling_bamba", "BambaMixer"),
    "granitemoehybrid": ("transformers.models.granitemoehybrid.modeling_granitemoehybrid",
                         "GraniteMoeHybridMambaLayer"),
    # Nemotron-H's mixer (5.24) computes what Bamba's does but for a lower time-step limit
    # (``_LIMITED``); its blocks hold one mixer each, MLP and MoE blocks nothing (``_STATELESS``)
    "nemotron_h": ("transformers.models.nemotron_h.modeling_nemotron_h", "NemotronHMamba2Mixer"),
    # Falcon-H1's mixer (5.24) beside attention in every layer: Bamba's arithmetic with muP
    # multipliers on its input and projections, and a plain SiLU gate unless mamba_rms_norm
    "falcon_h1": ("transformers.models.falcon_h1.modeling_falcon_h1", "FalconH1Mixer"),
}
# family -> the layer types whose decoder layer holds a mixer and attention side by side
# (Falcon-H1's "hybrid" layers): two cache layers, the mixer's state then the attention's pages
_PARALLEL = {"falcon_h1": ("hybrid",)}
# family -> the block types (``config.layers_block_type``) that keep neither K/V nor state:
# Nemotron-H's MLP and MoE blocks get no cache layer (``cache_layers``)
_STATELESS = {"nemotron_h": ("mlp", "moe")}
# families whose mixer clamps dt from below (Nemotron-H: ``(time_step_min, inf)``, always set)
_LIMITED = frozenset(("nemotron_h",))
# family -> (the module, the class) of its gated DeltaNet: read line by line (transformers 5.24:
# projections, conv, the chunked / recurrent gated delta rule, the gated norm)
_GDN_CLASSES = {
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next",
                   "Qwen3NextGatedDeltaNet"),
}
STATE_FAMILIES = tuple(sorted({**_CONV_CLASSES, **_MAMBA_CLASSES, **_GDN_CLASSES}))
"""The model types whose recurrent-state layers run on the cache (LFM2's short convolutions,
the Mamba-2 mixers of Bamba, Granite-4.0-H, Nemotron-H and Falcon-H1, Qwen3-Next's gated
DeltaNet)."""
SERVED_STATE_LAYERS = (f"the short convolutions of {', '.join(sorted(_CONV_CLASSES))}, the "
                       f"Mamba-2 mixers of {', '.join(sorted(_MAMBA_CLASSES))} and the gated "
                       f"DeltaNet layers of {', '.join(sorted(_GDN_CLASSES))}")
"""What ``refuse_hybrid``'s message names as served."""
SSM_STATE = "ssm"
"""The name of a Mamba-2 layer's SSM state (``(heads, head_dim, d_state)``)."""
RECURRENT_STATE = "recurrent"
"""The name of a gated DeltaNet layer's recurrent state (``(value heads, key head dim, value
head dim)``)."""
GDN_CHUNK = 64
"""The chunk length of transformers' chunked gated delta rule: the layer's forward passes
none, so the function's default (64 in 5.24 and 5.17; ``gdn_layers`` checks the installed
one)."""
_LAYER_TYPES = ("conv", "full_attention")
# a Mamba-2 family's layer types: transformers 5.24 names them linear_attention / full_attention,
# older releases' configs mamba / attention
_MAMBA_TYPES = ("linear_attention", "mamba")
_ATTENTION_TYPES = ("full_attention", "attention")

_ROUTED: "weakref.WeakSet" = weakref.WeakSet()     # state modules whose forward is routed
# the cache of the forward the adapter is running in this thread (None: none): a decoder layer
# that does not pass its keyword arguments down to its conv or mixer (transformers releases
# differ) still reaches the cache's states; outside it the module is transformers' own
_SERVING: contextvars.ContextVar = contextvars.ContextVar("kvcache_state_cache", default=None)


@contextlib.contextmanager
def serving(cache):
    """The routed state modules (convs, mixers) of any model run on ``cache``'s state slots for
    the duration, also when their decoder layer does not pass ``kvcache=cache`` down
    (``TransformersAdapter`` wraps each model call of a forward in it)."""
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
    types = _layer_types(family, config, ("layer_types",), _LAYER_TYPES, "short convolutions")
    hidden, taps = int(config.hidden_size), int(config.conv_L_cache)
    return _state_modules(
        model, family, known, types, ("conv",), "conv module", "convolution",
        lambda where, m: _check_conv(family, where, m, hidden, taps),
        match=lambda cls: cls.__name__.endswith("ShortConv"))


def _layer_types(family: str, config, attrs: tuple, allowed: tuple, what: str) -> list:
    """The layer types of ``config`` (the first of its fields ``attrs`` that is set), one per
    layer. Raises ``UnsupportedFeatureError`` for fewer than ``config.num_hidden_layers`` of
    them (``what``: the family's state layers in words) or a type not in ``allowed``."""
    n = int(config.num_hidden_layers)
    types: list = []
    for attr in attrs:
        types = list(getattr(config, attr, None) or ())
        if types:
            break
    if len(types) < n:
        raise UnsupportedFeatureError(
            f"the {family} model has {len(types)} {' / '.join(attrs)} for {n} layers: which "
            f"layers are {what} is not understood")
    for i, kind in enumerate(types[:n]):
        if kind not in allowed:
            names = [repr(k) for k in allowed]
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has layer type {kind!r}: the cache serves "
                f"{', '.join(names[:-1])} and {names[-1]} layers of this family only")
    return types


def _state_modules(model, family: str, known: tuple, types: list, kinds: tuple, noun: str,
                   what: str, check, match=None) -> dict:
    """``{layer: (path, module)}``: the modules of class ``known`` (``(module, class name)``,
    read line by line) of ``model``, one at each layer whose type is in ``kinds``, each
    passed to ``check(where, module)``. ``match(cls)``: which classes are candidates (None:
    a class named ``known``'s name, subclasses too). Raises ``UnsupportedFeatureError`` naming
    the module for a subclass or replacement, a ``layer_idx`` not of such a layer, two in one
    layer, or such layers without one (``noun``: the modules in words; ``what``: what they
    compute)."""
    n = len(types)
    found: dict = {}
    for path, m in model.named_modules():
        cls = type(m)
        if not (match(cls) if match is not None
                else any(c.__name__ == known[1] for c in cls.__mro__)):
            continue
        where = f"{path} ({cls.__name__})"
        if (cls.__module__, cls.__name__) != known:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} is not transformers' {known[1]} (a subclass or "
                f"a replacement): its {what} is not understood")
        layer = getattr(m, "layer_idx", None)
        if not isinstance(layer, int) or not 0 <= layer < n or types[layer] not in kinds:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} has layer_idx={layer!r}, not a "
                f"{'/'.join(map(repr, kinds))} layer of its {n} layers")
        if layer in found:
            raise UnsupportedFeatureError(
                f"the {family} model has two {noun}s in layer {layer} ({found[layer][0]}, "
                f"{path}); the cache holds one state per layer")
        check(where, m)
        found[layer] = (path, m)
    want = [i for i in range(n) if types[i] in kinds]
    if sorted(found) != want:
        raise UnsupportedFeatureError(
            f"the {family} model's layer types name the {'/'.join(kinds)} layers {want}, but "
            f"{noun}s were found in layers {sorted(found)}")
    return {i: found[i] for i in want}


def _refuser(family: str, where: str, what: str, increment: int) -> Callable[[str], NoReturn]:
    """A ``refuse(problem)`` that raises ``UnsupportedFeatureError`` naming the module and the
    problem (``what``: the cache's copy of the module in words, ``increment``: its section of
    docs/hybrid.md)."""
    def refuse(problem: str) -> NoReturn:
        raise UnsupportedFeatureError(
            f"the {family} model's {where}: {problem}; the cache's {what} serves what was read "
            f"(docs/hybrid.md increment {increment}) only")
    return refuse


def _check_depthwise(refuse: Callable[[str], NoReturn], conv, attr: str, channels: tuple,
                     taps: tuple) -> None:
    """Refuses (``refuse(problem)``) a module's conv ``conv`` (its attribute ``attr``) that is
    not what the cache's packed convolution computes: a ``Conv1d`` with weight ``(C, 1, k)``,
    ``groups == C``, stride 1, dilation 1 and ``k >= 2`` taps equal to the config's.
    ``channels``, ``taps``: ``(name, value)`` of ``C`` and of the config's taps, named in the
    messages."""
    (c_name, c), (t_name, t) = channels, taps
    weight = getattr(conv, "weight", None)
    if not isinstance(conv, torch.nn.Conv1d) or weight is None:
        refuse(f"no Conv1d `{attr}`")
    k = int(weight.shape[-1])
    if k < 2 or k != t:
        refuse(f"a kernel of {k} taps ({t_name}={t}): the cache serves kernels of >= 2 taps "
               f"equal to {t_name}")
    if (tuple(weight.shape) != (c, 1, k) or conv.groups != c
            or tuple(conv.stride) != (1,) or tuple(conv.dilation) != (1,)):
        refuse(f"conv weight {tuple(weight.shape)}, groups={conv.groups}, stride="
               f"{tuple(conv.stride)}, dilation={tuple(conv.dilation)}: not a depthwise causal "
               f"convolution over {c_name}={c} channels (weight ({c}, 1, {k}), groups={c}, "
               f"stride 1, dilation 1)")


def _check_unhooked(family: str, where: str, parts: tuple, what: str) -> None:
    # the cache's forward reads the weights (conv.weight first) where they are: an offloaded
    # module's weights are not there between accelerate's hooks
    for part in parts:
        if getattr(part, "_hf_hook", None) is not None:
            raise UnsupportedFeatureError(
                f"the {family} model's {where} has accelerate hooks (device_map offloading): the "
                f"cache's {what} reads the weights where they are; load the model whole on one "
                f"device")


def _check_conv(family: str, where: str, m, hidden: int, taps: int) -> None:
    refuse = _refuser(family, where, "short convolution", 5)
    conv = getattr(m, "conv", None)
    _check_depthwise(refuse, conv, "conv", ("hidden_size", hidden), ("config.conv_L_cache", taps))
    if int(m.conv_kernel_size) != taps:
        refuse(f"conv_kernel_size={m.conv_kernel_size} is not config.conv_L_cache={taps}")
    proj = getattr(m, "in_proj", None)
    if not isinstance(proj, torch.nn.Linear) or proj.out_features != 3 * hidden:
        refuse(f"in_proj must be a Linear of 3 * {hidden} outputs (B, C, x), got {proj!r:.80}")
    _check_unhooked(family, where, (m, conv), "convolution")


def mamba_layers(model) -> dict:
    """``{layer: (path, module)}``: the Mamba-2 mixers of a Bamba-family ``model``
    (``bamba``, ``granitemoehybrid``, ``nemotron_h``, ``falcon_h1``), by decoder layer; empty
    for any other family. Raises ``UnsupportedFeatureError`` naming the layer and the value
    when the model is of such a family but something is not what was read: a layer type other
    than a mamba or attention layer (or Nemotron-H's MLP and MoE blocks, which hold nothing,
    and Falcon-H1's hybrid layers: ``cache_layers``), a mixer of another class (a subclass
    too), a kernel below 2 taps or not ``conv_kernel_size``, a conv that is not depthwise over
    ``conv_dim`` channels, strided or dilated, projections, heads, groups or parameters of
    other sizes, an activation other than SiLU, a ``time_step_limit`` other than ``(0, inf)`` (Nemotron-H: ``(time_step_min >= 0,
    inf)``), a gated norm of another class or size, Falcon-H1's multipliers not as read
    (``_check_falcon_mixer``), accelerate hooks on the mixer, or mixers not exactly at the
    mamba layers."""
    family = _family(model)
    known = _MAMBA_CLASSES.get(family)
    if known is None:
        return {}
    config = model.config
    both = _PARALLEL.get(family, ())
    types = _layer_types(family, config, ("layers_block_type", "layer_types"),
                         _MAMBA_TYPES + _ATTENTION_TYPES + _STATELESS.get(family, ()) + both,
                         "Mamba mixers")
    return _state_modules(model, family, known, types, _MAMBA_TYPES + both, "mixer", "mixer",
                          lambda where, m: _check_mixer(family, where, m,
                                                        int(config.hidden_size)))


def _check_mixer(family: str, where: str, m, hidden: int) -> None:
    refuse = _refuser(family, where, "Mamba-2 mixer", 12 if family in _LIMITED else 7)
    try:
        heads, head_dim, d_state = int(m.num_heads), int(m.head_dim), int(m.ssm_state_size)
        groups, inner, conv_dim = int(m.n_groups), int(m.intermediate_size), int(m.conv_dim)
        taps, chunk = int(m.conv_kernel_size), int(m.chunk_size)
        limit, activation = m.time_step_limit, m.activation
        conv, norm, in_proj, out_proj = m.conv1d, m.norm, m.in_proj, m.out_proj
        params = (m.A_log, m.D, m.dt_bias)
    except (AttributeError, TypeError) as e:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} lacks what its mixer was read with ({e})") from None
    check_mamba_dims(refuse, heads, head_dim, groups, inner, conv_dim, d_state)
    _check_depthwise(refuse, conv, "conv1d", ("conv_dim", conv_dim), ("conv_kernel_size", taps))
    if (not isinstance(in_proj, torch.nn.Linear) or in_proj.in_features != hidden
            or in_proj.out_features != inner + conv_dim + heads):
        refuse(f"in_proj must be a Linear {hidden} -> {inner + conv_dim + heads} (gate, x B C, "
               f"dt), got {in_proj!r:.80}")
    if not isinstance(out_proj, torch.nn.Linear) or out_proj.in_features != inner:
        refuse(f"out_proj must be a Linear from {inner}, got {out_proj!r:.80}")
    if any(tuple(p.shape) != (heads,) for p in params):
        refuse(f"A_log, D, dt_bias of shapes {[tuple(p.shape) for p in params]}, not ({heads},)")
    if activation not in ("silu", "swish"):
        refuse(f"activation {activation!r}: the cache's mixer applies SiLU after the conv")
    try:
        lo, hi = (float(v) for v in limit)
    except (TypeError, ValueError):
        refuse(f"time_step_limit={limit!r}: not two numbers")
    if family in _LIMITED:
        # the family's mixer always clamps dt from below (time_step_min) in its chunked form and
        # never in its recurrent step: the cache's copies of the two forms do the same
        # (docs/hybrid.md increment 12 says where that parts from generate)
        if not 0.0 <= lo < float("inf") or hi != float("inf"):
            refuse(f"time_step_limit={limit!r}: the cache serves (time_step_min >= 0, inf) only")
    elif (lo, hi) != (0.0, float("inf")):
        # transformers clamps dt in its chunked form but not in its recurrent step: a limit
        # would make the token a prefill chunk ends on depend on where the chunk ends
        refuse(f"time_step_limit={limit!r}: the cache serves (0.0, inf) only")
    if chunk < 1:
        refuse(f"chunk_size={chunk}")
    plain = False                       # Falcon-H1 without its norm: the gate alone
    if family in _PARALLEL:
        _check_falcon_mixer(refuse, m, inner + conv_dim + heads)
        plain = m.mamba_rms_norm is False
    # the gated norm runs as the model's own module (per token): its class and size are checked,
    # not its grouping (releases differ; whatever it computes, generate computes too)
    if not plain and (not type(norm).__name__.endswith("RMSNormGated")
                      or tuple(getattr(getattr(norm, "weight", None), "shape", ())) != (inner,)):
        refuse(f"norm {type(norm).__name__}: the cache runs the mixer's gated RMS norm "
               f"(a *RMSNormGated of weight ({inner},)) only")
    _check_unhooked(family, where, (m, conv), "mixer")


def _check_falcon_mixer(refuse: Callable[[str], NoReturn], m, projected: int) -> None:
    """What Falcon-H1's mixer adds to Bamba's, as read: a number ``ssm_in_multiplier`` on its
    input, a ``mup_vector`` buffer of ``(1, 1, projected)`` on ``in_proj``'s outputs, and
    ``mamba_rms_norm`` (True: the gated norm; False: ``norm`` an ``nn.Identity``, the gate
    alone)."""
    mult = getattr(m, "ssm_in_multiplier", None)
    mup = getattr(m, "mup_vector", None)
    rms = getattr(m, "mamba_rms_norm", None)
    if isinstance(mult, bool) or not isinstance(mult, (int, float)):
        refuse(f"ssm_in_multiplier={mult!r:.40}: not a number")
    shape = tuple(getattr(mup, "shape", ()))
    if not torch.is_tensor(mup) or shape != (1, 1, projected):
        refuse(f"mup_vector {shape}: not (1, 1, {projected}), one multiplier per projected "
               f"value")
    if rms not in (True, False):
        refuse(f"mamba_rms_norm={rms!r:.40}: not a bool")
    if rms is False and not isinstance(m.norm, torch.nn.Identity):
        refuse(f"norm {type(m.norm).__name__} with mamba_rms_norm=False: the mixer's forward "
               f"skips its norm then, the cache gates the output with SiLU alone")


def gdn_layers(model) -> dict:
    """``{layer: (path, module)}``: the gated DeltaNet layers of a Qwen3-Next ``model``
    (``qwen3_next``), by decoder layer; empty for any other family. Raises
    ``UnsupportedFeatureError`` naming the layer and the value when the model is of that family
    but something is not what was read: a layer type other than ``linear_attention`` /
    ``full_attention``, a module of another class (a subclass too), value heads that the key
    heads do not divide, a conv that is not depthwise over ``2 * key_dim + value_dim``
    channels, strided or dilated, a kernel below 2 taps or not ``conv_kernel_size``,
    projections, parameters or a gated norm of other sizes, an activation transformers does
    not name, a chunk length of transformers' chunked rule other than ``GDN_CHUNK``,
    accelerate hooks, or modules not exactly at the ``linear_attention`` layers."""
    family = _family(model)
    known = _GDN_CLASSES.get(family)
    if known is None:
        return {}
    config = model.config
    types = _layer_types(family, config, ("layer_types",), ("linear_attention", "full_attention"),
                         "gated DeltaNet layers")
    _check_gdn_rule(family, known[0])
    return _state_modules(model, family, known, types, ("linear_attention",),
                          "gated DeltaNet module", "linear attention",
                          lambda where, m: _check_gdn(family, where, m, int(config.hidden_size)))


def _check_gdn_rule(family: str, module_name: str) -> None:
    """The chunk length transformers' chunked rule runs with (its forward passes none: the
    function's default) must be ``GDN_CHUNK``, the one the cache's copy of the rule uses."""
    import importlib
    import inspect
    rule = getattr(importlib.import_module(module_name), "torch_chunk_gated_delta_rule", None)
    try:
        default = inspect.signature(rule).parameters["chunk_size"].default  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError):
        default = None
    if default != GDN_CHUNK:
        raise UnsupportedFeatureError(
            f"the {family} model's torch_chunk_gated_delta_rule runs chunks of {default!r} "
            f"tokens: the cache's gated delta rule was read with chunks of {GDN_CHUNK}")


def _check_gdn(family: str, where: str, m, hidden: int) -> None:
    refuse = _refuser(family, where, "gated DeltaNet", 9)
    try:
        nv, nk = int(m.num_v_heads), int(m.num_k_heads)
        dk, dv = int(m.head_k_dim), int(m.head_v_dim)
        key_dim, value_dim, conv_dim = int(m.key_dim), int(m.value_dim), int(m.conv_dim)
        taps, activation = int(m.conv_kernel_size), m.activation
        conv, norm, qkvz, ba, out_proj = m.conv1d, m.norm, m.in_proj_qkvz, m.in_proj_ba, m.out_proj
        params = (m.A_log, m.dt_bias)
        if not callable(m.fix_query_key_value_ordering):
            raise TypeError("fix_query_key_value_ordering is not a method")
    except (AttributeError, TypeError) as e:
        raise UnsupportedFeatureError(
            f"the {family} model's {where} lacks what its layer was read with ({e})") from None
    check_gdn_dims(refuse, nk, nv, dk, dv, key_dim, value_dim, conv_dim)
    _check_depthwise(refuse, conv, "conv1d", ("conv_dim", conv_dim), ("conv_kernel_size", taps))
    for name, proj, size in (("in_proj_qkvz", qkvz, 2 * key_dim + 2 * value_dim),
                             ("in_proj_ba", ba, 2 * nv)):
        if (not isinstance(proj, torch.nn.Linear) or proj.in_features != hidden
                or proj.out_features != size):
            refuse(f"{name} must be a Linear {hidden} -> {size}, got {proj!r:.80}")
    if not isinstance(out_proj, torch.nn.Linear) or out_proj.in_features != value_dim:
        refuse(f"out_proj must be a Linear from {value_dim}, got {out_proj!r:.80}")
    if any(tuple(p.shape) != (nv,) for p in params):
        refuse(f"A_log, dt_bias of shapes {[tuple(p.shape) for p in params]}, not ({nv},)")
    from transformers.activations import ACT2FN
    if activation not in ACT2FN:
        refuse(f"activation {activation!r}: not one transformers names (ACT2FN)")
    # the gated norm runs as the model's own module, per head of each token
    if (type(norm).__name__ != "Qwen3NextRMSNormGated"
            or tuple(getattr(getattr(norm, "weight", None), "shape", ())) != (dv,)):
        refuse(f"norm {type(norm).__name__}: the cache runs the layer's gated RMS norm "
               f"(Qwen3NextRMSNormGated of weight ({dv},)) only")
    _check_unhooked(family, where, (m, conv), "linear attention")


def state_modules(model) -> dict:
    """``{layer: (path, module)}``: the modules whose state the cache keeps for ``model``, by
    decoder layer: LFM2's short convolutions (``conv_layers``), a Bamba-family model's
    Mamba-2 mixers (``mamba_layers``) or Qwen3-Next's gated DeltaNet layers (``gdn_layers``);
    empty for any other family. Raises ``UnsupportedFeatureError`` for what about a served
    family is not understood."""
    return conv_layers(model) or mamba_layers(model) or gdn_layers(model)


def stateless_layers(model) -> tuple:
    """The decoder layers of ``model`` that keep neither K/V nor a state, which get no cache
    layer: Nemotron-H's MLP and MoE blocks (``config.layers_block_type``); () for any other
    family. Raises ``UnsupportedFeatureError`` for a block type the family's reading does not
    know (as ``mamba_layers``)."""
    family = _family(model)
    kinds = _STATELESS.get(family)
    if not kinds:
        return ()
    types = _layer_types(family, model.config, ("layers_block_type", "layer_types"),
                         _MAMBA_TYPES + _ATTENTION_TYPES + kinds, "Mamba mixers")
    return tuple(i for i, kind in enumerate(types[:int(model.config.num_hidden_layers)])
                 if kind in kinds)


def parallel_layers(model) -> tuple:
    """The decoder layers of ``model`` that hold a mixer and attention side by side, each two
    cache layers (``cache_layers``): every layer of Falcon-H1; () for any other family."""
    family = _family(model)
    kinds = _PARALLEL.get(family)
    if not kinds:
        return ()
    types = _layer_types(family, model.config, ("layers_block_type", "layer_types"), kinds,
                         "Mamba mixers")
    return tuple(i for i, kind in enumerate(types[:int(model.config.num_hidden_layers)])
                 if kind in kinds)


def cache_layers(model) -> dict:
    """``{decoder layer: its first cache layer}`` of the decoder layers that hold K/V or a
    state, the cache's layers numbered in their order: the identity, unless the model has
    blocks that hold nothing (``stateless_layers``: Nemotron-H's MLP and MoE blocks), which
    the cache has no layer for (a layer of pages there would be memory no attention reads), or
    layers that hold a mixer and attention side by side (``parallel_layers``: Falcon-H1), two
    cache layers each (the mixer's state at the first, the attention's pages at the next)."""
    skip, both = set(stateless_layers(model)), set(parallel_layers(model))
    out, k = {}, 0
    for i in range(int(model.config.num_hidden_layers)):
        if i not in skip:
            out[i] = k
            k += 2 if i in both else 1
    return out


def num_cache_layers(model) -> int:
    """The cache layers of ``model`` (``cache_layers``): ``CacheConfig.num_layers``."""
    return len(cache_layers(model)) + len(parallel_layers(model))


# module -> its cache layer, for the modules of models whose decoder layers are not one cache
# layer each (``cache_layers``): their ``layer_idx`` counts decoder layers, MLP blocks too
_CACHE_LAYER: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layer_of(module) -> int:
    """The cache layer of an attention or state module: its ``layer_idx``, or where
    ``map_cache_layers`` put it."""
    layer = module.layer_idx
    if _CACHE_LAYER:            # (empty unless such a model was mapped: no lookup otherwise)
        layer = _CACHE_LAYER.get(module, layer)
    return layer


def map_cache_layers(model) -> None:
    """Give the attention and state modules of a model with blocks that hold nothing
    (``stateless_layers``) or layers that hold both (``parallel_layers``) their cache layers
    (``cache_layers``; read by the ``"kvcache"`` attention and the state layers' forwards
    through ``layer_of``). Nothing for any other model (its ``layer_idx`` is its cache layer).
    ``cache_config`` and ``TransformersAdapter`` call it."""
    both = set(parallel_layers(model))
    if not both and not stateless_layers(model):
        return
    where = cache_layers(model)
    from .model import attention_modules
    for m in attention_modules(model):
        _CACHE_LAYER[m] = where[m.layer_idx] + (m.layer_idx in both)
    for _, m in state_modules(model).values():
        _CACHE_LAYER[m] = where[m.layer_idx]


def state_kinds(model) -> dict:
    """The ``CacheConfig.layer_kinds`` entries of ``model``'s state layers, beside any window
    groups (the model cannot run on the cache without them); empty for families without
    served state layers. LFM2's short convolutions (``conv_layers``):
    ``State({"conv": (hidden_size, conv_L_cache - 1)})``; a Bamba-family Mamba-2 mixer
    (``mamba_layers``): ``State({"conv": (conv_dim, conv_kernel_size - 1), "ssm": (num_heads,
    head_dim, ssm_state_size)})``, the conv's last inputs channels first (oldest first) and the
    SSM state as the model keeps it; a Qwen3-Next gated DeltaNet layer (``gdn_layers``):
    ``State({"conv": (conv_dim, conv_kernel_size - 1), "recurrent": (num_v_heads, head_k_dim,
    head_v_dim)})``. The last two are stored in float32 (``State.dtype``): the model keeps its
    recurrent state in float32 under a 16-bit model, and a 16-bit state's rounding compounds
    over the steps (a bfloat16 GPU run of Qwen3-Next parted from ``generate`` beyond the
    near-tie margin so). Keyed by cache layer (``cache_layers``: the decoder layer but for
    Nemotron-H, whose MLP and MoE blocks have none, and Falcon-H1, two a layer). Raises
    ``UnsupportedFeatureError`` for what is not understood."""
    from ...config import State
    layers = conv_layers(model)
    if layers:
        hidden, taps = int(model.config.hidden_size), int(model.config.conv_L_cache)
        return {i: State({CONV_STATE: (hidden, taps - 1)}) for i in layers}
    mixers = mamba_layers(model)
    if mixers:
        where = cache_layers(model)     # (the identity but for Nemotron-H and Falcon-H1)
        return {where[i]: State({CONV_STATE: (int(m.conv_dim), int(m.conv_kernel_size) - 1),
                                 SSM_STATE: (int(m.num_heads), int(m.head_dim),
                                             int(m.ssm_state_size))}, dtype=WIDE_STATE)
                for i, (_, m) in mixers.items()}
    return {i: State({CONV_STATE: (int(m.conv_dim), int(m.conv_kernel_size) - 1),
                      RECURRENT_STATE: (int(m.num_v_heads), int(m.head_k_dim), int(m.head_v_dim))},
                     dtype=WIDE_STATE)
            for i, (_, m) in gdn_layers(model).items()}


def route_state_layers(model) -> list:
    """Route the state modules of ``model`` (``state_modules``: LFM2's short convolutions,
    Bamba-family Mamba-2 mixers, Qwen3-Next's gated DeltaNet) through the cache: each module's
    forward, called with ``kvcache=cache`` (the keyword the ``"kvcache"`` attention reads,
    passed down by the decoder layers) or inside ``serving(cache)``, runs ``conv_forward`` /
    ``mamba_forward`` / ``gdn_forward`` on the cache's state slots; called without it
    (transformers' own ``generate``, a plain forward) it is transformers' own, unchanged.
    Idempotent (a module is wrapped once). Returns the layers routed ([] for a family without
    state layers). ``cache_config`` and ``TransformersAdapter`` call it."""
    layers = state_modules(model)
    family = _family(model)
    run = (mamba_forward if family in _MAMBA_CLASSES
           else gdn_forward if family in _GDN_CLASSES else conv_forward)
    for _, (_, module) in layers.items():
        if module in _ROUTED:
            continue
        original = module.forward
        names = _positional_names(original)

        @functools.wraps(original)
        def forward(*args, _module=module, _original=original, _names=names, **kwargs):
            cache = kwargs.get("kvcache")
            if cache is None:
                cache = _SERVING.get()
            if cache is None:
                return _original(*args, **kwargs)
            return _routed_call(_module, cache, args, kwargs, _names, run)

        module.forward = forward
        _ROUTED.add(module)
    return sorted(layers)


# keywords a decoder layer passes its conv that change nothing the cache computes: positions
# are the cache's, use_cache / output flags (router logits too) belong to other modules,
# ``kvcache`` is the cache
_IGNORED = frozenset(("kvcache", "position_ids", "use_cache", "output_attentions",
                      "output_hidden_states", "cache_position", "logits_to_keep",
                      "return_dict", "output_router_logits"))


_NAMES = ("hidden_states", "cache", "attention_mask")
# the keywords transformers' releases give a state module its own cache by
_OWN_CACHE = ("cache", "cache_params", "past_key_values")


def _positional_names(forward) -> tuple:
    """The names of ``forward``'s positional parameters, read off its signature (transformers'
    releases order a mixer's parameters differently); ``_NAMES`` where it has none to read."""
    import inspect
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return _NAMES
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names if names and names[0] == "hidden_states" else _NAMES


def _routed_call(module, cache, args: tuple, kwargs: dict, names: tuple = _NAMES,
                 run=None):
    """A state module's call with ``kvcache=cache``: its arguments checked (transformers'
    ``(hidden_states, cache=None, attention_mask=None, **kwargs)``; ``names`` its positional
    parameters), then ``run`` (``conv_forward``, ``mamba_forward`` or ``gdn_forward``)."""
    layer = module.layer_idx
    kw = dict(kwargs)
    if len(args) > len(names):
        raise UnsupportedFeatureError(
            f"layer {layer} ({type(module).__name__}) was called with {len(args)} positional "
            f"arguments; its forward on the cache takes ({', '.join(names)})")
    for name, value in zip(names, args):
        kw[name] = value
    hidden_states = kw.pop("hidden_states", None)
    if hidden_states is None:
        raise InvalidArgumentError(f"layer {layer} ({type(module).__name__}) got no hidden_states")
    for key in _OWN_CACHE:
        own = kw.pop(key, None)
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
                f"forward on the cache does not implement {name!r}")
    return (run or conv_forward)(module, cache, hidden_states)


def _state_to_torch(cache, state, device, dtype):
    if torch.is_tensor(state):
        return state.to(device=device, dtype=dtype)
    return torch.from_numpy(np.asarray(to_numpy(state), np.float32)).to(device=device, dtype=dtype)


def _state_to_cache(cache, values, layer: int):
    """``values`` as the cache stores state layer ``layer``'s states (``State.dtype``)."""
    dtype = _storage(cache.config, layer)
    if cache.backend.is_native(values):
        return values.to(getattr(torch, dtype)).contiguous()
    return cache.from_numpy(values.detach().to("cpu", torch.float32).numpy(), dtype)


@functools.lru_cache(maxsize=256)
def _storage(config, layer: int) -> str:
    return config.state_layers[layer].storage(config.dtype)


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
    layer = layer_of(module)
    _, lengths = _open_forward(module, cache, hidden_states, "a short convolution")
    bcx = module.in_proj(hidden_states).transpose(-1, -2)        # (1, 3H, T)
    b, c, x = bcx.chunk(3, dim=-2)
    y = _packed_conv(cache, layer, lengths, (b * x)[0], module.conv)
    y = (c[0] * y.to(hidden_states.dtype)).transpose(0, 1).unsqueeze(0).contiguous()
    return module.out_proj(y)                                     # (1, T, H)


def _packed_conv(cache, layer: int, lengths: tuple, inputs, conv):
    """A causal depthwise ``conv`` (weight (C, 1, K)) of state layer ``layer`` over ``inputs``
    (C, T), the open forward's new inputs packed in ``begin_forward`` order (``lengths`` per
    sequence): one block per sequence, its conv state's ``K - 1`` columns
    (``cache.get_state(layer, "conv")``) then its inputs, one conv over every block, the
    windows that cross a block boundary dropped (no sequence reads another's inputs). Writes
    each sequence's last ``K - 1`` inputs as its new state (``cache.set_state``) and the
    ``K - 1`` inputs before each prefix-cache boundary inside the appends
    (``cache.set_state_checkpoints``). Returns the conv's outputs (C, T) in its weight's dtype,
    before any activation."""
    weight = conv.weight
    c, k1, s = int(weight.shape[0]), int(weight.shape[-1]) - 1, len(lengths)
    device = inputs.device
    states = _state_to_torch(cache, cache.get_state(layer, CONV_STATE), device, inputs.dtype)
    order, out, keep = (torch.from_numpy(a).to(device) for a in _indices(lengths, k1))
    src = torch.cat([states.permute(1, 0, 2).reshape(c, s * k1), inputs], dim=1)
    laid = src.index_select(1, order)                             # (C, S*k1 + T)
    y = torch.nn.functional.conv1d(laid.unsqueeze(0).to(weight.dtype), weight, conv.bias,
                                   groups=c)[0].index_select(1, out)
    new = laid.index_select(1, keep).view(c, s, k1).permute(1, 0, 2)
    cache.set_state(layer, CONV_STATE, _state_to_cache(cache, new, layer))
    marks = cache.state_checkpoints()
    if marks:
        at = torch.from_numpy(checkpoint_columns(lengths, k1, marks)).to(device)
        kept = laid.index_select(1, at).view(c, len(marks), k1).permute(1, 0, 2)
        cache.set_state_checkpoints(layer, CONV_STATE, _state_to_cache(cache, kept, layer))
    return y


def _open_forward(module, cache, hidden_states, what: str) -> tuple:
    """``(plan, lengths)`` of ``cache``'s open forward for a state module's call, checked:
    a forward is open, not a static-shape step, and ``hidden_states`` is its packed row."""
    layer = layer_of(module)
    plan = cache.open_plan
    if plan is None:
        cache.get_state(layer, CONV_STATE)          # raises ForwardStateError: no forward
    if cache.static_bucket is not None:
        raise UnsupportedFeatureError(
            f"layer {layer}: a static-shape (captured) step cannot run {what} on the cache; "
            f"graphs are off for models with state layers")
    lengths = tuple(int(n) for n in plan.append_lengths)
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1 \
            or hidden_states.shape[1] != sum(lengths):
        raise InvalidArgumentError(
            f"layer {layer}: hidden_states {tuple(hidden_states.shape)} is not the forward's "
            f"packed row (1, {sum(lengths)}, hidden) of sequences {plan.seq_ids}")
    return plan, lengths


def _recurrence(cache, layer: int, name: str, lengths: tuple, past, state, out, one_step,
                chunked):
    """A recurrent layer's state ``name`` over the open forward, in transformers' two forms:
    the decode tokens of sequences with a past (``past``: each sequence's length before the
    forward) all at once, ``one_step(rows, seqs) -> (outputs, new states)`` (``rows``: their
    rows of the packed tokens, ``seqs``: their sequences); every other sequence alone,
    ``chunked(i, first row, n, at) -> (outputs (n, ...), final state, states after the first
    ``r`` tokens for each ``r`` of ``at``)``, from ``state`` (S, ...) float32. Puts the outputs
    in ``out``'s rows, writes the new states (``cache.set_state``) and those at the prefix
    cache's boundaries inside the appends (``cache.set_state_checkpoints``). Returns the
    decode tokens' rows (a tensor), or None."""
    device, s = state.device, len(lengths)
    new = torch.empty_like(state)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    step = [i for i in range(s) if lengths[i] == 1 and past[i] > 0]
    rows = None
    if step:
        rows = torch.from_numpy(starts[step]).to(device)
        seqs = torch.as_tensor(step, device=device)
        ys, st = one_step(rows, seqs)
        out[rows] = ys.to(out.dtype)
        new[seqs] = st
    marks = cache.state_checkpoints()      # the prefix cache's boundaries inside the chunks
    wanted: dict = {}
    for row, n in marks:
        wanted.setdefault(row, []).append(n)
    kept: dict = {}
    chosen = set(step)
    for i in range(s):
        if i in chosen:
            continue
        lo, n = int(starts[i]), lengths[i]
        ys, st, at = chunked(i, lo, n, tuple(wanted.get(i, ())))
        out[lo:lo + n] = ys
        new[i] = st
        kept.update(((i, r), inner) for r, inner in zip(wanted.get(i, ()), at))
    cache.set_state(layer, name, _state_to_cache(cache, new, layer))
    if marks:
        cache.set_state_checkpoints(layer, name, _state_to_cache(
            cache, torch.stack([kept[w] for w in marks]), layer))
    return rows


def _ssm_step(m, state, x, dt, A, B, C):
    """The mixer's recurrent form for one token of each of ``N`` sequences, in the order of
    transformers' own decode step (so float32 tokens match it): ``state`` (N, heads, head_dim,
    d_state) float32, ``x`` (N, heads, head_dim), ``dt`` (N, heads), ``B``/``C`` (N, groups,
    d_state). Returns ``(y (N, heads, head_dim) in x's dtype, new state float32)``."""
    n, heads, hd = x.shape
    groups, ds = B.shape[1], B.shape[2]
    dt = dt[:, :, None].expand(-1, -1, hd)
    dt = dt + m.dt_bias[:, None].expand(-1, hd).to(dt.dtype)
    dt = torch.nn.functional.softplus(dt)[..., None]
    dA = torch.exp(dt.float() * A[:, None, None].expand(-1, hd, ds).float())
    B = B.reshape(n, groups, 1, ds).expand(n, groups, heads // groups, ds).contiguous()
    dBx = dt * B.reshape(n, heads, 1, ds) * x[..., None]
    new = state * dA + dBx
    C = C.reshape(n, groups, 1, ds).expand(n, groups, heads // groups, ds).contiguous()
    C = C.reshape(n, heads, ds)
    y = torch.bmm(new.to(C.dtype).view(n * heads, hd, ds), C.view(n * heads, ds, 1))
    y = y.view(n, heads, hd)
    y = (y + x * m.D[:, None].expand(-1, hd)).to(y.dtype)
    return y.to(x.dtype), new.float()


def _segsum(a):
    """Segment sums over the last dim (``a[..., i] + ... + a[..., j+1]`` below the diagonal,
    0 on it, -inf above), by masked cumulative sums as the model computes them."""
    k = a.size(-1)
    a = a[..., None].expand(*a.size(), k)
    below = torch.tril(torch.ones(k, k, device=a.device, dtype=torch.bool), diagonal=-1)
    s = torch.cumsum(a.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(k, k, device=a.device, dtype=torch.bool), diagonal=0)
    return s.masked_fill(~keep, -torch.inf)


def _chunks(t, pad: int, size: int):
    """``t`` (1, L, ...) padded with zeros to a multiple of ``size`` tokens, as (1, chunks,
    size, ...)."""
    t = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.reshape(t.shape[0], -1, size, *t.shape[2:])


def _ssm_chunked(m, state, x, dt, A, B, C, at: tuple = ()):
    """The mixer's chunked (segment-sum) form over the ``L`` tokens of one sequence starting
    from ``state`` (1, heads, head_dim, d_state) float32 (zeros: a new sequence), in the order
    of transformers' own prefill: ``x`` (1, L, heads, head_dim), ``dt`` (1, L, heads),
    ``B``/``C`` (1, L, groups, d_state). A chunk continuing a sequence gives what one prefill
    over the whole prompt gives (the scan's chunks restart from the carried state). Returns
    ``(y (1, L, heads, head_dim) float32, final state (1, heads, head_dim, d_state) float32,
    states)``, ``states`` the list of the states (heads, head_dim, d_state) float32 after the
    first ``r`` tokens for each ``r`` of ``at`` (``0 < r < L``: the prefix cache's
    checkpoints inside the chunk, ``_inner_state``)."""
    length, heads = x.shape[1], x.shape[2]
    groups, size = B.shape[2], int(m.chunk_size)
    lo, hi = m.time_step_limit
    dt = torch.nn.functional.softplus(dt + m.dt_bias.to(dt.dtype))
    dt = torch.clamp(dt, min=lo, max=hi)
    x = x.float()
    B = B.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    C = C.float().repeat_interleave(heads // groups, dim=2, output_size=heads)
    pad = (size - length % size) % size
    skip = m.D[..., None] * torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, B, C = (_chunks(t, pad, size) for t in (x, A, B, C))
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segsum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", M, x)
    decay = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, x)
    states = torch.cat([state[:, None].to(dtype=states.dtype), states], dim=1)
    decay_chunk = torch.exp(_segsum(torch.nn.functional.pad(A_cumsum[:, :, :, -1], (1, 0))))
    new = torch.einsum("bzch,bzhpn->bchpn", decay_chunk.transpose(1, 3), states)
    states, final = new[:, :-1], new[:, -1]
    C_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    y_off = C_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).contiguous().reshape(1, -1, heads, x.shape[-1]) + skip
    inner = [_inner_state(new, A_cumsum, B, x, r, size) for r in at]
    return y[:, :length], final, inner


def _inner_state(new, A_cumsum, B, x, r: int, size: int):
    """The SSM state after the first ``r`` tokens of a chunked scan (``_ssm_chunked``'s
    tensors: ``new`` (1, chunks + 1, heads, head_dim, d_state) the states before each chunk,
    ``A_cumsum`` (1, heads, chunks, size), ``B`` (1, chunks, size, heads, d_state), ``x``
    (1, chunks, size, heads, head_dim) scaled by dt): the state before its chunk decayed to
    token ``r - 1``, plus the chunk's tokens before ``r``, each decayed from its own step.
    The same sums the scan's next chunk starts from, in another order: a checkpoint, equal to
    the scan's own state up to rounding."""
    c, o = divmod(r, size)
    if o == 0:
        return new[0, c]
    last = A_cumsum[0, :, c, o - 1]                                       # (heads,)
    decay = torch.exp(last[None, :] - A_cumsum[0, :, c, :o].transpose(0, 1))   # (o, heads)
    tokens = torch.einsum("jh,jhn,jhp->hpn", decay, B[0, c, :o], x[0, c, :o])
    return new[0, c] * torch.exp(last)[:, None, None] + tokens


def mamba_forward(module, cache, hidden_states):
    """A Bamba-family Mamba-2 mixer over the open forward of ``cache``, per sequence.

    ``module``: the layer's mixer (``mamba_layers``); ``hidden_states`` (1, T, hidden): the T
    new tokens of the forward's sequences packed in ``begin_forward`` order (prefill chunks
    and decode tokens alike). The projections and the gated norm run on the packed row; the
    causal depthwise conv (``conv_kernel_size`` taps, then SiLU) over one block per sequence
    that starts with its conv state (``cache.get_state(layer, "conv")``, (B, conv_dim,
    conv_kernel_size - 1): zeros for a new sequence), as ``conv_forward`` does; the SSM per
    sequence from its state (``"ssm"``, (B, heads, head_dim, d_state)): one token of a sequence
    with a past in the recurrent form (all such tokens at once), anything else (a new
    sequence, a prefill chunk) in the chunked form, as transformers' decode step and prefill
    compute them. The new states are written with ``cache.set_state`` (committed at
    ``end_forward``). Returns the mixer's output (1, T, hidden) in ``hidden_states``' dtype.
    Raises ``InvalidArgumentError`` when ``hidden_states`` is not the open forward's packed
    row."""
    layer = layer_of(module)
    plan, lengths = _open_forward(module, cache, hidden_states, "a Mamba mixer")
    past = np.asarray(plan.tokens.k_rope_offset)[:len(lengths)]   # committed lengths
    dtype, device = hidden_states.dtype, hidden_states.device
    inner, conv_dim, heads = module.intermediate_size, module.conv_dim, module.num_heads
    hd, groups, ds = module.head_dim, module.n_groups, module.ssm_state_size
    if hasattr(module, "mup_vector"):
        # Falcon-H1's muP multipliers, in its order: on the input, then per projected part
        proj = module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
    else:
        proj = module.in_proj(hidden_states)
    gate, xbc, dt = proj.split([inner, conv_dim, heads], dim=-1)
    # (the conv's output in its input's dtype, as transformers': the model dtype, or float32
    # where Falcon-H1's float32 multipliers promoted the projections)
    sdtype = xbc.dtype
    y = torch.nn.functional.silu(_packed_conv(cache, layer, lengths, xbc[0].t(),
                                              module.conv1d)).to(sdtype).t()  # (T, conv_dim)
    x, B, C = y.split([inner, groups * ds, groups * ds], dim=-1)
    A = -torch.exp(module.A_log.float())
    ssm = _state_to_torch(cache, cache.get_state(layer, SSM_STATE), device, torch.float32)
    scan = torch.empty(len(y), heads, hd, dtype=torch.float32, device=device)

    def one_step(rows, seqs):
        m = len(rows)
        return _ssm_step(module, ssm.index_select(0, seqs),
                         x.index_select(0, rows).view(m, heads, hd), dt[0].index_select(0, rows),
                         A, B.index_select(0, rows).view(m, groups, ds),
                         C.index_select(0, rows).view(m, groups, ds))

    def chunked(i, a, n, at):
        ys, st, inner_states = _ssm_chunked(
            module, ssm[i:i + 1], x[a:a + n].view(1, n, heads, hd), dt[:, a:a + n], A,
            B[a:a + n].view(1, n, groups, ds), C[a:a + n].view(1, n, groups, ds), at)
        return ys[0], st[0], inner_states
    rows = _recurrence(cache, layer, SSM_STATE, lengths, past, ssm, scan, one_step, chunked)
    flat = scan.view(1, -1, inner)
    # Falcon-H1 without its norm: the gate alone
    gated = _silu_gate if getattr(module, "mamba_rms_norm", True) is False else module.norm
    if rows is None:
        out = gated(flat, gate).to(dtype)
    else:
        # transformers' decode step hands the norm (or gate) its output in the model dtype,
        # its prefill in float32: it rounds where its input's dtype says (bfloat16 differs)
        is_step = torch.zeros(len(y), dtype=torch.bool, device=device)
        is_step[rows] = True
        out = torch.empty(1, len(y), inner, dtype=dtype, device=device)
        out[:, is_step] = gated(flat[:, is_step].to(sdtype), gate[:, is_step]).to(dtype)
        if len(rows) < len(y):
            rest = ~is_step
            out[:, rest] = gated(flat[:, rest], gate[:, rest]).to(dtype)
    return module.out_proj(out)


def _silu_gate(v, gate):
    """Falcon-H1's mixer output without its gated norm (``mamba_rms_norm=False``): ``v *
    silu(gate)``, in the order of both its forms."""
    return v * torch.nn.functional.silu(gate)


def _l2norm(x, eps: float = 1e-6):
    """transformers' ``l2norm`` of the gated delta rule (last dim, in x's dtype)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gdn_inputs(q, k, v, g, beta):
    """The gated delta rule's inputs as both of transformers' forms prepare them: ``q``/``k``
    (N, L, key heads, dk), ``v`` (N, L, value heads, dv), ``g``/``beta`` (N, L, value heads) ->
    float32 (N, value heads, L, ...), keys repeated over their value heads, ``q``/``k``
    L2-normalized, ``q`` scaled by ``dk ** -0.5`` (returned unscaled too: the recurrent form
    divides, the chunked form multiplies)."""
    nk, nv = k.shape[2], v.shape[2]
    if nk != nv:
        q = q.repeat_interleave(nv // nk, dim=2)
        k = k.repeat_interleave(nv // nk, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for t in (q, k, v, beta, g))
    return _l2norm(q), _l2norm(k), v, g, beta


def _gdn_step(q, k, v, g, beta, state):
    """transformers' recurrent gated delta rule for one token of each of ``N`` sequences, in
    its order of operations (so float32 tokens match its decode step): ``q``/``k`` (N, 1, key
    heads, dk), ``v`` (N, 1, value heads, dv), ``g``/``beta`` (N, 1, value heads), ``state``
    (N, value heads, dk, dv) float32. Returns ``(out (N, 1, value heads, dv) in q's dtype, new
    state float32)``."""
    dtype = q.dtype
    q, k, v, g, beta = _gdn_inputs(q, k, v, g, beta)
    q = q / (q.shape[-1] ** 0.5)
    s = state.to(v)
    q_t, k_t, v_t = q[:, :, 0], k[:, :, 0], v[:, :, 0]
    s = s * g[:, :, 0].exp()[..., None, None]
    kv_mem = (s * k_t.unsqueeze(-1)).sum(dim=-2)
    delta = (v_t - kv_mem) * beta[:, :, 0].unsqueeze(-1)
    s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q_t.unsqueeze(-1)).sum(dim=-2)                   # (N, heads, dv)
    return out[:, None].contiguous().to(dtype), s


def _gdn_rule(q, k, v, g, beta, state, size: int):
    """transformers' chunked gated delta rule over one sequence's ``L`` tokens (the inputs as
    ``_gdn_inputs`` gives them, batch 1) from ``state`` (1, heads, dk, dv) float32, in chunks of
    ``size`` tokens, in its order of operations. Returns ``(out (1, heads, L, dv) float32,
    final state, starts)``, ``starts`` the states before each chunk."""
    length = q.shape[2]
    q = q * (q.shape[-1] ** -0.5)
    pad = (size - length % size) % size
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (torch.nn.functional.pad(t, (0, pad)) for t in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(t.shape[0], t.shape[1], -1, size, t.shape[-1])
                            for t in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, size)
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False,
                                               unitriangular=True)
    s = state.to(new_values)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    starts = []
    for i in range(new_values.shape[2]):
        starts.append(s)
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(out.shape[0], out.shape[1], -1, out.shape[-1])[:, :, :length]
    return out, s, starts


def _gdn_chunked(q, k, v, g, beta, state, size: int = GDN_CHUNK, at: tuple = ()):
    """The chunked gated delta rule over one sequence's ``L`` tokens from ``state`` (1, value
    heads, dk, dv) float32 (zeros: a new sequence), as transformers' prefill computes it:
    ``q``/``k`` (1, L, key heads, dk), ``v`` (1, L, value heads, dv), ``g``/``beta`` (1, L,
    value heads). A chunk continuing a sequence is what transformers gives a prefill that
    continues from ``initial_state``. Returns ``(out (1, L, value heads, dv) in q's dtype,
    final state (1, value heads, dk, dv) float32, states)``, ``states`` the states (value
    heads, dk, dv) float32 after the first ``r`` tokens for each ``r`` of ``at`` (``0 < r <
    L``: the prefix cache's checkpoints inside the chunk). Such a state is the one a run over
    the first ``r`` tokens reaches, computed as that run computes it: the state before ``r``'s
    rule chunk, then the rule over that chunk's tokens before ``r`` (zero padding adds nothing
    to the state, and the padded chunk has the same shape)."""
    dtype = q.dtype
    q, k, v, g, beta = _gdn_inputs(q, k, v, g, beta)
    out, final, starts = _gdn_rule(q, k, v, g, beta, state, size)
    inner = []
    for r in at:
        c, o = divmod(int(r), size)
        if o == 0:
            inner.append(starts[c][0])
            continue
        a = c * size
        _, s, _ = _gdn_rule(q[:, :, a:r], k[:, :, a:r], v[:, :, a:r], g[:, :, a:r],
                            beta[:, :, a:r], starts[c], size)
        inner.append(s[0])
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), final, inner


def gdn_forward(module, cache, hidden_states):
    """A Qwen3-Next gated DeltaNet layer over the open forward of ``cache``, per sequence.

    ``module``: the layer's ``Qwen3NextGatedDeltaNet`` (``gdn_layers``); ``hidden_states``
    (1, T, hidden): the T new tokens of the forward's sequences packed in ``begin_forward``
    order (prefill chunks and decode tokens alike). The projections (the layer's own
    ``fix_query_key_value_ordering``) and the gated norm run on the packed row; the causal
    depthwise conv (then the layer's activation) over one block per sequence that starts with
    its conv state (``cache.get_state(layer, "conv")``, (B, conv_dim, kernel - 1): zeros for a
    new sequence), as ``conv_forward`` does; the gated delta rule per sequence from its state
    (``"recurrent"``, (B, value heads, dk, dv)): one token of a sequence with a past in the
    recurrent form (all such tokens at once), anything else in the chunked form, as
    transformers' decode step and prefill compute them. The new states are written with
    ``cache.set_state`` (committed at ``end_forward``), and the states at the prefix cache's
    boundaries inside the appends with ``cache.set_state_checkpoints``. Returns the layer's
    output (1, T, hidden) in ``hidden_states``' dtype. Raises ``InvalidArgumentError`` when
    ``hidden_states`` is not the open forward's packed row."""
    from transformers.activations import ACT2FN
    layer = layer_of(module)
    plan, lengths = _open_forward(module, cache, hidden_states, "a gated DeltaNet layer")
    past = np.asarray(plan.tokens.k_rope_offset)[:len(lengths)]   # committed lengths
    dtype, device = hidden_states.dtype, hidden_states.device
    nk, nv = module.num_k_heads, module.num_v_heads
    dk, dv = module.head_k_dim, module.head_v_dim
    key_dim, value_dim = module.key_dim, module.value_dim
    query, key, value, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states))
    t = hidden_states.shape[1]
    mixed = torch.cat([part.reshape(1, t, -1) for part in (query, key, value)], dim=-1)[0]
    y = ACT2FN[module.activation](_packed_conv(cache, layer, lengths, mixed.t(),
                                               module.conv1d)).to(dtype).t()   # (T, conv_dim)
    q, k, v = y.split([key_dim, key_dim, value_dim], dim=-1)
    q, k, v = q.reshape(t, nk, dk), k.reshape(t, nk, dk), v.reshape(t, nv, dv)
    beta = b.sigmoid()[0]                                         # (T, value heads)
    g = (-module.A_log.float().exp() * torch.nn.functional.softplus(
        a.float() + module.dt_bias))[0]
    rec = _state_to_torch(cache, cache.get_state(layer, RECURRENT_STATE), device, torch.float32)
    core = torch.empty(t, nv, dv, dtype=dtype, device=device)

    def one_step(rows, seqs):
        qs, ks, vs, gs, bs = (x_.index_select(0, rows)[:, None] for x_ in (q, k, v, g, beta))
        ys, st = _gdn_step(qs, ks, vs, gs, bs, rec.index_select(0, seqs))
        return ys[:, 0], st

    def chunked(i, lo, n, at):
        qs, ks, vs, gs, bs = (x_[lo:lo + n][None] for x_ in (q, k, v, g, beta))
        ys, st, inner_states = _gdn_chunked(qs, ks, vs, gs, bs, rec[i:i + 1], GDN_CHUNK, at)
        return ys[0], st[0], inner_states
    _recurrence(cache, layer, RECURRENT_STATE, lengths, past, rec, core, one_step, chunked)
    # the gated norm per head of each token (both of transformers' forms hand it the rule's
    # output in the model dtype), then the projection
    normed = module.norm(core.reshape(-1, dv), z.reshape(-1, dv))
    return module.out_proj(normed.reshape(1, t, value_dim))
