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
benchmark's dense SGD (its learning rate and momentum), so a DiLoCo row differs from dense
by the outer step alone.
"""
from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

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


def build(spec: DiLoCoSpec, lr: float, momentum: float, model: torch.nn.Module,
          backend=None) -> Tuple[mergecomp.DiLoCo, Dict[str, Any]]:
    """DiLoCo around SGD(lr, momentum) for ``model``, as ``spec`` says; (optimizer, the
    settings that describe the row, in the convergence benchmark's keys)."""
    compressor = compressors.create(spec.compressor, **spec.kwargs)
    memory_name = spec.memory or compressor.recommended_memory
    comm_name = spec.comm or compressor.recommended_communicator
    inner = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    outer = outer_settings(spec, inner)
    optimizer = mergecomp.DiLoCo(inner, model=model, sync_every=spec.sync_every, compressor=compressor,
                                 memory=memories.create(memory_name), communicator=comm_name,
                                 backend=backend, **outer)
    settings = {"compressor": repr(compressor), "memory": memory_name, "communicator": comm_name,
                "memory_repr": repr(optimizer.memory), "clip_mode": "inner", "recipe_arguments": {},
                "lr": lr, "lr_scale": 1.0, "optimizer_momentum": momentum, "momentum_in": "optimizer",
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
