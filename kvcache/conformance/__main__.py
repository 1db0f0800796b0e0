"""``python -m kvcache.conformance --backend NAME ...`` (same as ``kvcache conformance``)."""

import sys

from kvcache.cli_kit import guarded

from .cli import main

sys.exit(guarded("kvcache conformance", main, sys.argv[1:]))
