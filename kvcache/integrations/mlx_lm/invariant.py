"""Batch-invariant model ops for an mlx-lm model: ``MlxBatchInvariant``.

MLX picks its matmul kernel by the shape (a matrix-vector kernel for one row, tiled GEMMs, on
the CPU a BLAS call), so a token's row gets other last bits beside other rows, as torch's do
(``kvcache.integrations.torch_invariant``). MLX has no dispatch hook to catch ``@`` inside model
code, so this meets the model where its weights are applied: while the context is active, each
``nn.Linear`` / ``nn.QuantizedLinear`` of the model (and a tied head's
``Embedding.as_linear``) runs on blocks of exactly ``ROWS`` rows, the last padded with zeros, so
every call has one shape, one kernel and one summation order per row, whatever the batch. The
rest of a dense decoder is per row already: RMSNorm/LayerNorm (``mx.fast``: one row at a time),
RoPE and the MLP's elementwise ops, and the attention is the cache's.

What this cannot see is refused (``unsupported`` says why): matmuls in the model's own code
(own-attention models compute their scores there; MoE experts go through ``gather_mm``), so
only the families the engine test proves are taken (``FAMILIES``).

The swap is per module instance (its class is switched to a subclass and back), so other models
and other threads' MLX code are untouched, and it costs one attribute write per linear layer a
step.
"""

from __future__ import annotations

from typing import Optional

from .. import require

mx = require("mlx.core", "mlx-lm")
nn = require("mlx.nn", "mlx-lm")

__all__ = ["MlxBatchInvariant", "ROWS", "FAMILIES", "unsupported"]

ROWS = 32
"""Rows per block: every linear layer runs on ``ROWS`` rows at a time."""

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma")
"""The mlx-lm model types whose every weight product goes through a linear layer or the tied
embedding, proven bit-identical however they are served (tests/integrations/
test_engine_deterministic.py); others are refused until shown."""


def _in_blocks(fn, x):
    """``fn`` over ``x`` (..., d) as (ROWS, d) blocks of its rows (the last padded with zeros);
    the result in ``x``'s leading shape."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m == 0:
        return fn(x)
    pad = (-m) % ROWS
    if pad:
        rows = mx.concatenate([rows, mx.zeros((pad, rows.shape[1]), dtype=rows.dtype)])
    outs = [fn(rows[i:i + ROWS]) for i in range(0, m + pad, ROWS)]
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    if pad:
        out = out[:m]
    return out.reshape(*lead, out.shape[-1])


_SUBCLASSES: dict = {}


def _blocked(cls):
    """``cls`` (a linear layer or an embedding) with its products in row blocks, made once."""
    if cls not in _SUBCLASSES:
        if issubclass(cls, (nn.Embedding, nn.QuantizedEmbedding)):
            def as_linear(self, x):
                return _in_blocks(lambda rows: cls.as_linear(self, rows), x)
            body = {"as_linear": as_linear}
        else:
            def call(self, x):
                return _in_blocks(lambda rows: cls.__call__(self, rows), x)
            body = {"__call__": call}
        _SUBCLASSES[cls] = type(f"RowBlocked{cls.__name__}", (cls,), body)
    return _SUBCLASSES[cls]


_KINDS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)


def unsupported(model, description) -> Optional[str]:
    """Why ``model`` cannot run batch-invariant here, or None."""
    family = getattr(getattr(model, "args", None), "model_type", None) or \
        getattr(model, "model_type", None)
    if description.own_attention:
        return (f"the {family} model computes its attention itself (own-attention mode), with "
                f"matmuls whose shapes follow the chunking")
    experts = sorted({type(m).__name__ for _, m in model.named_modules()
                      if "Switch" in type(m).__name__})
    if experts:
        return f"its MoE experts ({', '.join(experts)}) multiply through gather_mm, not covered"
    if family not in FAMILIES:
        return (f"model type {family!r} is not among the families proven bit-identical "
                f"({', '.join(FAMILIES)})")
    return None


class MlxBatchInvariant:
    """While active, ``model``'s linear layers (and a tied embedding's ``as_linear``) run in
    blocks of ``ROWS`` rows (module doc). Re-entrant after it is left; not nested."""

    def __init__(self, model):
        self.swaps = [(m, type(m), _blocked(type(m))) for _, m in model.named_modules()
                      if type(m) in _KINDS]

    def __enter__(self):
        for m, _, sub in self.swaps:
            m.__class__ = sub
        return self

    def __exit__(self, *exc):
        for m, cls, _ in self.swaps:
            m.__class__ = cls
        return False
