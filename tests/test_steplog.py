"""The step log: the wrapper and the DDP hook on two gloo ranks write rows that say what
compression did (bytes, density, time, dropped steps, residual), to CSV and TensorBoard."""
import csv
import os
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mergecomp
import mergecomp.ddp
from mergecomp import steplog
from tests.distributed import run_ranks

try:
    steplog.tensorboard_writer()
    HAVE_TENSORBOARD = True
except ImportError:
    HAVE_TENSORBOARD = False


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def _train(step_fn, steps, rank, nan_at=None):
    for step in range(steps):
        x, y = _batch(step, rank)
        if step == nan_at and rank == 1:
            x = x * float("nan")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the dropped step's warning
            step_fn(x, y)


def wrapper_worker(rank, world_size, log_dir, tensorboard):
    model = _model()
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model,
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1),
        memory="residual", communicator="allgather", schedule=2)
    with mergecomp.StepLog(log_dir, tensorboard=tensorboard) as log:
        handle = optimizer.add_step_log(log)

        def step(x, y):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        _train(step, 5, rank, nan_at=2)
        handle.remove()
        _train(step, 1, rank)  # detached: no row
    lifecycle = optimizer.reducer.lifecycle
    return bool(lifecycle.phase_listeners) or bool(lifecycle.step_listeners)


def hook_worker(rank, world_size, log_dir):
    model = _model()
    ddp = DDP(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, 2))
    state = mergecomp.ddp.register(ddp, compressor=mergecomp.compressors.create("topk", compress_ratio=0.1),
                                   memory="residual", communicator="allgather")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with mergecomp.StepLog(log_dir, every=2) as log:
        state.add_step_log(log)

        def step(x, y):
            optimizer.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            optimizer.step()
        _train(step, 6, rank)
    return True


def _rows(log_dir):
    with open(os.path.join(log_dir, "steps.csv"), newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == steplog.COLUMNS
        return list(reader)


def _check_plausible(row, ratio):
    assert float(row["bytes_sent"]) > 0
    assert float(row["fp32_bytes"]) == 4 * (32 * 64 + 64 + 64 * 4 + 4)
    assert abs(float(row["density"]) - ratio) < 0.01
    assert float(row["compression_ratio"]) > 1
    assert float(row["compress_s"]) > 0 and float(row["wait_s"]) >= 0 and float(row["decode_s"]) > 0
    assert float(row["ef_norm"]) > 0  # top-k leaves a residual


def test_wrapper_writes_a_row_per_step_on_rank_0(tmp_path):
    tensorboard = HAVE_TENSORBOARD
    left_attached = run_ranks(wrapper_worker, 2, str(tmp_path), tensorboard)
    assert left_attached == [False, False]  # remove() detached every listener
    rows = _rows(str(tmp_path))
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 2, 3]  # the dropped step is retried as step 2
    assert [int(r["skipped"]) for r in rows] == [0, 0, 1, 0, 0]
    assert [int(r["skipped_total"]) for r in rows] == [0, 0, 1, 1, 1]
    for row in rows:
        _check_plausible(row, 0.1)
    assert os.listdir(tmp_path) == ["steps.csv"] or HAVE_TENSORBOARD


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="the tensorboard package is not installed "
                    "(pip install tensorboard); the CSV is tested without it")
def test_tensorboard_events_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_ranks(wrapper_worker, 2, str(tmp_path), True)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "mergecomp/bytes_sent" in tags and "mergecomp/density" in tags
    density = events.Scalars("mergecomp/density")
    assert len(density) == 5 and all(abs(e.value - 0.1) < 0.01 for e in density)


def test_ddp_hook_writes_rows_every_two_steps(tmp_path):
    run_ranks(hook_worker, 2, str(tmp_path))
    rows = _rows(str(tmp_path))
    assert [int(r["step"]) for r in rows] == [1, 3, 5]
    # the hook compresses from DDP's first step on, its bucket rebuild included
    for row in rows:
        _check_plausible(row, 0.1)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="every must be"):
        mergecomp.StepLog(str(tmp_path), every=0)
    with pytest.raises(ValueError, match="would write nothing"):
        mergecomp.StepLog(str(tmp_path), csv=False)


def test_missing_tensorboard_says_what_to_install(monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("TensorBoard logging requires TensorBoard")
        return real_import(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        mergecomp.StepLog(str(tmp_path), tensorboard=True)
