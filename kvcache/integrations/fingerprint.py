"""A model's fingerprint: what a KV file (``cache.save_sequences``, the prefix cache's
``save``) records of the model that computed its K/V, so that loading refuses K/V of another
model (``load_sequences`` / ``load`` compare it key by key and name the first field that
differs). The Engine computes it with ``model_fingerprint`` (``Engine.fingerprint``).

The fields (a JSON object; docs/kv-files.md):

* ``library``: ``"transformers"`` or ``"mlx-lm"`` (their parameter names differ, so their
  ``shapes`` do too);
* ``architecture``: the model's class (``LlamaForCausalLM``, ``mlx_lm.models.llama.Model``);
  ``model_type``: its config's;
* ``num_layers``, ``num_qo_heads``, ``num_kv_heads``, ``head_dim``, ``head_dim_v``,
  ``vocab_size``, ``dtype`` (the parameters' floating dtype);
* ``rope``: every config field that names RoPE or rotary (its kind and parameters:
  ``rope_parameters`` / ``rope_scaling`` / ``rope_theta`` / ``partial_rotary_factor`` /
  ``rope_traditional`` ...), as the config holds them;
* ``shapes``: the SHA-256 of the parameters' names, dtypes and shapes, in name order;
* ``weights`` (only with ``weights=True``): the SHA-256 of the same and the parameters'
  bytes, so two checkpoints of one architecture differ (reading every weight once: about a
  second per GiB on a CPU).

Imports no model library itself: it reads whichever the model belongs to.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sys
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["model_fingerprint"]


def model_fingerprint(model, weights: bool = False) -> dict:
    """The fingerprint of ``model`` (a transformers ``PreTrainedModel`` or an mlx-lm model):
    a JSON-able dict of the fields in the module doc. ``weights``: also hash every parameter's
    bytes (``"weights"``). Raises InvalidArgumentError for an object of neither library."""
    if not isinstance(weights, bool):
        raise InvalidArgumentError(f"weights={weights!r} must be True or False")
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module) and hasattr(model, "config"):
        return _transformers(model, weights)
    nn = sys.modules.get("mlx.nn")
    if nn is not None and isinstance(model, nn.Module):
        return _mlx_lm(model, weights)
    raise InvalidArgumentError(
        f"model_fingerprint: {type(model).__name__} is neither a transformers model (a torch "
        f"module with a config) nor an mlx-lm model")


def _jsonable(x) -> Any:
    """``x`` as plain JSON values (tuples as lists, numpy scalars as numbers, NaN and other
    objects as their string), so that the fingerprint compares equal after a file's round
    trip."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if x is None or isinstance(x, (bool, int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    return str(x)


def _rope_fields(config: dict) -> dict:
    return _jsonable({k: v for k, v in config.items()
                      if "rope" in k.lower() or "rotary" in k.lower()})


def _digests(named, weights: bool, raw) -> dict:
    """``{"shapes": ..., ["weights": ...]}`` of ``named``: (name, dtype name, shape, array)
    in name order; ``raw(array)`` gives an array's bytes (only called with ``weights``)."""
    shapes = hashlib.sha256()
    full = hashlib.sha256() if weights else None
    for name, dtype, shape, array in sorted(named, key=lambda t: t[0]):
        line = f"{name}:{dtype}:{list(shape)}\n".encode()
        shapes.update(line)
        if full is not None:
            full.update(line)
            full.update(raw(array))
    out = {"shapes": shapes.hexdigest()}
    if full is not None:
        out["weights"] = full.hexdigest()
    return out


def _float_dtype(dtypes) -> str:
    """The parameters' floating dtype (the most common), as a name without its library."""
    names = [d for d in dtypes if "float" in d]
    return max(set(names), key=names.count) if names else ""


def _transformers(model, weights: bool) -> dict:
    import torch
    config = model.config
    cfg = config.to_dict()
    heads = int(config.num_attention_heads)
    nope, rot = getattr(config, "qk_nope_head_dim", None), getattr(config, "qk_rope_head_dim", None)
    if nope is not None and rot is not None:        # MLA in expanded form (as head_dims)
        head_dim = int(nope) + int(rot)
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    state = model.state_dict()
    named = [(name, str(t.dtype).replace("torch.", ""), tuple(t.shape), t)
             for name, t in state.items()]

    def raw(t) -> bytes:
        t = t.detach().to("cpu").contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""

    out = {
        "library": "transformers",
        "architecture": type(model).__name__,
        "model_type": str(getattr(config, "model_type", "") or ""),
        "num_layers": int(config.num_hidden_layers),
        "num_qo_heads": heads,
        "num_kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
        "head_dim": head_dim,
        "head_dim_v": int(getattr(config, "v_head_dim", None) or head_dim),
        "vocab_size": int(config.vocab_size),
        "dtype": _float_dtype([d for _, d, _, _ in named]),
        "rope": _rope_fields(cfg),
    }
    return {**out, **_digests(named, weights, raw)}


def _mlx_lm(model, weights: bool) -> dict:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        cfg = dataclasses.asdict(args)
    else:
        cfg = dict(vars(args)) if args is not None else {}
    from .mlx_lm.routing import describe             # the probe's heads and head dims
    d = describe(model)
    leaves: Any = tree_flatten(model.parameters())     # [(dotted name, array)]
    named = [(name, str(a.dtype).replace("mlx.core.", ""), tuple(a.shape), a)
             for name, a in leaves]

    def raw(a) -> bytes:
        return np.array(a.reshape(-1).view(mx.uint8)).tobytes() if a.size else b""

    out = {
        "library": "mlx-lm",
        "architecture": f"{type(model).__module__}.{type(model).__name__}",
        "model_type": str(cfg.get("model_type", "") or ""),
        "num_layers": int(d.num_layers),
        "num_qo_heads": int(d.num_qo_heads),
        "num_kv_heads": int(d.num_kv_heads),
        "head_dim": int(d.head_dim),
        "head_dim_v": int(d.head_dim_v),
        "vocab_size": int(d.vocab_size),
        "dtype": _float_dtype([dt for _, dt, _, _ in named]),
        "rope": _rope_fields(cfg),
    }
    return {**out, **_digests(named, weights, raw)}

