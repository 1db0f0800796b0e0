"""Helpers of the tests that run the conformance suite in a subprocess and read what it printed:
pytest's own final line, the summary table, and the plugin guide's snippets."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "plugin-guide.md"


def clean_env(**extra) -> dict:
    """The environment of a fresh shell: no pytest or suite settings inherited from this run."""
    env = dict(os.environ)
    for key in list(env):
        if key.startswith(("PYTEST_", "KVCACHE_CONFORMANCE_")) or key in (
                "KVCACHE_EXAMPLE_BROKEN", "KVCACHE_PLUGINS", "KVCACHE_TEST_BACKENDS"):
            del env[key]
    if extra.get("PYTHONPATH") and env.get("PYTHONPATH"):      # added to, not replaced
        extra = dict(extra, PYTHONPATH=os.pathsep.join((str(extra["PYTHONPATH"]), env["PYTHONPATH"])))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, cwd, timeout=600, **env):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=str(cwd),
                          env=clean_env(**env), timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


def pytest_counts(out: str) -> dict:
    """pytest's own final line ("2 failed, 68 passed, 1 error in 3.1s") -> {category: n}, in the
    summary's words (``error``), without ``deselected`` and ``warnings`` (not outcomes)."""
    lines = [line for line in out.splitlines()
             if re.search(r"\d+ (passed|failed|errors?|skipped|xfailed|xpassed)\b", line)
             and re.search(r" in [\d.]+s", line)]
    assert lines, out[-3000:]
    got = {}
    for n, word in re.findall(r"(\d+) (\w+)", lines[-1].split(" in ")[0]):
        word = "error" if word == "errors" else word
        if word not in ("deselected", "warnings", "warning"):
            got[word] = int(n)
    return got


def summary_tables(out: str) -> dict:
    """{backend: {area: {column: n}}} from the printed summary tables (``total`` included)."""
    lines = out.splitlines()
    tables = {}
    for i, line in enumerate(lines):
        m = re.match(r"backend '([^']+)' on ", line)
        if not m:
            continue
        columns = lines[i + 1].split()[1:]
        rows = {}
        for row in lines[i + 2:]:
            cells = row.split()
            if len(cells) != len(columns) + 1 or not all(c.isdigit() for c in cells[1:]):
                break
            rows[cells[0]] = dict(zip(columns, map(int, cells[1:])))
        tables[m.group(1)] = rows
    return tables


def nonzero(counts: dict) -> dict:
    """``counts`` with the summary's column names in pytest's words and the zeros left out."""
    return {("xfailed" if k == "xfail" else k): v for k, v in counts.items() if v}


def verdicts(out: str) -> list[str]:
    return re.findall(r"^\s*verdict: (.*)$", out, re.M)


# ---------------------------------------------------------------------------- the plugin guide
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"#\s*(\S+\.(?:py|toml|txt))\s*$")


def guide_files(text: str | None = None) -> dict:
    """{relative path: content} of the guide's code blocks that name a file in a first-line
    comment (``# pyproject.toml``, ``# kvcache_mydevice/backend.py``, ...): the files of the
    plugin the guide walks through. A path named twice is an error."""
    text = GUIDE.read_text() if text is None else text
    files = {}
    for _lang, body in FENCE.findall(text):
        first = body.split("\n", 1)[0]
        m = MARKER.fullmatch(first.strip())
        if m:
            path = m.group(1)
            assert path not in files, f"the guide has two blocks for {path}"
            files[path] = body
    return files


def guide_commands(text: str | None = None) -> list[str]:
    """The guide's shell lines (``$ ...`` in console blocks)."""
    text = GUIDE.read_text() if text is None else text
    return [line[2:].strip() for lang, body in FENCE.findall(text) if lang == "console"
            for line in body.splitlines() if line.startswith("$ ")]


def write_files(files: dict, where: Path) -> Path:
    for rel, content in files.items():
        path = where / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return where


def install_target(project: Path, target: Path) -> None:
    """``pip install`` the project into the folder ``target`` (on PYTHONPATH it is the plugin
    installed: its entry point is found there), offline, without touching this venv."""
    rc, out = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                   "--no-index", "--no-cache-dir", "--disable-pip-version-check", "-q",
                   "--target", target, project], project, timeout=300)
    assert rc == 0, f"pip install of the guide's plugin failed:\n{out[-4000:]}"
