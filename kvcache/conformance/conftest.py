"""Loads the suite's plugin when pytest collects this package directly
(``pytest --pyargs kvcache.conformance``) without ``-p kvcache.conformance.plugin``.

pytest reads command-line options before it sees this file, so in that form use the
environment (``KVCACHE_CONFORMANCE_BACKEND=NAME``) or add ``-p kvcache.conformance.plugin`` for
the ``--kvcache-*`` options.
"""


def pytest_addoption(parser, pluginmanager):
    from kvcache.conformance.plugin import register
    register(pluginmanager)
