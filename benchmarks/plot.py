#!/usr/bin/env python
"""Figures from a sweep's summary.csv, in the style of MergeComp's.

    python benchmarks/plot.py benchmarks/results/<run>/summary.csv --out benchmarks/results/<run>

Per network profile it writes two PNGs, one row of panels per model and one column per worker
count:

- ``scaling_<profile>.png``: the scaling factor of every compressor, layer-wise (fusion-num 0)
  next to the best fused setting (the fusion-num > 0 with the highest scaling factor, written
  above its bar), PyTorch DDP PowerSGD bars at the right, DDP FP32 as a dashed line and DDP
  FP16 as a dotted line.  A cell that failed is marked "failed" where its bar would be.
- ``itertime_<profile>.png``: iteration time (one training step) against fusion-num, one
  line per compressor, with DDP FP32 dashed.

Needs matplotlib (``pip install matplotlib``, the ``plots`` extra); it draws with the Agg
backend, so no display is needed.
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
from typing import List, Optional

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
    ax.set_ylabel("iteration time (s)")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside: lines cross


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("summary", help="summary.csv written by benchmarks/sweep.py")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: the CSV's folder)")
    args = p.parse_args(argv)
    try:
        paths = render(args.summary, args.out or os.path.dirname(os.path.abspath(args.summary)))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
