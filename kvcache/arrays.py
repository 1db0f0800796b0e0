"""``kvcache.to_numpy``: bring any backend's array back to host numpy without importing array
libraries the caller did not already use."""

from __future__ import annotations

import numpy as np


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
    from .reference import np_dtype
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
