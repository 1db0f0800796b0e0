"""kvcache backend plugin 'metal': MLX arrays and streams; Metal kernels on Apple GPUs, MLX ops on
MLX's CPU device. ``MetalBackend`` is importable without MLX (it reports itself unavailable)."""

__version__ = "0.1.0"


def __getattr__(name):
    if name == "MetalBackend":
        from .backend import MetalBackend
        return MetalBackend
    raise AttributeError(name)
