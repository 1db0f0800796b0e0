"""Issue 30, finding 6 (`kvcache info` took 1.2-2.1 s: it imported torch and MLX): `kvcache info` is
lazy now and `--check` imports them to check availability. The docs that show what
`kvcache info` lists say so, and name `--check` next to it; the option they name exists.
(tests/cli/test_cli_info.py proves the laziness itself, by the modules a listing imports.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcache.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
# where a reader learns what `kvcache info` shows: the README and the plugin guide
DOCS = ["README.md", "docs/plugin-guide.md"]


def blocks(text: str) -> list[str]:
    """Paragraphs and fenced blocks, each whitespace-normalised."""
    out, fence, current = [], False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        if not line.strip() and not fence:
            if current:
                out.append(" ".join(" ".join(current).split()))
            current = []
        else:
            current.append(line)
    if current:
        out.append(" ".join(" ".join(current).split()))
    return out


def showing_info(text: str) -> list[str]:
    """The blocks that show `kvcache info` or say what it lists (the capabilities alone need no
    --check: "the capabilities that `kvcache info` prints" is right as it is)."""
    return [b for b in blocks(text)
            if re.search(r"\$ kvcache info\b|`kvcache info` lists", b)]


@pytest.mark.parametrize("doc", DOCS)
def test_where_the_docs_show_kvcache_info_they_name_check(doc):
    shown = showing_info((ROOT / doc).read_text())
    assert shown, f"{doc} no longer shows `kvcache info`"
    for block in shown:
        assert "kvcache info --check" in block, f"{doc}: `kvcache info` without --check: {block}"
        if not block.startswith("```"):       # the prose says what plain `kvcache info` skips
            assert "unchecked" in block, f"{doc}: what plain `kvcache info` leaves out: {block}"


def test_the_documented_option_exists(capsys):
    info = next(a for a in build_parser()._actions if hasattr(a, "choices") and
                isinstance(a.choices, dict) and "info" in a.choices).choices["info"]
    check = next(a for a in info._actions if "--check" in a.option_strings)
    assert "torch" in check.help and "availability" in check.help
    assert info.parse_args(["--check"]).check and not info.parse_args([]).check
