"""Move per-group state to a new plan, so that switching plans loses nothing.

Error-feedback memories (and a few compressors) keep state per group: a flat tensor the
size of the group's buffer (a residual, a velocity, a momentum).  When the scheduler
switches plans, each such tensor is cut into its parameters' pieces (element ranges: a
sliced parameter has several) and the new groups' pieces are cut from them in the new
order (zeros for a parameter that had no state).  The sum of everything is unchanged, so
error feedback stays exact across the switch.

State kept per parameter view of a group (per-layer PowerSGD's warm-start queries and
errors, ``{group: {view: tensor}}``) follows each view into whichever new group holds the
same view (the same parameter, or the same slice of it).  State that is neither
(a flat low-rank matrix of a whole group, a parameter server's shard residuals held on
other ranks, a view the new plan cuts differently) cannot move; :func:`regroup_state`
raises :class:`CannotRegroup` naming it, and the caller keeps the current plan.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from ..plan import CannotRegroup  # what a plan switch raises, defined beside the plan

#: group name → [(parameter name, first element, end element)] in buffer order
Layout = Dict[str, List[Tuple[str, int, int]]]


def group_sizes(layout: Layout) -> Dict[str, int]:
    """Elements per group of ``layout``."""
    return {group: sum(stop - start for _, start, stop in pieces) for group, pieces in layout.items()}


def _pieces(tensors: Dict[str, torch.Tensor], layout: Layout) -> Dict[str, List[Tuple[int, int, torch.Tensor]]]:
    """{parameter: [(start, stop, its state for those elements)]} from per-group tensors."""
    pieces: Dict[str, List[Tuple[int, int, torch.Tensor]]] = {}
    for group, value in tensors.items():
        offset = 0
        flat = value.reshape(-1)
        for param, start, stop in layout[group]:
            pieces.setdefault(param, []).append((start, stop, flat.narrow(0, offset, stop - start)))
            offset += stop - start
    return pieces


def _cut(pieces: List[Tuple[int, int, torch.Tensor]], start: int, stop: int, zeros) -> List[torch.Tensor]:
    """Elements ``start:stop`` of one parameter's state, from whichever old pieces hold them
    (zeros where none does)."""
    parts, at = [], start
    for first, end, value in sorted(pieces, key=lambda piece: piece[0]):
        low, high = max(first, at), min(end, stop)
        if low >= high:
            continue
        if low > at:
            parts.append(zeros(low - at))
        parts.append(value[low - first:high - first])
        at = high
    if at < stop:
        parts.append(zeros(stop - at))
    return parts


def regroup_tensors(tensors: Dict[str, torch.Tensor], old: Layout, new: Layout) -> Dict[str, torch.Tensor]:
    """Per-group flat tensors of ``old`` → per-group flat tensors of ``new``.

    Pieces are element ranges of parameters, so a parameter cut into slices differently
    (or not at all) in the two layouts keeps every element's state."""
    if not tensors:
        return {}
    pieces = _pieces(tensors, old)
    like = next(iter(tensors.values()))

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=like.dtype, device=like.device)

    result = {}
    for group, members in new.items():
        if any(p in pieces for p, _, _ in members):
            result[group] = torch.cat([part for p, start, stop in members
                                       for part in _cut(pieces.get(p, []), start, stop, zeros)])
    return result


def _is_group_tensors(value: Any, old: Layout) -> bool:
    return (isinstance(value, dict) and value and all(k in old for k in value)
            and all(isinstance(v, torch.Tensor) for v in value.values()))


def _is_view_state(value: Any, old: Layout) -> bool:
    return (isinstance(value, dict) and value and all(k in old for k in value)
            and all(isinstance(v, dict) and all(isinstance(t, torch.Tensor) for t in v.values())
                    for v in value.values()))


def _view_key(view: str, members: List[Tuple[str, int, int]]):
    """The (parameter, start, stop) of ``members`` that a view named ``view`` stands for (a
    parameter's name, or ``name[start:stop]`` for a slice), or None."""
    for param, start, stop in members:
        if view == param or view == f"{param}[{start}:{stop}]":
            return param, start, stop
    return None


def regroup_views(state: Dict[str, Dict[str, torch.Tensor]], old: Layout, new: Layout,
                  where: str = "state") -> Dict[str, Dict[str, torch.Tensor]]:
    """``{group: {view: tensor}}`` of ``old`` → the same tensors under the ``new`` group that
    holds each view, unchanged; a view the new plan cuts differently raises CannotRegroup."""
    holder = {}
    for group, members in new.items():
        for param, start, stop in members:
            holder.setdefault(param, []).append((group, start, stop))
    moved: Dict[str, Dict[str, torch.Tensor]] = {}
    for group, views in state.items():
        for view, tensor in views.items():
            key = _view_key(view, old[group])
            places = holder.get(key[0], []) if key else []
            target = [g for g, start, stop in places if (key[0], start, stop) == key]
            if key is None or not target or (view == key[0] and len(places) != 1):
                raise CannotRegroup(f"{where} holds state of view {view!r} of group {group!r}, which the "
                                    "new plan cuts differently")
            moved.setdefault(target[0], {})[view] = tensor
    return moved


def regroup_state(state: Any, old: Layout, new: Layout, where: str = "state") -> Any:
    """Walk a state dict and regroup every {group name: tensor} mapping in it.

    Per-group counters and measurements (``{group: int}``, e.g. a step count seeding shared
    randomness; ``{group: float}`` or ``{group: [float, ...]}``, e.g. the norms a memory
    recorded while it waited for the loop's clipping threshold) restart empty for the new
    groups, identically on every rank: they describe the old grouping.  Anything else keyed
    by group names raises :class:`CannotRegroup`.
    """
    if not isinstance(state, dict):
        return state
    if _is_group_tensors(state, old):
        sizes = group_sizes(old)
        wrong = [g for g, t in state.items() if t.numel() != sizes[g]]
        if wrong:
            raise CannotRegroup(f"{where} holds tensors for groups {wrong} that are not shaped like "
                                "the group's gradient buffer")
        return regroup_tensors(state, old, new)
    if _is_view_state(state, old):
        return regroup_views(state, old, new, where)
    if state and all(k in old for k in state):
        if all(_is_measure(v) for v in state.values()):
            return {}
        raise CannotRegroup(f"{where} holds per-group values of type "
                            f"{sorted({type(v).__name__ for v in state.values()})}")
    if any(isinstance(k, str) and k.split("/")[0] in old and k not in old for k in state):
        raise CannotRegroup(f"{where} holds state for parts of groups ({sorted(state)[:3]}...), "
                            "e.g. a parameter server's shards")
    return {k: regroup_state(v, old, new, f"{where}.{k}") for k, v in state.items()}


def _is_measure(value: Any) -> bool:
    """A per-group counter or measurement: a number, or a list of numbers (not a tensor)."""
    if isinstance(value, (list, tuple)):
        return all(_is_measure(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
