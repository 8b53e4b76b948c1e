"""``benchmarks/convergence.py --combine``: one table from rows trained in several
invocations of the same task and settings (each of which ran dense first)."""
import json
import os

import pytest

from benchmarks import convergence

COMMITTED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "results", "2026-11-24-lm-convergence", "char-lstm", "convergence.json")


def _split(tmp_path):
    """The committed run cut into two files, each with dense's runs, as two invocations write."""
    with open(COMMITTED) as f:
        data = json.load(f)
    dense = [run for run in data["runs"] if run["label"] == convergence.DENSE]
    others = [run for run in data["runs"] if run["label"] != convergence.DENSE]
    labels = sorted({run["label"] for run in others})
    paths = []
    for index, part in enumerate((labels[:2], labels[2:])):
        piece = dict(data, runs=dense + [run for run in others if run["label"] in part])
        path = tmp_path / f"part{index}.json"
        path.write_text(json.dumps(piece))
        paths.append(str(path))
    return data, paths


def test_combined_rows_equal_one_invocations_rows(tmp_path):
    data, paths = _split(tmp_path)
    runs, options, workers, _, errors = convergence.combine(paths)
    rows, table = convergence.tabulate(runs, options, workers)
    assert workers == data["workers"] and not errors
    assert sum(run["label"] == convergence.DENSE for run in runs) == len(options.seeds) == 2
    assert {r["label"]: r["valid_loss_mean"] for r in rows} == \
        pytest.approx({r["label"]: r["valid_loss_mean"] for r in data["rows"]})
    assert "| none |" in table and "gap to dense" in table


def test_main_writes_the_combined_table(tmp_path):
    _, paths = _split(tmp_path)
    out = tmp_path / "combined"
    assert convergence.main(["--combine", *paths, "--out", str(out)]) == 0
    written = json.loads((out / "convergence.json").read_text())
    assert written["combined_from"] == paths and (out / "convergence.md").exists()


def test_runs_of_other_settings_are_refused(tmp_path, capsys):
    _, paths = _split(tmp_path)
    other = json.loads(open(paths[1]).read())
    other["options"]["lr"] = 4.0
    open(paths[1], "w").write(json.dumps(other))
    with pytest.raises(ValueError, match=r"other settings.*'lr': \(2\.0, 4\.0\)"):
        convergence.combine(paths)
    assert convergence.main(["--combine", *paths]) == 2
    assert "only runs of the same task and settings" in capsys.readouterr().err


def test_an_unreadable_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*bad.json"):
        convergence.combine([str(bad)])


def test_without_dense_trains_only_the_rows_named():
    args = convergence.parse_args(["--task", "char-lstm", "--without-dense", "--compressors", "topk", "none"])
    assert [spec.label for spec in args.specs] == ["topk"]
    assert [spec.label for spec in convergence.parse_args(["--compressors", "topk"]).specs] == \
        [convergence.DENSE, "topk"]


def test_finished_rows_are_handed_on_as_each_spec_finishes(monkeypatch):
    """A long table that is stopped keeps the rows already trained (``--out``'s partial file)."""
    def spawn(worker, world_size, args, master_port=None, timeout_s=None):
        spec = args[0][0]
        if spec.label == "fp16":
            raise TimeoutError("ranks did not finish in 1 s")
        return [[dict(label=spec.label, seed=0, valid_loss=1.0, diverged=False, lr=2.0, memory="residual",
                      communicator="allgather", bytes_per_step=1.0)]]

    monkeypatch.setattr(convergence.launch, "spawn", spawn)
    seen = []
    specs = [convergence.parse_spec(label) for label in ("topk", "fp16", "qsgd")]
    options = convergence.parse_args(["--task", "char-lstm"])
    convergence.run_benchmark(specs, options, 2, log=lambda *_: None,
                              on_done=lambda runs, errors: seen.append(
                                  ([r["label"] for r in runs], [e["label"] for e in errors])))
    assert seen == [(["topk"], []), (["topk"], ["fp16"]), (["topk", "qsgd"], ["fp16"])]


def test_a_compressor_argument_named_like_a_run_key_is_prefixed():
    spec = convergence.parse_spec("terngrad:compressor.clip=2.5:clip=local")
    assert spec.kwargs == {"clip": 2.5} and spec.clip == "local"
    with pytest.raises(ValueError, match="'compressor.clip=2.5'"):
        convergence.parse_spec("terngrad:clip=2.5")
