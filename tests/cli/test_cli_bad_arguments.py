"""A bad argument is a usage error (issue 53 item 6): one line ``PROG: error: ...`` on stderr and
exit status 2, as argparse does, not 1 (the demo's code for a failed check) nor a traceback."""

from __future__ import annotations

import pytest

from kvcache.cli import main


def usage_error(capsys, argv, prog) -> str:
    rc = main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert rc == 2, captured
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), captured.err
    assert captured.out == ""                                   # nothing ran
    return lines[0]


@pytest.mark.parametrize("disaggregate", [[], ["--disaggregate"]])
def test_demo_with_an_unknown_model_names_the_choices(capsys, disaggregate):
    line = usage_error(capsys, ["demo", *disaggregate, "--model", "BAD"], "kvcache demo")
    assert "--model 'BAD' is neither a model family" in line
    assert "llama" in line and "synthetic" in line and "checkpoint directory" in line


@pytest.mark.parametrize("disaggregate", [[], ["--disaggregate"]])
def test_demo_with_a_directory_that_is_no_checkpoint(tmp_path, capsys, disaggregate):
    line = usage_error(capsys, ["demo", *disaggregate, "--model", str(tmp_path)], "kvcache demo")
    assert "without a config.json" in line


def test_build_model_refuses_a_bad_name_as_a_usage_error():
    pytest.importorskip("transformers")
    from kvcache.cli_kit import UsageError
    from kvcache.demo.real import build_model
    with pytest.raises(UsageError, match="neither a model family"):
        build_model("BAD", 0)


def test_bench_device_without_a_backend_is_refused_not_ignored(capsys):
    line = usage_error(capsys, ["bench", "--device", "BAD"], "kvcache bench")
    assert "--device BAD applies to a backend's benchmarks" in line
