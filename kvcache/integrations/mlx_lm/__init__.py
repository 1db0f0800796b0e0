"""mlx-lm models on a ``PagedKVCache`` (extra ``kvcache[mlx-lm]``).

``Engine(model, ...)`` runs continuous-batching generation (see
``kvcache.integrations.engine``) of an mlx-lm model (``mlx_lm.load``, or a model class of
``mlx_lm.models``) on the metal backend (Apple GPU, or MLX's CPU device with
``device="cpu"``), with the paged cache in place of mlx-lm's own KV cache. There is no family
list: the model's own code runs unchanged, and every model whose attention goes through
mlx-lm's cache protocol runs; any other is refused (``UnsupportedFeatureError`` naming why).

How the model reaches the cache (mlx-lm's cache protocol, the model's code unchanged):

* **Layout.** A forward's ``T`` packed tokens (several sequences) go in as ``T`` batch rows of
  one token each: inputs ``(T, 1)``. Everything outside attention is per token, so the rows
  are independent.
* **Positions.** Each layer gets a ``LayerCache`` as its ``cache``; its ``offset`` is an
  ``mx.array`` ``(T,)`` of the tokens' positions, so the model's own
  ``self.rope(x, offset=cache.offset)`` rotates row ``t`` at token ``t``'s position
  (``mx.fast.rope`` takes one offset per batch row; every mlx-lm RoPE class, llama3 / YaRN /
  su-scaled included, passes it on). A RoPE that cannot take per-row offsets (e.g.
  ``DynamicNTKScalingRoPE``) fails in the probe and the model is refused.
* **K/V and attention.** ``cache.update_and_fetch(keys, values)`` hands the new keys and
  values back as they are; mlx-lm's ``scaled_dot_product_attention`` (wrapped, once, in the
  modules of the model's classes: the wrapper is mlx-lm's own function for any other cache)
  sends ``queries``, those keys and values, the model's ``scale`` and ``sinks`` to
  ``PagedKVCache.attention`` of the layer, which appends K/V and attends over each sequence's
  history. Whatever the model does before (q/k norms, biases, partial or scaled RoPE, NoPE
  layers) and after (output projection, logit scaling and soft-capping of the head) is its own.
* **Masks.** ``cache.make_mask`` (what ``create_attention_mask`` calls) returns None: the
  paged cache knows each token's sequence and applies causality itself. A model that hands
  ``scaled_dot_product_attention`` a mask array of its own (e.g. an additive bias) is refused.
* **Windows.** Per layer, from ``model.make_cache()`` as mlx-lm builds it: a
  ``RotatingKVCache(max_size=w)`` layer is a sliding layer (a query sees the previous ``w``
  positions, itself included: ``window_left = w - 1``, capability ``window_left`` once a
  sequence outgrows it); a ``KVCache`` layer is full attention; any other cache type is
  refused.
* **Head.** The model's own ``__call__`` computes the logits; its inner model is wrapped for
  the call so that only the rows whose logits are wanted reach the head.

* **Models that attend themselves.** A model whose layers fetch through ``update_and_fetch``
  but do not hand exactly those keys and values (and no mask array) to
  ``scaled_dot_product_attention`` (mlx-lm's gemma2 soft-caps its scores by hand; its
  deepseek_v3 runs MLA over the latent and rotary keys it fetches, with the rotary scores as
  a mask) runs in *own-attention* mode: one model call per sequence of the forward (its new
  tokens as one batch row, ``offset`` its first new position, ``make_mask`` mlx-lm
  ``KVCache``'s), ``update_and_fetch`` returns the sequence's history in that layer from the
  pages (``PagedKVCache.get_kv(..., layer=)``) followed by the new keys/values, and the new
  ones of all sequences go into the pages after the calls (``PagedKVCache.append_kv``). The
  cache stores what the model fetches: for deepseek_v3 the compressed latent (head dim
  ``kv_lora_rank``) and its rotary key (``head_dim_v`` = ``qk_rope_head_dim``), one KV head.
  Sliding-window layers are refused in this mode (they expect mlx-lm's rotating cache to drop
  old keys).

At construction a probe runs the model once lazily (nothing is computed) on two tokens with
recording layer caches: each layer must call ``update_and_fetch`` once, and either
``scaled_dot_product_attention`` with its cache object, exactly the fetched keys and values
and no mask array (the cache's kernels attend), or attend itself (own-attention mode). The
probe also reads the cache configuration off the calls (query and KV heads, q/k and value
head dims, dtype, sinks). Refused, with the reason: a layer that never uses its cache
object, recurrent or chunked caches (LFM2's short convolutions, the Mamba-2 mixers of
Granite-4.0-H, Nemotron-H, Falcon-H1 and Mamba-2, Mamba-1's mixers and Qwen3-Next's gated
DeltaNet layers excepted), layers of different head shapes, sinks on a backend without
``attention_sinks``.

* **State layers.** LFM2's short convolutions (``lfm2``, ``lfm2_moe``: their ``ArraysCache``
  layers in ``make_cache()``) run on the cache's state slots (``State({"conv": (conv_L_cache -
  1, hidden)})``, ``state_kinds``): the conv class's call with a ``LayerCache`` convolves each
  sequence's tokens after its own state (``kvcache.integrations.mlx_lm.states``). So do the
  Mamba-2 mixers of Granite-4.0-H and Nemotron-H (``granitemoehybrid``, ``nemotron_h``:
  ``State({"conv": (d_conv - 1, conv_dim), "ssm": (heads, head_dim, d_state)},
  dtype="float32")``, the conv per sequence after its state, the SSM by mlx-lm's own
  ``ssm_update`` per sequence from its state; Falcon-H1's, ``falcon_h1``, the same beside
  attention in every layer: its ``make_cache()`` gives each layer a ``CacheList`` of both, and
  the cache gives the mixer cache slot ``2 i`` and the attention slot ``2 i + 1``; Mamba-2's,
  ``mamba2``, in every layer without attention: a cache without pages; Mamba-1's mixers,
  ``mamba`` and ``falcon_mamba``, the same way (and Jamba's, ``jamba``, beside attention),
  ``State({"conv": ..., "ssm": (intermediate, d_state)})`` in the cache dtype, the scan by the
  module's own ``ssm_step``), and Qwen3-Next's gated DeltaNet layers (``qwen3_next``:
  ``State({"conv": (kernel - 1, conv_dim), "recurrent": (value heads, head_v_dim, head_k_dim)},
  dtype="float32")``, the conv per sequence after its state, the gated delta rule by mlx-lm's own
  ``gated_delta_update`` per sequence from its state). Every other recurrent cache (``ArraysCache``
  of RWKV-7, RecurrentGemma, ...) is refused naming the family.

For a loop of your own: ``layer_caches(model, cache)`` inside ``cache.forward(...)`` gives the
list to pass as ``model(tokens[:, None], cache=...)``. The cache uses ``rope_mode="none"``.

The package's modules: ``model`` (what is read off a model, ``ModelDescription``),
``protocol`` (``LayerCache``), ``states`` (LFM2's short convolutions, the Mamba-2 mixers
of Granite-4.0-H, Nemotron-H, Falcon-H1 and Mamba-2, Mamba-1's mixers, Qwen3-Next's gated
DeltaNet),
``routing``
(``route``, ``layer_caches``, ``describe``, ``cache_config``) and ``adapter`` (``MlxLmAdapter``); this module checks the requirements,
holds ``Engine`` and re-exports their names.
"""

from __future__ import annotations

from typing import Optional, Sequence

from ...serving import RequestOutput
from .. import require
from ..engine import Engine as _Engine
from ..engine import EngineConfig
from ..sampling import SamplingParams

mx = require("mlx.core", "mlx-lm")
mlx_lm = require("mlx_lm", "mlx-lm", "0.32")

from mlx_lm.models import base as _mlx_base  # noqa: E402
from mlx_lm.models import cache as _mlx_cache  # noqa: E402

__all__ = ["Engine", "LayerCache", "MlxLmAdapter", "ModelDescription", "RequestOutput",
           "STATE_FAMILIES", "SamplingParams", "cache_config",
           "describe", "eos_token_ids", "layer_caches", "layer_kinds", "route_state_layers",
           "sliding_windows", "state_kinds"]

# the package's modules, imported once the requirements are checked; every name the module had
# stays importable from here
from .adapter import MlxLmAdapter  # noqa: E402
from .model import (_DTYPES, ModelDescription, _eos_ids, _family, _Label,  # noqa: E402
                    _label, _layers, _mlx_caches, eos_token_ids, layer_kinds,
                    sliding_windows)
from .protocol import (LayerCache, _Forward, _from_cache, _mx_dtype,  # noqa: E402
                       _to_cache, _window_unsupported)
from .routing import (_DESCRIBED, _ROUTED_ATTR, _described, _one_dtype,  # noqa: E402
                      _own_attention, _routed, _RowsOf, _run, cache_config, describe,
                      layer_caches, route)
from .states import STATE_FAMILIES, route_state_layers, state_kinds  # noqa: E402


class Engine(_Engine):
    """Continuous-batching generation of an mlx-lm model on a ``PagedKVCache``.

    ``model``: an mlx-lm model (e.g. from ``mlx_lm.load``) whose attention goes through
    mlx-lm's cache protocol (refused with the reason otherwise: see the module docstring).
    ``tokenizer`` (e.g. ``mlx_lm.load``'s) or ``eos_token_ids``: where a sample ends unless
    ``ignore_eos`` (``eos_token_ids(model, tokenizer)``; explicit ids win).

    ``config`` / ``options``: the engine's options, an ``EngineConfig`` and / or its fields as
    keywords (``backend``: a backend name or ``"auto"``, ``"metal"`` for MLX; ``device``:
    ``"gpu"`` or ``"cpu"``, None: MLX's default device; ``dtype`` (None: the model's),
    ``page_size``, ``max_total_tokens``, ``memory_fraction``, ``max_batch_size``,
    ``prefill_chunk_size``, ``offload``, ``offload_tokens``, ``overlap``, ``prefix_cache``,
    ``kv_dtype``; MLX has no whole-step graphs), see ``kvcache.integrations.engine.Engine``.
    See ``kvcache.integrations.engine.Engine.generate``.
    """

    def __init__(self, model, *, tokenizer=None, eos_token_ids: Optional[Sequence[int]] = None,
                 config: Optional[EngineConfig] = None, **options):
        # a bad option fails before the model is touched
        config = EngineConfig.of(config, **options)
        self.model = model
        super().__init__(MlxLmAdapter(model, tokenizer=tokenizer, eos_token_ids=eos_token_ids),
                         config=config)
