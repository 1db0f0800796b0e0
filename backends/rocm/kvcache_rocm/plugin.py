"""Entry point of the rocm plugin."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    return []
