"""plot.py drift: the loss curve beside the drift and the density scale per compressor, and the
controller's decisions of two runs, from a convergence.json; clear errors where there is none."""
import json
import math

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plot
from benchmarks.harness import drift_plots


def _run(label, seed=0, drift=True, decisions=True):
    curve = [dict(step=s, bytes=s * 10, valid_loss=3.0 * math.exp(-s / 300),
                  drift=(0.5 + s / 400) if drift else None, density_scale=None) for s in range(0, 1001, 250)]
    run = dict(label=label, seed=seed, valid_loss=curve[-1]["valid_loss"], curve=curve, bytes_total=10_000)
    if drift and label != "none":
        run["drift_trace"] = [dict(step=s, drift=0.5 + s / 400, density_scale=1.0 + (s > 500), ef_norm=0.1)
                              for s in range(10, 1001, 10)]
    if decisions and label != "none":
        run["controller_decisions"] = [dict(step=s, scales={"group0": 1.0 + s / 1000, "group1": 1.0})
                                       for s in range(100, 1001, 100 if label == "topk" else 200)]
    return run


def _write(folder, runs, task="char-lstm"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "convergence.json").write_text(json.dumps(dict(
        options=dict(task=task, optimizer="adamw", controller="on", seeds=[0, 1]), workers=4,
        rows=[], runs=runs)))
    return str(folder)


def test_drift_and_controller_figures_are_drawn(tmp_path, capsys):
    folder = _write(tmp_path / "run", [_run("none"), _run("topk"), _run("topk", seed=1), _run("dgc"),
                                       _run("qsgd", drift=False, decisions=False)])
    assert plot.main(["drift", folder]) == 0
    written = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[1] for p in written] == ["drift.png", "controller.png"]
    assert (tmp_path / "run" / "drift.png").stat().st_size > 10_000
    assert plot.main(["drift", folder, "--out", str(tmp_path / "figures" / "new")]) == 0  # made, not an error
    assert (tmp_path / "figures" / "new" / "drift.png").exists()


def test_a_compressor_read_as_noise_is_drawn_with_its_noise(tmp_path):
    qsgd = _run("qsgd", drift=False)
    qsgd["drift_trace"] = [dict(step=s, drift=None, noise=0.6 if s < 20 else 0.04, density_scale=2.0)
                           for s in range(0, 1001, 10)]
    folder = _write(tmp_path / "run", [_run("none"), qsgd, _run("topk")])
    runs = drift_plots._by_label(drift_plots.read(folder))
    assert drift_plots.reading_key(runs["qsgd"]) == "noise" and drift_plots.reading_key(runs["topk"]) == "drift"
    assert drift_plots.drift_series(qsgd, "noise")[:3] == [(0, 0.6), (10, 0.6), (20, 0.04)]
    assert (tmp_path / "run" / "drift.png").exists() is False
    drift_plots.render_drift(folder)
    assert (tmp_path / "run" / "drift.png").stat().st_size > 10_000


def test_the_two_runs_with_most_decisions_are_chosen_unless_named(tmp_path):
    folder = _write(tmp_path / "run", [_run("none"), _run("topk"), _run("dgc"), _run("powersgd", decisions=False)])
    runs = {r["label"]: r for r in drift_plots.read(folder)["runs"]}
    assert len(drift_plots.decisions(runs["topk"])["group0"]) == 10
    back = {"controller_decisions": [dict(step=0, scales={"group0": 16.0}), dict(step=10, scales={})]}
    assert drift_plots.decisions(back) == {"group0": [(0, 16.0), (10, 1.0)]}  # left out: back at 1
    drift_plots.render_controller(folder, str(tmp_path), ["dgc"])
    with pytest.raises(ValueError, match=r"no run labelled \['signsgd'\]"):
        drift_plots.render_controller(folder, str(tmp_path), ["signsgd"])


def test_the_drift_falls_back_to_the_evaluations_readings():
    run = _run("topk")
    assert drift_plots.drift_series(run)[0] == (10, 0.525)
    del run["drift_trace"]
    assert drift_plots.drift_series(run)[:2] == [(0, 0.5), (250, 1.125)]
    digits = dict(label="topk", curve=[0.5, 0.9], readings=[dict(epoch=1, step=22, drift=0.4),
                                                          dict(epoch=2, step=44, drift=None)])
    assert drift_plots.drift_series(digits) == [(22, 0.4)]
    assert drift_plots.loss_series(digits) == [(22, 0.5), (44, 0.9)]


def test_runs_without_a_drift_are_a_clear_error(tmp_path, capsys):
    folder = _write(tmp_path / "old", [_run("none", drift=False), _run("topk", drift=False, decisions=False)])
    assert plot.main(["drift", folder]) == 2
    assert "no run records a drift or a noise" in capsys.readouterr().err
    assert plot.main(["drift", str(tmp_path / "missing")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot.main(["drift"])
    assert "takes one convergence run's folder" in capsys.readouterr().err
