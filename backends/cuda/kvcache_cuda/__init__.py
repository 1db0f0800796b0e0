"""kvcache backend plugin 'cuda': torch memory/streams, Triton kernels, torch fallback."""

__all__ = ["CudaBackend", "DecodeGraphs"]


def __getattr__(name):
    # lazy so that `import kvcache_cuda` stays cheap and never imports triton
    if name == "CudaBackend":
        from .backend import CudaBackend
        return CudaBackend
    if name == "DecodeGraphs":
        from .graphs import DecodeGraphs
        return DecodeGraphs
    raise AttributeError(name)
