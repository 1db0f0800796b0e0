"""The benchmark driver's Python paths on CPU (tiny shapes, fake CUDA events): catches errors in
setup, table and verdict code before the GPU run; the numbers themselves mean nothing here."""

import json

import pytest
import torch

import cuda_cases as cc


class FakeEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 0.01            # ms


@pytest.mark.skipif(cc.ON_GPU or cc.INTERPRET, reason="CPU smoke test of the bench driver")
def test_bench_driver_runs_end_to_end(monkeypatch, tmp_path, capsys):
    from kvcache_cuda import bench, bench_kit
    monkeypatch.setattr(bench, "DECODE_CASES", [(1, 40), (16, 20)])
    monkeypatch.setattr(bench, "PREFILL_CASES", [(2, 24)])
    monkeypatch.setattr(bench, "APPEND_TOKENS", [8])
    monkeypatch.setattr(bench, "FEATURE_CASES", [("decode", 2, 40), ("prefill-paged", 1, 24),
                                                 ("prefill-ragged", 1, 24)])
    monkeypatch.setattr(bench, "DECODE_TILES", bench.DECODE_TILES[:2])
    monkeypatch.setattr(bench, "PREFILL_TILES", bench.PREFILL_TILES[:2])
    monkeypatch.setattr(bench, "SPLITS", (1, 2))
    monkeypatch.setattr(bench, "SWEEP_DECODE", (2, 40))
    monkeypatch.setattr(bench, "SWEEP_PREFILL", (1, 24))
    monkeypatch.setattr(bench, "GRAPH_LAYERS", 2)
    monkeypatch.setattr(bench, "GRAPH_KV", 20)
    monkeypatch.setattr(bench, "GRAPH_BATCHES", (1, 2))
    monkeypatch.setattr(bench, "_kernel_time_us", lambda torch, fn: (fn(), 5.0)[1])
    monkeypatch.setattr(bench_kit, "FLUSH_BYTES", 1024)
    monkeypatch.setattr(bench_kit, "COPY_BYTES", 1 << 16)
    monkeypatch.setattr(bench, "FP8_DECODE", [(16, 40)])
    monkeypatch.setattr(bench, "FP8_PREFILL", [(1, 24)])
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    out = tmp_path / "bench.json"
    from kvcache_cuda.backend import CudaBackend
    rc = CudaBackend.run_benchmarks(["--device", "cpu", "--iters", "1", "--warmup", "0",
                                     "--json", str(out), "--sweep"])
    assert rc == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    kinds = {c["kind"] for c in data["cases"]}
    features = {f"{k}+{f}" for k in ("decode", "prefill-paged", "prefill-ragged")
                for f in ("softcap", "sinks")}
    fp8 = {"decode-fp8", "prefill-paged-fp8", "prefill-ragged-fp8"}
    assert kinds == {"decode", "prefill-paged", "prefill-ragged", "append-fused",
                     "append-unfused"} | features | fp8
    # decode x2, paged and ragged prefill, fused append, 6 softcap / sinks ratios, 3 fp8
    # ratios, graph replay, eager host time at B=1 (64 not run)
    assert len(data["verdicts"]) == 2 + 2 + 1 + 6 + 3 + 1 + 1
    assert any(v.startswith(("PASS decode B=16,L=20", "MISS decode B=16,L=20"))
               and v.endswith("of floor (target >= 0.95)") for v in data["verdicts"])
    assert any(v.startswith(("PASS paged prefill B=2,L=24", "MISS paged prefill B=2,L=24"))
               and v.endswith("of contiguous SDPA (target >= 0.95)") for v in data["verdicts"])
    assert any(v.startswith(("PASS ragged prefill B=2,L=24", "MISS ragged prefill B=2,L=24"))
               and v.endswith("of contiguous causal SDPA (target >= 0.95)")
               for v in data["verdicts"])
    assert any(v.startswith(("PASS decode-fp8 B=16,L=40", "MISS decode-fp8 B=16,L=40"))
               and v.endswith("of the fp8 floor (target >= 0.9)") for v in data["verdicts"])
    assert all(c["fp8_ratio"] > 0 for c in data["cases"] if c["kind"] in fp8)
    assert any(v.startswith(("PASS decode+sinks B=2,L=40", "MISS decode+sinks B=2,L=40"))
               and v.endswith("x plain (target <= 1.10)") for v in data["verdicts"])
    assert any("eager decode host B=1" in v and v.endswith("us/layer (target <= 30)")
               for v in data["verdicts"])
    assert all(r["host_us_per_layer"] > 0 for r in data["graphs"]) and "host us/layer" in text
    assert [r["batch"] for r in data["graphs"]] == [1, 2] and "CUDA-graph decode" in text
    assert any(v.endswith("(target <= 1.3)") for v in data["verdicts"])
    assert "# targets" in text and "sweep decode" in text and "best prefill" in text
    assert "sweep B=1 L=40 splits=2" in text and set(data["split_sweep"]) == {"L=40,splits=1", "L=40,splits=2"}
