"""Entry point of the metal plugin."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    return []
