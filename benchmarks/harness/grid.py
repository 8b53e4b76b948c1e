"""The quality grid: every compressor at its defaults, with the quality controller on and off,
against dense, over tasks × optimizers × worker counts × seeds.

A compressor tuned on the benchmark's own models can still fall short on a model nobody
tuned for; the controller is meant to hold quality there within a byte budget.  The grid is
the evidence either way: one cell per (task, optimizer, workers, seed), each cell two
``benchmarks/convergence.py`` invocations into the cell's folder —

- ``on/``: dense and every compressor, the controller on (the library's default);
- ``off/``: every compressor again with the controller off ("before"), no dense row (its
  dense is ``on/``'s: dense exchanges everything, so the controller has nothing to raise);

then :func:`summarise` writes ``summary.md`` per cell and ``grid.md`` over all cells: each
compressor's gap to dense with the controller on and off, the bytes of the whole run (the
controller's extra bytes included), and the controller's last density scale.

Every cell trains the user's loop of the untuned model: a cosine learning rate over the
run and ``set_epoch`` every :data:`SET_EPOCH_EVERY` steps, each task at its swept dense
learning rate for the optimizer (``--lr`` and anything else after ``--`` pass through).
"""
from __future__ import annotations

import itertools
import json
import os
import shlex
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

#: The compressors of the grid by default: each at its defaults (DGC at 1% with a warm-up
#: over a fifth of a 1,500-step run too: the setting docs/results.md recommends on the
#: language models).
COMPRESSORS = ("topk", "dgc", "dgc:compress_ratio=0.01:warmup_steps=300", "powersgd", "qsgd", "efsignsgd")
CONTROLLER_STATES = ("on", "off")
SET_EPOCH_EVERY = 37
#: CPU seconds one worker spends on one training step at batch 16 (digits: 32 images), dense,
#: from the dense runs of the AdamW tuning (2 workers on the 2-core host; see
#: benchmarks/results/2026-11-27-adamw-tuning); a compressed step costs up to about twice.
CPU_SECONDS_PER_STEP = {}
#: A compressed row's step against dense's, for the estimate (compression and decoding on the CPU).
COMPRESSED_COST = 1.5


@dataclass(frozen=True)
class Cell:
    task: str
    optimizer: str
    workers: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}-{self.optimizer}-{self.workers}w-seed{self.seed}"


def cells(tasks: Sequence[str], optimizers: Sequence[str], workers: Sequence[int],
          seeds: Sequence[int]) -> List[Cell]:
    """Every combination, in the order given (task slowest)."""
    return [Cell(*combination) for combination in itertools.product(tasks, optimizers, workers, seeds)]


def commands(cell: Cell, out: str, steps: int, compressors: Sequence[str], python: str,
             passthrough: Sequence[str] = (), eval_every: int = 250) -> List[List[str]]:
    """The two convergence.py command lines of ``cell`` (controller on, then off)."""
    folder = os.path.join(out, cell.name)
    common = ["benchmarks/convergence.py", "--task", cell.task, "--optimizer", cell.optimizer,
              "--workers", str(cell.workers), "--seeds", str(cell.seed)]
    if cell.task != "digits":  # the digits train 30 epochs and evaluate at each
        common += ["--steps", str(steps), "--eval-every", str(eval_every)]
    common += ["--lr-schedule", "cosine", "--set-epoch-every", str(SET_EPOCH_EVERY)]
    lines = []
    for state in CONTROLLER_STATES:
        line = [python] + common + ["--controller", state, "--compressors", *compressors,
                                    "--out", os.path.join(folder, state)]
        if state == "off":
            line.insert(line.index("--compressors"), "--without-dense")
        lines.append(line + list(passthrough))
    return lines


def estimate_cpu_seconds(cell: Cell, steps: int, rows: int, batch_size: Optional[int] = None) -> Optional[float]:
    """CPU seconds the cell's two invocations take (dense once, ``rows`` compressed rows
    twice), or None for a task not measured."""
    per_step = CPU_SECONDS_PER_STEP.get(cell.task)
    if per_step is None:
        return None
    if cell.task == "digits":
        steps = 30 * 1437 // (cell.workers * (batch_size or 32))  # 30 epochs of its training split
    scale = (batch_size or 16) / 16 if cell.task != "digits" else 1.0
    return per_step * scale * cell.workers * steps * (1 + 2 * rows * COMPRESSED_COST)


def shell(line: Sequence[str]) -> str:
    return " ".join(shlex.quote(part) for part in line)


# -- the tables ---------------------------------------------------------------------------------

def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def cell_rows(folder: str) -> List[Dict[str, object]]:
    """One row per compressor of a cell's folder: its final validation loss (or accuracy)
    and gap to dense with the controller on and off, the bytes of each whole run, the
    controller's last mean scale.  Missing runs are None."""
    on, off = _read(os.path.join(folder, "on", "convergence.json")), _read(os.path.join(folder, "off", "convergence.json"))
    if on is None:
        raise ValueError(f"{folder} holds no on/convergence.json: run the cell first (quality_grid.py run)")
    runs = {state: {r["label"]: r for r in (data or {}).get("runs", [])} for state, data in (("on", on), ("off", off))}
    dense = runs["on"].get("none")
    if dense is None:
        raise ValueError(f"{folder}/on/convergence.json has no dense row ('none'); the cell's gaps need it")
    rows = []
    labels = [label for label in runs["on"] if label != "none"]
    labels += [label for label in runs["off"] if label not in runs["on"] and label != "none"]
    for label in labels:
        row: Dict[str, object] = {"label": label}
        for state in CONTROLLER_STATES:
            run = runs[state].get(label)
            row[f"gap_{state}"] = None if run is None else _gap(run, dense)
            row[f"bytes_{state}"] = None if run is None else run.get("bytes_total")
            scales = (run or {}).get("controller_scales") or {}
            row[f"scale_{state}"] = statistics.fmean(scales.values()) if scales else None
        row["dense_bytes"] = dense.get("bytes_total")
        rows.append(row)
    return rows


def _gap(run: dict, dense: dict) -> Optional[float]:
    """Percent of dense's validation loss (positive: worse), or points of accuracy (negative: worse)."""
    if "valid_loss" in run:
        loss, base = run["valid_loss"], dense["valid_loss"]
        return None if loss != loss else 100.0 * (loss - base) / base
    return 100.0 * (run["test_accuracy"] - dense["test_accuracy"])


def _cell_text(value, form: str) -> str:
    return "—" if value is None else format(value, form)


def cell_table(folder: str) -> str:
    """``summary.md`` of one cell."""
    rows = cell_rows(folder)
    lines = [f"{os.path.basename(os.path.normpath(folder))}: gap to dense (language models: % of its "
             f"validation loss, positive is worse; digits: points of accuracy), bytes of the whole run "
             f"per worker against dense's, the controller's last mean density scale.", "",
             "| compressor | gap, controller on | gap, off | × fewer bytes, on | × fewer bytes, off | scale, on |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        fewer = {state: None if not row[f"bytes_{state}"] or not row["dense_bytes"]
                 else row["dense_bytes"] / row[f"bytes_{state}"] for state in CONTROLLER_STATES}
        lines.append(f"| {row['label']} | {_cell_text(row['gap_on'], '+.1f')} | {_cell_text(row['gap_off'], '+.1f')} | "
                     f"{_cell_text(fewer['on'], '.1f')} | {_cell_text(fewer['off'], '.1f')} | "
                     f"{_cell_text(row['scale_on'], '.2f')} |")
    return "\n".join(lines) + "\n"


def summarise(out: str) -> List[str]:
    """``summary.md`` in every cell folder under ``out`` that has run, and ``grid.md`` over
    them (gap with the controller on / off per compressor and cell); the paths written."""
    folders = sorted(os.path.join(out, d) for d in os.listdir(out)
                     if os.path.exists(os.path.join(out, d, "on", "convergence.json")))
    if not folders:
        raise ValueError(f"{out} holds no cell that has run (no */on/convergence.json)")
    written, grid = [], {}
    for folder in folders:
        path = os.path.join(folder, "summary.md")
        with open(path, "w") as f:
            f.write(cell_table(folder))
        written.append(path)
        grid[os.path.basename(folder)] = {row["label"]: row for row in cell_rows(folder)}
    labels = list(dict.fromkeys(label for rows in grid.values() for label in rows))
    lines = ["Gap to dense per cell, controller on / off (language models: % of dense's validation "
             "loss; digits: points of accuracy).", "",
             "| compressor | " + " | ".join(grid) + " |", "|---|" + "---:|" * len(grid)]
    for label in labels:
        cells_text = []
        for name in grid:
            row = grid[name].get(label)
            cells_text.append("—" if row is None else
                              f"{_cell_text(row['gap_on'], '+.1f')} / {_cell_text(row['gap_off'], '+.1f')}")
        lines.append(f"| {label} | " + " | ".join(cells_text) + " |")
    path = os.path.join(out, "grid.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return written + [path]
