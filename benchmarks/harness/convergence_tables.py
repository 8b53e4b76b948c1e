"""The convergence benchmark's tables: one row per compressor over its seeds, and the markdown
table of the digits (test accuracy) or of a language model (validation loss), with the
recipes the rows applied and the rows whose settings contradict their recipe.

Kept apart from ``benchmarks/convergence.py``, which trains; both read the run records it
writes (``convergence.json``'s ``runs``)."""
from __future__ import annotations

import math
import statistics
from typing import Any, Dict, List, Optional, Tuple

from . import lm, optimizers

DENSE = "none"
#: Steps a language-model row trains when ``--steps`` is not given: long enough that dense
#: is close to its plateau on both tasks at 2 workers (the gaps of the compressors that
#: delay coordinates, error feedback's sparsifiers and low-rank ones, are early-training
#: lag for hundreds of steps and close later; the results' curves show it).
DEFAULT_LM_STEPS = 1500


def summarise(runs: List[dict], dense_label: Optional[str]) -> List[dict]:
    """One row per label: accuracy mean, sample std, min, max over seeds; gap to dense."""
    rows, by_label = [], {}
    for run in runs:
        by_label.setdefault(run["label"], []).append(run)
    dense = None
    if dense_label in by_label:
        dense = statistics.fmean(r["test_accuracy"] for r in by_label[dense_label])
    for label, group in by_label.items():
        accs = [r["test_accuracy"] for r in group]
        first = group[0]
        mean = statistics.fmean(accs)
        rows.append(dict(
            label=label, compressor=first["compressor"], memory=first["memory"],
            communicator=first["communicator"], lr=first["lr"], lr_scale=first["lr_scale"],
            momentum_in=first["momentum_in"], optimizer_momentum=first["optimizer_momentum"],
            recipe=first.get("recipe"), advice=first.get("advice"), seeds=[r["seed"] for r in group],
            recipe_arguments=first.get("recipe_arguments") or {},
            accuracy_mean=mean, accuracy_std=statistics.stdev(accs) if len(accs) > 1 else 0.0,
            accuracy_min=min(accs), accuracy_max=max(accs),
            gap_to_dense_points=None if dense is None else 100.0 * (mean - dense),
            diverged_runs=sum(r["diverged"] for r in group),
            epochs=max(r["epochs_run"] for r in group),
            bytes_per_step=statistics.fmean(r["bytes_per_step"] for r in group),
            wire_bytes_per_step=statistics.fmean(r["wire_bytes_per_step"] for r in group),
            last_epoch_bytes_per_step=statistics.fmean(r["last_epoch_bytes_per_step"] for r in group),
            seconds_per_run=statistics.fmean(r["seconds"] for r in group)))
    return rows


#: How the lr column says where the momentum went (nothing: the optimizer's, as dense).
_MOMENTUM_NOTE = {"compressor/memory": " (momentum in the compressor or memory)",
                  "taken over": " (SGD's momentum taken over by the memory)",
                  "folded into lr": " (momentum folded in)", "none": " (no momentum)",
                  "adam, β1 in the compressor or memory": " (AdamW β1 0: the compressor's or memory's momentum)",
                  "adam, β1 taken over by the memory": " (AdamW's β1 taken over by the memory)",
                  "adam, β1 off (folded by the memory)": " (AdamW β1 0: folded by the memory)",
                  "adam, β1 off (folded by the compressor)": " (AdamW β1 0: folded by the compressor)"}

def _row_cells(r: Dict[str, Any], dense_bytes) -> Tuple[str, str, str]:
    """A table row's label (with what its recipe set), lr (with where the momentum went) and
    × fewer bytes than dense: the cells the digits and language-model tables share."""
    label = r["label"] + "".join(f" ({k} {v:g} by its recipe)" for k, v in r["recipe_arguments"].items())
    lr = f"{r['lr']:g}" + _MOMENTUM_NOTE.get(r["momentum_in"], "")
    less = "—" if not dense_bytes or not r["bytes_per_step"] else f"{dense_bytes / r['bytes_per_step']:.1f}"
    return label, lr, less


def _with_recipe_notes(lines: List[str], rows: List[Dict[str, Any]], heading: str) -> str:
    """The table's text, followed by the recipes its rows applied and the rows whose
    settings contradict their compressor's recipe."""
    used = [f"- {r['label']}: {r['recipe']}" for r in rows if r.get("recipe")]
    if used:
        lines += ["", heading, ""] + used
    advised = [f"- {r['label']}: {r['advice']}" for r in rows if r.get("advice")]
    if advised:
        lines += ["", "Rows whose settings contradict their compressor's recipe:", ""] + advised
    return "\n".join(lines) + "\n"



def _pace(options) -> str:
    """The table's words for a schedule, an epoch rhythm and a controller that are not the defaults."""
    words = [", cosine learning rate over the run"] if options.lr_schedule == "cosine" else []
    if options.set_epoch_every:
        words.append(f", set_epoch every {options.set_epoch_every} steps")
    if options.controller:
        words.append(f", quality controller {options.controller}")
    return "".join(words)


def markdown(rows: List[dict], options, workers: int) -> str:
    dense_bytes = next((r["bytes_per_step"] for r in rows if r["label"] == DENSE), None)
    lines = [
        f"Digits CNN, {workers} workers (gloo), {optimizers.describe(_hyper(options))}{_pace(options)} "
        f"(dense's settings; each row's lr column says where a recipe or a component changed "
        f"them), batch "
        f"{options.batch_size} per worker, {options.epochs} epochs, "
        f"{'the optimizer’s default grouping' if options.fusion_num is None else f'fusion-num {options.fusion_num}'}, seeds "
        f"{', '.join(map(str, options.seeds))}; test accuracy over the seeds.",
        "",
        "| compressor | memory | communicator | lr | test accuracy % (mean ± std) | min–max | "
        "gap to dense (points) | diverged | bytes/step/worker handed | on the wire | × less than dense |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = "—" if r["gap_to_dense_points"] is None or r["label"] == DENSE \
            else f"{r['gap_to_dense_points']:+.1f}"
        label, lr, less = _row_cells(r, dense_bytes)
        lines.append(
            f"| {label} | {r['memory']} | {r['communicator']} | {lr} | "
            f"{100 * r['accuracy_mean']:.1f} ± {100 * r['accuracy_std']:.1f} | "
            f"{100 * r['accuracy_min']:.1f}–{100 * r['accuracy_max']:.1f} | {gap} | "
            f"{r['diverged_runs']}/{len(r['seeds'])} | {r['bytes_per_step']:,.0f} | "
            f"{r['wire_bytes_per_step']:,.0f} | {less} |")
    return _with_recipe_notes(lines, rows, "Recipes applied (the lr column is the dense lr × the recipe's "
                                           "lr_scale, ÷ (1 − momentum) where the recipe folds the momentum in):")


def summarise_lm(runs: List[dict], dense_label: Optional[str]) -> List[dict]:
    """One row per label: validation loss mean, sample std, min, max over seeds; its gap to
    dense in percent of dense's loss (positive: worse); bits per symbol; bytes per step."""
    rows, by_label = [], {}
    for run in runs:
        by_label.setdefault(run["label"], []).append(run)
    dense = None
    if dense_label in by_label:
        dense = statistics.fmean(r["valid_loss"] for r in by_label[dense_label])
    for label, group in by_label.items():
        losses = [r["valid_loss"] for r in group]
        first = group[0]
        mean = statistics.fmean(losses)
        rows.append(dict(
            label=label, compressor=first["compressor"], memory=first["memory"],
            memory_repr=first.get("memory_repr"), communicator=first["communicator"],
            lr=first["lr"], lr_scale=first["lr_scale"], clip_mode=first.get("clip_mode"),
            momentum_in=first["momentum_in"], optimizer_momentum=first["optimizer_momentum"],
            recipe=first.get("recipe"), advice=first.get("advice"), seeds=[r["seed"] for r in group],
            recipe_arguments=first.get("recipe_arguments") or {},
            valid_loss_mean=mean, valid_loss_std=statistics.stdev(losses) if len(losses) > 1 else 0.0,
            valid_loss_min=min(losses), valid_loss_max=max(losses),
            bits_per_symbol=lm.bits_per_symbol(mean),
            gap_to_dense_percent=None if dense is None or not math.isfinite(mean)
            else 100.0 * (mean - dense) / dense,
            diverged_runs=sum(r["diverged"] for r in group), steps=max(r["steps"] for r in group),
            bytes_per_step=statistics.fmean(r["bytes_per_step"] for r in group),
            wire_bytes_per_step=statistics.fmean(r["wire_bytes_per_step"] for r in group),
            seconds_per_run=statistics.fmean(r["seconds"] for r in group)))
    return rows


def markdown_lm(rows: List[dict], options, workers: int, parameters: int = 0) -> str:
    """The language-model table: validation loss, bits per symbol, gap to dense in percent."""
    task = lm.sized(lm.get_task(options.task), options.embedding, options.hidden, options.layers)
    dense_bytes = next((r["bytes_per_step"] for r in rows if r["label"] == DENSE), None)
    unit = "character" if options.level == "char" else "word"
    clip = (f"gradient norm clipped to {options.clip:g} (the averaged gradient, or each rank's "
            f"at {options.clip:g}/√{workers} where the row says local)" if options.clip else "no clipping")
    lines = [
        f"{options.task} ({task.model}, {task.layers} layers, width {task.hidden}"
        f"{f', {parameters:,} parameters' if parameters else ''}) on {options.corpus} "
        f"({unit} level), {workers} workers (gloo), {optimizers.describe(_hyper(options))}{_pace(options)} "
        f"(dense's settings; the lr column says where a recipe or a component changed them), "
        f"{clip}, batch {options.batch_size} rows × {task.bptt} per worker, "
        f"{options.steps or DEFAULT_LM_STEPS} steps, seeds {', '.join(map(str, options.seeds))}; "
        f"validation loss in nats per {unit} over the seeds (gap: percent of dense's loss, "
        f"positive is worse).",
        "",
        f"| compressor | memory | communicator | lr | clip | validation loss (mean ± std) | min–max | "
        f"bits/{unit} | gap to dense | diverged | bytes/step/worker | × less than dense |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap = "—" if r["gap_to_dense_percent"] is None or r["label"] == DENSE \
            else f"{r['gap_to_dense_percent']:+.1f}%"
        label, lr, less = _row_cells(r, dense_bytes)
        lines.append(
            f"| {label} | {r['memory']} | {r['communicator']} | {lr} | {r['clip_mode'] or '—'} | "
            f"{r['valid_loss_mean']:.4f} ± {r['valid_loss_std']:.4f} | "
            f"{r['valid_loss_min']:.4f}–{r['valid_loss_max']:.4f} | {r['bits_per_symbol']:.3f} | "
            f"{gap} | {r['diverged_runs']}/{len(r['seeds'])} | {r['bytes_per_step']:,.0f} | {less} |")
    return _with_recipe_notes(lines, rows, "Recipes applied:")



def _hyper(options) -> optimizers.Hyper:
    return optimizers.Hyper(options.optimizer, options.lr, options.momentum, options.weight_decay,
                            tuple(options.betas))
