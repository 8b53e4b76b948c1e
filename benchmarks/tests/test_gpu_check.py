"""The prepared GPU session (benchmarks/gpu_check.py), rehearsed on the CPU.

A session with a GPU runs ``make gpu-check`` once, with minutes to spare at most; these
tests make sure that every stage's code runs before it gets there (``--dry-run``: CPU
tensors, tiny sizes, the Triton kernels in Triton's interpreter) and that a failing or
overlong stage is recorded while the next one still runs.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from benchmarks import gpu_check

ROOT = gpu_check.ROOT


def _stage(name, code, budget_s):
    return gpu_check.Stage(name, budget_s, f"python -c {code!r}", lambda settings: [
        gpu_check.Command([settings.python, "-c", code], f"{name}.log")])


def test_a_failing_or_overlong_stage_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    # Timeline: "fails" at once, "hangs" killed at 2 s, "works" 3 s more; then less than the
    # 5 s a stage needs are left of the 10 s deadline, so "late" does not start.
    monkeypatch.setattr(gpu_check, "STAGES", [
        _stage("fails", "import sys; print('partial output'); sys.exit(3)", 30),
        _stage("hangs", "import time; print('started', flush=True); time.sleep(60)", 2),
        _stage("works", "import time; time.sleep(3); print('fine')", 30),
        _stage("late", "print('never')", 30),
    ])
    code = gpu_check.main(["--out", str(tmp_path), "--dry-run", "--deadline-s", "10"])
    record = json.loads((tmp_path / "manifest.json").read_text())
    statuses = {stage["name"]: stage["status"] for stage in record["stages"]}
    assert code == 1
    assert statuses == {"fails": "failed", "hangs": "timed out", "works": "ok",
                        "late": "not run: the deadline was reached"}
    assert "partial output" in (tmp_path / "fails.log").read_text()
    assert "started" in (tmp_path / "hangs.log").read_text()
    assert record["dry_run"] and record["commit"] and record["torch"]


def test_unknown_stages_are_refused_with_the_list(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path), "--dry-run", "--stages", "kernels,benchmarks"])
    assert "unknown stages ['benchmarks']" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed: the dry run interprets the Triton kernels")
def test_the_dry_run_runs_every_stage_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    record = json.loads((tmp_path / "manifest.json").read_text())
    assert done.returncode == 0, done.stdout + "".join(
        (tmp_path / name).read_text()[-3000:] for stage in record["stages"] for name in stage.get("files", []))
    assert [stage["name"] for stage in record["stages"]] == [stage.name for stage in gpu_check.STAGES]
    for name in ("kernels.md", "kernels.json", "compressors-triton.md", "compressors-torch.md",
                 "step-profile.md", "step-profile.json", "step-operators.md", "step-operators.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    kernels = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert kernels and all(row.get("matches", "yes") == "yes" and "error" not in row for row in kernels)
    profile = json.loads((tmp_path / "step-profile.json").read_text())["rows"]
    assert all("step_ms" in row and "dense_ms" in row for row in profile), profile
    operators = json.loads((tmp_path / "step-operators.json").read_text())["rows"]
    assert {row["compressor"] for row in operators} == {"none", "dgc"}
    dense, dgc = (next(r["summary"] for r in operators if r["compressor"] == c) for c in ("none", "dgc"))
    assert dgc["operators"] > dense["operators"] > 0 and dgc["host_reads"]["aten::nonzero"] >= 1
    assert "| cpu | 4,000 | powersgd |" in (tmp_path / "compressors-triton.md").read_text()
