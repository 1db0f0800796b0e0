"""Hugging Face transformers models on a ``PagedKVCache`` (extra ``kvcache[transformers]``).

Two ways in:

* your own loop: ``register()`` adds an attention implementation named ``"kvcache"``; after
  ``model.set_attn_implementation("kvcache")`` a forward run inside ``cache.forward(seq_ids,
  lengths)`` with the batch packed into one row (``input_ids`` of shape (1, T), per-token
  ``position_ids`` (1, T)), ``use_cache=False`` and ``kvcache=cache`` sends each decoder layer's
  attention to ``cache.attention(layer_idx, q, k, v)``. Build the cache with
  ``cache_config(model)`` (``rope_mode="none"``: the model applies its own RoPE);
* ``Engine(model, ...)``: continuous-batching generation (see ``kvcache.integrations.engine``);
  ``Engine(model, tp=N)`` on N tensor-parallel ranks (see ``kvcache.integrations.tp``).

RoPE: by default the model keeps its own rotary embedding, so the cache must not rotate: a
cache whose ``rope_mode`` is not ``"none"`` is refused by the attention function (it would rotate
q and k a second time). The cache's fused RoPE append is opt-in (``Engine(model, rope="cache")``,
or ``cache_config(model, rope="cache")`` with ``fused_rope(model, cache)`` in your own loop): it
is allowed only when ``model_rotary(model)`` proves the model's rotary is the standard
rotate-half one with static inverse frequencies and no output scaling; the cache then rotates
with the model's own ``inv_freq`` (and partial rotary dim), and the model's rotary embedding
returns cos=1, sin=0 for the duration so its layers hand over unrotated q and k. Sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Phi-3 with a
``sliding_window``) see the previous ``sliding_window`` positions including their own, as
transformers defines it; that is ``window_left = sliding_window - 1`` in the cache's terms and
needs the backend capability ``window_left`` once a sequence outgrows the window.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import weakref
from typing import Optional

import numpy as np

from . import MissingExtraError, install_hint, require
from ..serving import RequestOutput
from .engine import Engine as _Engine
from .sampling import SamplingParams
from .engine import ModelAdapter, PendingPicks
from ..arrays import to_numpy
from ..backend import Capabilities
from ..config import CacheConfig
from ..errors import InvalidArgumentError, UnsupportedFeatureError

MIN_VERSION = (5, 17)
torch = require("torch", "transformers")
transformers = require("transformers", "transformers", "5.17")


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


if _version(transformers.__version__) < MIN_VERSION:
    raise MissingExtraError(
        f"kvcache.integrations.transformers needs transformers >= "
        f"{'.'.join(map(str, MIN_VERSION))}, found {transformers.__version__}; install it with: "
        f"{install_hint('transformers')}")

__all__ = ["ATTN_IMPLEMENTATION", "Engine", "ROPE_CHOICES", "ROPE_FAMILIES", "RequestOutput",
           "SamplingParams", "TransformersAdapter",
           "attention", "cache_config", "fused_rope", "model_rotary", "register",
           "sliding_windows"]

ATTN_IMPLEMENTATION = "kvcache"
"""The name ``register()`` gives the attention implementation."""

ROPE_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3", "gemma",
                 "gemma2", "granite", "olmo2", "starcoder2")
"""Model families (``config.model_type``) whose rotary the cache's fused RoPE may replace
(``rope="cache"``): their layers rotate q and k with transformers' rotate-half
``apply_rotary_pos_emb`` over one rotary embedding module, on every layer. Others are refused
for ``rope="cache"`` with the reason (interleaved rotation: cohere, glm4, deepseek_v3; layers
without RoPE: smollm3; one rotary per layer type: gemma3; YaRN's attention factor: gpt_oss);
``rope="model"`` (the default) needs no list."""

ROPE_CHOICES = ("model", "cache")
"""Who rotates q and k: ``"model"`` (its own rotary embedding; cache ``rope_mode="none"``) or
``"cache"`` (the cache's fused RoPE append with the model's frequencies; ``rope_mode="normal"``)."""

# rope types whose inverse frequencies are fixed at construction (dynamic NTK and longrope
# change them with the sequence length, which a fixed cache table cannot follow)
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# attention module -> the cache whose fused RoPE rotates for it (inside fused_rope only)
_FUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# attention-function keywords that change nothing the cache computes: positions are the
# cache's (query_positions), the cache is the KV store, and routing / output flags belong to
# other modules of the layer. Every other keyword is honoured (``attention``) or refused.
_IGNORED = frozenset(("position_ids", "use_cache", "output_router_logits", "output_attentions",
                      "cache_position", "kvcache", "past_key_values", "past_key_value",
                      "layer_idx", "is_causal"))
# keywords with a meaning the cache implements, and the capability each needs
_HONOURED = {"sliding_window": "window_left", "softcap": "logit_softcap",
             "s_aux": "attention_sinks", "sinks": "attention_sinks"}


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


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise UnsupportedFeatureError(f"the cache stores float32, float16 or bfloat16, not {dtype}")
    return _DTYPES[dtype]


def _rotary_module(model):
    found = [m for m in model.modules()
             if hasattr(m, "inv_freq") and hasattr(m, "attention_scaling")]
    if len(found) != 1:
        raise UnsupportedFeatureError(
            f"rope='cache' needs the model's one rotary embedding module (with inv_freq and "
            f"attention_scaling); {type(model).__name__} has {len(found)}")
    return found[0]


def _check_rope(rope: str) -> str:
    if rope not in ROPE_CHOICES:
        raise InvalidArgumentError(f"rope={rope!r} is not one of {ROPE_CHOICES}")
    return rope


def model_rotary(model) -> tuple:
    """``(inv_freq, rotary_dim)`` of the model's rotary embedding, once proven standard:
    ``inv_freq`` (R/2,) float64 (R: the rotated dims), ``rotary_dim`` R when R < head_dim
    (partial rotary, e.g. Phi-3's ``partial_rotary_factor``), else 0.

    Standard means: a family of ``ROPE_FAMILIES`` (its layers rotate q and k with transformers'
    rotate-half ``apply_rotary_pos_emb`` before attention), a rope type whose frequencies are
    fixed (``default``, ``linear``, ``llama3``, ``yarn``), ``attention_scaling == 1`` (YaRN's
    attention factor scales cos/sin, which the cache does not) and cos/sin that equal
    ``cos/sin(position * inv_freq)`` repeated over both halves at probe positions. Raises
    ``UnsupportedFeatureError`` naming what fails."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in ROPE_FAMILIES:
        raise UnsupportedFeatureError(
            f"rope='cache': model family {family!r} is not one whose rotary the cache's fused "
            f"RoPE is known to reproduce (rotate-half over one rotary embedding, on every "
            f"layer): {', '.join(ROPE_FAMILIES)}; use rope='model' (the default)")
    emb = _rotary_module(model)
    rope_type = getattr(emb, "rope_type", None)
    if not isinstance(rope_type, str) or rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rope type {rope_type!r} is not one with fixed "
            f"inverse frequencies {_STATIC_ROPE_TYPES} (dynamic and longrope frequencies change "
            f"with the sequence length); use rope='model'")
    scaling = float(emb.attention_scaling)
    if scaling != 1.0:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rotary ({rope_type}) scales cos and sin by "
            f"attention_scaling={scaling} (e.g. YaRN's attention factor), which the cache's RoPE "
            f"does not; use rope='model'")
    inv_freq = emb.inv_freq.detach().to("cpu", torch.float64)
    original = getattr(emb, "original_inv_freq", None)
    if original is not None and not torch.equal(inv_freq, original.detach().to("cpu", torch.float64)):
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's inv_freq differs from the one it was built "
            f"with (updated for a sequence length); use rope='model'")
    head_dim = _head_dim(model.config)
    rot = 2 * inv_freq.numel()
    if rot > head_dim:
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model rotates {rot} dims, more than head_dim {head_dim}")
    # probe: cos/sin must be the standard table of these frequencies, unscaled
    device = emb.inv_freq.device
    pos = torch.tensor([[0, 1, 2, 17, 255, 4095]], device=device)
    with torch.no_grad():
        cos, sin = emb(torch.zeros(1, device=device, dtype=torch.float32), pos)
    angles = pos[0, :, None].double().cpu() * emb.inv_freq.detach().to("cpu", torch.float32).double()
    angles = torch.cat([angles, angles], -1)
    got = (cos[0].double().cpu(), sin[0].double().cpu())
    want = (angles.cos(), angles.sin())
    if any(g.shape != w.shape or not torch.allclose(g, w, rtol=0, atol=2e-3) for g, w in zip(got, want)):
        raise UnsupportedFeatureError(
            f"rope='cache': the {family} model's rotary embedding {type(emb).__name__} does not "
            f"return the standard rotate-half cos/sin of its inv_freq; use rope='model'")
    return inv_freq.numpy(), (rot if rot < head_dim else 0)


def attention_layers(model) -> list:
    """The model's attention modules, one per decoder layer in layer order (each with its
    ``layer_idx``). Raises ``UnsupportedFeatureError`` with the reason when the model's layers
    do not map one to one onto cache layers (layers without attention, or two attention modules
    in one layer)."""
    config = model.config
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    found: dict = {}
    for m in model.modules():
        idx = getattr(m, "layer_idx", None)
        if isinstance(idx, int) and hasattr(m, "config") and any(
                hasattr(m, name) for name in ("q_proj", "qkv_proj", "q_a_proj", "query_key_value", "c_attn")):
            if idx in found:
                raise UnsupportedFeatureError(
                    f"{type(model).__name__}: layer {idx} has two attention modules "
                    f"({type(found[idx]).__name__}, {type(m).__name__}); the cache holds one per layer")
            found[idx] = m
    if sorted(found) != list(range(layers)):
        raise UnsupportedFeatureError(
            f"{type(model).__name__}: {layers} decoder layers, but attention modules with a "
            f"layer_idx in layers {sorted(found)} only (layers without attention, e.g. a hybrid "
            f"recurrent model, cannot run on the cache)")
    return [found[i] for i in range(layers)]


def _model_needs(model) -> list:
    """``(what, capability)`` the model's attention needs beyond plain causal attention, read off
    its config and modules: logit soft-capping (gemma2), learned sinks (gpt-oss), sliding
    windows are checked per request (``ModelAdapter.check_request``)."""
    needs = []
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        needs.append((f"attention logit soft-capping (attn_logit_softcapping="
                      f"{model.config.attn_logit_softcapping})", "logit_softcap"))
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in attention_layers(model)):
        needs.append(("learned attention sinks (the layers' `sinks` parameters)", "attention_sinks"))
    if head_dims(model.config)[0] != head_dims(model.config)[1]:
        needs.append((f"value head dim {head_dims(model.config)[1]} other than the query/key "
                      f"head dim {head_dims(model.config)[0]}", "head_dims_v"))
    return needs


def _unrotated(module, args, output):
    """Forward hook: the rotary embedding returns cos=1, sin=0 (its layers rotate nothing)."""
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


# True in the thread (and context) running inside fused_rope: the family's
# apply_rotary_pos_emb, wrapped by _skip_rotation, hands q and k back as they are
_ROTATION_SKIPPED = contextvars.ContextVar("kvcache_rotation_skipped", default=False)


_WRAPPED: "weakref.WeakSet" = weakref.WeakSet()     # the wrappers _skip_rotation installed


def _rotation_skipped() -> bool:
    return _ROTATION_SKIPPED.get()


def _skip_rotation(layers) -> None:
    """Wrap the ``apply_rotary_pos_emb`` of the modules that define ``layers``' classes (once;
    idempotent) so that it returns q and k unchanged while ``_ROTATION_SKIPPED`` is set. With
    cos=1 and sin=0 (``_unrotated``) its rotation is the identity anyway, but costs five
    elementwise kernels per layer for each of q and k (``q * cos + rotate_half(q) * sin``).
    Outside fused_rope, and in other threads, the wrapped function is transformers' own."""
    for module in {sys.modules.get(type(m).__module__) for m in layers}:
        original = getattr(module, "apply_rotary_pos_emb", None)
        if not callable(original) or original in _WRAPPED:
            continue

        def apply(q, k, *args, _original=original, **kwargs):
            if _rotation_skipped():
                return q, k
            return _original(q, k, *args, **kwargs)

        functools.update_wrapper(apply, original)
        _WRAPPED.add(apply)
        setattr(module, "apply_rotary_pos_emb", apply)


@contextlib.contextmanager
def fused_rope(model, cache):
    """Let ``cache``'s fused RoPE append rotate q and k for ``model`` for the duration.

    ``cache``: built with ``cache_config(model, rope="cache")`` (``rope_mode="normal"``, the
    model's ``inv_freq`` and rotary dim). Checks that the model's rotary is standard
    (``model_rotary``) and that the cache rotates with exactly its frequencies, then makes the
    model's rotary embedding return cos=1, sin=0 (a forward hook, removed on exit), skips the
    layers' ``apply_rotary_pos_emb`` (the identity at cos=1, sin=0: ``_skip_rotation``) and
    lets the ``"kvcache"`` attention of the model's layers accept this cache. Raises
    ``UnsupportedFeatureError`` (a rotary the cache cannot reproduce) or
    ``InvalidArgumentError`` (a cache whose RoPE differs from the model's)."""
    inv_freq, rot = model_rotary(model)
    cfg = cache.config
    spec_rot = cfg.rope_rotary_dim if cfg.rope_rotary_dim != cfg.head_dim else 0
    same = (cfg.effective_rope_mode == "normal" and cfg.rope_scale == 1.0 and spec_rot == rot
            and len(cfg.rope_inv_freq) == len(inv_freq)
            and np.array_equal(np.asarray(cfg.rope_inv_freq, np.float64), inv_freq))
    if not same:
        raise InvalidArgumentError(
            f"fused_rope: the cache (rope_mode={cfg.rope_mode!r}, rope_scale={cfg.rope_scale}, "
            f"rope_rotary_dim={cfg.rope_rotary_dim}, {len(cfg.rope_inv_freq)} rope_inv_freq "
            f"values) does not rotate exactly as the model ({len(inv_freq)} inverse "
            f"frequencies, rotary dim {rot or 'all'}); build it with "
            f"cache_config(model, rope='cache')")
    layers = [m for m in model.modules() if getattr(m, "layer_idx", None) is not None]
    if any(m in _FUSED for m in layers):
        raise InvalidArgumentError("fused_rope: the model is already inside a fused_rope block")
    handle = _rotary_module(model).register_forward_hook(_unrotated)
    _skip_rotation(layers)
    token = _ROTATION_SKIPPED.set(True)
    try:
        for m in layers:
            _FUSED[m] = cache
        yield
    finally:
        _ROTATION_SKIPPED.reset(token)
        handle.remove()
        for m in layers:
            _FUSED.pop(m, None)


def cache_config(model, *, dtype=None, page_size: int = 16, max_total_tokens: int = 65536,
                 max_batch_size: int = 64, prefill_chunk_size: int = 2048,
                 rope: str = "model") -> CacheConfig:
    """A ``CacheConfig`` for a transformers causal LM: layers, query/KV heads and head_dim from
    ``model.config``, ``dtype`` (None: the model's parameter dtype) and the given sizes.
    ``rope``: ``"model"`` gives ``rope_mode="none"`` (the model rotates q and k itself);
    ``"cache"`` gives ``rope_mode="normal"`` with the model's ``inv_freq`` and partial rotary
    dim (``model_rotary``; raises ``UnsupportedFeatureError`` when they cannot be proven
    standard); run the model inside ``fused_rope(model, cache)`` then."""
    config = model.config
    heads = int(config.num_attention_heads)
    head_dim, head_dim_v = head_dims(config)
    mode, inv_freq, rot = "none", (), 0
    if _check_rope(rope) == "cache":
        freqs, rot = model_rotary(model)
        mode, inv_freq = "normal", tuple(freqs.tolist())
    return CacheConfig(
        num_layers=int(config.num_hidden_layers), num_qo_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=head_dim, head_dim_v=head_dim_v, page_size=page_size,
        max_batch_size=max_batch_size,
        max_total_tokens=max_total_tokens, prefill_chunk_size=prefill_chunk_size,
        dtype=_dtype_name(dtype if dtype is not None else model.dtype),
        rope_mode=mode, rope_theta=float(getattr(config, "rope_theta", None) or 10000.0),
        rope_inv_freq=inv_freq, rope_rotary_dim=rot)


# ---------------------------------------------------------------------- attention function
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
    if sliding_window is not None:
        if getattr(caps, "window_left", False):
            extra["window_left"] = int(sliding_window) - 1
        else:
            # fine while no query is as far as the window from the start of its sequence
            positions = to_numpy(cache.query_positions())
            if positions.size and int(positions.max()) >= int(sliding_window):
                raise _window_unsupported(cache, layer, int(sliding_window))
    return extra


def _show(value) -> str:
    if torch.is_tensor(value):
        return f"<tensor {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}>"
    return repr(value)[:60]


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
    in query's dtype, None)``.
    """
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
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise InvalidArgumentError(f"{type(module).__name__} has no layer_idx: cannot tell which "
                                   f"cache layer its attention uses")
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


# ---------------------------------------------------------------------- engine adapter
class TransformersAdapter(ModelAdapter):
    """A transformers decoder-only causal LM as the engine's model: any family whose decoder
    layers call transformers' attention interface (checked: ``attention_layers``; refused with
    the reason otherwise)."""

    def __init__(self, model, rope: str = "model"):
        config = getattr(model, "config", None)
        family = getattr(config, "model_type", None)
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise UnsupportedFeatureError(f"{type(model).__name__} has no language-model head: the "
                                          f"Engine needs a *ForCausalLM model")
        if getattr(config, "is_encoder_decoder", False):
            raise UnsupportedFeatureError(
                f"{type(model).__name__} is an encoder-decoder model; the Engine runs decoder-only "
                f"causal LMs")
        attention_layers(model)          # refuses a model whose layers the cache cannot serve
        self.model = model
        self.family = str(family or type(model).__name__)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.windows = sliding_windows(config)
        self.device = next(model.parameters()).device
        self.rope = _check_rope(rope)
        self._picks_ring: dict = {}      # batch size -> two pinned pick buffers and whose turn
        if rope == "cache":
            model_rotary(model)            # refuse a rotary the cache cannot reproduce, early

    def cache_config(self, *, dtype, page_size, max_total_tokens, max_batch_size,
                     prefill_chunk_size) -> CacheConfig:
        return cache_config(self.model, dtype=dtype, page_size=page_size,
                            max_total_tokens=max_total_tokens, max_batch_size=max_batch_size,
                            prefill_chunk_size=prefill_chunk_size, rope=self.rope)

    def default_device(self) -> Optional[str]:
        return str(self.device)

    def eos_token_ids(self) -> tuple:
        return eos_token_ids(self.model)

    def check(self, cache) -> None:
        for need, cap in _model_needs(self.model):
            if not getattr(cache.capabilities, cap, False):
                raise UnsupportedFeatureError(
                    f"the {self.family} model needs {need}, and backend {cache.backend.name!r} "
                    f"does not support it: {Capabilities.reason(cap)}")
        dtype = _dtype_name(self.model.dtype)
        if cache.config.dtype != dtype and cache.backend.is_native(torch.zeros(1, device=self.device)):
            raise UnsupportedFeatureError(
                f"the model computes in {dtype} but the cache stores {cache.config.dtype}; the "
                f"{cache.backend.name!r} backend takes the model's tensors as they are, so the "
                f"dtypes must match (pass dtype=None)")

    @contextlib.contextmanager
    def session(self, cache):
        """The model runs the "kvcache" attention for the duration (restored afterwards); with
        ``rope="cache"`` inside ``fused_rope(model, cache)``."""
        register()
        before = self.model.config._attn_implementation
        if before != ATTN_IMPLEMENTATION:
            try:
                self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            except (ValueError, NotImplementedError) as exc:
                raise UnsupportedFeatureError(
                    f"{type(self.model).__name__} cannot switch to a custom attention "
                    f"implementation ({exc}); its attention cannot reach the cache") from None
            if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
                self.model.set_attn_implementation(before)
                raise UnsupportedFeatureError(
                    f"{type(self.model).__name__} kept its attention implementation "
                    f"{before!r} when asked for {ATTN_IMPLEMENTATION!r} (its layers do not call "
                    f"transformers' attention interface): its attention cannot reach the cache")
        rotary = fused_rope(self.model, cache) if self.rope == "cache" else contextlib.nullcontext()
        try:
            with torch.inference_mode(), rotary:
                yield
        finally:
            if before != ATTN_IMPLEMENTATION:
                self.model.set_attn_implementation(before)

    def _upload(self, array: np.ndarray):
        """A host array on the model's device without waiting for the device: a pageable copy
        synchronizes the stream, which would hold a step planned ahead (pipelined) until the
        one in flight is done; a pinned block (torch's pinned allocator keeps it until the copy
        has run) does not."""
        t = torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def forward(self, cache, tokens, positions, logit_rows):
        # ``tokens`` may be the previous step's picks, already on the device (overlapped decode)
        ids = (tokens.to(self.device) if torch.is_tensor(tokens) else self._upload(tokens)).unsqueeze(0)
        pos = self._upload(positions).unsqueeze(0)
        keep = self._upload(logit_rows) if len(logit_rows) else 1
        out = self.model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep,
                         kvcache=cache)
        ran = cache.layers_run
        if len(ran) != cache.config.num_layers:
            missing = sorted(set(range(cache.config.num_layers)) - ran)
            raise UnsupportedFeatureError(
                f"layers {missing} of the {self.family} model ({type(self.model).__name__}) did "
                f"not call transformers' attention interface: their attention cannot reach the "
                f"cache, so the model cannot run on it")
        return out.logits[0] if len(logit_rows) else None

    def graphs_by_default(self, device) -> Optional[bool]:
        """Whole-step graphs pay on a GPU (the model's device); on a CPU they save nothing."""
        return torch.device(device if device is not None else self.device).type != "cpu"

    def step_graphs(self, cache):
        """Decode steps captured per bucket: the model's whole forward (embedding, layers with
        the cache's attention, LM head) over a fixed ``(3, bucket)`` input buffer (token ids,
        positions, logit rows); see ``kvcache.integrations.torch_graphs``."""
        from .torch_graphs import StepGraphs
        model = self.model

        def step(inputs):
            out = model(input_ids=inputs[0].unsqueeze(0), position_ids=inputs[1].unsqueeze(0),
                        use_cache=False, logits_to_keep=inputs[2], kvcache=cache)
            return out.logits[0]

        return StepGraphs(cache, step, self.device)

    def to_numpy(self, logits) -> np.ndarray:
        return logits.detach().to("cpu", torch.float64).numpy()

    @staticmethod
    def _greedy_picks(logits, logprobs: bool = True):
        """On the logits' device: the argmax tokens ``(B,)`` and a ``(2, B)`` float64 tensor of
        them and their log-probabilities, NaN unless ``logprobs`` (the one copy a step sends to
        the host)."""
        if not logprobs:
            # argmax in the logits' own dtype (widening is exact and keeps the order): the
            # float32 copy and log-sum-exp passes were 0.19 ms of a 3.4 ms B=64 decode step
            tokens = logits.detach().argmax(dim=-1)
            return tokens, torch.stack([tokens.to(torch.float64),
                                        torch.full_like(tokens, float("nan"), dtype=torch.float64)])
        rows = logits.detach().float()
        tokens = rows.argmax(dim=-1)
        lps = rows.gather(-1, tokens[:, None])[:, 0] - torch.logsumexp(rows, dim=-1)
        return tokens, torch.stack([tokens.to(torch.float64), lps.to(torch.float64)])

    def greedy(self, logits, logprobs: bool = True) -> tuple[np.ndarray, np.ndarray]:
        picked = self._greedy_picks(logits, logprobs)[1].cpu().numpy()
        return picked[0].astype(np.int64), picked[1]

    def device_memory(self, device):
        dev = torch.device(device if device is not None else self.device)
        if dev.type != "cuda":
            return None
        return torch.cuda.mem_get_info(dev)

    def peak_memory(self, device, run) -> int:
        dev = torch.device(device if device is not None else self.device)
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        run()
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - before)

    def step_tokens(self, tokens, picks, dst, src):
        on = picks.tokens
        if not torch.is_tensor(on):
            return super().step_tokens(tokens, picks, dst, src)
        # the picks stay on their device: the ids are gathered there, in stream order
        out = self._upload(tokens)
        out[self._upload(dst)] = on[self._upload(src)].to(out.dtype)
        return out

    def greedy_async(self, logits, logprobs: bool = True) -> PendingPicks:
        tokens, picked = self._greedy_picks(logits, logprobs)
        if picked.device.type == "cpu":
            host = picked.numpy()
            return PendingPicks(tokens, lambda: (host[0].astype(np.int64), host[1]))
        # a pinned copy and an event: the host reads the picks when it needs them, the device
        # goes on with the next step meanwhile
        host_t = self._pinned_picks(picked.shape[1])
        host_t.copy_(picked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def result():
            done.synchronize()
            out = host_t.numpy().copy()
            return out[0].astype(np.int64), out[1]
        return PendingPicks(tokens, result)

    def _pinned_picks(self, n: int):
        """One of two pinned (2, n) float64 host buffers, in turn: the overlapped decode has at
        most two steps' picks in flight, and reads a step's before the next-but-one is made."""
        slot = self._picks_ring.get(n)
        if slot is None:
            slot = self._picks_ring[n] = [
                [torch.empty((2, n), dtype=torch.float64, pin_memory=True) for _ in range(2)], 0]
        bufs, k = slot
        slot[1] = 1 - k
        return bufs[k]


def _tensor_parallel(model, tp, tp_group) -> bool:
    """Whether the Engine runs ``model`` on tensor-parallel ranks: asked for, or the model is
    already split (by transformers' ``tp_plan``, or by ``kvcache.integrations.tp.shard_model``,
    which needs torch.distributed initialised)."""
    size = getattr(model, "tp_size", None)
    if tp not in (None, 1) or tp_group is not None or (isinstance(size, int) and size > 1):
        return True
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return False
    from .tp import tp_layout
    return tp_layout(model) is not None


class Engine(_Engine):
    """Continuous-batching generation of a transformers causal LM on a ``PagedKVCache``.

    ``model``: a decoder-only ``*ForCausalLM`` whose layers call transformers' attention
    interface (any family; what its attention needs, soft-capping, sinks, per-layer windows,
    a value head dim of its own, must be declared by the backend). ``backend``: a backend name or
    ``"auto"``; ``device``: the cache's device (None: the model's); ``dtype``: the cache dtype
    (None: the model's); ``page_size``, ``max_total_tokens`` (None: sized from free device memory, ``memory_fraction`` of it, default 0.9, where the device can be asked; else ``512 * max_batch_size``),
    ``max_batch_size``, ``prefill_chunk_size`` (None: ``min(8192, max_total_tokens)``): as in
    ``CacheConfig``. ``rope``: who rotates q and k, ``"model"`` (default: the model's own
    rotary embedding, cache ``rope_mode="none"``) or ``"cache"`` (the cache's fused RoPE append
    with the model's inverse frequencies, ``rope_mode="normal"``; raises
    ``UnsupportedFeatureError`` unless ``model_rotary`` proves the rotary standard and the
    backend has ``rope_frequencies``). ``graphs`` (None: on for a GPU model on a backend
    declaring ``static_decode``; True / False force it) and ``graph_batch_sizes``: whole-step
    decode graphs, see ``kvcache.integrations.engine.Engine``. ``offload`` / ``offload_tokens``:
    the host tier preempted sequences are parked in (None: on for a GPU cache); ``overlap``
    (default True): greedy decode with the host one step ahead of the device; both as in
    ``kvcache.integrations.engine.Engine``. ``tp`` / ``tp_group``: tensor parallelism, one
    process per rank (``tp``: the number of ranks, None: 1 unless the model is already split;
    ``tp_group``: their torch.distributed group, None: the default group); the model is split
    over the ranks and each rank's cache holds its ``num_kv_heads / tp`` heads, see
    ``kvcache.integrations.tp``. See ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, backend: str = "auto", device: Optional[str] = None,
                 dtype=None, page_size: int = 16, max_total_tokens: Optional[int] = None,
                 max_batch_size: int = 64, prefill_chunk_size: Optional[int] = None,
                 rope: str = "model", graphs: Optional[bool] = None,
                 graph_batch_sizes=None, offload: Optional[bool] = None,
                 offload_tokens: Optional[int] = None, overlap: bool = True,
                 tp: Optional[int] = None, tp_group=None, memory_fraction: float = 0.9):
        self.model = model
        adapter: ModelAdapter
        if _tensor_parallel(model, tp, tp_group):
            from .tp import TensorParallelAdapter
            adapter = TensorParallelAdapter(model, rope, tp=tp, group=tp_group)
        else:
            adapter = TransformersAdapter(model, rope)
        super().__init__(adapter, backend=backend, device=device, dtype=dtype,
                         page_size=page_size, max_total_tokens=max_total_tokens,
                         max_batch_size=max_batch_size, prefill_chunk_size=prefill_chunk_size,
                         graphs=graphs, graph_batch_sizes=graph_batch_sizes, offload=offload,
                         offload_tokens=offload_tokens, overlap=overlap,
                         memory_fraction=memory_fraction)
