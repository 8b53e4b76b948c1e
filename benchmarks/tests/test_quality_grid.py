"""benchmarks/quality_grid.py: the cells' commands and CPU estimate (--dry-run trains nothing),
the refusals, and the per-cell and grid tables from the cells' results."""
import json

import pytest

from benchmarks import quality_grid
from benchmarks.harness import grid, optimizers


def test_dry_run_prints_both_invocations_of_every_cell(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quality_grid.drift, "supported", lambda entry=None: True)
    monkeypatch.setitem(optimizers.DENSE_LR["adamw"], "char-lstm", 0.003)
    monkeypatch.setitem(grid.CPU_SECONDS_PER_STEP, "char-lstm", 0.05)
    assert quality_grid.main(["run", "--tasks", "char-lstm", "--optimizers", "sgd", "adamw", "--workers", "2", "4",
                              "--seeds", "0", "--steps", "100", "--out", str(tmp_path), "--dry-run",
                              "--", "--batch-size", "12"]) == 0
    out = capsys.readouterr().out
    commands = [line for line in out.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 8
    on, off = commands[0], commands[1]
    assert "--controller on" in on and "--without-dense" not in on and on.endswith("--batch-size 12")
    assert "--controller off" in off and "--without-dense" in off
    assert "--lr-schedule cosine --set-epoch-every 37" in on and "char-lstm-sgd-2w-seed0/on" in on
    assert "# 4 cells, about" in out and "nothing trained" in out
    assert not any(tmp_path.iterdir())


def test_a_mergecomp_without_the_controller_runs_the_default_state(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quality_grid.drift, "supported", lambda entry=None: False)
    with pytest.raises(SystemExit):
        quality_grid.main(["run", "--out", str(tmp_path), "--dry-run"])
    assert "run --controllers default" in capsys.readouterr().err
    assert quality_grid.main(["run", "--optimizers", "sgd", "--controllers", "default", "--out", str(tmp_path),
                              "--dry-run"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 1 and "--controller" not in commands[0] and "--without-dense" not in commands[0]
    assert commands[0].split("--out ")[1].endswith("char-lstm-sgd-4w-seed0/default")


def test_the_estimate_counts_workers_steps_and_rows(monkeypatch):
    monkeypatch.setitem(grid.CPU_SECONDS_PER_STEP, "char-lstm", 0.1)
    cell = grid.Cell("char-lstm", "sgd", 4, 0)
    assert grid.estimate_cpu_seconds(cell, 1000, 6) == pytest.approx(0.1 * 4 * 1000 * (1 + 2 * 6 * grid.COMPRESSED_COST))
    assert grid.estimate_cpu_seconds(cell, 1000, 6, batch_size=8) == pytest.approx(
        grid.estimate_cpu_seconds(cell, 1000, 6) / 2)
    monkeypatch.delitem(grid.CPU_SECONDS_PER_STEP, "char-lstm")
    assert grid.estimate_cpu_seconds(cell, 1000, 6) is None


def test_a_task_without_a_swept_rate_is_refused(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(quality_grid.drift, "supported", lambda entry=None: True)
    monkeypatch.delitem(optimizers.DENSE_LR["adamw"], "char-gpt", raising=False)
    with pytest.raises(SystemExit):
        quality_grid.main(["run", "--tasks", "char-gpt", "--optimizers", "adamw", "--out", str(tmp_path)])
    assert "no swept dense learning rate for char-gpt under adamw" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        quality_grid.main(["run", "--workers", "0", "--out", str(tmp_path)])
    assert "got [0]" in capsys.readouterr().err


def _write(path, runs, controller):
    path.mkdir(parents=True)
    (path / "convergence.json").write_text(json.dumps(dict(options=dict(controller=controller), runs=runs)))


def test_summaries_give_each_compressors_gap_with_the_controller_on_and_off(tmp_path, capsys):
    cell = tmp_path / "char-lstm-sgd-4w-seed0"
    _write(cell / "on", [dict(label="none", valid_loss=2.0, bytes_total=1000),
                         dict(label="topk", valid_loss=2.1, bytes_total=40, controller_scales={"a": 1.0, "b": 2.0})],
           "on")
    _write(cell / "off", [dict(label="topk", valid_loss=2.4, bytes_total=20)], "off")
    (tmp_path / "unrelated").mkdir()
    other = tmp_path / "char-lstm-adamw-4w-seed0"
    _write(other / "default", [dict(label="none", valid_loss=2.0, bytes_total=1000),
                               dict(label="topk", valid_loss=1.9, bytes_total=20)], None)
    assert quality_grid.main(["summarise", str(tmp_path)]) == 0
    summary = (cell / "summary.md").read_text()
    assert "| topk | +5.0 | +20.0 | 25.0 | 50.0 | 1.50 |" in summary
    table = (tmp_path / "grid.md").read_text()
    assert "controller on / off / default" in table and "| topk | — / — / -5.0 | +5.0 / +20.0 / — |" in table
    assert "| topk | -5.0 | 50.0 | — |" in (other / "summary.md").read_text()
    capsys.readouterr()
    assert quality_grid.main(["summarise", str(tmp_path / "unrelated")]) == 2
    assert "holds no cell that has run" in capsys.readouterr().err
