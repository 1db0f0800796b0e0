"""``kvcache bench --transfer`` on CPUs (gloo, two processes): it moves the whole sequence and
prints both bandwidths and their ratio against the target."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvcache.bench import main as bench_main  # noqa: E402
from kvcache.bench.transfer import measure  # noqa: E402


def test_measure_moves_the_whole_sequence():
    r = measure("cpu", "reference", tokens=40, layers=3, repeat=2, kv_heads=2, head_dim=16,
                batch=5)
    assert r["received_shape"] == [3, 40, 2, 16]            # every layer, every token arrived
    b = r["batch_row"]                                      # five sequences in one call
    assert b["sequences"] == 5 and b["tokens"] == 200 and b["bit_exact"] is True
    assert b["received_shape"] == [3, 40, 2, 16] and b["ratio"] > 0
    assert r["bit_exact"] is True                           # and the same bits as the source
    assert r["bytes"] == 40 * 3 * 2 * 2 * 16 * 4
    assert r["kv_s"] > 0 and r["plain_s"] > 0
    assert r["ratio"] == pytest.approx(r["plain_s"] / r["kv_s"])
    assert r["unverified_s"] > 0 and "verify=False" not in r           # a column, not a mode


@pytest.mark.slow       # the table's path; CI runs the one-size bench below
def test_a_table_of_sizes_moves_each_sequence_whole():
    r = measure("cpu", "reference", tokens=[3, 40], layers=3, repeat=1, kv_heads=2, head_dim=16)
    assert [row["received_shape"] for row in r["rows"]] == [[3, 3, 2, 16], [3, 40, 2, 16]]
    assert all(row["bit_exact"] for row in r["rows"])
    assert r["ratio"] == min(row["ratio"] for row in r["rows"])


def test_cli_prints_the_ratio_and_json(capsys, monkeypatch):
    # one measurement (two spawned ranks, most of this test's time on 2 cores) for both forms:
    # the table is printed from it, then the same result as --json
    from kvcache.bench import transfer
    measured, real_measure = [], transfer.measure

    def measure_once(*args, **kw):
        if not measured:
            measured.append((args, kw, real_measure(*args, **kw)))
        assert (args, kw) == measured[0][:2]           # the JSON run asks for the same sizes
        return measured[0][2]

    monkeypatch.setattr(transfer, "measure", measure_once)
    argv = ["--transfer", "--transfer-tokens", "32", "--transfer-layers", "2", "--transfer-repeat", "2"]
    assert bench_main(argv) == 0
    out = capsys.readouterr().out
    assert "send/recv ms" in out and "plain send ms" in out
    assert "(target >= 0.8)" in out and "host tier (" in out and "checksums kept" in out
    assert "sent layer by layer from inside it" in out and "bit for bit: yes" in out
    assert bench_main(argv + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens"] == 32 and r["layers"] == 2 and r["received_shape"][1] == 32
    assert r["host_tier"]["tokens"] == 32 and r["host_tier"]["offload_s"] > 0
    assert r["pipelined"]["bit_exact"] is True and r["pipelined"]["during_s"] > 0


def test_bad_sizes_are_usage_errors():
    from kvcache.cli import UsageError
    with pytest.raises(UsageError, match="--transfer-tokens"):
        bench_main(["--transfer", "--transfer-tokens", "0"])
