"""`twine check --strict` passes on every sdist and wheel (`make dist` builds the same), and the
example plugin ships as the plugin guide says: a distribution of its own, built from
docs/examples/kvcache-example."""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        return z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()


def test_every_distribution_builds_and_passes_twine_check(dists, run_checked):
    pytest.importorskip("twine", reason="`make` installs build and twine")
    assert set(dists) == {"kvcache", "kvcache_cuda", "kvcache_rocm", "kvcache_metal",
                          "kvcache_example"}
    files = [path for built in dists.values() for path in (built["sdist"], built["wheel"])]
    out = run_checked([sys.executable, "-m", "twine", "check", "--strict", *files])
    assert out.count("PASSED") == len(files) == 10 and "WARNING" not in out, out
    for name, built in dists.items():      # a README for the index page, and the license
        meta = _metadata(built["wheel"])
        assert "Description-Content-Type: text/markdown" in meta, name
        assert "License-Expression: Apache-2.0" in meta, name
        body = meta.split("\n\n", 1)[1]
        assert body.lstrip().startswith("# kvcache"), (name, body[:200])


def test_the_example_plugin_ships_where_the_guide_says(dists):
    """The guide's worked example is the distribution kvcache-example in
    docs/examples/kvcache-example: `make dist` builds it beside the others."""
    guide = (ROOT / "docs" / "plugin-guide.md").read_text()
    assert "docs/examples/kvcache-example" in guide and "`kvcache-example`" in guide
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("\ndist:"):].split("\n\n", 1)[0]
    assert "docs/examples/kvcache-example" in recipe and "twine check --strict" in recipe, recipe
    built = dists["kvcache_example"]
    assert built["wheel"].name.startswith("kvcache_example-")
    with zipfile.ZipFile(built["wheel"]) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert {"kvcache_example/plugin.py", "kvcache_example/backend.py"} <= set(names)
    assert re.search(r"^\[kvcache\]\nexample = kvcache_example\.plugin$", entry_points, re.M)
    readme = (ROOT / "docs" / "examples" / "kvcache-example" / "README.md").read_text()
    assert readme.strip() in _metadata(built["wheel"])      # its README is its index page
    with tarfile.open(built["sdist"]) as tar:      # the wheel above was built from this sdist
        assert any(n.endswith("kvcache_example-0.1.0/README.md") for n in tar.getnames())
