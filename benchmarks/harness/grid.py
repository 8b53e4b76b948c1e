"""The quality grid: every compressor at its defaults, with the quality controller on and off,
against dense, over tasks × optimizers × worker counts × seeds.

A compressor tuned on the benchmark's own models can still fall short on a model nobody
tuned for; the controller is meant to hold quality there within a byte budget.  The grid is
the evidence either way: one cell per (task, optimizer, workers, seed), each cell two
``benchmarks/convergence.py`` invocations into the cell's folder —

- ``on/``: dense and every compressor, the controller on (the library's default);
- ``off/``: every compressor again with the controller off ("before"), no dense row (its
  dense is ``on/``'s: dense exchanges everything, so the controller has nothing to raise);

(``--controllers default`` runs one invocation, ``default/``, that leaves the flag out: a
mergecomp without the controller can run the grid that way), then :func:`summarise` writes ``summary.md`` per cell and ``grid.md`` over all cells: each
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
#: Every state a cell can hold: "default" leaves --controller out (the library's default).
STATES = CONTROLLER_STATES + ("default",)
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
             passthrough: Sequence[str] = (), eval_every: int = 250,
             states: Sequence[str] = CONTROLLER_STATES) -> List[List[str]]:
    """The convergence.py command lines of ``cell``, one per controller state in ``states``
    (the first trains dense too, the others run --without-dense)."""
    folder = os.path.join(out, cell.name)
    common = ["benchmarks/convergence.py", "--task", cell.task, "--optimizer", cell.optimizer,
              "--workers", str(cell.workers), "--seeds", str(cell.seed)]
    if cell.task != "digits":  # the digits train 30 epochs and evaluate at each
        common += ["--steps", str(steps), "--eval-every", str(eval_every)]
    common += ["--lr-schedule", "cosine", "--set-epoch-every", str(SET_EPOCH_EVERY)]
    lines = []
    for index, state in enumerate(states):
        line = [python] + common + (["--controller", state] if state != "default" else [])
        line += (["--without-dense"] if index else []) + ["--compressors", *compressors,
                                                          "--out", os.path.join(folder, state)]
        lines.append(line + list(passthrough))
    return lines


def estimate_cpu_seconds(cell: Cell, steps: int, rows: int, batch_size: Optional[int] = None,
                         states: int = 2) -> Optional[float]:
    """CPU seconds the cell's invocations take (dense once, ``rows`` compressed rows once per
    state), or None for a task not measured."""
    per_step = CPU_SECONDS_PER_STEP.get(cell.task)
    if per_step is None:
        return None
    if cell.task == "digits":
        steps = 30 * 1437 // (cell.workers * (batch_size or 32))  # 30 epochs of its training split
    scale = (batch_size or 16) / 16 if cell.task != "digits" else 1.0
    return per_step * scale * cell.workers * steps * (1 + states * rows * COMPRESSED_COST)


def shell(line: Sequence[str]) -> str:
    return " ".join(shlex.quote(part) for part in line)


# -- the tables ---------------------------------------------------------------------------------

def _read(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def states_of(folder: str) -> List[str]:
    """The controller states a cell's folder holds results of, in :data:`STATES`' order."""
    return [state for state in STATES if os.path.exists(os.path.join(folder, state, "convergence.json"))]


def cell_rows(folder: str) -> List[Dict[str, object]]:
    """One row per compressor of a cell's folder: its gap to dense (validation loss, or
    accuracy) in each controller state the cell ran, the bytes of each whole run, the
    controller's last mean scale.  Missing runs are None."""
    states = states_of(folder)
    if not states:
        raise ValueError(f"{folder} holds no on/, off/ or default/ convergence.json: run the cell first "
                         f"(quality_grid.py run)")
    runs = {state: {r["label"]: r for r in (_read(os.path.join(folder, state, "convergence.json")) or {}).get("runs", [])}
            for state in states}
    dense = next((runs[state]["none"] for state in states if "none" in runs[state]), None)
    if dense is None:
        raise ValueError(f"{folder}: no state's convergence.json has a dense row ('none'); the cell's gaps need it")
    rows = []
    labels = list(dict.fromkeys(label for state in states for label in runs[state] if label != "none"))
    for label in labels:
        row: Dict[str, object] = {"label": label}
        for state in STATES:
            run = runs.get(state, {}).get(label)
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
    rows, states = cell_rows(folder), states_of(folder)
    lines = [f"{os.path.basename(os.path.normpath(folder))}: gap to dense (language models: % of its "
             f"validation loss, positive is worse; digits: points of accuracy), bytes of the whole run "
             f"per worker against dense's, the controller's last mean density scale.", "",
             "| compressor | " + " | ".join(f"gap, controller {s}" for s in states) + " | "
             + " | ".join(f"× fewer bytes, {s}" for s in states) + " | "
             + " | ".join(f"scale, {s}" for s in states) + " |",
             "|---|" + "---:|" * (3 * len(states))]
    for row in rows:
        fewer = {state: None if not row[f"bytes_{state}"] or not row["dense_bytes"]
                 else row["dense_bytes"] / row[f"bytes_{state}"] for state in states}
        cells_text = ([_cell_text(row[f"gap_{s}"], "+.1f") for s in states]
                      + [_cell_text(fewer[s], ".1f") for s in states]
                      + [_cell_text(row[f"scale_{s}"], ".2f") for s in states])
        lines.append(f"| {row['label']} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines) + "\n"


def summarise(out: str) -> List[str]:
    """``summary.md`` in every cell folder under ``out`` that has run, and ``grid.md`` over
    them (gap with the controller on / off per compressor and cell); the paths written."""
    folders = sorted(os.path.join(out, d) for d in os.listdir(out) if states_of(os.path.join(out, d)))
    if not folders:
        raise ValueError(f"{out} holds no cell that has run (no */on/, */off/ or */default/ convergence.json)")
    written, grid = [], {}
    for folder in folders:
        path = os.path.join(folder, "summary.md")
        with open(path, "w") as f:
            f.write(cell_table(folder))
        written.append(path)
        grid[os.path.basename(folder)] = {row["label"]: row for row in cell_rows(folder)}
    labels = list(dict.fromkeys(label for rows in grid.values() for label in rows))
    states = [s for s in STATES if any(s in states_of(folder) for folder in folders)]
    lines = [f"Gap to dense per cell, controller {' / '.join(states)} (language models: % of dense's "
             "validation loss; digits: points of accuracy).", "",
             "| compressor | " + " | ".join(grid) + " |", "|---|" + "---:|" * len(grid)]
    for label in labels:
        cells_text = []
        for name in grid:
            row = grid[name].get(label)
            cells_text.append("—" if row is None else
                              " / ".join(_cell_text(row[f"gap_{s}"], "+.1f") for s in states))
        lines.append(f"| {label} | " + " | ".join(cells_text) + " |")
    path = os.path.join(out, "grid.md")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return written + [path]
