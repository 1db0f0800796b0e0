"""Base class of every conformance test class. The plugin recognises suite tests by it, so the
classes keep working when a plugin author imports them into their own test module."""


class Conformance:
    """Marker base class (no behaviour)."""
