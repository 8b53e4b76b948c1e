"""Every compressor at its defaults against dense, as one grid: a table and a picture.

    python benchmarks/plot.py benchmarks/results/<folder with cells.json>   # defaults.md, defaults.png

A grid folder's ``cells.json`` names, for each cell, the committed convergence run it comes
from (a folder under ``benchmarks/results`` and the row's label), and for each optimizer,
task and seed the committed run of dense training it is held against:

    {"columns": [["sgd", "char-lstm"], ["sgd", "char-gpt"], ...],
     "dense": {"sgd char-lstm 0": "2026-11-27-quality-control/sgd-off", ...},
     "rows": [{"compressor": "topk", "title": "top-k 1%"}, ...],
     "cells": [{"compressor": "topk", "optimizer": "sgd", "task": "char-lstm", "seed": 0,
                "run": "2026-12-05-sgd-mask-once-clipped/once/lstm-topk-s0"}, ...],
     "notes": {"signum adamw": "refused: ..."}}

Each cell's gap is its validation loss over dense's with the same optimizer, task and seed,
minus one (positive is worse); its bytes, dense's bytes over the run's, the controller's
included.  ``defaults.md`` is the table docs/results.md shows (one cell: the seeds' gaps, and
the bytes); ``defaults.png`` colours each cell by its worst seed, so that what misses dense by
more than 2% stands out.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

from benchmarks.harness import drift_plots

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
#: The gap, in percent of dense's loss, within which a cell counts as reaching dense.
WITHIN = 2.0
TITLES = {"sgd": "SGD", "adamw": "AdamW"}


def _run(results: str, folder: str, label: str, seed: int) -> dict:
    """The row ``label`` of seed ``seed`` in ``folder``'s convergence.json (under ``results``)."""
    path = os.path.join(results, folder)
    try:
        result = drift_plots.read(path)
    except ValueError as error:
        raise ValueError(f"{error} (cells.json names a run that is not committed)") from None
    for run in result["runs"]:
        if run.get("label") == label and run.get("seed") == seed:
            return run
    raise ValueError(f"{path}/convergence.json has no run labelled {label!r} with seed {seed}")


def read(folder: str, results: str = RESULTS) -> dict:
    """``folder``'s ``cells.json`` with every cell's gap and bytes filled in from the runs it
    names (folders under ``results``)."""
    path = os.path.join(folder, "cells.json")
    try:
        with open(path) as handle:
            grid = json.load(handle)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from None
    dense: Dict[str, dict] = {}
    for key, run_folder in grid["dense"].items():  # "optimizer task seed"
        dense[key] = _run(results, run_folder, "none", int(key.split()[-1]))
    for cell in grid["cells"]:
        key = f"{cell['optimizer']} {cell['task']} {cell['seed']}"
        if key not in dense:
            raise ValueError(f"{path}: no dense run for {key!r} (the 'dense' map names one per optimizer, "
                             f"task and seed)")
        run, reference = _run(results, cell["run"], cell.get("label", cell["compressor"]), cell["seed"]), dense[key]
        cell["gap"] = 100.0 * (run["valid_loss"] / reference["valid_loss"] - 1.0)
        cell["fewer"] = reference["bytes_total"] / run["bytes_total"] if run.get("bytes_total") else None
    return grid


def _cells(grid: dict) -> Dict[Tuple[str, str, str], List[dict]]:
    found: Dict[Tuple[str, str, str], List[dict]] = {}
    for cell in grid["cells"]:
        found.setdefault((cell["compressor"], cell["optimizer"], cell["task"]), []).append(cell)
    for cells in found.values():
        cells.sort(key=lambda c: c["seed"])
    return found


def _signed(gap: float) -> str:
    """A gap with its sign, the minus a true minus sign, as the documents write it."""
    return f"{gap:+.1f}".replace("-", "\u2212")


def _text(cells: Optional[List[dict]], note: Optional[str]) -> str:
    if not cells:
        return note or "not run"
    gaps = " / ".join(_signed(c["gap"]) + "%" for c in cells)
    fewer = {round(c["fewer"], 1) for c in cells if c["fewer"]}
    return gaps + (f" ({'–'.join(f'{f:g}' for f in sorted(fewer))}×)" if fewer else "")


def table(grid: dict) -> str:
    """The grid as a markdown table: one row per compressor, one column per optimizer and task."""
    cells, notes = _cells(grid), grid.get("notes", {})
    head = "| compressor | " + " | ".join(f"{TITLES.get(o, o)}, {t}" for o, t in grid["columns"]) + " |"
    lines = [head, "|---|" + "---:|" * len(grid["columns"])]
    for row in grid["rows"]:
        name = row["compressor"]
        lines.append(f"| {row.get('title', name)} | " + " | ".join(
            _text(cells.get((name, o, t)), notes.get(f"{name} {o}")) for o, t in grid["columns"]) + " |")
    return "\n".join(lines) + "\n"


def render(folder: str, out: Optional[str] = None, results: str = RESULTS) -> List[str]:
    """``defaults.md`` and ``defaults.png`` of the grid in ``folder`` (written beside it, or in ``out``)."""
    grid = read(folder, results)
    out = out or folder
    os.makedirs(out, exist_ok=True)
    md = os.path.join(out, "defaults.md")
    with open(md, "w") as handle:
        handle.write(table(grid))
    return [md, _picture(grid, os.path.join(out, "defaults.png"))]


def _picture(grid: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm
    cells, notes = _cells(grid), grid.get("notes", {})
    rows, columns = grid["rows"], grid["columns"]
    worst = [[max((c["gap"] for c in cells.get((r["compressor"], o, t), [])), default=float("nan"))
              for o, t in columns] for r in rows]
    fig, ax = plt.subplots(figsize=(2.3 * len(columns) + 2.2, 0.42 * len(rows) + 1.4))
    norm = TwoSlopeNorm(vmin=-10.0, vcenter=0.0, vmax=20.0)
    clipped = [[min(max(v, -10.0), 20.0) if v == v else float("nan") for v in line] for line in worst]
    image = ax.imshow(clipped, cmap="RdYlGn_r", norm=norm, aspect="auto")
    for i, row in enumerate(rows):
        for j, (optimizer, task) in enumerate(columns):
            found = cells.get((row["compressor"], optimizer, task))
            text = " / ".join(_signed(c["gap"]) for c in found) if found else \
                ("refused" if notes.get(f"{row['compressor']} {optimizer}", "").startswith("refused") else "—")
            bold = found and max(c["gap"] for c in found) > WITHIN
            ax.text(j, i, text, ha="center", va="center", fontsize=8, fontweight="bold" if bold else "normal")
    ax.set_xticks(range(len(columns)), [f"{TITLES.get(o, o)}\n{t}" for o, t in columns], fontsize=9)
    ax.set_yticks(range(len(rows)), [r.get("title", r["compressor"]) for r in rows], fontsize=9)
    ax.xaxis.tick_top()
    bar = fig.colorbar(image, ax=ax, shrink=0.8)
    bar.set_label("% of dense's validation loss (worst seed; bold: more than 2% behind)", fontsize=8)
    ax.set_title("Every compressor at its defaults, quality controller on: gap to dense (seeds 0 / 1)",
                 fontsize=10, pad=34)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return path
