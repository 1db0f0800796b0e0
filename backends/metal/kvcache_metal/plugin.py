"""Entry point of the 'metal' plugin (works without MLX: availability() then says why)."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    from .backend import MetalBackend
    return [MetalBackend]
