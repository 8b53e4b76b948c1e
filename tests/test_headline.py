"""benchmarks/headline.py as a user runs it: one small cell on two spawned ranks, then the
per-cell table and the one-row-per-cell summary read back from the saved result."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    assert f"{ours['versus_ddp_fp16']:.2f} | {ours['scaling_vs_bound']:.2f} |" in row

    other = headline("--summary", str(out), "--ours", "auto-topk")
    assert other.returncode != 0
    assert "has no configuration 'auto-topk'" in other.stderr and "pass one of them as --ours" in other.stderr


def test_summary_refuses_a_file_that_is_not_a_headline_result(tmp_path):
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps({"model": "vgg16"}))
    done = headline("--summary", str(stray))
    assert done.returncode != 0 and "is not a result of benchmarks/headline.py" in done.stderr
