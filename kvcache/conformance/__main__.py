"""``python -m kvcache.conformance --backend NAME ...`` (same as ``kvcache conformance``)."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
