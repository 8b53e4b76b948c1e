"""benchmarks/headline.py as a user runs it: one small cell on two spawned ranks, then the
per-cell table and the one-row-per-cell summary read back from the saved result."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADLINE = os.path.join(ROOT, "benchmarks", "headline.py")


def headline(*flags, timeout=600):
    return subprocess.run([sys.executable, HEADLINE, *flags], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_a_cell_measures_every_configuration_side_by_side(tmp_path):
    out = tmp_path / "cell.json"
    done = headline("--nproc", "2", "--model", "resnet20", "--batch-size", "4", "--num-warmup-batches", "1",
                    "--rounds", "2", "--window", "1", "--compressors", "dgc", "--hook-compressors", "fp16",
                    "--json", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    configurations = result["configurations"]
    assert list(configurations) == ["bound", "solo", "ddp-fp32", "ddp-fp16", "ddp-powersgd", "auto-dgc",
                                    "hook-fp16"]
    assert configurations["bound"]["bytes_per_step"] == 0  # the bound exchanges nothing
    fp32 = configurations["ddp-fp32"]["bytes_per_step"]
    assert fp32 > 0 and configurations["ddp-fp16"]["bytes_per_step"] == fp32 / 2
    assert configurations["ddp-fp16"]["versus_ddp_fp16"] == 1.0
    for name, entry in configurations.items():
        assert len(entry["step_s_rounds"]) == 2 and entry["step_s"] > 0, name
    ours = configurations["auto-dgc"]
    assert set(ours["phases_s"]) >= {"launch", "finish", "sync"} and ours["groups"] >= 1

    table = headline("--table", str(out))
    assert table.returncode == 0, table.stderr
    assert "resnet20, 2 workers, loopback: median of 2 rounds of 1 steps" in table.stdout
    assert "| auto-dgc |" in table.stdout and "| solo (one worker alone) |" in table.stdout

    summary = headline("--summary", str(out))
    assert summary.returncode == 0, summary.stderr
    row = summary.stdout.strip().splitlines()[-1]
    assert row.startswith("| resnet20 | loopback | 2 | ") and "(ddp-" in row
    per_round = [sorted(b / s for b, s in zip(configurations[name]["step_s_rounds"], ours["step_s_rounds"]))
                 for name in ("ddp-fp16", "bound")]
    medians = [(r[0] + r[1]) / 2 for r in per_round]  # two rounds
    assert f"| {medians[0]:.2f} | {medians[1]:.2f} |" in row

    other = headline("--summary", str(out), "--ours", "auto-topk")
    assert other.returncode != 0
    assert "has no configuration 'auto-topk'" in other.stderr and "pass one of them as --ours" in other.stderr


def test_every_ratio_of_the_summary_is_a_median_of_per_round_ratios(tmp_path):
    """Three rounds where the median of per-round ratios and the ratio of medians differ in
    every column: each column takes the former, so '× best DDP' equals '× ddp-fp16' when DDP
    fp16 is the best."""
    sys.path.insert(0, ROOT)
    from benchmarks import headline as module
    rounds = {"bound": [1.0, 2.0, 1.0], "ddp-fp32": [9.0, 9.0, 9.0], "ddp-fp16": [3.0, 4.0, 2.0],
              "auto-dgc": [1.0, 3.0, 4.0]}
    result = {"model": "vgg16", "link": "1gbit", "workers": 2, "rounds": 3, "window": 1,
              "configurations": {name: {"step_s": sorted(r)[1], "step_s_rounds": r} for name, r in rounds.items()}}
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(result))
    row = module.summary([str(path)], "auto-dgc").splitlines()[-1]
    # × ddp-fp16: median(3/1, 4/3, 2/4) = 1.33 (of the medians: 3/3 = 1.00); × bound: median(1, 2/3,
    # 1/4) = 0.67 (1/3 = 0.33); ddp-fp16 × bound: median(1/3, 2/4, 1/2) = 0.50 (1/3 = 0.33)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[3:7] == ["1.33", "0.67", "1.33 (ddp-fp16)", "0.50"], row


def test_summary_refuses_a_file_that_is_not_a_headline_result(tmp_path):
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps({"model": "vgg16"}))
    done = headline("--summary", str(stray))
    assert done.returncode != 0 and "is not a result of benchmarks/headline.py" in done.stderr


def refused(argv, capsys):
    """What ``headline.py`` says to bad flags, in this process: argparse's message or the
    ValueError that the script prints as one line."""
    from benchmarks import headline
    try:
        headline.main(argv)
    except SystemExit as exited:
        assert exited.code == 2, exited.code
        return capsys.readouterr().err
    except ValueError as error:
        return str(error)
    raise AssertionError(f"{argv} was accepted")


def test_exchanges_mode_times_communicators_side_by_side_with_bytes_per_rank(tmp_path, capsys):
    from benchmarks import headline
    out = tmp_path / "exchanges.json"
    assert headline.main(["exchanges", "--nproc", "2", "--model", "mlp", "--width", "32", "--fusion-num", "1",
                          "--compressors", "topk:compress_ratio=0.1", "--contenders", "allgather", "sparse_allreduce",
                          "--rounds", "2", "--window", "1", "--num-warmup-batches", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    configurations = result["configurations"]
    assert list(configurations) == ["bound", "allgather-topk:compress_ratio=0.1",
                                    "sparse_allreduce-topk:compress_ratio=0.1"]
    assert result["reference"] == "allgather" and result["model_options"] == {"width": 32}
    assert configurations["bound"]["wire_bytes_per_step"] == 0
    gather, sparse = configurations["allgather-topk:compress_ratio=0.1"], configurations[
        "sparse_allreduce-topk:compress_ratio=0.1"]
    assert gather["versus_reference_rounds"] == [1.0, 1.0] and len(sparse["versus_reference_rounds"]) == 2
    for entry in (gather, sparse):
        assert 0 < entry["wire_bytes_per_step"] <= entry["wire_bytes_per_step_max"]
        assert entry["bytes_per_step"] > 0 and set(entry["phases_s"]) >= {"launch", "finish", "sync"}
    assert "SparseAllreduce" in sparse["communicator"] or "sparse" in sparse["communicator"].lower()
    capsys.readouterr()
    assert headline.main(["exchanges", "--table", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| × allgather |" in table and "| sparse_allreduce-topk:compress_ratio=0.1 |" in table


def test_exchanges_mode_refuses_before_any_rank_starts(capsys):
    for flags, message in ((["--contenders", "flat", "flat"], "distinct contenders"),
                           (["--model", "resnet20", "--width", "8"], "--model resnet20 has no width"),
                           (["--contenders", "flat", "hierarchcal"], "hierarchcal"),
                           (["--compressors", "topk:ratio"], "is not key=value"),
                           (["--fusion-num", "0"], "--fusion-num must be ≥ 1")):
        said = refused(["exchanges", "--nproc", "2", *flags], capsys)
        assert message in said, said


def test_fsdp_mode_counts_bytes_against_fsdp2s_own_reduction(tmp_path, capsys):
    from benchmarks import headline
    assert headline.main(["fsdp", "--width", "32", "--depth", "1", "--steps", "1", "--warmup", "0",
                          "--compressors", "topk:compress_ratio=0.1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "fsdp-bytes.json").read_text())
    rows = {row["configuration"]: row for row in saved["results"]}
    assert list(rows) == ["fsdp2-fp32", "fsdp2-bf16-reduce", "topk:compress_ratio=0.1"]
    assert rows["fsdp2-bf16-reduce"]["ratio_to_fp32"] == 0.5
    assert 0 < rows["topk:compress_ratio=0.1"]["ratio_to_fp32"] < 0.5
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["runs"][-1]["command"].startswith("python benchmarks/headline.py fsdp --width 32")
    capsys.readouterr()
    assert headline.main(["fsdp", "--table", str(tmp_path / "fsdp-bytes.json")]) == 0
    assert "| topk:compress_ratio=0.1 |" in capsys.readouterr().out
    for flags, message in ((["--hsdp", "--ranks", "2"], "4 with --hsdp"), (["--steps", "0"], "--steps must be ≥ 1"),
                           (["--compressors", "topkk"], "topkk")):
        said = refused(["fsdp", *flags], capsys)
        assert message in said, said


def test_fsdp_accuracy_runs_as_a_module_and_says_so_when_run_as_a_script():
    module = subprocess.run([sys.executable, "-m", "benchmarks.fsdp", "--help"], capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert module.returncode == 0 and "accuracy" in module.stdout, module.stderr[-2000:]
    script = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fsdp.py"), "accuracy"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert script.returncode != 0 and "python -m benchmarks.fsdp accuracy" in script.stderr, script.stderr


class _Controller:
    """A quality controller's counters: one decision (10 steps) every 10 steps."""

    def __init__(self, horizon=None, bytes_ratio=1.9):
        self.front, self.every, self.horizon, self.steps = 10, 10, horizon, 0
        self.byte_budget, self.bytes_ratio, self.scales = 2.0, bytes_ratio, {"group0": 8.0}
        self.history = []


class _Entry:
    def __init__(self, controller, knob="density"):
        self.controller = controller
        self.compressor = type("Compressor", (), {"knob": knob})()


class _Log:
    def __init__(self):
        self.lines = []

    def log(self, line):
        self.lines.append(line)


@pytest.mark.parametrize("horizon, catching_up, expected", [(None, 0, 100), (500, 0, 0), (None, 50, 150)])
def test_timing_waits_for_the_quality_controller_to_settle(horizon, catching_up, expected):
    """Past its front (100 steps, unless it knows the run's length), and its byte budget
    spent: here it catches up on an unused allowance for ``catching_up`` more steps."""
    from benchmarks.harness.contenders import Configuration, settle_controller
    controller, calls = _Controller(horizon, bytes_ratio=1.0 if catching_up else 1.9), []

    def step():
        calls.append(1)
        if len(calls) % controller.every == 0:
            controller.steps += controller.every
        if catching_up and len(calls) == 100 + catching_up:
            controller.bytes_ratio = 1.85

    configuration = Configuration("auto-dgc", step, lambda: 0.0, entry_point=_Entry(controller))
    work = _Log()
    assert configuration.controller is controller
    assert settle_controller("auto-dgc", configuration, work) == expected == len(calls)
    assert "settled after" in work.lines[0] and ("1.85x" if catching_up else "1.90x") in work.lines[0]
    assert Configuration("bound", step, lambda: 0.0).controller is None
    assert Configuration("auto-fp16", step, lambda: 0.0, entry_point=_Entry(controller, knob=None)).controller is None


def test_timing_waits_for_a_new_plans_groups_to_be_raised_and_held():
    """Past its front but with a plan just chosen, the controller raises its groups again
    from scale 1 (its budget not spent): timing waits until its scales held three decisions
    at a rate within the budget."""
    from benchmarks.harness.contenders import Configuration, settle_controller
    controller, calls = _Controller(bytes_ratio=1.2), []
    controller.steps, controller.scales = 200, {}
    decisions = {10: {"group0": 2.0}, 20: {"group0": 4.0}, 40: {"group0": 2.0}}  # raised, then gave back

    def step():
        calls.append(1)
        if len(calls) % controller.every == 0:
            controller.steps += controller.every
        if len(calls) in decisions:
            controller.scales = decisions[len(calls)]
            controller.history.append((controller.steps, dict(controller.scales)))

    configuration = Configuration("auto-dgc", step, lambda: 0.0, entry_point=_Entry(controller))
    assert settle_controller("auto-dgc", configuration, _Log()) == 70 == len(calls)
