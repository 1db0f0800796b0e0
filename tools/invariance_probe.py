"""Issue 54 probe: would the cuda backend's kernels pass ``TestBatchInvariance`` as they are?
Registers ``cuda-bi``, the cuda backend declaring ``batch_invariant``, and runs the suite's
class on it (every dtype and page size with ``--full``); the failures name the first token
whose bits differ and the run (batched and chunked, from the prefix cache, ...).

    python tools/invariance_probe.py [conformance args, e.g. --full]
"""

from __future__ import annotations

import dataclasses
import sys

import kvcache
from kvcache.conformance.cli import main
from kvcache.plugins import register_plugin
from kvcache_cuda.backend import CudaBackend


class CudaDeclaringInvariance(CudaBackend):
    name = "cuda-bi"
    capabilities = dataclasses.replace(CudaBackend.capabilities, batch_invariant=True)


class Plugin:
    @kvcache.hookimpl
    def kvcache_register_backends(self):
        return [CudaDeclaringInvariance]


if __name__ == "__main__":
    register_plugin(Plugin(), name="invariance-probe")
    sys.exit(main(["--backend", "cuda-bi", "-k", "BatchInvariance", "--jobs", "1",
                   *sys.argv[1:]]))
