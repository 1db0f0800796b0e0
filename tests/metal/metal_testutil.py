"""Shared helpers of the metal backend tests (imported as a top-level module: tests/ has no
packages)."""

import os

import numpy as np

import kvcache
from kvcache.reference import NP_DTYPES

DEVICE = os.environ.get("KVCACHE_METAL_TEST_DEVICE", "cpu")
"""'cpu' here (MLX's CPU device); 'gpu' on an Apple GPU to verify the Metal paths."""

# per-dtype tolerances against the float64 reference (outputs are rounded to the dtype once)
TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "float16": dict(atol=2e-3, rtol=2e-3),
       "bfloat16": dict(atol=1.6e-2, rtol=1.6e-2)}
LSE_TOL = {"float32": dict(atol=2e-5, rtol=1e-5), "float16": dict(atol=1e-4, rtol=1e-5),
           "bfloat16": dict(atol=1e-4, rtol=1e-5)}


def quantize(x, dtype):
    """Round a float array to the storage dtype and back to float32 (both backends see it)."""
    return np.asarray(x, np.float32).astype(NP_DTYPES[dtype]).astype(np.float32)


def assert_close(got, want, dtype, what="", lse=False):
    got, want = kvcache.to_numpy(got), kvcache.to_numpy(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = (LSE_TOL if lse else TOL)[dtype]
    ninf_g, ninf_w = np.isneginf(got), np.isneginf(want)
    assert np.array_equal(ninf_g, ninf_w), f"{what}: -inf pattern differs"
    assert not np.isnan(got).any(), f"{what}: NaN"
    np.testing.assert_allclose(np.where(ninf_g, 0, got), np.where(ninf_w, 0, want),
                               err_msg=what, **tol)
