"""Issue 53, item 4: every ```python block of the README runs as pasted, each in a fresh Python
of this environment (the CPU: the reference backend), from an empty folder; and the README's
set-up section is the two commands.

(The first block also runs from the installed wheels in tests/packaging/test_wheels.py.)"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
# what each block must print, so that a block cut short (or printing nothing) fails too
PRINTS = {
    0: r"^\(5, 8, 64\) 5 \d+$",                            # the cache: out's shape, the fork's length
    1: r"^\[\[\[(\d+, ){7}\d+\]\], \[\[(\d+, ){7}\d+\]\]\]$",  # generate: 2 prompts x 1 sample x 8
}
# appended to each block: which backend its cache ran on (the reference one, on this CPU)
BACKEND = """
for _name in ("cache", "engine"):
    if _name in globals():
        _c = globals()[_name]
        print("BACKEND", getattr(_c, "cache", _c).backend.name)
        break
"""


def test_the_readme_has_its_snippets():
    assert len(BLOCKS) == len(PRINTS), f"{len(BLOCKS)} python blocks: give each its PRINTS line"
    assert "engine = Engine(model)" in BLOCKS[1] and "LlamaForCausalLM(" in BLOCKS[1]


def _needs(index) -> tuple:
    if re.search(r"^from transformers import|^import torch", BLOCKS[index], re.M):
        return ("numpy", "torch", "transformers")
    return ("numpy",)


# Each block's fresh Python starts when collection ends and runs on CI's second core beside the
# session (tests/cuda/background_runs.py; at once, in the test, where that queue does not run),
# each in an empty folder of its own.
sys.path.append(str(ROOT / "tests" / "cuda"))          # tests/ has no packages
import background_runs  # noqa: E402

_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVCACHE_PLUGINS")}
_ENV.update(CUDA_VISIBLE_DEVICES="", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
_FOLDERS = {i: tempfile.mkdtemp(prefix=f"readme-block-{i}-") for i in range(len(BLOCKS))}
for _folder in _FOLDERS.values():          # (each test removes its own; these the deselected)
    atexit.register(shutil.rmtree, _folder, True)
for _i, _block in enumerate(BLOCKS):
    background_runs.register(f"test_a_python_block_runs_as_pasted[{_i}]",
                             [sys.executable, "-W", "error::FutureWarning", "-c", _block + BACKEND],
                             _ENV, cwd=_FOLDERS[_i], timeout=300, needs=_needs(_i))


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_python_block_runs_as_pasted(index):
    for module in _needs(index):
        pytest.importorskip(module)
    try:
        proc = background_runs.result(f"test_a_python_block_runs_as_pasted[{index}]")
    finally:
        shutil.rmtree(_FOLDERS[index], ignore_errors=True)
    out = proc.stdout
    assert proc.returncode == 0, f"README python block {index + 1}:\n{BLOCKS[index]}\n" \
                                 f"{out[-3000:]}{proc.stderr[-5000:]}"
    lines = out.splitlines()
    assert lines[-1] == "BACKEND reference", out[-2000:]
    assert re.match(PRINTS[index], lines[-2]), (PRINTS[index], out[-2000:])


def test_the_set_up_section_is_two_commands():
    section = README.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```\n(.*?)^```", section, re.S | re.M).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"], commands
    assert section.count("```") == 2, "one command block in the set-up section"
