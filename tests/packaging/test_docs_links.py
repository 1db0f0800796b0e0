"""The docs' links resolve (issue 53 item 7: docs split into a user guide, reference pages and a
lab record under docs/lab/): every relative Markdown link in docs/ (but docs/api, which
`mkdocs build --strict` checks) and the README names a file that exists and, with `#anchor`, a
heading of that file (GitHub's anchors); every path of a page under docs/ that the sources,
tests, tools and docs mention exists; the user guide's pages stay short and cite the lab
record."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOC_PATH = re.compile(r"\bdocs/[\w./-]+\.md\b")


def _markdown_pages():
    pages = [p for p in DOCS.rglob("*.md") if "api" not in p.relative_to(DOCS).parts[:1]]
    return sorted(pages + [ROOT / "README.md"])


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    kept, fence = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        kept.append("" if fence else line)
    return re.sub(r"`[^`]*`", "", "\n".join(kept))


def slug(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fence = set(), {}, False
    for line in page.read_text().split("\n"):
        if line.startswith("```"):
            fence = not fence
        elif not fence and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_anchor_rule_is_githubs():
    assert slug("Host overhead of `begin_forward` (issue 2)") == "host-overhead-of-begin_forward-issue-2"
    assert slug("The code's new shape costs no serving time (issue 52), H100, 2026-11-28") == \
        "the-codes-new-shape-costs-no-serving-time-issue-52-h100-2026-11-28"
    assert slug("5. Proving it: the conformance suite") == "5-proving-it-the-conformance-suite"


@pytest.mark.parametrize("page", _markdown_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    bad = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):            # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_every_docs_path_named_exists():
    sources = [ROOT / "README.md", ROOT / "Makefile", *_markdown_pages()]
    for folder in ("kvcache", "backends", "tests", "tools"):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh", ".md")
                    and not {"build", ".venv"} & set(p.parts)]
    missing = sorted({f"{p.relative_to(ROOT)}: {m}" for p in sources if p.is_file()
                      for m in DOC_PATH.findall(p.read_text(errors="replace"))
                      if not (ROOT / m).exists()})
    assert not missing, "\n".join(missing)


def test_the_user_guide_is_short_and_cites_the_lab_record():
    guide = sorted((DOCS / "guide").glob("*.md"))
    assert {p.stem for p in guide} >= {"serving", "prefix-caching", "quantized-kv", "two-gpus",
                                       "writing-a-backend"}
    for page in guide:
        text = page.read_text()
        assert len(text.splitlines()) <= 200, f"{page.name}: keep a guide page under 200 lines"
        assert "../lab/" in text, f"{page.name}: its numbers should link the lab record"
    start = (DOCS / "index.md").read_text()
    for page in guide:
        assert f"guide/{page.name}" in start, f"docs/index.md does not link guide/{page.name}"
    assert "lab/index.md" in start
