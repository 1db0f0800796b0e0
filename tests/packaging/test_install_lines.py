"""Install lines work from a clone: kvcache and its backends are not on PyPI, so a line that asks
pip for them by name (`pip install 'kvcache[transformers]'`, `pip install kvcache-cuda`) fails in a
fresh venv unless it points pip at wheels (`--find-links`). The docs and every message of the
sources say a line that works: the extra's own requirements, or `pip install '.[EXTRA]'` in the
clone; and every extra they name exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:      # Python 3.10
    tomllib = pytest.importorskip("tomli")

from kvcache.integrations import MissingExtraError, install_hint, require

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

# one pip command: up to the end of the line, a backtick, a comment, a parenthesis or a shell
# separator
COMMAND = re.compile(r"\bpip3?\s+install\b(?P<args>[^`#\n;&|(]*)")
# an argument that names kvcache or one of its backends as a package, not a path: kvcache,
# 'kvcache[transformers]', "kvcache-cuda>=0.1", 'kvcache[{extra}]' ...
BY_NAME = re.compile(r"""(?:^|\s)['"]?kvcache(?:-[a-z]+)?(?:\[[^\]\s]*\])?(?:[<>=!~][^\s'"]*)?['"]?(?=[\s)'",.:]|$)""")
# files still being fixed: reported, not failed on, until they are clean (issue 30 emptied it)
PENDING: set[str] = set()
# what an adopter reads or runs: the docs, the sources' messages, the backends' own README text
# (their pyproject) and scripts, the example plugin, the Makefile and the tools
SCANNED = ("README.md", "docs/**/*.md", "kvcache/**/*.py", "backends/*/kvcache_*/**/*.py",
           "backends/*/pyproject.toml", "backends/**/*.sh", "backends/**/*.md",
           "docs/examples/**/*.py", "docs/examples/**/*.toml", "Makefile", "tools/*.sh")


def _sources():
    seen = set()
    for pattern in SCANNED:
        for p in sorted(ROOT.glob(pattern)):
            skip = {"build", ".venv", "node_modules"} & set(p.relative_to(ROOT).parts) \
                or any(part.endswith(".egg-info") for part in p.parts)
            if p.is_file() and not skip and p not in seen:
                seen.add(p)
                yield p


def _bad_lines_in(text: str, where: str = "") -> list[str]:
    bad, number = [], 0
    for line in text.splitlines():
        start, number = number + 1, number + 1 + line.count("\0")   # \0: a line joined to it
        line = line.replace("\0", "")
        for command in COMMAND.finditer(line):
            args = command.group("args")
            if BY_NAME.search(args) and not re.search(r"(^|\s)(--find-links|-f)\b", args):
                bad.append(f"{where}:{start}: {line.strip()}")
    return bad


def _bad_lines(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix == ".py":     # "a string " "continued" on the next line reads as one
        text = re.sub(r"""["']\s*\n\s*f?["']""", lambda m: "\0" * m.group(0).count("\n"), text)
    return _bad_lines_in(text, path.relative_to(ROOT).as_posix())


def test_the_pattern_finds_what_fails():
    def bad(line):
        return bool(BY_NAME.search(COMMAND.search(line).group("args")))
    for line in ("pip install 'kvcache[transformers]'", 'raise X(f"... pip install \'kvcache[{extra}]\'")',
                 "pip install -U 'kvcache[transformers]')", "pip install kvcache", "`pip install kvcache-cuda`",
                 "(pip install 'kvcache[cuda]', or a CUDA build"):
        assert bad(line), line
    for line in ("pip install '.[transformers]'", "pip install . ./backends/cuda",
                 "pip install -e docs/examples/kvcache-example", "pip install 'torch>=2.4'",
                 "pip install -e . -e backends/cuda && kvcache conformance --backend rocm"):
        assert not bad(line), line


def test_no_install_line_asks_pip_for_kvcache_by_name():
    bad = [line for path in _sources() if path.relative_to(ROOT).as_posix() not in PENDING
           for line in _bad_lines(path)]
    assert not bad, "kvcache is not on PyPI; say pip install '.[EXTRA]' (in the clone) " \
                    "or name the requirements:\n" + "\n".join(bad)


def test_the_scan_covers_the_docs_the_sources_and_the_backends():
    scanned = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert not PENDING, "every file is clean now: fix a new bad line rather than listing its file"
    for must in ("README.md", "docs/plugin-guide.md", "docs/integrations.md", "kvcache/cli.py",
                 "kvcache/integrations/transformers/__init__.py", "kvcache/distributed/tp.py",
                 "kvcache/demo/__init__.py", "kvcache/conformance/cli.py",
                 "backends/cuda/kvcache_cuda/backend.py", "backends/metal/kvcache_metal/backend.py",
                 "backends/cuda/pyproject.toml", "docs/examples/kvcache-example/pyproject.toml"):
        assert must in scanned, must
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert docs and docs <= scanned, docs - scanned


def test_every_extra_the_sources_and_docs_name_exists():
    named = set()
    for path in _sources():
        text = path.read_text()
        named |= set(re.findall(r"""\brequire\([^()]*?,\s*["']([\w-]+)["']""", text))   # require(mod, extra)
        named |= set(re.findall(r"""pip3? install [^\n`]*?['"]\.\[([\w,-]+)\]['"]""", text))
    named = {extra for group in named for extra in group.split(",")}
    assert {"transformers", "mlx-lm", "distributed"} <= named, named
    assert named <= set(EXTRAS), named - set(EXTRAS)
    assert {"transformers", "mlx-lm", "test", "distributed", "demo", "plot"} <= set(EXTRAS)


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_install_hint_works_without_pypi_knowing_kvcache(extra):
    hint = install_hint(extra)
    assert hint.startswith("pip install ") and not _bad_lines_in(hint), hint
    for req in EXTRAS[extra]:
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
        if name.startswith("kvcache-"):      # a backend: its folder in the clone
            folder = f"./backends/{name.removeprefix('kvcache-')}"
            assert folder in hint and (ROOT / folder / "pyproject.toml").exists(), hint
        else:
            assert f"'{req}'" in hint or f"'.[{extra}]'" in hint, hint


def test_require_names_a_line_that_works():
    with pytest.raises(MissingExtraError) as info:
        require("kvcache_no_such_module", "transformers", "5.17")
    message = str(info.value)
    assert "'kvcache_no_such_module' package >= 5.17" in message
    assert "in a kvcache clone: pip install '.[transformers]'" in message
    assert "'transformers>=5.17'" in message and "'torch>=2.4'" in message
    assert "'kvcache[" not in message, message
