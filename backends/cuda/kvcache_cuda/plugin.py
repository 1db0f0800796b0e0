"""Entry point of the cuda plugin."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    return []
