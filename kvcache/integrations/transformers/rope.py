"""Who rotates q and k: ``model_rotary`` proves a model's rotary standard, ``fused_rope`` lets
the cache's fused RoPE append do the rotating (re-exported by the package)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
import weakref

import numpy as np

from ...errors import InvalidArgumentError, UnsupportedFeatureError
from .. import require
from .model import _head_dim

torch = require("torch", "transformers")

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


# model -> (its rotary module, the layers with a layer_idx, {inv_freq's (pointer, version):
# model_rotary's result}): fused_rope is entered once a step, and walking the modules and
# probing the rotary on the device (a host sync: it stopped the host from running ahead of
# the GPU, about half of each step idle on the H200) then cost more than the step itself
_PROVEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _proven(model) -> tuple:
    """``(rotary module, layers, model_rotary(model))``, the proof kept while the rotary's
    ``inv_freq`` is the same tensor unchanged (its data pointer and in-place version)."""
    held = _PROVEN.get(model)
    if held is None:
        layers = [m for m in model.modules() if getattr(m, "layer_idx", None) is not None]
        fresh: dict = {}
        held = _PROVEN[model] = (_rotary_module(model), layers, fresh)
    emb, layers, results = held
    freq = emb.inv_freq
    key = (freq.data_ptr(), freq._version, getattr(emb, "rope_type", None),
           float(getattr(emb, "attention_scaling", 1.0)))
    if key not in results:
        results.clear()
        results[key] = model_rotary(model)
    return emb, layers, results[key]


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


def _unrotated(module, args, output):
    """Forward hook: the rotary embedding returns cos=1, sin=0 (its layers rotate nothing)."""
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


# True in the thread (and context) running inside fused_rope: the family's
# apply_rotary_pos_emb, wrapped by _skip_rotation, hands q and k back as they are
_ROTATION_SKIPPED = contextvars.ContextVar("kvcache_rotation_skipped", default=False)


_WRAPPED: "weakref.WeakSet" = weakref.WeakSet()     # the wrappers _skip_rotation installed


# what traced code (torch.compile of a step inside fused_rope: the Engine's compile_step) reads
# instead: the compiler cannot trace ContextVar.get and would break the graph at every layer
_SKIPPED_BLOCKS = 0


def _rotation_skipped() -> bool:
    if torch.compiler.is_compiling():
        return _SKIPPED_BLOCKS > 0
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
    (``model_rotary``; proven once per model and ``inv_freq`` tensor, the model's modules read
    at its first block: change its modules after that and build a new Engine) and that the
    cache rotates with exactly its frequencies, then makes the
    model's rotary embedding return cos=1, sin=0 (a forward hook, removed on exit), skips the
    layers' ``apply_rotary_pos_emb`` (the identity at cos=1, sin=0: ``_skip_rotation``) and
    lets the ``"kvcache"`` attention of the model's layers accept this cache. Raises
    ``UnsupportedFeatureError`` (a rotary the cache cannot reproduce) or
    ``InvalidArgumentError`` (a cache whose RoPE differs from the model's)."""
    emb, layers, (inv_freq, rot) = _proven(model)
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
    if any(m in _FUSED for m in layers):
        raise InvalidArgumentError("fused_rope: the model is already inside a fused_rope block")
    handle = emb.register_forward_hook(_unrotated)
    _skip_rotation(layers)
    global _SKIPPED_BLOCKS
    token = _ROTATION_SKIPPED.set(True)
    _SKIPPED_BLOCKS += 1
    try:
        for m in layers:
            _FUSED[m] = cache
        yield
    finally:
        _SKIPPED_BLOCKS -= 1
        _ROTATION_SKIPPED.reset(token)
        handle.remove()
        for m in layers:
            _FUSED.pop(m, None)
