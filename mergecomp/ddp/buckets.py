"""Compression state kept per DDP bucket, and how it follows the parameters when DDP
re-buckets (after its first iteration, or in a restarted job) or a checkpoint comes back.

A bucket is identified by its :data:`BucketKey`, the (parameter name, elements) it holds in
order; state is kept under ``"group<i>"`` for bucket ``i``, as the optimizer names its groups.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, Mapping, Optional, Tuple

import torch

from .. import checkpoint
from ..compressors.base import ParamView
from ..runtime.regroup import CannotRegroup, regroup_state

#: What the state remembers of a bucket's layout: (parameter name, elements) in order.
BucketKey = Tuple[Tuple[str, int], ...]


def regrouped(state: Dict[str, Any], old: Mapping[int, BucketKey], new: Mapping[int, BucketKey],
              named: bool) -> Optional[Dict[str, Any]]:
    """``state`` (a communicator's ``state_dict()``) moved from the ``old`` buckets to the
    ``new`` by parameter, or None when it cannot follow (then it starts afresh, with a
    warning if it held anything)."""
    try:
        if not named:
            raise CannotRegroup("the parameters have no names: build the HookState with the model, "
                                "or call attach(model) after unpickling it")
        return regroup_state(state, {f"group{i}": _pieces(key) for i, key in old.items()},
                             {f"group{i}": _pieces(key) for i, key in new.items()})
    except (CannotRegroup, KeyError, ValueError) as error:
        if any(_holds_tensors(v) for v in state.values()):
            warnings.warn(f"mergecomp: DDP changed its buckets and the compression state could not "
                          f"follow the parameters ({error}); it starts afresh", RuntimeWarning)
        return None


def group_specs(shapes: Mapping[str, tuple], layouts: Mapping[int, BucketKey]) -> Dict[str, checkpoint.GroupSpec]:
    """What each held bucket exchanges (for checking a checkpoint against it), from the
    model's parameter ``shapes`` (name → (shape, dtype)) when they are known."""
    specs = {}
    for index, key in layouts.items():
        known = [shapes.get(name) for name, _ in key]
        whole = all(k is not None and k[0].numel() == numel for k, (_, numel) in zip(known, key))
        views, offset = [], 0
        for (name, numel), k in zip(key, known):
            views.append(ParamView(name, k[0] if whole else torch.Size([numel]), offset))
            offset += numel
        dtypes = {k[1] for k in known if k is not None}
        specs[f"group{index}"] = checkpoint.GroupSpec(
            offset, dtypes.pop() if whole and len(dtypes) == 1 else None, tuple(views) if whole else None)
    return specs


def read_layouts(saved: Any, where: str) -> Dict[int, BucketKey]:
    """The ``"layouts"`` of a saved hook state, or CheckpointError saying what is wrong."""
    try:
        return {int(i): tuple((str(n), int(k)) for n, k in key) for i, key in saved.items()}
    except (AttributeError, TypeError, ValueError) as error:
        raise checkpoint.CheckpointError(
            f"{where}: its bucket layouts are not {{bucket: [[parameter, elements], ...]}} ({error}); "
            "the file is damaged") from None


def _pieces(key: BucketKey):
    return [(name, 0, numel) for name, numel in key]


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False
