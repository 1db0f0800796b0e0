"""What the transformers integration reads off a model and its config: head dims, windows, EOS
ids, the attention layers and what they need of a backend (re-exported by the package)."""

from __future__ import annotations

import re

from ...errors import UnsupportedFeatureError
from .. import require

torch = require("torch", "transformers")

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


# ---------------------------------------------------------------------- model description
def _head_dim(config) -> int:
    return head_dims(config)[0]


def head_dims(config) -> tuple:
    """``(head_dim, head_dim_v)`` of a transformers config: the query/key head dim and the
    value (and output) head dim. MLA models in expanded form (DeepSeek V2/V3: q/k
    ``qk_nope_head_dim + qk_rope_head_dim``, values ``v_head_dim``) differ; others are equal."""
    nope, rope_dim = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rope_dim is not None:
        d = int(nope) + int(rope_dim)
    else:
        d = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return d, int(getattr(config, "v_head_dim", None) or d)


def eos_token_ids(model) -> tuple:
    """The end-of-sequence ids ``model.generate`` stops at: the generation config's
    ``eos_token_id`` (an int or a list), else the model config's; () when neither names one."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids = getattr(source, "eos_token_id", None)
        if ids is not None:
            ids = [ids] if isinstance(ids, int) else list(ids)
            return tuple(int(t) for t in ids)
    return ()


def sliding_windows(config) -> dict:
    """``{layer index: sliding_window}`` for the model's sliding-window layers (empty: none).
    Layers listed in ``config.layer_types`` as ``"sliding_attention"`` use the window; without
    ``layer_types`` a set ``config.sliding_window`` applies to every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return {}
    types = getattr(config, "layer_types", None)
    layers = range(config.num_hidden_layers)
    if types is not None:
        return {i: int(window) for i in layers if types[i] == "sliding_attention"}
    return {i: int(window) for i in layers}


# the layer types whose attention transformers' masks and attention calls treat as full or as
# a sliding window of ``config.sliding_window`` positions (masking_utils'
# ``sliding_window_overlay``: a query at q sees the keys k with k > q - sliding_window)
_FULL_TYPES = frozenset(("full_attention",))
_SLIDING_TYPES = frozenset(("sliding_attention",))


def layer_kinds(model) -> dict:
    """``{layer: kvcache.Window(W - 1)}`` for the model's sliding-window layers (the
    ``CacheConfig.layer_kinds`` of a cache whose windowed layers keep only the pages their
    windows still see; empty: none). transformers' ``sliding_window=W`` counts the query
    itself (its masks let a query at ``q`` see the keys ``q - W + 1 .. q``), so ``W`` is
    ``Window(W - 1)``. The layers come from ``sliding_windows(config)`` and are checked against
    what each attention module will pass to attention (its ``sliding_window`` attribute, where
    it keeps one).

    Raises ``UnsupportedFeatureError`` naming the layer when the model's windowing is not
    understood: a ``layer_types`` entry other than full or sliding attention (e.g. chunked
    attention), a window below 1, or a module whose own window differs from the config's.
    Freeing a window's pages on a misread window would change the tokens without an error;
    keeping every page (``CacheConfig`` without ``layer_kinds``) is always exact."""
    from ...config import Window
    config = model.config
    family = getattr(config, "model_type", None) or type(model).__name__
    windows = sliding_windows(config)
    types = getattr(config, "layer_types", None)
    if types is not None and windows:
        for i, kind in enumerate(types[:int(config.num_hidden_layers)]):
            if kind not in _FULL_TYPES and kind not in _SLIDING_TYPES:
                raise UnsupportedFeatureError(
                    f"layer {i} of the {family} model has layer type {kind!r}: window groups "
                    f"know full and sliding attention only, so its windowing is not understood; "
                    f"pass window_groups=False (every page kept)")
    for i, module in enumerate(attention_layers(model)):
        if module is None:
            continue                    # a state layer: no attention, no window
        want = windows.get(i)
        if want is not None and want < 1:
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model has sliding_window={want}: a window must see "
                f"at least the query itself (>= 1)")
        if "sliding_window" in vars(module) and module.sliding_window != want:
            raise UnsupportedFeatureError(
                f"layer {i} of the {family} model ({type(module).__name__}) passes "
                f"sliding_window={module.sliding_window!r} to attention, but its config says "
                f"{want!r} (config.sliding_window, layer_types): its windowing is not "
                f"understood; pass window_groups=False (every page kept)")
    return {i: Window(w - 1) for i, w in windows.items()}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise UnsupportedFeatureError(f"the cache stores float32, float16 or bfloat16, not {dtype}")
    return _DTYPES[dtype]


_QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "q_a_proj", "query_key_value", "c_attn")


def attention_modules(model) -> list:
    """The attention modules of ``model``: those with an int ``layer_idx``, a config and a query
    projection, in module order."""
    return [m for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config")
            and any(hasattr(m, name) for name in _QUERY_PROJECTIONS)]


def attention_layers(model) -> list:
    """The model's attention modules, one per cache layer in layer order (each with its
    ``layer_idx``); ``None`` at a state layer (an LFM2 short convolution, a Bamba-family
    Mamba-2 mixer: ``state_kinds``), which has no attention. The cache layers are the decoder
    layers but for blocks that hold nothing (Nemotron-H's MLP and MoE blocks) and layers that
    hold a mixer beside their attention (Falcon-H1's: two cache layers, the mixer's first;
    ``states.cache_layers``). Raises ``UnsupportedFeatureError`` with the reason when the
    model's layers do not map one to one onto cache layers (layers without attention that are
    not state layers, two attention modules in one layer, or one in a block that holds
    nothing)."""
    from .states import parallel_layers, stateless_layers, state_modules
    config = model.config
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    skip, both = set(stateless_layers(model)), set(parallel_layers(model))
    found: dict = dict.fromkeys(i for i in state_modules(model) if i not in both)
    for m in attention_modules(model):
        idx = m.layer_idx
        if idx in skip:
            raise UnsupportedFeatureError(
                f"{type(model).__name__}: layer {idx} is a block that holds nothing by its "
                f"type (no cache layer), but has an attention module ({type(m).__name__})")
        if idx in found and found[idx] is None:
            raise UnsupportedFeatureError(
                f"{type(model).__name__}: layer {idx} is a state layer (a recurrent state) "
                f"and has an attention module ({type(m).__name__}) too; the cache holds one "
                f"kind per layer")
        if idx in found:
            raise UnsupportedFeatureError(
                f"{type(model).__name__}: layer {idx} has two attention modules "
                f"({type(found[idx]).__name__}, {type(m).__name__}); the cache holds one per layer")
        found[idx] = m
    want = [i for i in range(layers) if i not in skip]
    if sorted(found) != want:
        raise UnsupportedFeatureError(
            f"{type(model).__name__}: {layers} decoder layers, but attention modules with a "
            f"layer_idx in layers {sorted(found)} only (layers without attention, e.g. a hybrid "
            f"recurrent model, cannot run on the cache)")
    out: list = []
    for i in want:
        if i in both:
            out.append(None)            # the mixer's cache layer, then the attention's
        out.append(found[i])
    return out


# ---------------------------------------------------------------------- hybrid models
# what keeps state the cache does not hold, by the words of a module's class name (its model's
# prefix taken off: "FalconH1Mixer" -> "mixer"), and why it matters
_STATE_MODULES = (
    (re.compile(r"\b(mamba\d*|ssm|mixer)\b"), "a Mamba / state-space mixer: its convolution "
     "and SSM state carry from token to token"),
    (re.compile(r"\b(linear (attention|attn)|delta (net|attention|rule)|gated delta|lightning|"
                r"gdn|kda)\b"),
     "linear attention: its recurrent state carries from token to token"),
    (re.compile(r"\b(recurrent|rglru|lru)\b"), "a recurrent block: its hidden state carries from "
     "token to token"),
    (re.compile(r"\b(short conv\w*|causal conv\w*)\b"), "a short causal convolution: its window "
     "of earlier inputs carries from token to token"),
    (re.compile(r"\b(position bias|relative position\w*|alibi)\b"), "a position bias added to "
     "the attention scores, which the cache's attention does not apply"),
)
_CONV_REASON = _STATE_MODULES[3][1]
# transformers' layer types whose cache keeps a recurrent or convolution state (legacy names too)
_STATE_LAYER_TYPES = frozenset(("conv", "linear_attention", "hybrid", "hybrid_sliding", "mamba",
                                "recurrent"))


def _state_layer_types() -> frozenset:
    """The layer types (``config.layer_types``) for which transformers' own cache keeps a
    recurrent or convolution state: its ``LinearAttentionCacheLayerMixin`` layers, and the
    names above."""
    try:
        from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING,
                                              LinearAttentionCacheLayerMixin)
    except ImportError:         # (an older transformers: the names above)
        return _STATE_LAYER_TYPES
    return _STATE_LAYER_TYPES | {
        name for name, cls in DYNAMIC_LAYER_TYPE_MAPPING.items()
        if isinstance(cls, type) and issubclass(cls, LinearAttentionCacheLayerMixin)}


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except Exception:            # (a config that cannot tell: itself)
        return config


def _layer_types(config) -> list:
    try:
        types = getattr(config, "layer_types", None)
    except Exception:            # (a derived property that cannot be computed)
        types = None
    if isinstance(types, str) or not isinstance(types, (list, tuple)):
        return []
    return [str(t) for t in types]


def _decoder_layer_lists(model) -> list:
    """``(path, ModuleList)`` of the lists that hold the model's decoder layers: those with an
    attention module (``layer_idx``), and the other layers of the same lists."""
    attn = [name for name, m in model.named_modules()
            if isinstance(getattr(m, "layer_idx", None), int) and any(
                hasattr(m, n) for n in _QUERY_PROJECTIONS)]
    lists: dict = {}
    modules = dict(model.named_modules())
    for name in attn:
        parts = name.split(".")
        for k in range(len(parts) - 1, 0, -1):
            path = ".".join(parts[:k])
            if isinstance(modules.get(path), torch.nn.ModuleList):
                lists[path] = modules[path]
                break
    return sorted(lists.items())


def stateful_layers(model) -> list:
    """What in ``model`` keeps state the cache does not hold, beside (or instead of) attention:
    ``(layer, where, reason)`` per decoder layer that has it (``where``: the module's path and
    class, or the layer type transformers' own cache gives it). Read off the config's
    ``layer_types`` (transformers' own cache keeps a recurrent or convolution state for
    ``conv``, ``linear_attention``, ``hybrid``... layers) and off the decoder layers' modules
    (Mamba / SSM mixers, linear attention and gated DeltaNet, recurrent blocks, short
    convolutions, relative position biases). Empty for a model the cache can serve whole."""
    found: dict = {}                    # layer -> {reason: where}
    prefix = re.sub(r"(For\w+|Model|LMHeadModel)$", "", type(model).__name__)
    for path, layers in _decoder_layer_lists(model):
        for i, layer in enumerate(layers):
            matched: list = []
            for name, m in layer.named_modules():
                if not name or any(name.startswith(p + ".") for p in matched):
                    continue            # (the layer itself: its parts tell; a match's parts)
                cls = type(m).__name__
                own = cls[len(prefix):] if prefix and cls.startswith(prefix) else cls
                words = " ".join(re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", own)).lower()
                reason = next((why for pattern, why in _STATE_MODULES if pattern.search(words)),
                              None)
                if reason is None and isinstance(m, torch.nn.Conv1d):
                    reason = _CONV_REASON
                if reason is not None:
                    matched.append(name)
                    found.setdefault(i, {}).setdefault(reason, f"{path}.{i}.{name} ({cls})")
    config = _text_config(model.config)
    state = _state_layer_types()
    for i, kind in enumerate(_layer_types(config)):
        if kind.lower() in state and i not in found:
            found[i] = {"transformers' own cache keeps a recurrent or convolution state for it":
                        f"a {kind!r} layer"}
    return [(i, where, why) for i in sorted(found) for why, where in found[i].items()]


def refuse_hybrid(model) -> None:
    """Raise ``UnsupportedFeatureError`` naming the model type, the layers and modules and the
    reason when ``model`` keeps state the cache does not hold (``stateful_layers``): a hybrid
    (Jamba, Zamba, Qwen3.5 ...) or a recurrent model. The cache holds attention K/V and the
    state of the layers ``state_kinds`` gives (``STATE_FAMILIES``: LFM2's short convolutions,
    the Mamba-2 mixers of Bamba, Granite-4.0-H, Nemotron-H and Falcon-H1, Qwen3-Next's gated
    DeltaNet); any other state would be lost between steps, and the tokens would differ from
    the model's own generation without an error. A model of a served family whose state
    modules are not what was read is refused too (``state_modules``)."""
    from .states import SERVED_STATE_LAYERS, state_modules
    found = stateful_layers(model)
    if not found:
        return
    # the state layers the cache serves: exactly their module, nothing else in the layer
    served = {i: f"{path} ({type(m).__name__})" for i, (path, m) in state_modules(model).items()}
    found = [(i, where, why) for i, where, why in found if served.get(i) != where]
    if not found:
        return
    config = _text_config(model.config)
    family = getattr(config, "model_type", None) or getattr(model.config, "model_type", None)
    layers = sorted({i for i, _, _ in found})
    shown = "; ".join(f"layer {i}: {where}, {why}" for i, where, why in found
                      if i in layers[:3])
    more = f"; and {len(layers) - 3} more layers" if len(layers) > 3 else ""
    raise UnsupportedFeatureError(
        f"the {family} model ({type(model).__name__}) keeps state the cache does not hold: "
        f"{shown}{more}. The cache holds attention K/V only: that state would be lost between "
        f"steps and the tokens would differ from the model's own generation, so hybrid and "
        f"recurrent models cannot run on the cache (state layers are served for "
        f"{SERVED_STATE_LAYERS} only)")


def _model_needs(model) -> list:
    """``(what, capability)`` the model's attention needs beyond plain causal attention, read off
    its config and modules: logit soft-capping (gemma2), learned sinks (gpt-oss), sliding
    windows are checked per request (``ModelAdapter.check_request``)."""
    needs = []
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        needs.append((f"attention logit soft-capping (attn_logit_softcapping="
                      f"{model.config.attn_logit_softcapping})", "logit_softcap"))
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter)
           for m in attention_layers(model) if m is not None):
        needs.append(("learned attention sinks (the layers' `sinks` parameters)", "attention_sinks"))
    if head_dims(model.config)[0] != head_dims(model.config)[1]:
        needs.append((f"value head dim {head_dims(model.config)[1]} other than the query/key "
                      f"head dim {head_dims(model.config)[0]}", "head_dims_v"))
    return needs
