"""How a model's attention reaches the cache (the package's docstring gives the rules): mlx-lm's
``scaled_dot_product_attention`` wrapped (``route``), ``layer_caches``, the model run for its
wanted rows, and the probe that checks it all at construction (``describe``, ``cache_config``);
re-exported by the package."""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from typing import Optional

from ...arrays import to_numpy
from ...config import CacheConfig
from ...errors import InvalidArgumentError, KVCacheError, UnsupportedFeatureError
from .. import require
from .model import (_DTYPES, ModelDescription, _family, _label, _mlx_caches, layer_kinds,
                    model_caches, sliding_windows)
from .protocol import LayerCache, _Forward
from .states import route_state_layers, state_kinds

mx = require("mlx.core", "mlx-lm")

from mlx_lm.models import base as _mlx_base  # noqa: E402


# ---------------------------------------------------------------------- routing
_ROUTED_ATTR = "__kvcache_routed__"


def _routed(original):
    """mlx-lm's ``scaled_dot_product_attention`` that hands a call with a ``LayerCache`` to its
    ``attend`` and any other call to ``original`` unchanged."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def scaled_dot_product_attention(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return original(*args, **kwargs)
        cache = bound.arguments.get("cache")
        if isinstance(cache, LayerCache) and not cache.own_attention:
            arguments = dict(bound.arguments)
            arguments.pop("cache")
            arguments.update(arguments.pop("kwargs", {}))
            return cache.attend(**arguments)
        return original(*args, **kwargs)

    setattr(scaled_dot_product_attention, _ROUTED_ATTR, True)
    return scaled_dot_product_attention


def route(model) -> None:
    """Wrap mlx-lm's ``scaled_dot_product_attention`` where ``model``'s classes call it (the
    modules defining them, and ``mlx_lm.models.base``) so that a call with a ``LayerCache``
    reaches the paged cache, and the calls of its state layers' classes with a ``LayerCache``
    (LFM2's short convolutions, Mamba-2 mixers, gated DeltaNet layers:
    ``route_state_layers``). Once
    per module / class, idempotent; calls with any other cache run mlx-lm's own code, so the
    wrappers stay installed."""
    route_state_layers(model)
    modules = {sys.modules.get(type(m).__module__) for m in [model, *model.modules()]}
    modules.add(_mlx_base)
    for module in modules:
        original = getattr(module, "scaled_dot_product_attention", None) if module else None
        if callable(original) and not getattr(original, _ROUTED_ATTR, False):
            setattr(module, "scaled_dot_product_attention", _routed(original))


def layer_caches(model, cache, positions=None) -> list:
    """The mlx-lm cache objects (one ``LayerCache`` per layer) that route ``model``'s
    attention to ``cache``'s open forward. Call the model with the forward's T tokens as T
    batch rows: ``model(tokens.reshape(-1, 1), cache=layer_caches(model, cache))``; logits come
    back ``(T, 1, vocab)`` (a Falcon-H1's list holds one ``(mixer's, attention's)`` pair of
    ``LayerCache`` objects per decoder layer, as its ``make_cache()`` holds ``CacheList``
    pairs: ``model_caches``). ``positions``: each token's position (None: the cache's
    ``query_positions()``). Sliding layers follow ``model.make_cache()`` (``sliding_windows``);
    state layers (LFM2's convolutions, the Mamba-2 mixers, the gated DeltaNet layers) read
    and write their states on
    the cache (``state_kinds``: the
    cache must have them, as ``cache_config(model)`` gives). A model that computes attention
    itself (``describe(model).own_attention``) needs one call per sequence: it is refused here
    (``MlxLmAdapter(model).forward`` runs it)."""
    if cache.config.rope_mode != "none":
        raise InvalidArgumentError(
            f"the cache has rope_mode={cache.config.rope_mode!r}, but an mlx-lm model applies "
            f"its own RoPE: build the cache with cache_config(model) (rope_mode='none')")
    if _described(model).own_attention:
        raise UnsupportedFeatureError(
            f"the {_family(model)} model computes attention itself over the keys and values "
            f"its cache returns, one sequence per call; layer_caches serves one call over "
            f"every sequence's tokens: use MlxLmAdapter(model).forward(cache, tokens, "
            f"positions, logit_rows) inside the forward")
    windows = sliding_windows(model)
    route(model)
    slots = len(_mlx_caches(model))
    forward = _Forward(model, windows, slots, states=_described(model).states)
    forward.begin(cache, to_numpy(cache.query_positions()) if positions is None else positions)
    return model_caches(model, [LayerCache(i, forward) for i in range(slots)])


class _RowsOf:
    """Stands in for a model's inner model during one call: runs it and hands the model's head
    only the hidden rows ``rows`` (``(B,)`` int32) of its ``(T, 1, hidden)`` output (``axis``
    1: the tokens ``rows`` of its ``(1, T, hidden)`` output)."""

    def __init__(self, inner, rows, axis: int = 0):
        self.inner, self.rows, self.axis, self.hidden = inner, rows, axis, None

    def __call__(self, *args, **kwargs):
        hidden = self.hidden = self.inner(*args, **kwargs)
        return hidden[:, self.rows] if self.axis else hidden[self.rows]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _run(model, inputs, caches, rows, axis: int = 0):
    """The model's own ``__call__`` over ``inputs`` (T, 1) with ``caches``: ``(logits (B,
    vocab) of rows ``rows``, hidden states (T, 1, hidden) or the logits of every row)``.
    ``axis`` 1: ``inputs`` (1, T), one sequence's tokens, and ``rows`` its tokens."""
    inner = model.get("model") if isinstance(model, dict) else None
    pick = (lambda out: out[0][rows]) if axis else (lambda out: out[rows][:, -1])
    if inner is None or "model" in vars(model) or not callable(inner):
        out = model(inputs, cache=caches)
        return pick(out), out
    wrapper = _RowsOf(inner, rows, axis)
    object.__setattr__(model, "model", wrapper)
    try:
        out = model(inputs, cache=caches)
    finally:
        object.__delattr__(model, "model")
    if wrapper.hidden is None:               # the model's call did not go through .model
        return pick(out), out
    return (out[0] if axis else out[:, -1]), wrapper.hidden


_DESCRIBED: dict = {}


def _described(model) -> ModelDescription:
    """``describe(model)``, once per model object (``layer_caches`` runs every forward)."""
    entry = _DESCRIBED.get(id(model))
    if entry is None or entry[0]() is not model:
        entry = (weakref.ref(model), describe(model))
        _DESCRIBED[id(model)] = entry
        weakref.finalize(model, _DESCRIBED.pop, id(model), None)
    return entry[1]


def describe(model) -> ModelDescription:
    """Probe ``model``'s attention through the cache protocol (``LayerCache`` objects that
    record, the model run lazily on two tokens: nothing is computed) and read the cache
    configuration off its calls. Raises ``UnsupportedFeatureError`` naming the reason when its
    attention cannot reach the paged cache this way (see the module docstring)."""
    family = _family(model)
    windows = sliding_windows(model)
    states = state_kinds(model)
    route(model)
    slots = len(_mlx_caches(model))
    forward = _Forward(model, windows, slots, states=states)
    forward.probe = {}
    forward.positions = mx.array([0, 1], mx.int32)
    caches = model_caches(model, [LayerCache(i, forward) for i in range(slots)])
    try:
        logits, _ = _run(model, mx.zeros((2, 1), mx.int32), caches, mx.array([1], mx.int32))
    except KVCacheError:
        raise
    except Exception as exc:
        raise UnsupportedFeatureError(
            f"the {family} model ({type(model).__module__}) fails with kvcache's layer caches "
            f"(each token a batch row, its position in the array cache.offset, no mask): "
            f"{type(exc).__name__}: {exc}") from exc
    records = forward.probe
    try:
        forward.check_all_attended()
        for layer, r in sorted(records.items()):
            if isinstance(r.get("attend"), str):
                raise UnsupportedFeatureError(
                    f"{_label(model, layer)} of the {family} model {r['attend']}")
    except UnsupportedFeatureError as exc:
        if states:          # a conv runs over every sequence's tokens at once: one call
            raise UnsupportedFeatureError(
                f"{exc}; with the state layers {sorted(states)} the model cannot attend itself "
                f"one sequence per call") from None
        return _own_attention(model, forward, windows, int(logits.shape[-1]), exc)
    if not records:     # every slot a state layer (checked above): no attention, no pages
        return _attention_free(model, slots, logits, states)
    shapes = {r["attend"]["heads"] for r in records.values()}
    if len(shapes) != 1:
        raise UnsupportedFeatureError(
            f"the layers of the {family} model differ in (query heads, KV heads, head dim, "
            f"value head dim): {sorted(shapes)}; the paged cache has one shape for all layers")
    H, Hkv, D, Dv = shapes.pop()
    return ModelDescription(
        num_layers=slots, num_qo_heads=int(H), num_kv_heads=int(Hkv), head_dim=int(D),
        head_dim_v=int(Dv), dtype=_one_dtype(family, {r["attend"]["dtype"] for r in records.values()}),
        vocab_size=int(logits.shape[-1]), windows=windows,
        sinks=tuple(sorted(i for i, r in records.items() if r["attend"]["sinks"])),
        states=states)


ATTENTION_FREE_HEADS = (1, 1, 64)
"""``(query heads, KV heads, head dim)`` of the cache of a model without attention layers
(mlx-lm's ``mamba2``, ``mamba``): its layers are all state layers, which have no pages, so
no layer uses them; a shape every backend takes, so that ``CacheConfig`` stands."""


def _attention_free(model, slots: int, logits, states: dict) -> ModelDescription:
    """The description of a model whose every cache slot is a state layer (``states``): the
    cache has no paged layer (``ATTENTION_FREE_HEADS``, never used) and the model's dtype is
    its logits' (no attention call shows it)."""
    H, Hkv, D = ATTENTION_FREE_HEADS
    return ModelDescription(
        num_layers=slots, num_qo_heads=H, num_kv_heads=Hkv, head_dim=D, head_dim_v=D,
        dtype=_one_dtype(_family(model), {logits.dtype}), vocab_size=int(logits.shape[-1]),
        windows={}, sinks=(), states=states)


def _one_dtype(family: str, dtypes: set) -> str:
    dtype = dtypes.pop()
    if dtypes or dtype not in _DTYPES:
        raise UnsupportedFeatureError(
            f"the {family} model's attention runs in {dtype}; the cache stores float32, "
            f"float16 or bfloat16 (one dtype for all layers)")
    return _DTYPES[dtype]


def _own_attention(model, forward: _Forward, windows: dict, vocab: int,
                   why: UnsupportedFeatureError) -> ModelDescription:
    """The description of a model whose attention does not run on the cache's kernels
    (``why``) but that fetches each layer's keys and values through ``update_and_fetch``
    once: it attends itself over the history the cache returns. Raises ``why`` (or the
    reason own attention cannot work either) otherwise."""
    family = _family(model)
    records = forward.probe or {}
    if any(f != 1 for f in forward.fetched) or len(records) != len(forward.fetched):
        raise why
    if windows:
        raise UnsupportedFeatureError(
            f"{why}; it could attend itself over the keys and values the cache returns, but "
            f"its sliding-window layers {sorted(windows)} (from model.make_cache()) expect "
            f"mlx-lm's rotating cache to drop old keys, which the paged cache does not do")
    shapes = {r["fetched"]["kv"] for r in records.values()}
    if len(shapes) != 1:
        raise UnsupportedFeatureError(
            f"the layers of the {family} model fetch keys and values of different (KV heads, "
            f"key dim, value dim): {sorted(shapes)}; the paged cache has one shape for all layers")
    Hkv, D, Dv = shapes.pop()
    return ModelDescription(
        num_layers=len(forward.fetched), num_qo_heads=int(Hkv), num_kv_heads=int(Hkv),
        head_dim=int(D), head_dim_v=int(Dv),
        dtype=_one_dtype(family, {r["fetched"]["dtype"] for r in records.values()}),
        vocab_size=vocab, windows={}, sinks=(), own_attention=True)


def cache_config(model, *, dtype: Optional[str] = None, page_size: int = 16,
                 max_total_tokens: int = 65536, max_batch_size: int = 64,
                 prefill_chunk_size: int = 2048,
                 description: Optional[ModelDescription] = None,
                 window_groups: bool = False, max_state_slots: int = 0) -> CacheConfig:
    """A ``CacheConfig`` for an mlx-lm model: layers, query/KV heads, head dims (values: their
    own, ``head_dim_v``) as its attention calls show them (``describe``), ``rope_mode="none"``
    (the model rotates q and k itself), ``dtype`` (None: the model's) and the given sizes.
    ``window_groups``: the sliding-window layers (``RotatingKVCache`` in ``make_cache()``) get
    ``layer_kinds`` and keep only the pages their windows still see; False: every page kept.
    LFM2's short convolutions, the Mamba-2 mixers and the gated DeltaNet layers
    (``STATE_FAMILIES``)
    are state layers: they always get
    their ``State`` kinds (``state_kinds(model)``), in ``max_state_slots`` slots (0:
    ``max_batch_size``, the sequences the cache holds at once)."""
    d = description if description is not None else describe(model)
    args = getattr(model, "args", None)
    return CacheConfig(
        num_layers=d.num_layers, num_qo_heads=d.num_qo_heads, num_kv_heads=d.num_kv_heads,
        head_dim=d.head_dim, head_dim_v=d.head_dim_v,
        page_size=page_size, max_batch_size=max_batch_size, max_total_tokens=max_total_tokens,
        prefill_chunk_size=prefill_chunk_size, dtype=dtype if dtype is not None else d.dtype,
        rope_mode="none", rope_theta=float(getattr(args, "rope_theta", None) or 10000.0),
        max_state_slots=max_state_slots,
        layer_kinds={**(layer_kinds(d.windows) if window_groups else {}), **d.states})
