"""benchmarks/drift_cost.py on a tiny run: both windows timed, the cost and a measured step's
own cost reported, the files written."""
import json

from benchmarks import drift_cost


def test_a_tiny_run_times_both_windows_and_writes_its_table(tmp_path):
    drift_cost.main(["--tasks", "char-lstm", "--compressors", "topk", "--rounds", "1", "--window", "11",
                     "--warmup", "1", "--batch-size", "2", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "drift-cost.json").read_text())
    (row,) = data["rows"]
    assert set(row["rounds"][0]) == {"measured", "unmeasured"}
    assert row["measured_step_alone"] is not None  # the window held a measured step
    assert "| char-lstm | topk |" in (tmp_path / "drift-cost.md").read_text()
    assert data["provenance"]["command"]
