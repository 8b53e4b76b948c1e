"""The low-communication rows of the benchmarks: DiLoCo and its variants as a method family.

``benchmarks/convergence.py --diloco SPEC ...`` (accuracy and validation loss) and
``benchmarks/headline.py`` (step time) build these rows here, so both measure the same
configurations.  A spec is ``H=<sync_every>`` followed by ``:key=value`` pairs:

    H=8                                   DiLoCo, an outer step every 8 inner steps
    H=8:fragments=2:overlap=1             streaming DiLoCo, 2 fragments, exchange behind 1 step
    H=8:compressor=sparseloco             SparseLoCo: chunked top-k, 2-bit values, residual memory
    H=8:compressor=topk:compress_ratio=0.03:memory=residual
    H=8:outer_lr=0.7:outer_momentum=0.9   the outer SGD (default: DiLoCo's lr, and the outer
                                          momentum its recipe gives for the inner SGD)

Keys: ``fragments``, ``overlap``, ``mix``, ``outer_lr``, ``outer_momentum``, ``nesterov``
(DiLoCo's arguments), ``compressor``, ``memory``, ``comm`` (how the pseudo-gradient travels:
default uncompressed allreduce, the memory and communicator the compressor recommends), and
any other key is the compressor's constructor argument.  The inner optimizer is the
benchmark's dense optimizer (SGD or AdamW, with dense's settings), so a DiLoCo row differs
from dense by the outer step alone.

Time to a target loss joins the two: the steps a validation-loss curve takes to reach the
target (linear between evaluations) times the step time the headline measured for that
method on a link (:func:`time_to_target`, :func:`time_to_target_table`; ``benchmarks/plot.py``
writes the table of a results folder).  A fewer-exchanges method can send less per step and
still lose here if it needs more steps.
"""
from __future__ import annotations

import ast
import inspect
import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

import mergecomp
from mergecomp import compressors, memories
from mergecomp.lowcomm import recommended_outer_momentum

#: The DiLoCo arguments a spec may set, and their types.
_DILOCO_KEYS = {"fragments": int, "overlap": int, "mix": float, "outer_lr": float,
                "outer_momentum": float, "nesterov": bool}
#: A spec's label starts with this, so tables and plots tell the family apart.
PREFIX = "diloco:"


@dataclass
class DiLoCoSpec:
    """One DiLoCo row: its schedule, outer step and how the pseudo-gradient travels."""

    label: str
    sync_every: int
    diloco: Dict[str, Any] = field(default_factory=dict)
    compressor: str = "none"
    kwargs: Dict[str, Any] = field(default_factory=dict)
    memory: Optional[str] = None
    comm: Optional[str] = None
    family: str = "diloco"


def parse(text: str) -> DiLoCoSpec:
    """``H=<n>[:key=value...]`` (with or without a leading ``diloco:``) → :class:`DiLoCoSpec`;
    ValueError naming the part that is wrong."""
    body = text[len(PREFIX):] if text.startswith(PREFIX) else text
    first, *pairs = body.split(":")
    key, sep, raw = first.partition("=")
    if key != "H" or not sep:
        raise ValueError(f"DiLoCo spec {text!r} must start with H=<inner steps between exchanges>, "
                         f"e.g. 'H=8' or 'H=8:fragments=2:overlap=1'")
    try:
        sync_every = int(raw)
    except ValueError:
        raise ValueError(f"DiLoCo spec {text!r}: H must be an integer, got {raw!r}") from None
    spec = DiLoCoSpec(label=PREFIX + body, sync_every=sync_every)
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"DiLoCo spec {text!r}: {pair!r} is not key=value; write e.g. 'H=8:fragments=2'")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if key in _DILOCO_KEYS:
            wanted = _DILOCO_KEYS[key]
            if wanted is bool and not isinstance(value, bool) or wanted is int and (
                    isinstance(value, bool) or not isinstance(value, int)) or wanted is float and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"DiLoCo spec {text!r}: {key} must be {wanted.__name__}, got {raw!r}")
            spec.diloco[key] = value
        elif key == "compressor":
            compressors.get(str(value))  # an unknown name raises with the closest match
            spec.compressor = str(value)
        elif key in ("memory", "comm"):
            setattr(spec, key, str(value))
        else:
            spec.kwargs[key] = value
    return spec


def build(spec: DiLoCoSpec, inner: torch.optim.Optimizer, model: torch.nn.Module,
          backend=None, **entry_options) -> Tuple[mergecomp.DiLoCo, Dict[str, Any]]:
    """DiLoCo around ``inner`` (the user's SGD or AdamW for ``model``), as ``spec`` says;
    (optimizer, the settings that describe the row, in the convergence benchmark's keys).
    ``entry_options`` go to ``mergecomp.DiLoCo`` as they are (the quality controller's)."""
    compressor = compressors.create(spec.compressor, **spec.kwargs)
    memory_name = spec.memory or compressor.recommended_memory
    comm_name = spec.comm or compressor.recommended_communicator
    outer = outer_settings(spec, inner)
    group = inner.param_groups[0]
    optimizer = mergecomp.DiLoCo(inner, model=model, sync_every=spec.sync_every, compressor=compressor,
                                 memory=memories.create(memory_name) if spec.memory else memories.recommended(compressor),
                                 communicator=comm_name,
                                 backend=backend, **outer, **entry_options)
    settings = {"compressor": repr(compressor), "memory": memory_name, "communicator": comm_name,
                "memory_repr": repr(optimizer.memory), "clip_mode": "inner", "recipe_arguments": {},
                "lr": group["lr"], "lr_scale": 1.0, "optimizer_momentum": group.get("momentum", 0.0),
                "momentum_in": "optimizer", "optimizer": type(inner).__name__.lower(),
                "betas": list(group["betas"]) if "betas" in group else None,
                "recipe": None, "advice": None, "sync_every": spec.sync_every,
                "outer_lr": outer["outer_lr"], "outer_momentum": outer["outer_momentum"],
                "fragments": outer["fragments"], "overlap": outer["overlap"]}
    return optimizer, settings


def outer_settings(spec: DiLoCoSpec, inner: torch.optim.Optimizer) -> Dict[str, Any]:
    """The spec's DiLoCo arguments with DiLoCo's defaults filled in, the outer momentum from
    its recipe for ``inner`` (:func:`mergecomp.lowcomm.recommended_outer_momentum`)."""
    defaults = {name: parameter.default for name, parameter
                in inspect.signature(mergecomp.DiLoCo.__init__).parameters.items()
                if name in _DILOCO_KEYS and name != "mix"}
    defaults["outer_momentum"] = recommended_outer_momentum(inner)
    return {**defaults, **spec.diloco}


def note(runs) -> str:
    """A paragraph for a results table with DiLoCo rows (empty without): what they share."""
    mine = {}
    for run in runs:
        if run["label"].startswith(PREFIX):
            mine.setdefault(run["label"], run)
    if not mine:
        return ""
    outer = sorted({(r["outer_lr"], r["outer_momentum"]) for r in mine.values()})
    return ("\nDiLoCo rows (diloco:…): the dense SGD above is each rank's inner optimizer; outer SGD with "
            "Nesterov momentum at (lr, momentum) " + ", ".join(f"({lr:g}, {m:g})" for lr, m in outer)
            + "; evaluated at the anchor, the weights every rank shares; bytes per inner step "
            "(an exchange every H steps, agreement checks included).\n")


# -- time to a target loss ------------------------------------------------------------------------
#: A curve: the evaluations of one run (or the mean of its seeds), ``{"step", "valid_loss"}`` each,
#: in step order, as ``benchmarks/convergence.py`` writes them.
Curve = List[Dict[str, float]]


def mean_curve(curves: Sequence[Curve]) -> Curve:
    """The mean validation loss of several seeds' curves, over the evaluations they share."""
    if not curves:
        raise ValueError("mean_curve() needs at least one curve")
    length = min(len(c) for c in curves)
    steps = [c[i]["step"] for c in curves for i in range(length)]
    if any(curves[0][i]["step"] != c[i]["step"] for c in curves for i in range(length)):
        raise ValueError(f"the seeds' curves were evaluated at different steps ({sorted(set(steps))}): "
                         "average curves of runs with the same --eval-every")
    return [{"step": curves[0][i]["step"], "valid_loss": statistics.mean(c[i]["valid_loss"] for c in curves)}
            for i in range(length)]


def loss_at(curve: Curve, step: float) -> float:
    """The curve's validation loss at ``step``, linear between the two evaluations around it."""
    if not curve or not curve[0]["step"] <= step <= curve[-1]["step"]:
        span = f"{curve[0]['step']}..{curve[-1]['step']}" if curve else "nothing"
        raise ValueError(f"step {step} is outside the curve's evaluations ({span})")
    for before, after in zip(curve, curve[1:]):
        if before["step"] <= step <= after["step"]:
            share = (step - before["step"]) / (after["step"] - before["step"])
            return before["valid_loss"] + share * (after["valid_loss"] - before["valid_loss"])
    return curve[0]["valid_loss"]


def steps_to_target(curve: Curve, target: float) -> Optional[float]:
    """The first step at which the curve is at or below ``target``, linear between the two
    evaluations around the crossing (a fractional step); None when it never gets there."""
    for before, after in zip(curve, curve[1:]):
        if before["valid_loss"] <= target:
            return float(before["step"])
        if after["valid_loss"] <= target:
            share = (before["valid_loss"] - target) / (before["valid_loss"] - after["valid_loss"])
            return before["step"] + share * (after["step"] - before["step"])
    return float(curve[-1]["step"]) if curve and curve[-1]["valid_loss"] <= target else None


def time_to_target(curve: Curve, step_s: float, target: float) -> Optional[float]:
    """Seconds to reach ``target``: :func:`steps_to_target` × the measured seconds per step
    (None when the curve never reaches it).  The exchange's cost is inside ``step_s`` (a
    DiLoCo step time is a window's time over its H inner steps, the exchange included)."""
    if not step_s > 0:
        raise ValueError(f"step_s must be a positive number of seconds per step, got {step_s!r}")
    steps = steps_to_target(curve, target)
    return None if steps is None else steps * step_s


def time_to_target_table(curves: Dict[str, Curve], timed: Dict[str, str], cells: Dict[str, Dict[str, float]],
                         target: float, baseline: str) -> str:
    """A markdown table: per method (a label of ``curves``), the headline configuration that
    times it (``timed``), and per link (``cells``: link → configuration → seconds per step)
    the steps to ``target``, the time to it and its ratio to ``baseline``'s time (> 1:
    slower than the baseline)."""
    links = list(cells)
    head = ["method", "timed as", "steps to target"]
    for link in links:
        head += [f"s/step {link}", f"time to target {link} (s)", f"× {baseline} {link}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    base_steps = steps_to_target(curves[baseline], target) if baseline in curves else None
    for label, curve in curves.items():
        steps = steps_to_target(curve, target)
        row = [label, timed.get(label) or "not timed", "not reached" if steps is None else f"{steps:.0f}"]
        for link in links:
            step_s = cells[link].get(timed.get(label, ""))
            base_s = cells[link].get(timed.get(baseline, ""))
            if step_s is None:
                row += ["", "", ""]
                continue
            row.append(f"{step_s:.3f}")
            if steps is None:
                row += ["not reached", ""]
                continue
            seconds = steps * step_s
            ratio = "" if base_steps is None or base_s is None else f"{seconds / (base_steps * base_s):.2f}"
            row += [f"{seconds:.0f}", ratio]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
