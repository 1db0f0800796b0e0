"""``kvcache.to_numpy``: bring any backend's array back to host numpy without importing array
libraries the caller did not already use."""

from __future__ import annotations

from typing import Optional

import numpy as np

try:   # numpy has no bfloat16; without ml_dtypes host arrays hold fp16/fp32 only
    import ml_dtypes
except ImportError as exc:
    ml_dtypes = None  # type: ignore[assignment]
    BFLOAT16_MISSING: Optional[str] = f"no bfloat16 storage: ml_dtypes cannot be imported ({exc})"
else:
    BFLOAT16_MISSING = None

NP_DTYPES: dict[str, np.dtype] = {"float16": np.dtype(np.float16), "float32": np.dtype(np.float32),
                                  "int32": np.dtype(np.int32), "uint8": np.dtype(np.uint8)}
"""The one name -> numpy dtype table of host arrays (bfloat16 as ml_dtypes' type)."""
if ml_dtypes is not None:
    NP_DTYPES["bfloat16"] = np.dtype(ml_dtypes.bfloat16)


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a storage dtype name; UnsupportedFeatureError for bfloat16 without
    ml_dtypes (``PagedKVCache`` raises the same error earlier, from the capabilities) and for
    a name with no host type."""
    if name not in NP_DTYPES:
        from .errors import UnsupportedFeatureError
        extra = f"; {BFLOAT16_MISSING}" if name == "bfloat16" and BFLOAT16_MISSING else ""
        raise UnsupportedFeatureError(
            f"backend 'reference' does not support dtype {name!r}: host arrays hold "
            f"{sorted(NP_DTYPES)}{extra}")
    return NP_DTYPES[name]


def to_numpy(array) -> np.ndarray:
    """A host numpy copy of a numpy, torch or mlx array; float16/bfloat16 become float32."""
    module = type(array).__module__
    if module.startswith("torch"):
        t = array.detach()
        if t.is_floating_point() and t.dtype.itemsize < 4:
            t = t.float()
        return t.cpu().numpy().copy()
    if module.startswith("mlx"):
        import mlx.core as mx
        if array.dtype in (mx.float16, mx.bfloat16):
            array = array.astype(mx.float32)
        return np.array(array, copy=True)
    out = np.array(array, copy=True)
    if out.dtype.kind == "f" and out.dtype.itemsize < 4 or out.dtype.name == "bfloat16":
        out = out.astype(np.float32)
    return out


def to_host(array, dtype: str) -> np.ndarray:
    """A host numpy copy of a numpy, torch or mlx array in the storage dtype ``dtype``
    ('float16' | 'bfloat16' | 'float32'; bfloat16 as ml_dtypes' type): the same bits, never
    widened (what a payload moved between backends keeps)."""
    want = np_dtype(dtype)
    module = type(array).__module__
    if module.startswith("torch") and dtype == "bfloat16":
        import torch
        t = array.detach()
        if t.dtype == torch.bfloat16:       # torch.numpy() has no bfloat16: move the bits
            return t.contiguous().view(torch.int16).cpu().numpy().view(want).copy()
    if type(array) is np.ndarray and array.dtype == want:
        return array.copy()
    return to_numpy(array).astype(want)
