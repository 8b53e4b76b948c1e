"""The scale check's campaign: its cells and commands, its tables (host-bound plans
refused), and its modes' dry runs."""
import json

import pytest

from benchmarks import scale_check
from benchmarks.harness import scalecheck
from benchmarks.harness.scalecheck import Cell


def test_the_simulator_table_runs_every_layout_of_both_models_with_both_compressors():
    cells = scalecheck.cells("simulator")
    layouts = {(c.nodes, c.local) for c in cells}
    assert layouts == {(8, 1), (16, 1), (32, 1), (2, 4), (4, 4), (4, 8)}
    assert {c.model for c in cells} == {"resnet50", "gpt2"} and {c.compressor for c in cells} == {"topk", "powersgd"}
    assert len({c.name for c in cells}) == len(cells) == 24
    with pytest.raises(ValueError, match="unknown table 'other'"):
        scalecheck.cells("other")
    with pytest.raises(ValueError, match="unknown model"):
        scalecheck.cells("claims", ["vgg"])


def test_a_cells_plans_cover_the_exchanges_it_compares():
    flat, nodes, power = Cell("resnet50", 32, 1, "topk"), Cell("gpt2", 4, 4, "topk"), Cell("gpt2", 4, 8, "powersgd")
    assert flat.plans() == "fp32-4,fp16-4,compress:allgather-4,compress:sparse_allreduce-4,optimal,auto"
    assert "compress-4" in nodes.plans().split(",") and nodes.communicator() == "hierarchical"
    assert power.plans() == "fp32-4,compress-4" and power.communicator() == "allreduce"
    assert (flat.name, nodes.name) == ("resnet50-topk-32", "gpt2-topk-4x4")


def test_the_link_is_slowed_by_the_shrink_and_the_time_scale():
    assert scalecheck.link_spec(1.0, 16, 8) == "rate=7812kbit"
    with pytest.raises(ValueError, match="too slow to shape"):
        scalecheck.link_spec(0.001, 32, 100)
    command = scalecheck.command(Cell("resnet50", 4, 4, "topk"), "t.json", "out", "python", 1.0, 4.0, "gpu", 3, 2, 60)
    assert command[:8] == ["python", "benchmarks/cluster.py", "--nodes", "4", "--workers-per-node", "4",
                           "--profile", "rate=15625kbit"]
    assert command[command.index("--replay-time-scale") + 1] == "4" and "--replay-codecs" in command
    assert command[-1] == "out/resnet50-topk-4x4.json"


def _result(model, workers, local, plans, communicator="allgather", compressor="topk"):
    return {"model": model, "workers": workers, "workers_per_node": local, "compressor": compressor,
            "communicator": communicator,
            "plans": {label: {"measured_s": [m] * 3, "predicted_s": [p] * 3, "error": p / m - 1,
                              "host": {"core_wait": wait, "cpu_total": 0.5, "cores": 2}}
                      for label, (m, p, wait) in plans.items()}}


def test_the_simulator_table_refuses_host_bound_plans_and_counts_the_rest():
    results = {"a": _result("replay:resnet50", 16, 1, {"fp32-4": (2.0, 2.1, 0.01), "compress:allgather-4": (1.0, 0.5, 0.02),
                                                       "optimal": (0.3, 0.3, 0.4)})}
    table = scalecheck.simulator_table(results)
    assert "| fp32-4 | 2000 | 2100 | +5.0% | 0.010 | within |" in table
    assert "| -50.0% | 0.020 | MISSED |" in table
    assert "| optimal | 300 | 300 | +0.0% | 0.400 | refused: host-bound |" in table
    assert "2 plan-cells checked (1 within 15%), 1 refused as host-bound" in table


def test_the_claims_table_compares_the_exchanges_and_says_whether_auto_picked_the_fastest():
    flat = _result("replay:resnet50", 32, 1, {"fp32-4": (3.0, 3, 0.01), "fp16-4": (2.0, 2, 0.01),
                                              "compress:allgather-4": (1.0, 1, 0.01),
                                              "compress:sparse_allreduce-4": (0.5, 0.5, 0.01),
                                              "optimal": (0.51, 0.5, 0.01), "auto": (0.8, 0.5, 0.01)})
    nodes = _result("replay:resnet50", 16, 4, {"compress:allgather-4": (1.0, 1, 0.01), "compress-4": (0.6, 1, 0.01),
                                                "auto": (0.6, 1, 0.3)}, communicator="hierarchical")
    table = scalecheck.claims_table({"flat": flat, "nodes": nodes})
    row32 = next(line for line in table.splitlines() if "| 32 |" in line)
    assert "| 0.50 |" in row32 and "| compress:sparse_allreduce | 800 | 510 | no (+60%) | yes |" in row32
    row44 = next(line for line in table.splitlines() if "| 4×4 |" in line)
    assert "| 600 | – | 0.60 | compress | host-bound |" in row44


def test_load_names_a_folder_without_results(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no cell results"):
        scalecheck.load(str(tmp_path))
    (tmp_path / "resnet50-topk-16.json").write_text(json.dumps(_result("m", 16, 1, {"fp32-4": (1, 1, 0)})))
    assert list(scalecheck.load(str(tmp_path))) == ["resnet50-topk-16"]


def test_dry_runs_print_every_command_and_run_nothing(tmp_path, capsys):
    assert scale_check.main(["run", "claims", "--out", str(tmp_path), "--dry-run", "--models", "gpt2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["gpt2-topk-16", "gpt2-topk-32", "gpt2-topk-4x4"]
    assert not list(tmp_path.iterdir())
    assert scale_check.main(["real8", "--out", str(tmp_path / "r8"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mlp-fp16-8x1:" in out and "mlp-fp16-2x4:" in out and "--no-cuda" in out
    assert "real8: SKIPPED" in out or "prerequisites met" in out
    assert not (tmp_path / "r8").exists()


def test_run_refuses_an_unknown_cell_and_a_missing_trace(tmp_path, capsys):
    with pytest.raises(SystemExit):
        scale_check.main(["run", "claims", "--out", str(tmp_path), "--only", "resnet50-topk-7"])
    assert "names no cell of table claims" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        scale_check.main(["run", "claims", "--out", str(tmp_path)])
    assert "no trace of ['gpt2', 'resnet50']" in capsys.readouterr().err


def test_layouts_replace_the_tables_for_a_smoke_run():
    assert scalecheck.parse_layouts("4, 2x2") == [(4, 1), (2, 2)]
    assert [c.name for c in scalecheck.cells("claims", ["resnet50"], [(2, 2)])] == ["resnet50-topk-2x2"]
    for bad in ("1", "2x", "x2", "", "four"):
        with pytest.raises(ValueError, match="--layouts"):
            scalecheck.parse_layouts(bad)


def test_a_replayed_rounds_run_keeps_the_host_load_and_predicts_again_offline(tmp_path, capsys):
    import copy
    import os
    import subprocess
    import sys
    from benchmarks.harness.replay import ReplayParam, ReplayTrace
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ReplayTrace("toy", tuple(ReplayParam(f"layer{i}.weight", (64, 200), "torch.float32", 0.003 * i)
                             for i in range(5)), forward_time=0.01).save(str(tmp_path / "toy.json"))
    out = tmp_path / "toy-topk-2.json"
    done = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "simulator.py"), "rounds", "--nproc", "2", "--threads", "1",
         "--replay", str(tmp_path / "toy.json"), "--replay-codecs", "gpu", "--compressor", "topk",
         "--compress-ratio", "0.05", "--net-profile", "1gbit", "--link-efficiency", "0.9", "--num-warmup-batches", "1",
         "--plans", "fp32-2,compress:sparse_allreduce-2", "--rounds", "2", "--window", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["model"] == "replay:toy" and result["replay"]["codecs"] == "gpu"
    for row in result["plans"].values():
        assert row["host"]["ranks"] == 2 and row["host"]["core_wait"] >= 0
        # A replay runs without the quality controller: its repeated gradients would make it
        # raise the density, and the cell would send more bytes than the setting it predicts.
        assert row["density_scale"] == 1.0
    same = scale_check.repredict(result, result["latency_us"])
    for label, row in result["plans"].items():
        assert same["plans"][label]["predicted_s"] == pytest.approx(row["predicted_s"])
    doubled = copy.deepcopy(result)
    doubled["plans"]["compress:sparse_allreduce-2"]["density_scale"] = 2.0   # as a controller could send
    denser = scale_check.repredict(doubled, result["latency_us"])["plans"]
    assert denser["compress:sparse_allreduce-2"]["predicted_s"][0] > same["plans"]["compress:sparse_allreduce-2"]["predicted_s"][0]
    assert denser["fp32-2"]["predicted_s"] == pytest.approx(same["plans"]["fp32-2"]["predicted_s"])
    slower = scale_check.repredict(result, 5000.0)   # 5 ms per ring step
    assert all(slower["plans"][k]["predicted_s"][0] > row["predicted_s"][0] for k, row in result["plans"].items())
    assert scale_check.main(["table", "simulator", str(tmp_path), "--latency-us", "profile"]) == 0
    assert "| replay:toy | 2 | topk | fp32-2 |" in capsys.readouterr().out
