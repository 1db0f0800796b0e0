"""Entry point of the ``rocm`` plugin (group ``kvcache``)."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    try:
        from .backend import RocmBackend
    except ImportError:          # kvcache-cuda not installed: nothing to register
        return []
    return [RocmBackend]
