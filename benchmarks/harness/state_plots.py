"""``state.png``: what a recurrent language model owes to the state it carries.

    python benchmarks/plot.py RESULTS_DIR     # a folder of convergence runs, one per subfolder

One panel per run (each subfolder's ``convergence.json``): the validation loss, read from a
fresh state at the start of each validation row, beside the loss of the batch just trained
on read twice, from the state carried into it over the rows' pass and from a fresh state
(:func:`benchmarks.harness.lm.state_reliance`, recorded at every evaluation of an LSTM).
Where the fresh-state batch loss leaves the carried one, the model leans on a long-carried
state, and the validation loss follows the fresh reading rather than the training loss.
"""
from __future__ import annotations

import glob
import json
import os
from typing import List, Optional

from .drift_plots import _pyplot, _save

CARRIED, FRESH = "batch_loss_carried_state", "batch_loss_fresh_state"


def runs_with_state(folder: str) -> List[tuple]:
    """``(subfolder name, run)`` for every run under ``folder`` that recorded the two readings."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*", "convergence.json"))):
        with open(path) as f:
            for run in json.load(f).get("runs", []):
                if any(CARRIED in point for point in run.get("curve", [])):
                    found.append((os.path.basename(os.path.dirname(path)), run))
    return found


def render(folder: str, out: Optional[str] = None) -> str:
    """Draw ``state.png`` for the runs under ``folder``; returns its path."""
    runs = runs_with_state(folder)
    if not runs:
        raise ValueError(f"no run under {folder!r} recorded a batch's loss from its carried and a "
                         "fresh state (an LSTM run of benchmarks/convergence.py records them)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4.2), sharey=True, squeeze=False)
    for ax, (name, run) in zip(axes[0], runs):
        curve = run["curve"]
        ax.plot([p["step"] for p in curve], [p["valid_loss"] for p in curve], color="black",
                linewidth=2, label="validation (each row from a fresh state)")
        for key, color, label in ((CARRIED, "tab:blue", "training batch, carried state"),
                                  (FRESH, "tab:red", "training batch, fresh state")):
            points = [p for p in curve if key in p]
            ax.plot([p["step"] for p in points], [p[key] for p in points], color=color,
                    linewidth=1, label=label)
        ax.set_title(f"{name}: {run['label']}, seed {run['seed']}", fontsize=9)
        ax.set_xlabel("training step")
    axes[0][0].set_ylabel("loss (nats per symbol)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "state.png"))
