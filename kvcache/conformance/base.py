"""Base class of every conformance test class: carries the marker the plugin keys on, so the
classes keep working when a plugin author imports them into their own test module."""

import pytest


class Conformance:
    pytestmark = [pytest.mark.kvcache_conformance]
