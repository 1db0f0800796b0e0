"""Loads the suite's plugin when pytest collects this package directly
(``pytest --pyargs kvcache.conformance``), also when no ``--kvcache-*`` option is given
(``KVCACHE_CONFORMANCE_BACKEND=NAME pytest --pyargs kvcache.conformance``).

pytest parses the command line before it imports this file, so the ``--kvcache-*`` options are
defined by kvcache's ``pytest11`` entry point (``_kvcache_pytestplugin``), which also loads the
plugin when one of them is given; registering here again is a no-op. With
``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` use the environment or ``-p kvcache.conformance.plugin``.
"""


def pytest_addoption(parser, pluginmanager):
    from kvcache.conformance.plugin import register
    register(pluginmanager)
