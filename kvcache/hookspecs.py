"""Plugin hooks (pluggy project name ``kvcache``, entry-point group ``kvcache``).

A plugin is a module with ``@hookimpl``-decorated functions, registered under the ``kvcache``
entry-point group in its distribution's metadata. The built-in reference backend is registered
the same way.
"""

import pluggy

hookspec = pluggy.HookspecMarker("kvcache")
"""Marks the hook specifications below (kvcache's own; plugins do not use it)."""
hookimpl = pluggy.HookimplMarker("kvcache")
"""The decorator a plugin puts on its hook functions (``@kvcache.hookimpl`` on
``kvcache_register_backends``): pluggy registers only functions marked for the ``kvcache``
project, so an unmarked function of the same name is ignored."""


@hookspec
def kvcache_register_backends():
    """Return a list of ``kvcache.Backend`` subclasses this plugin provides: concrete classes
    with a ``str`` name (not ``"auto"``), an ``int`` priority and a ``kvcache.Capabilities``.
    Anything else makes this plugin unusable (listed with the reason); a name that another
    class also claims makes that name unusable."""
