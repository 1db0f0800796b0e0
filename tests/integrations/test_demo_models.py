"""``kvcache demo --model FAMILY|PATH``: the serving workload on a real architecture, checked
against transformers' own generation."""

from __future__ import annotations

import pytest

from conftest import backend_or_skip, make_model, torch  # noqa: F401

from kvcache.demo import main
from kvcache.demo.real import build_parser, run

SMALL = ["--requests", "8", "--max-output", "16", "--long-prompt", "300", "--max-total-tokens",
         "384", "--max-batch-size", "6", "--prefill-chunk-size", "128", "--check-requests", "3",
         "--quiet", "--samples", "2"]


# the demo's code is the same for every family (the Engine on a transformers model): CI runs it
# on llama; gemma (head_dim 256, one KV head) runs with `make test-all`, and its attention is in
# CI in test_transformers_families.py
@pytest.mark.parametrize("family", ["llama", pytest.param("gemma", marks=pytest.mark.slow)])
def test_a_family_runs_every_feature_and_the_check_passes(family):
    r = run(build_parser().parse_args(["--model", family, "--backend", "reference"] + SMALL))
    assert r["ok"], r["failures"]
    assert r["backend"] == "reference" and r["checked"] >= 3
    s = r["stats"]
    assert s.preemptions > 0, "the small cache should preempt"
    assert s.forks > 0 and s.shared_prefix_tokens > 0      # parallel samples
    assert s.prefix_hit_tokens > 0                         # shared system prompts
    assert all(v > 0 for v in r["features"].values()), r["features"]
    assert all(d > 1 for d in r["distinct"]), "parallel samples should differ"


def test_a_checkpoint_directory_loads_without_network(tmp_path, capsys):
    model = make_model("qwen2", seed=4)
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    assert (tmp_path / "ckpt" / "config.json").exists()
    assert list((tmp_path / "ckpt").glob("*.safetensors"))
    rc = main(["--model", str(tmp_path / "ckpt"), "--backend", "reference"] + SMALL)
    out = capsys.readouterr().out
    assert rc == 0
    assert "qwen2 checkpoint" in out and "PASSED" in out


def test_an_unknown_model_name_is_refused():
    from kvcache.cli_kit import UsageError       # exit status 2 under `kvcache demo` (issue 53)
    with pytest.raises(UsageError, match="neither a model family"):
        main(["--model", "not-a-family-or-dir", "--backend", "reference"] + SMALL)


def test_the_demo_warms_the_engine_up_before_serving_and_splits_its_time(monkeypatch):
    """With whole-step graphs (the cuda backend's CPU test mode standing in for a GPU), the demo
    captures every kind of step before the first request: serving captures nothing, and the
    summary shows set-up, warm-up, serving and the check apart."""
    import kvcache.demo.real as real
    from kvcache.demo import build_parser as demo_parser
    from kvcache.demo import resolve, run_demo
    from kvcache.demo.report import rows, summary
    from kvcache.integrations.transformers import Engine
    backend, device = backend_or_skip("cuda", monkeypatch, 64)
    made = real.make_engine

    def with_graphs(opts, seed):
        engine, model, what, dtype = made(opts, seed)
        c = engine.config
        return (Engine(model, backend=backend, device=device, graphs=True, mixed_graphs=True,
                       page_size=c.page_size, max_total_tokens=c.max_total_tokens,
                       max_batch_size=c.max_batch_size, prefill_chunk_size=c.prefill_chunk_size),
                model, what, dtype)
    monkeypatch.setattr(real, "make_engine", with_graphs)
    opts = resolve(demo_parser().parse_args(["--model", "llama", "--backend", backend] + SMALL))
    r = run_demo(opts)
    assert r.check_ok, r.check.failures
    assert r.warm_up is not None and r.warm_up.captures > 0 and not r.warm_up.skipped
    assert r.stats.graph_captures == 0 and r.stats.graph_forwards == r.stats.forwards > 0
    text = dict(rows(r)[1])["time"]
    assert text.startswith("set-up ") and "warm-up" in text and "serving" in text \
        and "check" in text, text
    s = summary(r)
    assert s["warm_up"]["captures"] == r.warm_up.captures and s["setup_s"] > 0
