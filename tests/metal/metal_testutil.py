"""Shared helpers of the metal backend tests (imported as a top-level module: tests/ has no
packages)."""

import os

import numpy as np

import kvcache
from kvcache.conformance import assert_close as close
from kvcache.reference import NP_DTYPES

DEVICE = os.environ.get("KVCACHE_METAL_TEST_DEVICE", "cpu")
"""'cpu' here (MLX's CPU device); 'gpu' on an Apple GPU to verify the Metal paths."""


def quantize(x, dtype):
    """Round a float array to the storage dtype and back to float32 (both backends see it)."""
    return np.asarray(x, np.float32).astype(NP_DTYPES[dtype]).astype(np.float32)


def assert_close(got, want, dtype, what="", lse=False):
    """A metal array against a reference one, within the suite's tolerance for ``dtype``."""
    close(what, kvcache.to_numpy(want), kvcache.to_numpy(got), dtype, lse=lse)
