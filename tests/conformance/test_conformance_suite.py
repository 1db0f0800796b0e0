"""The conformance suite on every available backend (see conftest.py): exactly what a plugin
author writes in their own tests, plus the backend parametrization of conftest.py."""

from kvcache.conformance import *  # noqa: F401,F403  the suite's test classes
