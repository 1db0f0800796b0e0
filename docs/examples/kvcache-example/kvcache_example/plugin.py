"""The module named by the ``kvcache`` entry point: it implements the one hook."""

import os

import kvcache


@kvcache.hookimpl
def kvcache_register_backends():
    from .backend import ExampleBackend
    backends = [ExampleBackend]
    wanted = os.environ.get("KVCACHE_EXAMPLE_BROKEN", "")
    if wanted:   # opt-in: deliberately broken variants that the conformance suite must reject
        from .broken import broken_backends
        backends += broken_backends(wanted)
    return backends
