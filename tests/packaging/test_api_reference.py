"""The API reference builds (``make docs`` = ``tools/build_docs.sh``: mkdocs + mkdocstrings,
``--strict``, so any warning fails it) and its pages hold the objects they are for, rendered
from their docstrings (issue 30). The build reads the sources with griffe and imports nothing,
so it takes seconds."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.tools      # `make build-check` runs it once; `make test` leaves it out
# page -> objects it must render (mkdocstrings gives each a heading with the full path as id)
PAGES = {
    "index.html": [],
    "cache.html": ["kvcache.cache.PagedKVCache", "kvcache.config.CacheConfig",
                   "kvcache.cache.PagedKVCache.begin_forward"],
    "backends.html": ["kvcache.backend.Backend"],
    "integrations.html": ["kvcache.integrations.sampling.SamplingParams",
                          "kvcache.integrations.engine.Engine"],
    "serving.html": ["kvcache.serving.core.EngineCore", "kvcache.serving.request.Request.hold_kv"],
    "conformance.html": ["kvcache.conformance.test_forward.TestPrefill"],
    "transfer.html": [],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs tools: make installs them")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "build_docs.sh"), str(out)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


def test_the_build_is_strict():
    """Warnings fail the build: the script passes ``--strict`` and the config says so too."""
    assert "mkdocs build --strict" in (ROOT / "tools" / "build_docs.sh").read_text()
    assert "\nstrict: true\n" in (ROOT / "mkdocs.yml").read_text()


@pytest.mark.parametrize("page", sorted(PAGES))
def test_pages_render_their_objects(site, page):
    html = (site / page).read_text()
    missing = [name for name in PAGES[page] if f'id="{name}"' not in html]
    assert not missing, f"{page} does not render {missing}"


def test_pages_show_the_docstrings(site):
    """The docstrings' text reaches the pages (``code`` rendered as code), not only the names:
    a class docstring and a field's attribute docstring."""
    cache = (site / "cache.html").read_text()
    assert "A paged KV cache for <code>config.num_layers</code> attention layers" in cache
    serving = (site / "serving.html").read_text()
    assert "Its sequence stays in the cache when it finishes" in serving
