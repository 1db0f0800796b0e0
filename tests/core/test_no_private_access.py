"""Nothing outside the ``kvcache`` package touches a private attribute of a cache: backends,
tools, examples and tests go through its public API (``open_plan``, ``layers_run``,
``rerun_layers``, ``mark_layers_run``, ``forward_aux``, ``planner``, ``state``)."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# ``cache._x``, ``self.cache._x``, ``graph_cache._x``, ``t.a._x`` (a cache named a/b in twins)
PRIVATE = re.compile(r"\b(?:\w*cache|dut|ref|t\.a|t\.b)\._[a-zA-Z]\w*")


def test_no_code_outside_kvcache_reads_a_private_cache_attribute():
    hits = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if (rel.parts[0] in ("kvcache", ".venv", "build") or "site-packages" in rel.parts
                or path == Path(__file__).resolve()):
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            for m in PRIVATE.finditer(code):
                if not m.group(0).split(".")[-1].startswith("__"):
                    hits.append(f"{rel}:{n}: {m.group(0)}")
    assert not hits, "private cache attributes used outside kvcache:\n" + "\n".join(hits)


def test_the_pattern_catches_private_access():
    assert PRIVATE.search("x = self.cache._plan")
    assert PRIVATE.search("cache._layers_done = set()")
    assert not PRIVATE.search("cache.open_plan")
