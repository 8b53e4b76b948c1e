#!/usr/bin/env python
"""Figures from saved results: a sweep's summary.csv, a headline run, a convergence run.

    .venv/bin/python benchmarks/plot.py results     # every figure docs/results.md shows, from the
                                                    # committed data, written beside that data
    .venv/bin/python benchmarks/plot.py benchmarks/results/<low-communication run>  # loss-vs-time.png,
                                                    # time-to-target.md
    .venv/bin/python benchmarks/plot.py benchmarks/results/<headline run>      # headline.png
    .venv/bin/python benchmarks/plot.py benchmarks/results/<convergence run>   # accuracy.png
                                                   # (a language-model run: curves.png)
    .venv/bin/python benchmarks/plot.py benchmarks/results/<sweep>/summary.csv [--out DIR]
    .venv/bin/python benchmarks/plot.py benchmarks/results/<simulator rounds run>  # check.png
    .venv/bin/python benchmarks/plot.py benchmarks/results/<folder with cells.json>  # defaults.md,
                                                   # defaults.png (benchmarks/harness/defaults_grid.py)
    .venv/bin/python benchmarks/plot.py drift <convergence run> [--runs LABEL LABEL]  # drift.png
                                                   # and controller.png (benchmarks/harness/drift_plots.py)

A headline run's folder (``benchmarks/headline.py``'s JSON, one per model, link and worker
count) gives ``headline.png``: per link, one group of bars per model, mergecomp's speed
against DDP's 16-bit hook and against the zero-cost bound, at each worker count (> 1 is
faster).  A convergence run's folder (``convergence.json`` of ``benchmarks/convergence.py``)
gives ``accuracy.png``: test accuracy per epoch of every compressor (mean of the seeds), and
the final accuracy with its spread, dense SGD's marked.

A sweep's summary.csv gives, per network profile, two PNGs with one row of panels per model
and one column per worker count, in the style of MergeComp's figures:

- ``scaling_<profile>.png``: the scaling factor of every compressor, layer-wise (fusion-num 0)
  next to the best fused setting (the fusion-num > 0 with the highest scaling factor, written
  above its bar), PyTorch DDP PowerSGD bars at the right, DDP FP32 as a dashed line and DDP
  FP16 as a dotted line.  A cell that failed is marked "failed" where its bar would be.
- ``itertime_<profile>.png``: seconds per training step against fusion-num, one line per
  compressor, with DDP FP32 dashed.

Needs matplotlib (``pip install matplotlib``, the ``plots`` extra); it draws with the Agg
backend, so no display is needed.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: The runs docs/results.md and the README show, under benchmarks/results/: ``plot.py
#: results`` redraws their figures.  A new headline or convergence run replaces its entry.
SHOWN_RUNS = ("2026-11-24-headline", "2026-11-24-convergence", "2026-11-24-lowcomm-speed", "2026-11-24-scaling",
              "2026-11-24-simulator-8-ranks", "2026-12-06-defaults", "2026-12-07-word-state-spike")
#: Convergence runs whose drift and controller figures docs/results.md shows (``plot.py drift``'s).
SHOWN_DRIFT_RUNS = ("2026-11-27-quality-control/sgd-on", "2026-11-28-adamw-topk-default/gpt-topk",
                    "2026-11-28-adamw-thresholds/gpt-s0", "2026-12-06-noise-0.6/word/terngrad-s0",
                    "2026-12-06-noise-hold/word/terngrad-s0")

FLOAT_COLUMNS = ("rate_per_worker", "rate_total", "iteration_time_s", "scaling_factor",
                 "bytes_per_step", "compression_ratio", "compress_ratio")
REQUIRED_COLUMNS = ("model", "kind", "label", "fusion_num", "profile", "workers", "status",
                    "iteration_time_s", "scaling_factor")


def read_summary(path: str) -> List[dict]:
    """Rows of a summary.csv with numbers parsed (empty cells become None)."""
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
            if missing:
                raise ValueError(f"{path} lacks the column(s) {missing}; is it a summary.csv "
                                 f"written by benchmarks/sweep.py?")
            rows = list(reader)
    except OSError as err:
        raise ValueError(f"cannot read {path!r}: {err.strerror}") from None
    for row in rows:
        for key in FLOAT_COLUMNS:
            row[key] = float(row[key]) if row.get(key) not in (None, "") else None
        row["workers"] = int(row["workers"])
        row["fusion_num"] = int(row["fusion_num"]) if row.get("fusion_num") not in (None, "") else None
    return rows


def _ordered(values) -> list:
    """Unique values in first-seen order (the sweep's order, so plots follow the config)."""
    return list(dict.fromkeys(values))


def _baseline(rows: List[dict], label: str, key: str) -> Optional[float]:
    values = [r[key] for r in rows if r["label"] == label and r["status"] == "ok" and r[key] is not None]
    return values[0] if values else None


def render(summary: str, out: str) -> List[str]:
    """Write every figure for ``summary`` into ``out``; returns the PNG paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_summary(summary)
    os.makedirs(out, exist_ok=True)
    paths = []
    multi = [r for r in rows if r["workers"] > 1]
    if not multi:
        raise ValueError(f"{summary} has no multi-worker rows: nothing to plot")
    for profile in _ordered(r["profile"] for r in multi):
        here = [r for r in multi if r["profile"] == profile]
        models = _ordered(r["model"] for r in here)
        counts = sorted({r["workers"] for r in here})
        for kind, draw in (("scaling", _scaling_panel), ("itertime", _itertime_panel)):
            fig, axes = plt.subplots(len(models), len(counts), squeeze=False,
                                     figsize=(max(7.0, 5.5 * len(counts)), 3.8 * len(models)))
            for i, model in enumerate(models):
                for j, n in enumerate(counts):
                    panel = [r for r in here if r["model"] == model and r["workers"] == n]
                    draw(axes[i][j], panel, f"{model}, {n} workers, {profile}")
            fig.tight_layout()
            path = os.path.join(out, f"{kind}_{profile}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


def _scaling_panel(ax, rows: List[dict], title: str) -> None:
    comp = [r for r in rows if r["kind"] == "mergecomp" and r.get("scheduler") in (None, "", "fixed")]
    names = _ordered(r["label"] for r in comp)
    powersgd = _ordered(r["label"] for r in rows if r["label"].startswith("ddp-powersgd"))
    x = list(range(len(names) + len(powersgd)))
    width = 0.38
    for i, name in enumerate(names):
        mine = [r for r in comp if r["label"] == name]
        layer = [r for r in mine if r["fusion_num"] == 0]
        fused = [r for r in mine if r["fusion_num"] and r["status"] == "ok" and r["scaling_factor"] is not None]
        best = max(fused, key=lambda r: r["scaling_factor"]) if fused else None
        _bar(ax, i - width / 2, width, layer[0] if layer else None, "tab:blue", "layer-wise" if i == 0 else None)
        _bar(ax, i + width / 2, width, best or next((r for r in mine if r["fusion_num"]), None),
             "tab:orange", "best fused" if i == 0 else None)
        if best:
            ax.text(i + width / 2, best["scaling_factor"], f"{best['fusion_num']}", ha="center",
                    va="bottom", fontsize=7)
    for k, name in enumerate(powersgd):
        row = next(r for r in rows if r["label"] == name)
        _bar(ax, len(names) + k, width, row, "tab:gray", "DDP PowerSGD" if k == 0 else None)
    for label, style, text in (("ddp-fp32", "--", "DDP FP32"), ("ddp-fp16", ":", "DDP FP16")):
        value = _baseline(rows, label, "scaling_factor")
        if value is not None:
            ax.axhline(value, color="black", linestyle=style, linewidth=1.2, label=f"{text} ({value:.2f})")
    ax.axhline(1.0, color="tab:green", linewidth=0.8, alpha=0.6, label="linear scaling (1.0)")
    ax.set_xticks(x)
    ax.set_xticklabels(names + [n.replace("ddp-powersgd-", "DDP PSGD ") for n in powersgd],
                       rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("scaling factor")
    ax.set_ylim(0, 1.4 * max([1.0] + [r["scaling_factor"] or 0 for r in rows]))
    ax.set_title(title + "  (number above a fused bar: its fusion-num)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def _bar(ax, x: float, width: float, row: Optional[dict], color: str, legend: Optional[str]) -> None:
    """One bar, or a 'failed' mark where the cell failed (no mark where it was not run)."""
    if row is None:
        return
    if row["status"] == "ok" and row["scaling_factor"] is not None:
        ax.bar(x, row["scaling_factor"], width, color=color, label=legend)
    else:
        ax.bar(x, 0, width, color=color, label=legend)
        ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=7, color="red")


def _itertime_panel(ax, rows: List[dict], title: str) -> None:
    comp = [r for r in rows if r["kind"] == "mergecomp" and r.get("scheduler") in (None, "", "fixed") and r["status"] == "ok"]
    fusions = sorted({r["fusion_num"] for r in comp})
    position = {f: i for i, f in enumerate(fusions)}
    for name in _ordered(r["label"] for r in comp):
        points = sorted((position[r["fusion_num"]], r["iteration_time_s"]) for r in comp if r["label"] == name)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
    for label, style, text in (("ddp-fp32", "--", "DDP FP32"), ("ddp-fp16", ":", "DDP FP16")):
        value = _baseline(rows, label, "iteration_time_s")
        if value is not None:
            ax.axhline(value, color="black", linestyle=style, linewidth=1.2, label=text)
    ax.set_xticks(range(len(fusions)))
    ax.set_xticklabels([f"{f}\n(layer-wise)" if f == 0 else str(f) for f in fusions], fontsize=8)
    ax.set_xlabel("fusion-num (groups)")
    ax.set_ylabel("seconds per training step")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside: lines cross


# -- a headline run ------------------------------------------------------------------------------
MODEL_NAMES = {"lstm": "LSTM LM", "transformer": "transformer LM"}
LINK_NAMES = {"1gbit": "1 Gbit/s", "10gbit": "10 Gbit/s"}


def render_headline(folder: str, out: Optional[str] = None, ours: str = "auto-dgc") -> str:
    """``headline.png`` of a headline run's folder: ``ours`` against DDP's 16-bit hook and
    the zero-cost bound, per link, model and worker count; returns its path."""
    from benchmarks.harness import HEADLINE_BASELINE as BASELINE
    from benchmarks.harness import HEADLINE_LINKS as CAMPAIGN_LINKS
    from benchmarks.harness import HEADLINE_MODELS as CAMPAIGN_MODELS
    from benchmarks.harness import saved_results
    paths = sorted(glob.glob(os.path.join(folder, "*.json")))
    if not paths:
        raise ValueError(f"{folder} holds no JSON results of benchmarks/headline.py")
    cells: Dict[tuple, dict] = {}
    for result in saved_results(paths, "configurations", "benchmarks/headline.py"):
        if ours not in result["configurations"]:
            raise ValueError(f"{result['model']}, {result['link']}, {result['workers']} workers has no "
                             f"configuration {ours!r}; it has {', '.join(result['configurations'])}")
        cells[(result["link"], result["model"], result["workers"])] = result["configurations"][ours]

    def ordered(values, known):
        return sorted(set(values), key=lambda v: (known.index(v) if v in known else len(known), v))
    links = ordered((k[0] for k in cells), CAMPAIGN_LINKS)
    models = ordered((k[1] for k in cells), CAMPAIGN_MODELS)
    workers = sorted({k[2] for k in cells})
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(links), squeeze=False, sharey=True, figsize=(3.3 * len(links) + 0.6, 3.3))
    bars = [(f"× DDP {BASELINE.split('-')[-1]}, {n} workers", "versus_ddp_fp16", n) for n in workers] + \
           [(f"× zero-cost bound, {n} workers", "scaling_vs_bound", n) for n in workers]
    colors = ["#1f77b4", "#9ecae1", "#ff7f0e", "#fdd0a2"][:len(bars)] if len(workers) == 2 else None
    width = 0.8 / len(bars)
    for ax, link in zip(axes[0], links):
        for b, (label, key, n) in enumerate(bars):
            xs = [m + (b - (len(bars) - 1) / 2) * width for m in range(len(models))]
            values = [cells.get((link, model, n), {}).get(key, float("nan")) for model in models]
            ax.bar(xs, values, width, label=label, color=colors[b] if colors else None)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([MODEL_NAMES.get(m, m) for m in models], fontsize=8)
        ax.set_title(LINK_NAMES.get(link, link), fontsize=9)
    axes[0][0].set_ylabel(f"speed of mergecomp ({ours}), ×")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("mergecomp against DDP's 16-bit hook and the zero-cost bound (> 1: faster)", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "headline.png"))


# -- a convergence run -----------------------------------------------------------------------------
def _pretty(label: str) -> str:
    """A convergence spec's label as the README names it: "dgc:compress_ratio=0.01" → "dgc 1%",
    "dgc:compress_ratio=0.01:warmup_steps=300" → "dgc 1% warmup_steps 300"."""
    name, _, options = label.partition(":")
    words = [name]
    for option in filter(None, options.split(":")):
        key, _, value = option.partition("=")
        if key == "compress_ratio":
            words.append(f"{float(value) * 100:g}%")
        else:
            words.append(key if value == "True" else f"{key} {value}")
    return " ".join(words)


def render_accuracy(folder: str, out: Optional[str] = None) -> str:
    """``accuracy.png`` of a convergence run's folder: test accuracy per epoch of every
    compressor (mean of its seeds), and the final accuracy, mean ± one standard deviation,
    against dense SGD's; returns its path."""
    result = _read_convergence(folder)
    curves: Dict[str, List[List[float]]] = {}
    for run in result["runs"]:
        if run.get("curve"):
            curves.setdefault(run["label"], []).append(run["curve"])
    rows = sorted(result["rows"], key=lambda r: r["accuracy_mean"])
    dense = next((r for r in rows if r["label"] == "none"), None)
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), gridspec_kw={"width_ratios": [1.1, 1]})
    # a compressor a point or more behind dense SGD gets a colour of its own, in both panels
    failing_colors = iter(["tab:red", "tab:purple", "tab:brown", "tab:olive", "tab:cyan"] * 10)
    failing = {r["label"]: next(failing_colors) for r in rows if r["gap_to_dense_points"] <= -1.0}
    for label, runs in sorted(curves.items()):
        mean = [statistics.mean(epoch) * 100 for epoch in zip(*runs)]
        epochs = range(1, len(mean) + 1)
        if label == "none":
            left.plot(epochs, mean, color="black", linewidth=2, label="dense SGD", zorder=3)
        elif label in failing:
            left.plot(epochs, mean, color=failing[label], linewidth=1.6, label=_pretty(label), zorder=2)
        else:
            left.plot(epochs, mean, color="tab:gray", linewidth=0.7, alpha=0.6, zorder=1)
    left.plot([], [], color="tab:gray", linewidth=0.7, label="every other compressor")
    left.set_xlabel("epoch")
    left.set_ylabel("test accuracy % (mean of seeds)")
    left.set_ylim(0, 100)
    left.legend(fontsize=7, loc="lower right")
    left.set_title("accuracy per epoch", fontsize=9)
    names = [_pretty(r["label"]) if r["label"] != "none" else "none (dense)" for r in rows]
    means = [r["accuracy_mean"] * 100 for r in rows]
    spread = [r["accuracy_std"] * 100 for r in rows]
    colors = ["black" if r["label"] == "none" else failing.get(r["label"], "tab:blue") for r in rows]
    right.barh(range(len(rows)), means, xerr=spread, color=colors, height=0.7)
    right.set_yticks(range(len(rows)))
    right.set_yticklabels(names, fontsize=7)
    if dense is not None:
        right.axvline(dense["accuracy_mean"] * 100, color="black", linestyle=":", linewidth=1)
    low = min(means[i] for i, r in enumerate(rows) if r["label"] not in failing)
    right.set_xlim(max(0.0, low - 5), min(100.0, max(m + s for m, s in zip(means, spread)) + 0.5))
    for i, (r, value) in enumerate(zip(rows, means)):
        if value < low - 5:  # off the axis: say where it is
            right.text(low - 4.8, i, f"{value:.1f}% ←", va="center", fontsize=7, color=failing[r["label"]])
    right.set_xlabel("final test accuracy % (mean ± std of seeds)")
    right.set_title("final accuracy; dotted: dense SGD", fontsize=9)
    options = result.get("options", {})
    fig.suptitle(f"{result.get('workers', '?')} workers, {options.get('epochs', '?')} epochs, "
                 f"{_seeds(options)} (benchmarks/convergence.py)", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "accuracy.png"))


def render_lm_curves(folder: str, out: Optional[str] = None) -> str:
    """``curves.png`` of a language-model convergence run: validation loss of every
    compressor (mean of its seeds) against training steps and against the bytes each worker
    sent, dense SGD in black; returns its path."""
    result = _read_convergence(folder)
    by_label: Dict[str, List[List[dict]]] = {}
    for run in result["runs"]:
        if run.get("curve"):
            by_label.setdefault(run["label"], []).append(run["curve"])
    plt = _pyplot()
    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.4))
    colors = iter(plt.get_cmap("tab20").colors * 3)
    for label, curves in by_label.items():
        length = min(len(c) for c in curves)
        steps = [curves[0][i]["step"] for i in range(length)]
        sent = [statistics.mean(c[i]["bytes"] for c in curves) for i in range(length)]
        loss = [statistics.mean(c[i]["valid_loss"] for c in curves) for i in range(length)]
        style = dict(color="black", linewidth=2.2, zorder=3) if label == "none" else \
            dict(color=next(colors), linewidth=1.2)
        name = "none (dense)" if label == "none" else _pretty(label)
        by_step.plot(steps, loss, label=name, **style)
        by_bytes.plot(sent[1:], loss[1:], **style)
    dense = [r for r in result["rows"] if r["label"] == "none"]
    floor = min((r["valid_loss_mean"] for r in result["rows"]), default=0.0)
    for ax in (by_step, by_bytes):
        ax.set_ylabel("validation loss (nats per symbol, mean of seeds)")
        ax.set_ylim(floor - 0.05, floor + 1.5)
        if dense:
            ax.axhline(dense[0]["valid_loss_mean"] * 1.02, color="black", linestyle=":", linewidth=1)
    by_step.set_xlabel("training step")
    by_step.legend(fontsize=6, ncol=2)
    by_step.set_title("against steps; dotted: dense + 2%", fontsize=9)
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("bytes sent per worker (log)")
    by_bytes.set_title("against bytes sent", fontsize=9)
    options = result.get("options", {})
    fig.suptitle(f"{options.get('task', '?')}, {result.get('workers', '?')} workers, "
                 f"{options.get('steps', '?')} steps, {_seeds(options)} "
                 f"(benchmarks/convergence.py)", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "curves.png"))


# -- a low-communication run: validation loss against time on the emulated link -----------------------
def _cell_configuration(label: str, configurations: Dict[str, dict]) -> Optional[str]:
    """The headline configuration that times a convergence row: the same label (DiLoCo rows),
    DDP's hooks for dense and fp16, else ``auto-<compressor>``, mergecomp's DDP hook
    ``hook-<compressor>`` or DDP's own ``ddp-<compressor>`` (its PowerSGD hook)."""
    if label in configurations:
        return label
    name = label.split(":")[0]
    for candidate in ({"none": "ddp-fp32", "fp16": "ddp-fp16"}.get(name), f"auto-{name}", f"hook-{name}",
                      f"ddp-{name}"):
        if candidate in configurations:
            return candidate
    return None


def render_lowcomm(folder: str, out: Optional[str] = None) -> str:
    """``loss-vs-time.png`` of a low-communication run's folder: the validation loss of every
    row of its language-model convergence runs (subfolders, mean of the seeds) against
    training step × that method's step time in the folder's headline cell (the emulated
    link; the 1 Gbit/s cell where there are several).  The two are measured apart (the convergence task and the headline's timed
    model differ), so the x axis is a projection: what the step times say each curve would
    take on that link.  Rows with no timed configuration are left out, and say so."""
    from benchmarks.harness import saved_results
    timed = [p for p in sorted(glob.glob(os.path.join(folder, "*.json"))) if os.path.basename(p) != "manifest.json"]
    cells = list(saved_results(timed, "configurations", "benchmarks/headline.py"))
    runs = [_read_convergence(os.path.dirname(p)) for p in sorted(glob.glob(os.path.join(folder, "*", "convergence.json")))]
    runs = [r for r in runs if r.get("options", {}).get("task", "digits") != "digits"]
    if not cells or not runs:
        raise ValueError(f"{folder} needs a headline cell (*.json) and a language-model convergence run "
                         f"(*/convergence.json) for loss-vs-time.png")
    cell = next((c for c in cells if c.get("link") == "1gbit"), cells[0])  # the slow link, where it exists
    configurations = cell["configurations"]
    curves: Dict[str, List[List[dict]]] = {}
    for result in runs:
        for label in dict.fromkeys(run["label"] for run in result["runs"]):  # in run order: stable colours
            if label not in curves:
                curves[label] = [run["curve"] for run in result["runs"] if run["label"] == label and run.get("curve")]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    colors = iter(plt.get_cmap("tab10").colors * 3)
    missing = []
    for label, mine in curves.items():
        timed = _cell_configuration(label, configurations)
        if timed is None or not mine:
            missing.append(label)
            continue
        length = min(len(c) for c in mine)
        seconds = [mine[0][i]["step"] * configurations[timed]["step_s"] for i in range(length)]
        loss = [statistics.mean(c[i]["valid_loss"] for c in mine) for i in range(length)]
        style = dict(color="black", linewidth=2.2) if label == "none" else dict(color=next(colors), linewidth=1.4)
        ax.plot(seconds, loss, marker="o", markersize=3, label=f"{label} (timed as {timed})", **style)
    bound = configurations["bound"]["step_s"]
    steps = max(c[-1]["step"] for mine in curves.values() for c in mine)
    ax.axvline(steps * bound, color="grey", linestyle=":", linewidth=1)
    ax.text(steps * bound, ax.get_ylim()[1], " zero-cost bound, last step", fontsize=7, va="top", color="grey")
    ax.set_xlabel(f"projected seconds on the emulated {cell['link']} link ({cell['model']} step times, "
                  f"{cell['workers']} workers)")
    ax.set_ylabel("validation loss (nats per character, mean of seeds)")
    ax.legend(fontsize=7, loc="upper right")
    options = runs[0].get("options", {})
    title = (f"{options.get('task', '?')}, {runs[0].get('workers', '?')} workers: validation loss against "
             f"steps × measured step time")
    if missing:
        import textwrap
        title += "\n" + "\n".join(textwrap.wrap(f"(not timed: {', '.join(missing)})", 90))
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "loss-vs-time.png"))


def write_time_to_target(folder: str, out: Optional[str] = None, fraction: float = 0.75) -> str:
    """``time-to-target.md`` of a low-communication run's folder: the target is dense SGD's
    (``none``) mean validation loss at ``fraction`` of its steps; per method and per headline
    cell (link), the steps to reach it × that method's measured step time
    (:func:`benchmarks.harness.lowcomm.time_to_target`), against the ``fp16`` row (DDP's 16-bit
    hook) where the run has one, else dense."""
    from benchmarks.harness import lowcomm
    from benchmarks.harness import saved_results
    timed_paths = [p for p in sorted(glob.glob(os.path.join(folder, "*.json"))) if os.path.basename(p) != "manifest.json"]
    cells = list(saved_results(timed_paths, "configurations", "benchmarks/headline.py"))
    runs = [_read_convergence(os.path.dirname(p)) for p in sorted(glob.glob(os.path.join(folder, "*", "convergence.json")))]
    runs = [r for r in runs if r.get("options", {}).get("task", "digits") != "digits"]
    curves: Dict[str, list] = {}
    for result in runs:
        for label in dict.fromkeys(run["label"] for run in result["runs"]):
            mine = [run["curve"] for run in result["runs"] if run["label"] == label and run.get("curve")]
            if mine and label not in curves:
                curves[label] = lowcomm.mean_curve(mine)
    if "none" not in curves or not cells:
        raise ValueError(f"{folder} needs a convergence run with dense SGD ('none') and a headline cell "
                         f"(*.json) for time-to-target.md")
    dense = curves["none"]
    target_step = fraction * dense[-1]["step"]
    target = lowcomm.loss_at(dense, target_step)
    from benchmarks.harness import HEADLINE_LINKS
    cells.sort(key=lambda c: (HEADLINE_LINKS.index(c["link"]) if c["link"] in HEADLINE_LINKS else len(HEADLINE_LINKS),
                              c["link"], c["workers"]))
    by_link = {}
    for cell in cells:
        key = cell["link"] if sum(c["link"] == cell["link"] for c in cells) == 1 else f"{cell['link']} ×{cell['workers']}"
        by_link[key] = {name: entry["step_s"] for name, entry in cell["configurations"].items()}
    first = cells[0]["configurations"]
    timed = {label: _cell_configuration(label, first) for label in curves}
    baseline = "fp16" if "fp16" in curves else "none"
    task = runs[0].get("options", {}).get("task", "?")
    text = (f"# Time to a target validation loss\n\nTarget: dense SGD's mean validation loss at {fraction:.0%} of its "
            f"steps (step {target_step:g}): {target:.4f}. Steps to it from the {task} curves ({runs[0].get('workers', '?')} "
            f"workers, mean of the seeds, linear between evaluations), times each method's measured step time in "
            f"the headline cells ({cells[0]['model']}, {cells[0]['workers']} workers). The ratio is to the "
            f"{baseline} row's time (> 1: slower). Written by `benchmarks/plot.py {os.path.relpath(folder, ROOT)}`.\n\n"
            + lowcomm.time_to_target_table(curves, timed, by_link, target, baseline) + "\n")
    path = os.path.join(out or folder, "time-to-target.md")
    with open(path, "w") as f:
        f.write(text)
    return path


#: The plans a scaling run predicts, in drawing order, with their legend names.
SCALING_PLANS = (("fp32", "FP32 allreduce"), ("compress allgather", "top-k by allgather"),
                 ("compress sparse_allreduce", "top-k by sparse allreduce"), ("optimal", "optimal, per group"))


def render_scaling(folder: str, out: Optional[str] = None) -> str:
    """``scaling.png`` of a ``simulator.py scaling`` run: the predicted scaling factor against
    the number of workers, one panel per link, one line per plan, and the published settings
    (MergeComp's 8 GPUs, DGC's 32 workers) as points.  Predictions, not measurements: the
    run's README gives the per-GPU profile they rest on."""
    path = os.path.join(folder, "scaling.json")
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err.strerror}; is {folder} a run of "
                         f"benchmarks/simulator.py scaling?") from None
    cells = result.get("cells") if isinstance(result, dict) else None
    if not cells:
        raise ValueError(f"{path} has no 'cells': it is no result of benchmarks/simulator.py scaling")
    grid = [c for c in cells if c.get("setting", "grid") == "grid"]
    links = list(dict.fromkeys(c["link"] for c in grid))
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(links) + 1, figsize=(3.4 * (len(links) + 1), 3.6), sharey=True)
    colors = plt.get_cmap("tab10").colors
    for ax, link in zip(axes, links):
        mine = sorted((c for c in grid if c["link"] == link), key=lambda c: c["workers"])
        for color, (key, name) in zip(colors, SCALING_PLANS):
            ax.plot([c["workers"] for c in mine], [c[key]["scaling"] for c in mine], marker="o",
                    markersize=3, color=color, label=name)
        ax.set_xscale("log", base=2)
        ax.set_title(link, fontsize=9)
        ax.set_xlabel("workers")
    settings = [c for c in cells if c.get("setting", "grid") != "grid"]
    ax = axes[-1]
    for i, cell in enumerate(settings):
        for color, (key, _) in zip(colors, SCALING_PLANS):
            ax.scatter([i], [cell[key]["scaling"]], color=color, s=18)
    ax.set_xticks(range(len(settings)))
    ax.set_xticklabels([c["setting"].replace(": ", "\n", 1) for c in settings], fontsize=6)
    ax.set_title("published settings", fontsize=9)
    axes[0].set_ylabel("predicted scaling factor")
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"{result.get('model', '?')}: the simulator's predictions (a documented GPU profile, "
                 f"not measured)", fontsize=9)
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "scaling.png"))


#: The scaling predictions the simulator check's figure sets beside the check, and the link shown.
CHECK_SCALING = ("2026-11-24-scaling", "10gbit")


def _rounds_results(folder: str) -> List[dict]:
    """The ``simulator.py rounds`` results (``--json``) directly in ``folder``."""
    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            result = json.load(f)
        if isinstance(result, dict) and "plans" in result and "round_compute" in result:
            found.append(result)
    return found


def _plan_kind(result: dict, label: str) -> str:
    """fp32, flat or hierarchical: how a rounds plan's groups travel."""
    sends = set(result["plans"][label].get("sends") or {})
    if sends <= {"fp32", "fp16", "bf16"}:
        return "FP32 / raw"
    if "compress" in sends and result.get("communicator") == "hierarchical":
        return "hierarchical"
    return "flat"


def render_simulator_check(folder: str, out: Optional[str] = None) -> str:
    """``check.png``: the simulator's scaling predictions (the committed ``simulator.py
    scaling`` run, one line per plan and compressor, at one link) beside its check against
    the emulated cluster (the ``simulator.py rounds`` results in ``folder``: predicted
    against measured step time, median over rounds, per layout and plan, with the ±15%
    band)."""
    results = _rounds_results(folder)
    if not results:
        raise ValueError(f"{folder} holds no simulator.py rounds results (--json files with 'plans' "
                         "and 'round_compute')")
    run, link = CHECK_SCALING
    with open(os.path.join(ROOT, "benchmarks", "results", run, "scaling.json")) as f:
        scaling = json.load(f)
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    colors = plt.get_cmap("tab10").colors
    grid = sorted((c for c in scaling["cells"] if c.get("setting", "grid") == "grid" and c["link"] == link),
                  key=lambda c: c["workers"])
    for color, (key, name) in zip(colors, SCALING_PLANS):
        left.plot([c["workers"] for c in grid], [c[key]["scaling"] for c in grid], marker="o", markersize=3,
                  color=color, label=name)
    left.set_xscale("log", base=2)
    left.set_xlabel("workers")
    left.set_ylabel("predicted scaling factor")
    left.set_title(f"predicted: {scaling.get('model', '?')} at {link} (a documented GPU profile)", fontsize=8)
    left.legend(fontsize=7, loc="lower left")
    kinds = {"FP32 / raw": colors[0], "flat": colors[1], "hierarchical": colors[2]}
    markers = {}
    top = 0.0
    for result in results:
        local = result.get("workers_per_node", 1)
        layout = f"{result['workers'] // local}×{local}"
        marker = markers.setdefault(layout, "osD^v"[len(markers) % 5])
        for label, row in result["plans"].items():
            measured = statistics.median(row["measured_s"]) * 1e3
            predicted = statistics.median(row["predicted_s"]) * 1e3
            top = max(top, measured, predicted)
            right.scatter([measured], [predicted], color=kinds[_plan_kind(result, label)], marker=marker, s=28)
    line = [0, top * 1.1]
    right.plot(line, line, color="black", linewidth=0.8)
    right.fill_between(line, [0.85 * x for x in line], [1.15 * x for x in line], color="grey", alpha=0.2,
                       label="within 15%")
    for kind, color in kinds.items():
        right.scatter([], [], color=color, label=kind)
    for layout, marker in markers.items():
        right.scatter([], [], color="grey", marker=marker, label=f"{layout} nodes × ranks")
    right.set_xlim(0, line[1])
    right.set_ylim(0, line[1])
    right.set_xlabel("measured step, ms (median over rounds)")
    right.set_ylabel("predicted step, ms")
    first = results[0]
    right.set_title(f"checked: {first['model']}, {first['compressor']}, {first['workers']} ranks on the "
                    f"emulated cluster ({first['net_profile']} between nodes)", fontsize=8)
    right.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, os.path.join(out or folder, "check.png"))


def _read_convergence(folder: str) -> dict:
    from benchmarks.harness import drift_plots  # as render_drift_figures imports it
    return drift_plots.read(folder, ("rows", "runs"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _seeds(options) -> str:
    """"1 seed", "3 seeds", or "? seeds" when the options do not say."""
    count = len(options.get("seeds", []))
    return "? seeds" if not count else "1 seed" if count == 1 else f"{count} seeds"


def _save(fig, path: str) -> str:
    """Save without the date matplotlib would write into the file, so redrawing the same data
    gives the same bytes (a figure in git changes only when its data or code does)."""
    fig.savefig(path, dpi=100, metadata={"Software": None})
    _pyplot().close(fig)
    return path


def render_any(path: str, out: Optional[str] = None) -> List[str]:
    """The figures of ``path``: a sweep's summary.csv, a headline or convergence run's folder,
    or ``results`` (every run docs/results.md shows, from benchmarks/results)."""
    if path == "results":
        if out:
            raise ValueError("'results' writes each figure beside its data; drop --out")
        return ([p for run in SHOWN_RUNS for p in render_any(os.path.join(ROOT, "benchmarks", "results", run))]
                + [p for run in SHOWN_DRIFT_RUNS
                   for p in render_drift_figures(os.path.join(ROOT, "benchmarks", "results", run))])
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "cells.json")):
            from benchmarks.harness import defaults_grid
            return defaults_grid.render(path, out)
        if os.path.exists(os.path.join(path, "scaling.json")):
            return [render_scaling(path, out)]
        if _rounds_results(path):
            return [render_simulator_check(path, out)]
        if glob.glob(os.path.join(path, "*", "convergence.json")) and glob.glob(os.path.join(path, "*.json")):
            return [render_lowcomm(path, out), write_time_to_target(path, out)]
        if os.path.exists(os.path.join(path, "convergence.json")):
            if _read_convergence(path).get("options", {}).get("task", "digits") != "digits":
                return [render_lm_curves(path, out)]
            return [render_accuracy(path, out)]
        if glob.glob(os.path.join(path, "*", "convergence.json")):
            from benchmarks.harness import state_plots
            return [state_plots.render(path, out)]
        return [render_headline(path, out)]
    if not os.path.exists(path):
        raise ValueError(f"{path!r} does not exist: pass 'results', a run's folder under "
                         "benchmarks/results, or a sweep's summary.csv")
    return render(path, out or os.path.dirname(os.path.abspath(path)))


def render_drift_figures(folder: str, out: Optional[str] = None, runs=None) -> List[str]:
    """``drift.png``, and ``controller.png`` where a run recorded the controller's decisions."""
    from benchmarks.harness import drift_plots
    paths = [drift_plots.render_drift(folder, out)]
    try:
        paths.append(drift_plots.render_controller(folder, out, runs))
    except ValueError as error:
        if runs:  # asked for by name: say why not
            raise
        print(f"no controller.png: {error}", file=sys.stderr)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="'results', a headline or convergence run's folder, or a summary.csv "
                                  "written by benchmarks/sweep.py")
    p.add_argument("folder", nargs="?", help="with 'drift': the convergence run's folder")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: beside the data)")
    p.add_argument("--runs", nargs="+", default=None, metavar="LABEL",
                   help="with 'drift': the runs whose controller decisions controller.png shows")
    args = p.parse_args(argv)
    if (args.source == "drift") != (args.folder is not None) or (args.runs and args.source != "drift"):
        p.error("'drift' takes one convergence run's folder (plot.py drift DIR [--runs A B]); "
                "every other source stands alone")
    if args.out:
        os.makedirs(args.out, exist_ok=True)  # a folder named for the figures is made, not an error
    try:
        paths = render_drift_figures(args.folder, args.out, args.runs) if args.source == "drift" \
            else render_any(args.source, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # matplotlib is the optional 'plots' extra
        print(f"no plots ({err}); pip install matplotlib, then run benchmarks/plot.py again", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
