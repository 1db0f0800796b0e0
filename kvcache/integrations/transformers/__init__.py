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

The package's modules: ``model`` (what is read off a model), ``rope`` (``model_rotary``,
``fused_rope``), ``interface`` (the ``"kvcache"`` attention, ``register``), ``adapter``
(``cache_config``, ``TransformersAdapter``) and ``tp`` (the adapter on tensor-parallel ranks,
published as ``kvcache.integrations.tp``); this module checks the requirements, holds ``Engine``
and re-exports the names of the first four.
"""

from __future__ import annotations

from typing import Optional

from ...serving import RequestOutput
from .. import MissingExtraError, install_hint, require
from ..engine import Engine as _Engine
from ..engine import EngineConfig, ModelAdapter
from ..sampling import SamplingParams

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
           "attention", "cache_config", "fused_rope", "layer_kinds", "model_rotary", "refuse_hybrid",
           "register", "route_state_layers", "sliding_windows", "state_kinds", "stateful_layers",
           "STATE_FAMILIES"]

# the package's modules, imported once the requirements are checked; every name the module had
# stays importable from here
from .adapter import TransformersAdapter, cache_config  # noqa: E402
from .interface import (_HONOURED, _IGNORED, ATTN_IMPLEMENTATION,  # noqa: E402
                        _attention_options, _show, _to_cache, _window_unsupported, attention,
                        register)
from .model import (_DTYPES, _dtype_name, _head_dim, _model_needs,  # noqa: E402
                    attention_layers, eos_token_ids, head_dims, layer_kinds, refuse_hybrid,
                    sliding_windows, stateful_layers)
from .states import STATE_FAMILIES, route_state_layers, state_kinds  # noqa: E402
from .rope import (_FUSED, _ROTATION_SKIPPED, _STATIC_ROPE_TYPES, _WRAPPED,  # noqa: E402
                   ROPE_CHOICES, ROPE_FAMILIES, _check_rope, _rotary_module, _rotation_skipped,
                   _skip_rotation, _unrotated, fused_rope, model_rotary)


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
    a value head dim of its own, must be declared by the backend). ``rope``: who rotates q and
    k, ``"model"`` (default: the model's own rotary embedding, cache ``rope_mode="none"``) or
    ``"cache"`` (the cache's fused RoPE append with the model's inverse frequencies,
    ``rope_mode="normal"``; raises ``UnsupportedFeatureError`` unless ``model_rotary`` proves
    the rotary standard and the backend has ``rope_frequencies``). ``tp`` / ``tp_group``:
    tensor parallelism, one process per rank (``tp``: the number of ranks, None: 1 unless the
    model is already split; ``tp_group``: their torch.distributed group, None: the default
    group); the model is split over the ranks and each rank's cache holds its
    ``num_kv_heads / tp`` heads, see ``kvcache.integrations.tp``.

    ``config`` / ``options``: the engine's options, an ``EngineConfig`` and / or its fields as
    keywords (``backend``, ``device`` (None: the model's), ``dtype`` (None: the model's),
    ``page_size``, ``max_total_tokens``, ``memory_fraction``, ``max_batch_size``,
    ``prefill_chunk_size``, ``graphs``, ``graph_batch_sizes``, ``mixed_graphs``,
    ``compile_step``, ``offload``, ``offload_tokens``, ``overlap``, ``prefix_cache``,
    ``kv_dtype``), see ``kvcache.integrations.engine.Engine``. See
    ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, *, rope: str = "model", tp: Optional[int] = None, tp_group=None,
                 config: Optional[EngineConfig] = None, **options):
        # a bad option fails before the model is touched
        config = EngineConfig.of(config, **options)
        self.model = model
        adapter: ModelAdapter
        if _tensor_parallel(model, tp, tp_group):
            from .tp import TensorParallelAdapter
            adapter = TensorParallelAdapter(model, rope, tp=tp, group=tp_group)
        else:
            adapter = TransformersAdapter(model, rope)
        super().__init__(adapter, config=config)
