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

__all__ = ["MissingExtraError", "SamplingParams", "install_hint", "require"]


class MissingExtraError(KVCacheError, ImportError):
    """A model library an integration needs is not installed (the message names the extra)."""


def _extra_requirements(extra: str) -> list[str]:
    """The requirements kvcache's installed metadata lists for ``extra`` (empty if unknown)."""
    import re
    from importlib.metadata import PackageNotFoundError, requires
    try:
        lines = requires("kvcache") or []
    except PackageNotFoundError:      # run from a source tree that was never installed
        return []
    out = []
    for line in lines:
        req, _, marker = line.partition(";")
        names = re.findall(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra in names:
            out.append(req.strip())
    return out


def install_hint(extra: str) -> str:
    """The pip command that installs what kvcache's ``extra`` names. kvcache is not on PyPI, so
    installing ``kvcache[EXTRA]`` by name fails: the hint names the extra's requirements themselves
    (from the installed metadata), and the form that installs the extra from a clone."""
    import re
    reqs = _extra_requirements(extra)
    if not reqs:
        return f"pip install '.[{extra}]' (in a kvcache clone)"
    args, backend = [], False
    for req in reqs:
        name = re.split(r"[^A-Za-z0-9._-]", req, maxsplit=1)[0].lower().replace("_", "-")
        if name.startswith("kvcache-"):      # a backend distribution: a folder of the clone
            args.append(f"./backends/{name[len('kvcache-'):]}")
            backend = True
        else:
            args.append(f"'{req}'")
    if backend:
        return f"pip install {' '.join(args)} (in a kvcache clone)"
    return f"pip install {' '.join(args)} (or, in a kvcache clone: pip install '.[{extra}]')"


def require(module: str, extra: str, minimum: str = ""):
    """Import ``module`` or raise ``MissingExtraError`` naming the extra and the pip command that
    installs it (``install_hint``)."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        need = f" >= {minimum}" if minimum else ""
        raise MissingExtraError(
            f"this integration needs the {module!r} package{need}, which is not installed "
            f"({exc}); install the kvcache[{extra}] extra: {install_hint(extra)}") from None
