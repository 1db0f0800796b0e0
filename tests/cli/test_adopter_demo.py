"""Issue 30, finding 6 (the demo's rough edges), as a new user meets them:

* every option ``kvcache demo --help`` lists works in every mode the help offers it for: the
  single-engine options with the synthetic and the real models (``--plot`` with ``--model``;
  ``--shape`` is said to be the synthetic model's), and ``--disaggregate`` takes what its own
  ``--help`` lists (``--quiet`` included) and names a single-engine option it is given;
* the capacity error is consistent: the pages a request needs are more than the cache holds,
  and the ``--max-total-tokens`` it suggests runs (it said "2 of 2 pages free; the next request
  needs 1 pages ... needs more pages than the cache holds");
* the plot has integer ticks (counts, steps) and its legends outside the data.
"""

from __future__ import annotations

import argparse
import re

import pytest

from kvcache.cli import main
from kvcache.demo import build_parser, check_plot_prerequisite, resolve
from kvcache.demo.disaggregate import build_parser as disaggregate_parser

SMALL = ["--backend", "reference", "--requests", "6", "--long-prompt", "120", "--max-output", "8",
         "--check-requests", "1", "--quiet"]
# a valid value for an option that takes one and has no choices
VALUES = {"--backend": "reference", "--device": "cpu", "--model": "llama"}


def one_line_error(capsys, argv, prog="kvcache demo") -> str:
    rc = main(["demo", *argv])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def listed(parser: argparse.ArgumentParser, tmp_path) -> dict[str, list[str]]:
    """Every option the parser's --help lists, with the arguments that give it a valid value."""
    out = {}
    for action in parser._actions:
        flag = max(action.option_strings, key=len, default=None)
        if flag is None or isinstance(action, argparse._HelpAction):
            continue
        if action.nargs == 0:
            out[flag] = [flag]
        elif action.choices:
            out[flag] = [flag, str(list(action.choices)[0])]
        elif flag == "--plot":
            out[flag] = [flag, str(tmp_path / "demo.png")]
        else:
            out[flag] = [flag, VALUES.get(flag, "2")]
    return out


@pytest.mark.parametrize("model", ["synthetic", "llama"])
def test_every_listed_option_is_valid_with_both_models(model, tmp_path):
    """Parsed and resolved as ``kvcache demo`` does before any work; the only option refused
    with a real model is --shape, and its help says whose it is."""
    from kvcache.cli import UsageError
    refused = {}
    for flag, args in listed(build_parser(), tmp_path).items():
        if flag in ("--disaggregate", "--model"):      # another demo; the mode itself
            continue
        opts = build_parser().parse_args(["--model", model, *args])
        try:
            resolve(opts)
            if flag == "--plot" and model == "llama":      # old code: --model refused --plot
                pytest.importorskip("matplotlib")
                check_plot_prerequisite(opts.plot)
        except UsageError as exc:
            refused[flag] = str(exc)
    if model == "synthetic":
        assert refused == {}, refused
    else:
        assert set(refused) == {"--shape"}, refused
        assert "synthetic model's" in refused["--shape"]
        shape = next(a for a in build_parser()._actions if "--shape" in a.option_strings)
        assert "the synthetic model's" in shape.help and "not a real model's" in shape.help


def test_the_help_says_which_options_disaggregate_takes(tmp_path, capsys):
    """``--disaggregate`` is another demo: the main --help says so, its own --help lists what it
    takes (--quiet among them: old code refused it), each of those parses, and a single-engine
    option it does not take ends in one line naming it."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--disaggregate runs another demo, with options of its own" in text
    assert "`kvcache demo --disaggregate --help`" in text
    own = listed(disaggregate_parser(), tmp_path)
    assert {"--quiet", "--json", "--requests", "--model"} <= set(own)
    for flag, args in own.items():
        parsed = disaggregate_parser().parse_args(
            (["--disaggregate"] if flag != "--disaggregate" else []) + args)
        assert parsed.disaggregate
    assert disaggregate_parser().parse_args(["--disaggregate", "--quiet"]).quiet
    single = listed(build_parser(), tmp_path)
    others = sorted(set(single) - set(own))
    assert "--plot" in others and "--samples" in others
    for flag in others:
        line = one_line_error(capsys, ["--disaggregate", *single[flag]])
        assert flag in line and ("single-engine" in line), line


def test_the_capacity_error_is_consistent_and_its_fix_runs(capsys):
    line = one_line_error(capsys, SMALL + ["--max-total-tokens", "32"])
    assert "pages free" not in line          # old: "2 of 2 pages free; ... needs 1 pages ..."
    m = re.search(r"need (\d+) pages of (\d+) tokens, more than the whole cache holds \((\d+) "
                  r"pages?, --max-total-tokens 32; its (\d+) pages less the 1 kept spare\); "
                  r"raise --max-total-tokens to at least (\d+)", line)
    assert m, line
    need, page, holds, total, suggested = map(int, m.groups())
    assert page == 16 and need > holds and total == holds + 1, line
    # the largest request is named, so the suggestion fits every request: the run finishes
    assert main(["demo", *SMALL, "--max-total-tokens", str(suggested)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "requests:" in out
    # one page less than suggested (and a margin) still fails, naming the same need
    line = one_line_error(capsys, SMALL + ["--max-total-tokens", str(suggested - 2 * page)])
    assert f"need {need} pages" in line, line


def test_the_plot_has_integer_ticks_and_legends_outside_the_data(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure
    figures = []
    save = Figure.savefig

    def keep(fig, *args, **kwargs):
        figures.append(fig)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", keep)
    png = tmp_path / "demo.png"
    # a short run: a few requests, so that the counts span a handful of values (where
    # matplotlib's default locator puts ticks at 0.5, 1.5, ...)
    assert main(["demo", *SMALL, "--requests", "3", "--max-total-tokens", "512", "--plot",
                 str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)          # the figure was closed: draw it again, as saved
    canvas.draw()
    renderer = canvas.get_renderer()
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert len(axes) == 3
    for ax in axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            ticks = [t for t in axis.get_ticklocs() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_ylabel(), ticks)
        legend = ax.get_legend()
        assert legend is not None
        box = legend.get_window_extent(renderer)
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_ylabel()
        assert fig.bbox.contains(box.x1 - 1, box.y0 + 1), "legend cut off by the figure's edge"
