"""Adapters that let model libraries run their models on a ``PagedKVCache``.

* ``kvcache.integrations.transformers`` (extra ``kvcache[transformers]``): Hugging Face
  transformers models on the torch backends (cuda, rocm, cuda's CPU test mode) and the
  reference backend;
* ``kvcache.integrations.mlx_lm`` (extra ``kvcache[mlx-lm]``): mlx-lm models on the metal
  backend (Apple GPU, or MLX's CPU device);
* ``kvcache.integrations.engine``: the continuous-batching ``Engine`` they share (neutral to
  the model library; an adapter supplies the model's forward);
* ``kvcache.integrations.tp``: the transformers Engine on tensor-parallel ranks;
* ``kvcache.integrations.sampling``: ``SamplingParams`` (per-request sampling settings, exported
  here; importing it needs no model library) and the sampler on the logits' device.
"""

from ..errors import KVCacheError
from .sampling import SamplingParams

__all__ = ["MissingExtraError", "SamplingParams", "require"]


class MissingExtraError(KVCacheError, ImportError):
    """A model library an integration needs is not installed (the message names the extra)."""


def require(module: str, extra: str, minimum: str = ""):
    """Import ``module`` or raise ``MissingExtraError`` naming ``pip install 'kvcache[extra]'``."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        need = f" >= {minimum}" if minimum else ""
        raise MissingExtraError(
            f"this integration needs the {module!r} package{need}, which is not installed "
            f"({exc}); install it with: pip install 'kvcache[{extra}]'") from None
