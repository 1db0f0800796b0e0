"""What the mlx-lm integration reads off a model without running it: its family, layers, the
windows and EOS ids mlx-lm's own generation uses, and ``ModelDescription`` (what the probe
reads; re-exported by the package)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...errors import UnsupportedFeatureError
from .. import require

mx = require("mlx.core", "mlx-lm")

from mlx_lm.models import cache as _mlx_cache  # noqa: E402

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


PAIRED_FAMILIES = ("falcon_h1",)
"""The mlx-lm families whose ``make_cache()`` gives each decoder layer a ``CacheList`` of a
Mamba-2 mixer's ``ArraysCache`` and an attention's ``KVCache`` (Falcon-H1: the mixer and
attention run side by side in every layer): the cache gives each its own cache slot, the
mixer ``2 i`` and the attention ``2 i + 1`` of decoder layer ``i`` (``_mlx_caches``,
``model_caches``)."""


def _label(model, layer: int) -> str:
    """'layer i (module.Class)' of the attention module of cache slot ``layer``, for messages
    (a paired family's: 'layer i (module.Class, cache slot s)')."""
    layers = _layers(model)
    paired = _family(model) in PAIRED_FAMILIES
    i = layer // 2 if paired else layer
    if i < len(layers):
        block = layers[i]
        attn = next((getattr(block, a) for a in ("self_attn", "attention", "attn")
                     if getattr(block, a, None) is not None), block)
        slot = f", cache slot {layer}" if paired else ""
        return f"layer {i} ({type(attn).__module__}.{type(attn).__name__}{slot})"
    return f"layer {layer}"


class _Label:
    """``_label(model, layer)``, built when formatted (the hot path formats none)."""

    def __init__(self, model, layer: int):
        self.model, self.layer = model, layer

    def __str__(self) -> str:
        return _label(self.model, self.layer)


def _mlx_caches(model) -> list:
    """The cache objects mlx-lm's own generation would use (``make_prompt_cache``), one per
    cache slot: a ``PAIRED_FAMILIES`` model's ``CacheList`` entries of two taken apart (the
    states' check, ``state_kinds``, refuses any other entry first)."""
    if not hasattr(model, "make_cache"):
        return [_mlx_cache.KVCache() for _ in _layers(model)]
    caches = list(model.make_cache())
    if _family(model) not in PAIRED_FAMILIES:
        return caches
    return [c for entry in caches for c in (
        entry.caches if type(entry) is _mlx_cache.CacheList and len(entry.caches) == 2
        else (entry,))]


def model_caches(model, caches: list) -> list:
    """``caches`` (one per cache slot, ``_mlx_caches``' order) as ``model``'s call takes them:
    a ``PAIRED_FAMILIES`` model's as one ``(mixer's, attention's)`` pair per decoder layer (its
    layers index ``cache[0]`` and ``cache[1]``), any other's as they are."""
    if _family(model) not in PAIRED_FAMILIES:
        return caches
    return [tuple(caches[i:i + 2]) for i in range(0, len(caches), 2)]


def sliding_windows(model) -> dict:
    """``{layer: window}`` of the model's sliding-window layers (empty: none), as mlx-lm's own
    generation builds them (``model.make_cache()``): a ``RotatingKVCache(max_size=w)`` layer
    attends to the previous ``w`` positions, itself included; a ``KVCache`` layer to all of
    them; the ``ArraysCache`` of an LFM2 short convolution, a Granite-4.0-H / Nemotron-H /
    Falcon-H1 / Mamba-2 Mamba-2 mixer, a Mamba-1 mixer or a Qwen3-Next gated DeltaNet layer is
    a state layer (``state_kinds``), not a window (the layers are cache slots,
    ``_mlx_caches``: a Falcon-H1 layer's ``CacheList`` two of them). Any other cache type
    raises ``UnsupportedFeatureError`` naming it and the family."""
    from .states import SERVED_STATE_LAYERS, state_kinds
    states = state_kinds(model)
    windows = {}
    for i, c in enumerate(_mlx_caches(model)):
        if type(c) is _mlx_cache.KVCache or i in states:
            continue
        if type(c) is _mlx_cache.RotatingKVCache and not getattr(c, "keep", 0):
            windows[i] = int(c.max_size)
            continue
        what = (f"RotatingKVCache with keep={c.keep} (tokens kept at the start beside the "
                f"window)" if isinstance(c, _mlx_cache.RotatingKVCache) else type(c).__name__)
        raise UnsupportedFeatureError(
            f"{_label(model, i)} of the {_family(model)} model uses mlx-lm's {what} (from "
            f"model.make_cache()): the paged cache stands in for KVCache (full attention), "
            f"RotatingKVCache (a sliding window) and, as state layers, the ArraysCache of "
            f"{SERVED_STATE_LAYERS} only")
    return windows


def layer_kinds(windows: dict) -> dict:
    """``{layer: kvcache.Window(w - 1)}`` for the ``{layer: w}`` of ``sliding_windows``: a
    ``RotatingKVCache(max_size=w)`` layer sees ``w`` positions, itself included, which is
    ``Window(w - 1)`` (``CacheConfig.layer_kinds``: the layer keeps only the pages its window
    still sees)."""
    from ...config import Window
    return {layer: Window(w - 1) for layer, w in windows.items()}


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
    states: dict = dataclasses.field(default_factory=dict)
    """``{layer: kvcache.State}``: the model's state layers (LFM2's short convolutions,
    Granite-4.0-H's, Nemotron-H's, Falcon-H1's and Mamba-2's Mamba-2 mixers, Mamba-1's
    mixers, Qwen3-Next's gated DeltaNet layers; ``state_kinds``), which neither fetch nor
    attend; empty: none. A model whose every layer is one (Mamba-2, Mamba) has no attention:
    its head shape is a placeholder (``routing.ATTENTION_FREE_HEADS``)."""
