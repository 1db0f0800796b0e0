"""kvcache backend plugin 'cuda': torch memory/streams, Triton kernels, torch fallback."""

__all__ = ["CudaBackend"]


def __getattr__(name):
    # lazy so that `import kvcache_cuda` stays cheap and never imports triton
    if name == "CudaBackend":
        from .backend import CudaBackend
        return CudaBackend
    raise AttributeError(name)
