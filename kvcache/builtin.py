"""The core's own plugin: registers the reference backend through the entry point, exactly as a
third-party plugin would."""

from .hookspecs import hookimpl


@hookimpl
def kvcache_register_backends():
    from .reference import ReferenceBackend
    return [ReferenceBackend]
