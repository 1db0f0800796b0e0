"""``kvcache bench --serving``: the whole command at tiny sizes on the CPU (structure, not
speed)."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcache.bench_serving import tail_busy, union_length  # noqa: E402
from kvcache.cli import main  # noqa: E402

TINY = ["bench", "--serving", "--model", "llama", "--tiny", "--device", "cpu", "--layers", "1",
        "--batch", "2"]


# The bare `--tiny --json` run (every system, the JSON report) is asserted on in
# test_bench_serving_tiny.py: one run of that command serves all its tests (it was run twice, once
# here in-process and once there in a fresh process).


def test_serving_table_says_what_was_skipped(capsys, monkeypatch):
    # the cuda backend in its CPU test mode, as (a) runs on a GPU
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c",
                        "--backend", "cuda"]) == 0
    out = capsys.readouterr().out
    rows = {ln[:3]: ln for ln in out.splitlines() if ln[:3] in ("(a)", "(b)", "(c)")}
    assert set(rows) == {"(a)", "(b)", "(c)"}
    assert "skipped: --skip" in rows["(b)"] and "skipped: --skip" in rows["(c)"]
    assert "skipped" not in rows["(a)"] and "(cuda, rope=cache)" in rows["(a)"] and "(roofline)" in out
    # a smoke run's ratios are not held against the GPU targets
    assert "targets: not judged on a --tiny smoke run" in out and "MISSED" not in out


def test_serving_rejects_an_unknown_system_to_skip(capsys):
    assert main(TINY + ["--skip", "a,d"]) == 2
    assert "unknown system(s) d" in capsys.readouterr().err


def test_union_length_counts_overlaps_once():
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    assert union_length([]) == 0


def test_serving_on_a_missing_gpu_says_so_before_any_work(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert main(["bench", "--serving", "--device", "cuda"]) == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err


def test_tail_busy_is_the_covered_share_of_the_last_window():
    spans = [(0, 10), (10, 12), (14, 15), (18, 20)]      # the last 10: 12..14 and 15..18 idle
    assert tail_busy(spans, 10) == pytest.approx(0.5)
    assert tail_busy(spans, 2) == pytest.approx(1.0)
    assert tail_busy(spans + [(11, 19)], 10) == pytest.approx(1.0)    # overlaps count once
    assert tail_busy([], 5) is None and tail_busy(spans, 0) is None


@pytest.mark.parametrize("rope", ["cache", "model"])
def test_serving_rope_option_picks_who_rotates_in_a(capsys, monkeypatch, rope):
    # (a) runs inside the cache's fused RoPE by default (--rope cache), outside it with --rope model
    from kvcache.integrations import transformers as kvt
    monkeypatch.setenv("KVCACHE_CUDA_CPU", "1")
    entered = []
    real = kvt.fused_rope
    # patched where TransformersAdapter.session looks it up
    monkeypatch.setattr(kvt.adapter, "fused_rope",
                        lambda model, cache: entered.append(1) or real(model, cache))
    extra = [] if rope == "cache" else ["--rope", "model"]
    assert main(TINY + ["--requests", "2", "--new-tokens", "3", "--skip", "b,c", "--backend",
                        "cuda", "--json"] + extra) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["workload"]["a_rope"] == rope and res["systems"]["a"]["tokens"] == 2 * 3
    assert bool(entered) == (rope == "cache")
