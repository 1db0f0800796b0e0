#!/usr/bin/env bash
# The API reference (mkdocs.yml, docs/api/), rendered from the docstrings; warnings fail it.
# `make docs` runs it in the .venv that make sets up (which has the tools below); tests/packaging/
# test_api_reference.py runs it in `make test`.
# It installs nothing: it needs, in the Python it runs (PYTHON, default .venv/bin/python):
#   python -m pip install 'mkdocs==1.6.1' 'mkdocstrings==1.0.8' 'mkdocstrings-python==2.0.11' 'griffelib==2.4.1'
# (Python >= 3.11.5 for these versions; griffe reads the sources without importing them, so
# torch, transformers and MLX are not needed.)
# Usage: tools/build_docs.sh [SITE_DIR]   (relative to the repository root; default build/docs;
#        open SITE_DIR/index.html). VERBOSE=1 shows the mkdocs log on success too.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
SITE=${1:-build/docs}
if ! "$PYTHON" -c 'import mkdocs, mkdocstrings, mkdocstrings_handlers.python' 2>/dev/null; then
    echo "tools/build_docs.sh: $PYTHON lacks mkdocs / mkdocstrings; install them with" >&2
    echo "  $PYTHON -m pip install 'mkdocs==1.6.1' 'mkdocstrings==1.0.8' 'mkdocstrings-python==2.0.11' 'griffelib==2.4.1'" >&2
    exit 2
fi
# --strict: every warning (a broken reference, an unknown object, a docstring naming a
# parameter the signature lacks, a page outside the nav) is an error. Quiet on success: the
# log is shown when the build fails (or with VERBOSE=1).
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "$PYTHON" -m mkdocs build --strict --clean --site-dir "$SITE" --config-file mkdocs.yml \
        >"$log" 2>&1; then
    cat "$log" >&2
    echo "tools/build_docs.sh: the API reference did not build (warnings are errors)" >&2
    exit 1
fi
if [ -n "${VERBOSE:-}" ]; then cat "$log"; fi
echo "API reference: $SITE/index.html"
