"""What compress_benchmark.py shows a user whose output goes to a log file or a pipe: progress
lines during warm-up and timing, figures labelled per training step, and --log-dir's rows."""
import csv
import io
import os
import select
import subprocess
import sys

import pytest

from benchmarks.harness import Progress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_redirected_run_prints_progress_and_writes_a_step_log(tmp_path):
    log_dir = tmp_path / "log"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "compress_benchmark.py"), "--nproc", "2", "--threads", "1",
         "--compress", "--compressor", "topk", "--compress-ratio", "0.01", "--fusion-num", "2",
         "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "3",
         "--num-batches-per-iter", "2", "--num-iters", "2", "--progress-every", "0.001",
         "--log-dir", str(log_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    # a pipe is no terminal: plain lines, once per step at this interval, rank 0 only
    assert "warm-up: step 1 of 3, " in out and "warm-up: step 3 of 3, " in out
    assert "timed: step 4 of 4, " in out
    assert out.count("warm-up: step 2 of 3") == 1
    assert "per training step" in out and "per iteration" not in out
    with open(log_dir / "steps.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(7))  # warm-up and timed steps
    for row in rows:
        assert 0.009 < float(row["density"]) <= 0.01
        assert float(row["bytes_sent"]) > 0 and float(row["ef_norm"]) > 0
    assert f"Step log: {log_dir}" in out


def test_progress_prints_at_most_once_per_interval(capsys):
    progress = Progress(show=True, every_s=3600)
    progress.phase("warm-up", 10)
    for _ in range(10):
        progress.step()
    assert capsys.readouterr().out == ""  # not an hour yet
    progress = Progress(show=True, every_s=1e-9)
    progress.phase("timed")
    progress.step()
    assert capsys.readouterr().out.startswith("timed: step 1, ")
    quiet = Progress(show=False, every_s=1e-9)
    quiet.step()
    assert capsys.readouterr().out == ""


def test_help_and_flag_errors_say_training_step(capsys):
    import compress_benchmark
    help_text = " ".join(compress_benchmark.build_parser().format_help().split())
    assert "per training step" in help_text and "A timed iteration is --num-batches-per-iter training steps" in help_text
    for flags, message in ((["--progress-every", "-1"], "--progress-every must be"),
                           (["--tensorboard"], "--tensorboard writes into --log-dir")):
        with pytest.raises(SystemExit):
            compress_benchmark.parse_args(flags)
        assert message in capsys.readouterr().err


def test_a_terminal_a_launcher_made_gets_plain_lines():
    """mpirun gives each rank a pseudo-terminal and forwards it line by line: a progress bar
    drawn there with carriage returns reaches the log garbled or not at all."""
    from benchmarks.harness.workload import on_terminal

    class Terminal:
        def isatty(self):
            return True
    assert on_terminal(Terminal(), "torchrun") and on_terminal(Terminal(), "spawn")
    assert not on_terminal(Terminal(), "mpirun") and not on_terminal(Terminal(), "horovodrun")
    assert not on_terminal(io.StringIO(), "single")


def test_under_mpirun_on_a_terminal_rank_0_prints_plain_progress_lines():
    """One rank as Open MPI starts it (its variables), its output on a pseudo-terminal."""
    import pty
    env = dict(os.environ, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_COMM_WORLD_LOCAL_SIZE="1", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MERGECOMP_LAUNCHER"):
        env.pop(name, None)
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "compress_benchmark.py"), "--threads", "1", "--model", "resnet20",
         "--batch-size", "2", "--num-warmup-batches", "2", "--num-batches-per-iter", "1", "--num-iters", "2",
         "--progress-every", "0.001"],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    chunks = []
    try:  # read as it comes (a full terminal would block the writer), until the terminal closes
        while select.select([leader], [], [], 300)[0]:  # 300 s: a guard against a hang
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # every writer closed it
                break
            if not chunk:
                break
            chunks.append(chunk)
        returncode = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)
    shown = b"".join(chunks).decode(errors="replace")
    assert returncode == 0, shown[-3000:]
    assert "Workers: 1 (mpirun)" in shown, shown[-3000:]
    assert "warm-up: step 2 of 2, " in shown and "timed: step 2 of 2, " in shown, shown[-3000:]
    assert "iterations:" not in shown  # no bar: tqdm's prefix
