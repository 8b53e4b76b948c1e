"""plot.py on a folder of LSTM runs: state.png, the validation loss beside the batch's loss
from its carried and from a fresh state; a clear error where no run recorded them."""
import json

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plot


def _write(folder, label, readings=True):
    curve = [dict(step=0, bytes=0, valid_loss=8.5)]
    for step in range(25, 201, 25):
        point = dict(step=step, bytes=step * 10, valid_loss=4.0 + (step > 100) * 3.0)
        if readings:
            point.update(batch_loss_carried_state=4.0, batch_loss_fresh_state=point["valid_loss"])
        curve.append(point)
    folder.mkdir(parents=True)
    (folder / "convergence.json").write_text(json.dumps(dict(runs=[dict(label=label, seed=0, curve=curve)])))


def test_state_figure_draws_every_run_that_recorded_the_readings(tmp_path, capsys):
    _write(tmp_path / "dense-s0", "none")
    _write(tmp_path / "topk-s0", "topk")
    assert plot.main([str(tmp_path)]) == 0
    assert (tmp_path / "state.png").stat().st_size > 0
    assert capsys.readouterr().out.strip().endswith("state.png")


def test_runs_without_the_readings_are_a_clear_error(tmp_path, capsys):
    _write(tmp_path / "gpt-s0", "topk", readings=False)  # a transformer records none
    assert plot.main([str(tmp_path)]) == 2
    assert "carried and a fresh state" in capsys.readouterr().err
