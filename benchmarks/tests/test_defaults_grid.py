"""The defaults grid (benchmarks/harness/defaults_grid.py): gaps and bytes from the runs a
cells.json names, the table, the picture, and a cell whose run is missing refused by name."""
import json
import os

import pytest

from benchmarks.harness import defaults_grid


def _convergence(results, folder, rows):
    os.makedirs(os.path.join(results, folder))
    runs = [{"label": label, "seed": seed, "valid_loss": loss, "bytes_total": nbytes}
            for label, seed, loss, nbytes in rows]
    with open(os.path.join(results, folder, "convergence.json"), "w") as handle:
        json.dump({"runs": runs}, handle)


def _grid(tmp_path, cells):
    results = str(tmp_path / "results")
    _convergence(results, "dense-sgd", [("none", 0, 2.0, 1000.0), ("none", 1, 1.0, 1000.0)])
    _convergence(results, "topk-sgd", [("topk", 0, 2.1, 40.0), ("topk", 1, 0.99, 50.0)])
    folder = tmp_path / "grid"
    folder.mkdir()
    (folder / "cells.json").write_text(json.dumps({
        "columns": [["sgd", "char-lstm"], ["adamw", "char-lstm"]],
        "dense": {"sgd char-lstm 0": "dense-sgd", "sgd char-lstm 1": "dense-sgd"},
        "rows": [{"compressor": "topk", "title": "top-k 1%"}, {"compressor": "signum", "title": "SIGNUM"}],
        "cells": cells,
        "notes": {"signum adamw": "refused: its momentum is its own"}}))
    return str(folder), results


def test_gaps_and_bytes_come_from_the_named_runs(tmp_path):
    cells = [{"compressor": "topk", "optimizer": "sgd", "task": "char-lstm", "seed": seed, "run": "topk-sgd"}
             for seed in (1, 0)]
    folder, results = _grid(tmp_path, cells)
    grid = defaults_grid.read(folder, results)
    gaps = {cell["seed"]: (round(cell["gap"], 6), cell["fewer"]) for cell in grid["cells"]}
    assert gaps == {0: (5.0, 25.0), 1: (-1.0, 20.0)}
    table = defaults_grid.table(grid).splitlines()
    assert table[0] == "| compressor | SGD, char-lstm | AdamW, char-lstm |"
    assert table[2] == "| top-k 1% | +5.0% / \u22121.0% (20–25×) | not run |"  # seeds in order
    assert table[3] == "| SIGNUM | not run | refused: its momentum is its own |"


def test_the_picture_and_table_are_written_beside_the_grid(tmp_path):
    pytest.importorskip("matplotlib")
    folder, results = _grid(tmp_path, [{"compressor": "topk", "optimizer": "sgd", "task": "char-lstm",
                                        "seed": 0, "run": "topk-sgd"}])
    written = defaults_grid.render(folder, results=results)
    assert [os.path.basename(p) for p in written] == ["defaults.md", "defaults.png"]
    assert all(os.path.getsize(p) > 0 for p in written)


def test_a_run_that_is_not_there_is_named(tmp_path):
    folder, results = _grid(tmp_path, [{"compressor": "topk", "optimizer": "sgd", "task": "char-lstm",
                                        "seed": 0, "run": "gone"}])
    with pytest.raises(ValueError, match="gone.*not committed"):
        defaults_grid.read(folder, results)
    cells = [{"compressor": "topk", "optimizer": "adamw", "task": "char-lstm", "seed": 0, "run": "topk-sgd"}]
    (tmp_path / "grid" / "cells.json").write_text(json.dumps({
        "columns": [["adamw", "char-lstm"]], "dense": {}, "rows": [{"compressor": "topk"}], "cells": cells}))
    with pytest.raises(ValueError, match="no dense run for 'adamw char-lstm 0'"):
        defaults_grid.read(folder, results)
