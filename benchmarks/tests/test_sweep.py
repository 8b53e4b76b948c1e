"""Sweep configuration, resume, failure records and the scaling factor, with a fake runner:
no cluster and no benchmark processes, so the file runs in about a second."""
import os
import sys

import pytest

from benchmarks import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(**overrides):
    raw = {"models": [{"name": "resnet20", "batch_size": 4}],
           "compressors": ["fp16", {"name": "topk", "compress_ratio": 0.01}],
           "fusion_num": [0, 1], "profiles": ["1gbit"], "workers": [2],
           "baselines": [{"hook": "fp32"}, {"hook": "powersgd", "rank": 1}]}
    raw.update(overrides)
    return sweep.validate(raw)


class FakeRunner:
    """Stands in for run_cell: records the cells it was asked to run, fails the chosen ones."""

    def __init__(self, fail=()):
        self.calls, self.fail = [], set(fail)

    def __call__(self, cell, timeout_s):
        self.calls.append(cell)
        if sweep.label(cell) in self.fail:
            return {"status": "failed", "error": "rank 0 exited with code 1: RuntimeError: boom"}
        rate = 10.0 if cell["kind"] == "single" else 8.0
        return {"status": "ok", "result": {"rate_per_worker": rate, "rate_total": rate * cell["workers"],
                                           "iteration_time_s": 0.5, "bytes_per_step": 100.0}}


def test_grid_defaults_and_order():
    cells = sweep.expand(config())
    assert len(cells) == 1 + 2 + 2 * 2  # reference, 2 baselines, 2 compressors x 2 fusion-num
    assert [c["kind"] for c in cells[:3]] == ["single", "ddp", "ddp"]
    topk = [c for c in cells if c.get("compressor") == "topk"]
    assert {(c["memory"], c["comm"]) for c in topk} == {("residual", "allgather")}  # recommended
    fp16 = [c for c in cells if c.get("compressor") == "fp16"]
    assert {c["comm"] for c in fp16} == {"allreduce"}
    assert len({sweep.cell_key(c) for c in cells}) == len(cells)


def test_command_flags():
    cells = sweep.expand(config())
    topk = next(c for c in cells if c.get("compressor") == "topk" and c["fusion_num"] == 0)
    argv = sweep.command(topk, "out.json")
    assert argv[1].endswith("compress_benchmark.py")
    for flag in ("--compress", "--compress-ratio", "--fusion-num", "--json"):
        assert flag in argv
    single = sweep.command(cells[0], "out.json")
    assert "--nproc" in single and "--compress" not in single
    psgd = next(c for c in cells if c.get("hook") == "powersgd")
    argv = sweep.command(psgd, "out.json")
    assert argv[1].endswith("headline.py") and argv[2] == "ddp" and argv[argv.index("--powersgd-rank") + 1] == "1"


def test_resume_skips_finished_cells_and_keeps_failures(tmp_path):
    cells = sweep.expand(config())
    first = FakeRunner(fail={"ddp-powersgd-r1"})
    records = sweep.run_sweep(cells, str(tmp_path), 60, runner=first, progress=False)
    assert len(first.calls) == len(cells)
    failed = [r for r in records if r["status"] == "failed"]
    assert len(failed) == 1 and "boom" in failed[0]["error"]

    again = FakeRunner()
    sweep.run_sweep(cells, str(tmp_path), 60, runner=again, progress=False)
    assert again.calls == []  # finished and failed cells are both skipped

    retry = FakeRunner()
    records = sweep.run_sweep(cells, str(tmp_path), 60, retry_failed=True, runner=retry, progress=False)
    assert [sweep.label(c) for c in retry.calls] == ["ddp-powersgd-r1"]
    assert all(r["status"] == "ok" for r in records)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(cells) + 1  # append-only: the failure stays in the history


def test_truncated_last_line_is_ignored(tmp_path):
    cells = sweep.expand(config())[:2]
    sweep.run_sweep(cells[:1], str(tmp_path), 60, runner=FakeRunner(), progress=False)
    with open(tmp_path / "results.jsonl", "a") as f:
        f.write('{"key": "half a li')  # a sweep killed mid-write
    runner = FakeRunner()
    sweep.run_sweep(cells, str(tmp_path), 60, runner=runner, progress=False)
    assert [sweep.cell_key(c) for c in runner.calls] == [sweep.cell_key(cells[1])]


def record(cell, status="ok", rate_total=None, rate=None):
    result = {"rate_per_worker": rate, "rate_total": rate_total, "iteration_time_s": 1.0}
    return {"key": sweep.cell_key(cell), "cell": cell, "status": status,
            "result": result if status == "ok" else None, "error": "" if status == "ok" else "x"}


def test_scaling_factor_on_hand_made_records():
    cells = sweep.expand(config())
    single, fp32 = cells[0], cells[1]
    topk = next(c for c in cells if c.get("compressor") == "topk")
    other_batch = dict(topk, batch_size=64)  # no reference with that batch size
    rows = sweep.summarize([record(single, rate=20.0, rate_total=20.0),
                            record(fp32, rate=15.0, rate_total=30.0),
                            record(topk, rate=19.0, rate_total=38.0),
                            record(other_batch, rate=5.0, rate_total=10.0),
                            record(cells[2], status="failed")])
    by_label = {(r["label"], r["batch_size"]): r for r in rows}
    assert by_label[("single", 4)]["scaling_factor"] == pytest.approx(1.0)
    assert by_label[("ddp-fp32", 4)]["scaling_factor"] == pytest.approx(30.0 / (2 * 20.0))
    assert by_label[("topk", 4)]["scaling_factor"] == pytest.approx(38.0 / (2 * 20.0))
    assert by_label[("topk", 64)]["scaling_factor"] is None
    assert by_label[("ddp-powersgd-r1", 4)]["scaling_factor"] is None
    assert by_label[("ddp-powersgd-r1", 4)]["status"] == "failed"


@pytest.mark.parametrize("overrides, message", [
    ({"models": ["resnet2O"]}, "resnet20"),                       # closest match named
    ({"workers": [1]}, "≥ 2"),
    ({"fusion_num": [-1]}, "fusion_num"),
    ({"compressors": [{"name": "topk", "compress_ratio": 5}]}, "(0, 1]"),
    ({"compressors": [{"name": "topk", "ratio": 0.1}]}, "compress_ratio"),
    ({"baselines": [{"hook": "bf16"}]}, "hook"),
    ({"baselines": [{"hook": "powersgd"}]}, "rank"),
    ({"baselines": [{"hook": "mergecomp"}]}, "needs 'compressor'"),
    ({"baselines": [{"hook": "mergecomp", "compressor": "tpok"}]}, "topk"),
    ({"baselines": [{"hook": "mergecomp", "compressor": "dgc", "groups": 0}]}, "groups"),
    ({"baselines": [{"hook": "mergecomp", "compressor": "dgc", "rank": 2}]}, "hook: mergecomp"),
    ({"iterations": {"num_warmup_batches": 1}}, "num_warmup_batches ≥ 2"),
    ({"profiles": ["10 parsecs"]}, "10 parsecs"),
    ({"timeout": 5}, "unknown key"),
])
def test_config_errors_are_clear(overrides, message):
    with pytest.raises(sweep.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        config(**overrides)


def test_load_config_reports_bad_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("models: [vgg16\n")
    with pytest.raises(sweep.ConfigError, match="not valid YAML"):
        sweep.load_config(str(path))
    with pytest.raises(sweep.ConfigError, match="cannot read"):
        sweep.load_config(str(tmp_path / "missing.yaml"))


def test_shipped_sweeps_are_valid():
    for name in ("default.yaml", "smoke.yaml"):
        assert sweep.expand(sweep.load_config(os.path.join(ROOT, "benchmarks", "sweeps", name)))


def test_local_cell_timeout_is_recorded():
    failure, _ = sweep._run_local([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert failure == "timeout after 0.5 s"


def test_dry_run_lists_cells(tmp_path, capsys):
    assert sweep.main([os.path.join(ROOT, "benchmarks", "sweeps", "smoke.yaml"),
                       "--out", str(tmp_path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "5 cells" in out and "[todo]" in out and not (tmp_path / "results.jsonl").exists()


def test_error_tail_keeps_the_cause_and_drops_noise():
    stderr = ("[W1122 06:20:47.481844728 socket.cpp:207] [c10d] The hostname of the client socket "
              "cannot be retrieved. err=-3\n"
              "iterations:  50%|#####     | 1/2 [00:01<00:01,  1.00s/it]\r"
              "terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  Received data size doesn't match expected size.\n")
    tail = sweep.error_tail(stderr)
    assert tail.startswith("terminate called") and "doesn't match" in tail and "hostname" not in tail
    assert sweep.error_tail("") == "(no error output)"


def test_baseline_bucket_size_is_part_of_the_cell():
    cells = sweep.expand(config(baselines=[{"hook": "powersgd", "rank": 4},
                                           {"hook": "powersgd", "rank": 4, "bucket_cap_mb": 1000}]))
    ddp = [c for c in cells if c["kind"] == "ddp"]
    assert [sweep.label(c) for c in ddp] == ["ddp-powersgd-r4", "ddp-powersgd-r4-b1000"]
    assert "bucket_cap_mb" not in ddp[0]  # default-bucket cells keep their keys
    argv = sweep.command(ddp[1], "out.json")
    assert argv[argv.index("--bucket-cap-mb") + 1] == "1000"
    with pytest.raises(sweep.ConfigError, match="bucket_cap_mb"):
        config(baselines=[{"hook": "fp32", "bucket_cap_mb": 0}])


def test_a_mergecomp_hook_baseline_runs_headline_ddp_with_its_compressor():
    cells = sweep.expand(config(baselines=[{"hook": "mergecomp", "compressor": "dgc", "groups": 4},
                                           {"hook": "mergecomp", "compressor": "topk", "memory": "residual"}]))
    ddp = [c for c in cells if c["kind"] == "ddp"]
    assert [sweep.label(c) for c in ddp] == ["ddp-mergecomp-dgc-g4", "ddp-mergecomp-topk-g4"]
    argv = sweep.command(ddp[1], "out.json")
    assert argv[argv.index("--hook") + 1] == "mergecomp" and argv[argv.index("--compressor") + 1] == "topk"
    assert "--memory=residual" in argv and argv[argv.index("--fusion-num") + 1] == "4"


def test_rerun_measures_labelled_cells_again(tmp_path):
    cells = sweep.expand(config())
    sweep.run_sweep(cells, str(tmp_path), 60, runner=FakeRunner(), progress=False)
    again = FakeRunner()
    sweep.run_sweep(cells, str(tmp_path), 60, runner=again, progress=False, rerun=["single"])
    assert [sweep.label(c) for c in again.calls] == ["single"]


def test_schedulers_axis_adds_one_cell_per_adaptive_scheduler():
    cells = [c for c in sweep.expand(config(schedulers=["fixed", "binary", "auto"], fusion_num=[0, 2]))
             if c["kind"] == "mergecomp" and c["compressor"] == "topk"]
    fixed = [c for c in cells if "scheduler" not in c]
    adaptive = {c["scheduler"]: c for c in cells if "scheduler" in c}
    assert sorted(c["fusion_num"] for c in fixed) == [0, 2]
    assert set(adaptive) == {"binary", "auto"}
    argv = sweep.command(adaptive["auto"], "out.json")
    assert argv[argv.index("--scheduler") + 1] == "auto" and "--fusion-num" not in argv
    with pytest.raises(sweep.ConfigError, match="schedulers"):
        config(schedulers=["optimal"])
