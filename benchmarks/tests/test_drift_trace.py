"""The drift trace a convergence run records: the optimizer's reading at each evaluation, the
step log's measurement rows, the controller's decisions; nothing, without failing, where
mergecomp has no drift measure."""
import types

import pytest

from benchmarks.harness import drift
from mergecomp.runtime.drift import DriftReading


def _optimizer(lag=None, scales=None, history=()):
    optimizer = types.SimpleNamespace()
    optimizer.drift = None if lag is None else types.SimpleNamespace(lag=lag, groups={"g0": lag})
    optimizer.controller = None if scales is None else types.SimpleNamespace(scales=scales, history=list(history))
    return optimizer


def test_the_reading_is_the_lag_and_the_mean_scale():
    assert drift.reading(_optimizer()) == {"drift": None, "density_scale": None, "noise": None}
    assert drift.reading(_optimizer(lag=2.5, scales={"g0": 1.0, "g1": 3.0})) == {
        "drift": 2.5, "density_scale": 2.0, "noise": None}
    assert drift.reading(types.SimpleNamespace()) == {"drift": None, "density_scale": None, "noise": None}
    noisy = _optimizer(lag=0.7)
    noisy.drift = DriftReading(10, 0.7, {}, kind="noise")  # an unbiased compressor's noise, not a lag
    assert drift.reading(noisy) == {"drift": None, "density_scale": None, "noise": 0.7}


def test_the_controllers_decisions_are_recorded_on_rank_0():
    optimizer = _optimizer(lag=1.0, scales={"g0": 2.0}, history=[(10, {"g0": 1.5}), (20, {"g0": 2.0})])
    record = drift.Trace(optimizer, rank=0).finish()
    assert record["controller_decisions"] == [{"step": 10, "scales": {"g0": 1.5}},
                                              {"step": 20, "scales": {"g0": 2.0}}]
    assert record["controller_scales"] == {"g0": 2.0} and record["drift_trace"] == []
    assert drift.Trace(optimizer, rank=1).finish() == {}
    assert "controller_decisions" not in drift.Trace(_optimizer(lag=1.0), rank=0).finish()


class _Logged:
    """An optimizer that takes a step log, whose rows the test writes itself."""

    def __init__(self):
        self.logs = []

    def add_step_log(self, log):
        self.logs.append(log)


def test_the_step_logs_measurement_rows_become_the_trace(monkeypatch):
    rows = [dict(step=1, drift=None, density_scale=None, ef_norm=0.1),
            dict(step=10, drift=0.8, density_scale=1.0, ef_norm=0.3, noise=None),
            dict(step=20, drift=1.6, density_scale=1.5, ef_norm=0.4, noise=None)]
    monkeypatch.setattr(drift, "read_rows", lambda folder: rows)
    optimizer = _Logged()
    trace = drift.Trace(optimizer, rank=0)
    assert optimizer.logs and trace.folder
    record = trace.finish()
    assert record["drift_trace"] == [dict(step=10, drift=0.8, density_scale=1.0, ef_norm=0.3, noise=None),
                                     dict(step=20, drift=1.6, density_scale=1.5, ef_norm=0.4, noise=None)]
    import os
    assert not os.path.exists(trace.folder)


def test_a_step_log_without_the_drift_column_gives_an_empty_trace(monkeypatch):
    monkeypatch.setattr(drift, "read_rows", lambda folder: [dict(step=1, ef_norm=0.1)])
    assert drift.Trace(_Logged(), rank=0).finish()["drift_trace"] == []
    def unreadable(folder):
        raise OSError("gone")
    monkeypatch.setattr(drift, "read_rows", unreadable)
    assert drift.Trace(_Logged(), rank=0).finish()["drift_trace"] == []


@pytest.mark.skipif(not drift.supported(), reason="this mergecomp has no drift controller yet")
def test_the_wrapper_with_the_controller_reports_a_reading():
    from tests.distributed import run_ranks
    assert run_ranks(_controlled_steps, 2, timeout=120)[0]["steps"] == 30


def _controlled_steps(rank, world_size):
    import torch
    import mergecomp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                               model=model, compressor="topk", **drift.keywords("on"))
    trace = drift.Trace(optimizer, rank)
    for step in range(30):
        optimizer.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        optimizer.step()
    reading = trace.at_evaluation()
    record = trace.finish()
    optimizer.remove_hooks()
    assert rank != 0 or reading["drift"] is not None and record["drift_trace"], (reading, record)
    return {"steps": 30}


def test_the_horizon_choice_tells_the_controller_the_runs_steps():
    chosen = drift.keywords("horizon", steps=1500)["controller"]
    assert chosen.horizon == 1500 and chosen.byte_budget == 2.0
    assert drift.keywords("on") == {"controller": "auto"} and drift.keywords(None) == {}
    with pytest.raises(ValueError, match="needs a run counted in steps"):
        drift.keywords("horizon")
    warm = drift.keywords("warm-horizon", steps=1500)["controller"]
    assert (warm.start_scale, warm.horizon) == (16.0, 1500)
    assert drift.keywords("warm")["controller"].start_scale == 16.0
