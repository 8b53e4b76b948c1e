"""The step log: the wrapper and the DDP hook on two gloo ranks write rows that say what
compression did (bytes, density, time, dropped steps, residual), to CSV and TensorBoard; a
full disk stops the log, never the run; a resumed run continues the file."""
import copy
import errno
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
        assert f.readline().rstrip("\r\n") == ",".join(steplog.COLUMNS)
        assert ",".join(steplog.COLUMNS) not in f.read()  # one header: the file is one table
    return steplog.read_rows(log_dir)


def _check_plausible(row, ratio):
    assert row["bytes_sent"] > 0
    assert row["fp32_bytes"] == 4 * (32 * 64 + 64 + 64 * 4 + 4)
    assert abs(row["density"] - ratio) < 0.01
    assert row["compression_ratio"] > 1
    assert row["compress_s"] > 0 and row["wait_s"] >= 0 and row["decode_s"] > 0
    assert row["ef_norm"] > 0  # top-k leaves a residual


def test_wrapper_writes_a_row_per_step_on_rank_0(tmp_path):
    tensorboard = HAVE_TENSORBOARD
    left_attached = run_ranks(wrapper_worker, 2, str(tmp_path), tensorboard)
    assert left_attached == [False, False]  # remove() detached every listener
    rows = _rows(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 2, 3]  # the dropped step is retried as step 2
    assert [r["skipped"] for r in rows] == [0, 0, 1, 0, 0]
    assert [r["skipped_total"] for r in rows] == [0, 0, 1, 1, 1]
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
    assert [r["step"] for r in rows] == [1, 3, 5]
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


# -- a full disk, a resumed run, a partial last line -------------------------------------------------

class _DiskFillsUp:
    """A log file on a disk that fills up after ``lines`` lines: the next write lands in part
    (half a row, no line end, as a short write leaves it), then ENOSPC."""

    def __init__(self, file, lines):
        self._file, self._lines = file, lines

    def write(self, text):
        if self._lines <= 0:
            self._file.write(text[:len(text) // 2])
            self._file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._lines -= text.count("\n")
        return self._file.write(text)

    def flush(self):
        self._file.flush()

    def close(self):
        self._file.close()


def _fill_disk_after(lines):
    """Make steplog's files for appending fill up after ``lines`` lines (this process only)."""
    real_open = open

    def open_on_small_disk(path, mode="r", *args, **kwargs):
        file = real_open(path, mode, *args, **kwargs)
        return _DiskFillsUp(file, lines) if "a" in mode else file
    steplog.open = open_on_small_disk  # shadows the builtin in that module


def _fail_tensorboard_writes():
    """Make TensorBoard's event files refuse every record once the returned switch is
    called, as on a full disk (this process only).  The records are written on the
    writer's own thread."""
    from tensorboard.summary.writer import record_writer
    real_write, full = record_writer.RecordWriter.write, []

    def write(self, data):
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)
    record_writer.RecordWriter.write = write
    return lambda: full.append(True)


def _wrapper(seed=0):
    model = _model()
    optimizer = mergecomp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model=model,
        compressor=mergecomp.compressors.create("topk", compress_ratio=0.1),
        memory="residual", communicator="allgather", schedule=2)
    return model, optimizer


def full_disk_worker(rank, world_size, log_dir, fail):
    disk_full = None
    if rank == 0:
        # CSV: the header and two rows; TensorBoard: the file's version record and one row's scalars
        if fail == "csv":
            _fill_disk_after(3)
        else:
            disk_full = _fail_tensorboard_writes()
    model, optimizer = _wrapper()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log = mergecomp.StepLog(log_dir, tensorboard=fail == "tensorboard")
        optimizer.add_step_log(log)
        for step in range(5):
            x, y = _batch(step, rank)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()  # rank 0's log fails inside this call
            optimizer.step()
            if disk_full is not None and step == 0:
                disk_full()  # TensorBoard's disk fills once the first row is written
        log.close()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    messages = [str(w.message) for w in caught if "StepLog" in str(w.message)]
    return optimizer.steps, weights, messages, log.stopped


def _check_training_went_on(results):
    (steps0, weights0, _, _), (steps1, weights1, messages1, stopped1) = results
    assert steps0 == steps1 == 5  # every step completed on both ranks
    assert torch.equal(weights0, weights1)  # identically
    assert messages1 == [] and stopped1 is None  # rank 1 writes no log


def test_a_full_disk_stops_the_csv_log_with_one_warning_and_training_goes_on(tmp_path):
    results = run_ranks(full_disk_worker, 2, str(tmp_path), "csv")
    _check_training_went_on(results)
    _, _, messages, stopped = results[0]
    assert len(messages) == 1, messages  # once, not once per step
    assert "writing the row of step 2" in messages[0] and "No space left on device" in messages[0]
    assert "the step log stops here (its rows up to step 1 are kept) and training goes on" in messages[0]
    assert "No space left on device" in stopped
    assert [r["step"] for r in steplog.read_rows(str(tmp_path))] == [0, 1]  # the half row is skipped
    with open(tmp_path / "steps.csv") as f:
        assert not f.read().endswith("\n")  # the half row is there, without its line end


@pytest.mark.skipif(not HAVE_TENSORBOARD, reason="the tensorboard package is not installed "
                    "(pip install tensorboard)")
def test_a_full_disk_stops_the_tensorboard_log_with_one_warning_and_training_goes_on(tmp_path):
    results = run_ranks(full_disk_worker, 2, str(tmp_path), "tensorboard")
    _check_training_went_on(results)
    _, _, messages, _ = results[0]
    assert len(messages) == 1, messages
    assert "writing the row of step 1" in messages[0] and "No space left on device" in messages[0]
    assert "its rows up to step 0 are kept" in messages[0] and "training goes on" in messages[0]


def _train_logged(model, optimizer, log_dir, steps, rank, nan_at=None):
    with mergecomp.StepLog(log_dir) as log:
        optimizer.add_step_log(log)

        def step(x, y):
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        _train(step, steps, rank, nan_at=nan_at)


def _resumed(state):
    model, optimizer = _wrapper()
    model.load_state_dict(state[0])
    optimizer.load_state_dict(state[1])
    return model, optimizer


def resume_worker(rank, world_size, log_dir):
    seen = {}
    if rank == 0:  # a file of other columns is set aside, not erased or mixed in
        with open(os.path.join(log_dir, "steps.csv"), "w") as f:
            f.write("epoch,loss\n1,2.5\n")
    model, optimizer = _wrapper()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_logged(model, optimizer, log_dir, 3, rank)
    seen["set aside"] = [str(w.message) for w in caught if "other columns" in str(w.message)]
    at_3 = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    _train_logged(model, optimizer, log_dir, 3, rank, nan_at=0)  # steps 3 (dropped), 3, 4
    at_5 = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    if rank == 0:
        seen["first run"] = _rows(log_dir)
        with open(os.path.join(log_dir, "steps.csv"), "a") as f:
            f.write("5,0,1,1234.5,")  # killed while writing a row
        seen["partial"] = steplog.read_rows(log_dir)
    _train_logged(*_resumed(at_5), log_dir, 1, rank)  # resumed from the last step: appends
    if rank == 0:
        seen["resumed"] = _rows(log_dir)
    _train_logged(*_resumed(at_3), log_dir, 2, rank)  # from an earlier checkpoint: steps 3, 4 again
    if rank == 0:
        seen["resumed earlier"] = _rows(log_dir)
    return seen


def test_a_resumed_run_continues_the_log(tmp_path):
    seen = run_ranks(resume_worker, 2, str(tmp_path))[0]
    assert len(seen["set aside"]) == 1 and "kept as" in seen["set aside"][0]
    with open(tmp_path / "steps.csv.1") as f:
        assert f.read() == "epoch,loss\n1,2.5\n"
    steps = lambda rows: [(r["step"], r["skipped"], r["skipped_total"]) for r in rows]  # noqa: E731
    first = [(0, 0, 0), (1, 0, 0), (2, 0, 0), (3, 1, 1), (3, 0, 1), (4, 0, 1)]
    assert steps(seen["first run"]) == first
    assert steps(seen["partial"]) == first  # the partial last line is skipped
    assert steps(seen["resumed"]) == first + [(5, 0, 1)]  # appended, the partial line gone
    # resumed from step 3: the rows of steps 3 and later were this run's to write again
    assert steps(seen["resumed earlier"]) == first[:3] + [(3, 0, 0), (4, 0, 0)]
    for row in seen["resumed earlier"]:
        _check_plausible(row, 0.1)


def test_read_rows_skips_what_is_not_a_whole_row_and_refuses_another_table(tmp_path):
    header = ",".join(steplog.COLUMNS)
    (tmp_path / "steps.csv").write_text(f"{header}\r\n0,0,0,10,40,4,0.1,0.5,0,0.1,,2.5,1,\r\n1,0,0,10,4")
    assert steplog.read_rows(str(tmp_path)) == [
        {"step": 0, "skipped": 0, "skipped_total": 0, "bytes_sent": 10.0, "fp32_bytes": 40.0,
         "compression_ratio": 4.0, "density": 0.1, "compress_s": 0.5, "wait_s": 0.0, "decode_s": 0.1,
         "ef_norm": None, "drift": 2.5, "density_scale": 1.0, "noise": None}]
    (tmp_path / "steps.csv").write_text(header[:7])  # killed while writing the header
    assert steplog.read_rows(str(tmp_path)) == []
    (tmp_path / "steps.csv").write_text("epoch,loss\n1,2\n")
    with pytest.raises(ValueError, match="is not a step log: its columns are 'epoch,loss'"):
        steplog.read_rows(str(tmp_path))
