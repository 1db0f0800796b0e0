"""What the transformers integration reads off a model and its config: head dims, windows, EOS
ids, the attention layers and what they need of a backend (re-exported by the package)."""

from __future__ import annotations

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


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        return dtype
    if dtype not in _DTYPES:
        raise UnsupportedFeatureError(f"the cache stores float32, float16 or bfloat16, not {dtype}")
    return _DTYPES[dtype]


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
