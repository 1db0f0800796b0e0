"""Entry point of the 'cuda' plugin (entry-point group ``kvcache``)."""

from kvcache.hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    # importing the backend module needs neither torch nor a GPU; availability() says what's missing
    from .backend import CudaBackend
    return [CudaBackend]
