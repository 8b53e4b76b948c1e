"""Figures of the drift and the quality controller from a convergence run's ``convergence.json``.

    python benchmarks/plot.py drift RESULTS_DIR [--runs LABEL LABEL]

- ``drift.png``: one row per compressor: its validation loss against steps beside dense's
  (left), and what the exchange held back (the drift, in steps' worth of gradient) with the
  controller's density scale (right) over the same steps: whether the loss gap opens where
  the drift rises, and whether the controller answered.  A compressor read as noise (QSGD,
  TernGrad, ATOMO: nothing held back) has its noise there instead, each rank's compression
  error over its gradient's norm.
- ``controller.png``: the controller's decisions over time for two runs (by default the two
  with the most decisions; ``--runs`` names them): each group's density multiplier, step by
  step, as the controller set it.

The drift comes from each run's ``drift_trace`` (the step log's measurement rows), or, for a
run without one, from the readings stored at its evaluations; seeds are averaged step by
step where they share steps.  A run made by a mergecomp without the drift measure has
neither: the figure says so instead of drawing empty axes.
"""
from __future__ import annotations

import json
import os
import statistics
from typing import Dict, List, Optional, Sequence, Tuple

DENSE = "none"


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: str) -> str:
    """Without the date matplotlib would write in, so the same data gives the same bytes."""
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)
    return path


def read(folder: str, keys=("runs",)) -> dict:
    """``folder``'s ``convergence.json`` (written by ``benchmarks/convergence.py --out``), which
    must hold ``keys``; ValueError saying what is wrong otherwise."""
    path = os.path.join(folder, "convergence.json")
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}; pass a folder written by "
                         f"benchmarks/convergence.py --out") from None
    if not isinstance(result, dict) or not set(keys) <= set(result):
        raise ValueError(f"{path} has no " + " and ".join(repr(k) for k in keys)
                         + ": it is no result of benchmarks/convergence.py")
    return result


def _by_label(result: dict) -> Dict[str, List[dict]]:
    runs: Dict[str, List[dict]] = {}
    for run in result["runs"]:
        runs.setdefault(run["label"], []).append(run)
    return runs


def _mean_by_step(series: Sequence[Sequence[Tuple[int, float]]]) -> Tuple[List[int], List[float]]:
    """Steps every series has, and the mean of the series' values there."""
    if not series:
        return [], []
    common = set.intersection(*(set(step for step, _ in s) for s in series))
    steps = sorted(common)
    values = [statistics.fmean(dict(s)[step] for s in series) for step in steps]
    return steps, values


def _lm_curve(run: dict) -> bool:
    """Whether the run's curve is a language model's (points with a step and a validation
    loss) rather than the digits' accuracies per epoch."""
    return bool(run.get("curve")) and isinstance(run["curve"][0], dict)


def drift_series(run: dict, key: str = "drift") -> List[Tuple[int, float]]:
    """(step, value) of ``key`` (``drift``, ``noise`` or ``density_scale``): the trace's rows,
    else the evaluations' readings."""
    rows = run.get("drift_trace") or []
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    if points:
        return points
    readings = run.get("curve") if _lm_curve(run) else run.get("readings")
    return [(point["step"], point[key]) for point in readings or [] if point.get(key) is not None]


def loss_series(run: dict) -> List[Tuple[int, float]]:
    """(step, validation loss) of a language-model run; (step, test accuracy) of a digits run."""
    if _lm_curve(run):
        return [(point["step"], point["valid_loss"]) for point in run["curve"]]
    readings = run.get("readings") or []
    return [(reading["step"], accuracy) for reading, accuracy in zip(readings, run.get("curve") or [])]


#: What a run's reading is, by the key it is stored under, as the figure's axis says it.
READINGS = {"drift": "drift (steps held back)", "noise": "noise (error / gradient norm)"}


def reading_key(runs: Sequence[dict]) -> Optional[str]:
    """``"drift"`` or ``"noise"``: what the runs of one label recorded (None: neither)."""
    return next((key for key in READINGS if any(drift_series(run, key) for run in runs)), None)


def render_drift(folder: str, out: Optional[str] = None) -> str:
    """``drift.png`` of a convergence run (see the module's docstring); its path."""
    result = read(folder)
    runs = _by_label(result)
    keys = {label: reading_key(group) for label, group in runs.items() if label != DENSE}
    drifting = [label for label, key in keys.items() if key is not None]
    if not drifting:
        raise ValueError(f"{folder}: no run records a drift or a noise (no drift_trace rows, none at "
                         f"its evaluations): it was trained by a mergecomp without the drift measure, "
                         f"or has no compressed row")
    plt = _pyplot()
    fig, axes = plt.subplots(len(drifting), 2, figsize=(10, 2.6 * len(drifting)), squeeze=False)
    dense = _mean_by_step([loss_series(run) for run in runs.get(DENSE, [])])
    digits = result.get("options", {}).get("task", "digits") == "digits"
    for (loss_ax, drift_ax), label in zip(axes, drifting):
        steps, loss = _mean_by_step([loss_series(run) for run in runs[label]])
        if dense[0]:
            loss_ax.plot(*dense, color="black", linewidth=1.8, label="dense")
        loss_ax.plot(steps, loss, color="tab:blue", linewidth=1.2, label=label)
        loss_ax.set_ylabel("test accuracy" if digits else "validation loss")
        loss_ax.legend(fontsize=7)
        drift_steps, drift = _mean_by_step([drift_series(run, keys[label]) for run in runs[label]])
        drift_ax.plot(drift_steps, drift, color="tab:red", linewidth=1.0)
        drift_ax.set_ylabel(READINGS[keys[label]], color="tab:red", fontsize=8)
        scale_steps, scale = _mean_by_step([drift_series(run, "density_scale") for run in runs[label]])
        if scale_steps:
            twin = drift_ax.twinx()
            twin.step(scale_steps, scale, where="post", color="tab:green", linewidth=1.0)
            twin.set_ylabel("density scale", color="tab:green", fontsize=8)
            twin.set_ylim(bottom=0.9)
        drift_ax.set_title(label, fontsize=8)
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    options = result.get("options", {})
    fig.suptitle(f"{options.get('task', '?')}, {options.get('optimizer', 'sgd')}, {result.get('workers', '?')} "
                 f"workers, controller {options.get('controller') or 'at its default'}: loss and "
                 + " / ".join(sorted({keys[label] for label in drifting})),
                 fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "drift.png"))


def decisions(run: dict) -> Dict[str, List[Tuple[int, float]]]:
    """Each group's (step, scale) as the controller decided it.  A decision records every
    group's scale after it, leaving out those at 1: a group left out is back at 1."""
    recorded = run.get("controller_decisions") or []
    names = sorted({group for decision in recorded for group in decision["scales"]})
    return {group: [(decision["step"], decision["scales"].get(group, 1.0)) for decision in recorded]
            for group in names}


def render_controller(folder: str, out: Optional[str] = None, labels: Optional[Sequence[str]] = None) -> str:
    """``controller.png``: the decisions of two runs of ``folder`` (``labels``, or the two
    with the most decisions), one panel each; its path."""
    result = read(folder)
    first = {label: group[0] for label, group in _by_label(result).items()}
    if labels:
        unknown = [label for label in labels if label not in first]
        if unknown:
            raise ValueError(f"{folder} has no run labelled {unknown}; its labels: {sorted(first)}")
        chosen = list(labels)
    else:
        chosen = sorted((label for label in first if first[label].get("controller_decisions")),
                        key=lambda label: -len(first[label]["controller_decisions"]))[:2]
    chosen = [label for label in chosen if first[label].get("controller_decisions")]
    if not chosen:
        raise ValueError(f"{folder}: no run records controller decisions (the controller was off, "
                         f"decided nothing, or this mergecomp has none)")
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(chosen), figsize=(5.5 * len(chosen), 3.4), squeeze=False)
    for ax, label in zip(axes[0], chosen):
        for group, points in decisions(first[label]).items():
            ax.step([p[0] for p in points], [p[1] for p in points], where="post", linewidth=1.0, label=group)
        ax.set_title(f"{label} (seed {first[label].get('seed', '?')})", fontsize=8)
        ax.set_xlabel("training step")
        ax.set_ylabel("density multiplier")
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("the controller's decisions per group", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "controller.png"))
