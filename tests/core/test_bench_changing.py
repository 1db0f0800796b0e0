"""``kvcache bench --host``'s changing-batch cases run the general planner path and report each
target ratio (no timing is asserted)."""

from kvcache.bench import host


def test_changing_batch_rows_cover_every_case_and_report_target_ratios(capsys):
    rows = host.changing_bench(repeat=10, batches=(16, 64))
    assert [(r["case"], r["batch"]) for r in rows] == [
        (case, batch) for case in host.CHANGING_CASES for batch in (16, 64)]
    for r in rows:
        # a shared prefix is its own block depth; without one, one depth
        assert r["depths"] == (1 if r["case"] == "join_leave" else 2), r
        assert r["best_round_us"] > 0 and r["begin_forward_us"] > 0
        if r["batch"] == 64:
            assert r["target_us"] == 150.0
            assert abs(r["ratio"] - r["best_round_us"] / 150.0) < 1e-9
        else:
            assert r["target_us"] is None and r["ratio"] is None
    host.print_changing(rows)
    out = capsys.readouterr().out
    assert "join_leave_shared" in out and "ratio" in out
