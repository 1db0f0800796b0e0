"""Loads the suite's plugin when pytest collects this package directly
(``pytest --pyargs kvcache.conformance``), also when no ``--kvcache-*`` option is given
(``KVCACHE_CONFORMANCE_BACKEND=NAME pytest --pyargs kvcache.conformance``).

pytest parses the command line before it imports this file, so ``--kvcache-*`` options need
``-p kvcache.conformance.plugin`` on the command line; registering here again is a no-op.
"""


def pytest_addoption(parser, pluginmanager):
    from kvcache.conformance.plugin import register
    register(pluginmanager)
