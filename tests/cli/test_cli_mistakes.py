"""Each command-line mistake ends in one line on stderr naming the fix and exit status 2, never a
traceback; a closed pipe ends quietly; --json gives machines the same data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcache.cli import main, readable


def one_line_error(capsys, argv, prog):
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_bench_with_an_unknown_backend_names_the_choices(capsys):
    line = one_line_error(capsys, ["bench", "--backend", "nope"], "kvcache bench")
    assert "unknown backend 'nope'" in line and "reference" in line and "kvcache info" in line


def test_a_typo_in_a_backend_name_gets_a_suggestion(capsys):
    line = one_line_error(capsys, ["bench", "--backend", "refrence"], "kvcache bench")
    assert "did you mean 'reference'?" in line


def test_bench_on_an_unavailable_backend_says_why_before_any_work(capsys):
    from kvcache.plugins import list_backends
    down = [r for r in list_backends() if not r["available"] and r["class"] is not None]
    if not down:
        pytest.skip("every registered backend is available on this machine")
    line = one_line_error(capsys, ["bench", "--backend", down[0]["name"]], "kvcache bench")
    assert "is not available" in line and capsys.readouterr().out == ""


def test_bench_on_a_backend_without_kernel_benchmarks(capsys):
    line = one_line_error(capsys, ["bench", "--backend", "reference"], "kvcache bench")
    assert "ships no kernel benchmarks" in line and "--host" in line


def test_demo_with_an_unknown_backend(capsys):
    line = one_line_error(capsys, ["demo", "--backend", "nope"], "kvcache demo")
    assert "unknown backend 'nope'" in line


def test_real_model_demo_with_an_unknown_backend(capsys):
    line = one_line_error(capsys, ["demo", "--model", "llama", "--backend", "nope"], "kvcache demo")
    assert "unknown backend 'nope'" in line


def test_demo_plot_into_a_missing_folder_fails_before_the_workload(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    line = one_line_error(capsys, ["demo", "--plot", str(tmp_path / "no" / "x.png")], "kvcache demo")
    assert "does not exist" in line


def test_demo_plot_without_matplotlib_fails_before_the_workload(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails
    line = one_line_error(capsys, ["demo", "--plot", "x.png"], "kvcache demo")
    assert "pip install 'matplotlib" in line and "'.[plot]'" in line


def test_conformance_without_pytest_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pytest", None)
    line = one_line_error(capsys, ["conformance", "--backend", "reference"], "kvcache conformance")
    assert "pip install '.[test]'" in line and "'pytest>=7'" in line


def test_conformance_with_an_unknown_backend(capsys):
    line = one_line_error(capsys, ["conformance", "--backend", "nope"], "kvcache conformance")
    assert "unknown backend 'nope'" in line


@pytest.mark.parametrize("argv", [["bench", "--repeat", "0"], ["bench", "--frob"],
                                  ["demo", "--requests", "0"], ["demo", "--scale", "-1"],
                                  ["info", "--frob"]])
def test_bad_option_values_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert [ln for ln in err.splitlines() if ": error: " in ln] and "Traceback" not in err


@pytest.mark.parametrize("command, options", [
    ("info", ["--device", "--json"]),
    ("bench", ["--host", "--backend", "--device", "--repeat", "--json"]),
])
def test_every_option_is_described(command, options, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    for option in options:
        described = [ln for ln in out.splitlines() if ln.strip().startswith(option)]
        assert described and len(described[0].split()) > 2, (option, out)


def test_info_prints_capabilities_readably(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "fused_rope_append:  no" in out and "fused_rope_append:False" not in out
    assert "tree_attention:     yes" in out
    caps = [ln for ln in out.splitlines() if ln.startswith("  ") and ":" in ln
            and not ln.strip().startswith("platform:")]
    assert caps and not any(ln.rstrip().endswith(("True", "False")) for ln in caps)


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    ref = next(r for r in rows if r["name"] == "reference")
    assert ref["available"] is True and ref["capabilities"]["tree_attention"] is True
    assert isinstance(ref["capabilities"]["dtypes"], list)


def test_bench_json(capsys):
    assert main(["bench", "--host", "--repeat", "5", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["numpy_call_us"] > 0 and {r["batch"] for r in data["rows"]} >= {1, 1024}


def test_demo_json_and_plain_table(capsys):
    small = ["--requests", "6", "--long-prompt", "120", "--max-output", "8", "--check-requests", "2",
             "--max-total-tokens", "512"]
    assert main(["demo", "--json", *small]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["backend"] == "reference" and data["check_ok"] is True
    assert data["finished"] == data["requests"] == 6 and data["stats"]["forwards"] > 0
    assert main(["demo", "--quiet", *small]) == 0      # capsys is no terminal: no box drawing
    out = capsys.readouterr().out
    assert "check:" in out and "PASSED" in out and not set("│┃━─┏") & set(out)


def test_demo_options_are_valid_in_every_mode_that_lists_them(capsys):
    pytest.importorskip("transformers")
    # --quiet is the disaggregated demo's too; --plot is refused there by a one-line error
    # (its own --help does not list it), and --shape is the synthetic model's
    from kvcache.demo.disaggregate import build_parser as disaggregate_parser
    assert disaggregate_parser().parse_args(["--disaggregate", "--quiet"]).quiet
    with pytest.raises(SystemExit):
        disaggregate_parser().parse_args(["--disaggregate", "--help"])
    assert "--plot" not in capsys.readouterr().out
    line = one_line_error(capsys, ["demo", "--disaggregate", "--plot", "x.png"], "kvcache demo")
    assert "--plot" in line and "leave out --plot" in line
    line = one_line_error(capsys, ["demo", "--model", "llama", "--shape", "tiny"], "kvcache demo")
    assert "--shape is the synthetic model's" in line


def test_a_closed_pipe_ends_quietly(tmp_path):
    """``kvcache info | head -3``: the reader is gone before the first write."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "kvcache.cli", "info"], stdout=w,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


def test_readable_values():
    assert readable(True) == "yes" and readable(False) == "no"
    assert readable(("a", "b")) == "a, b" and readable(None) == "-"
    assert readable(tuple(range(2, 1026, 2))) == "2..1024 (512 values)"
