"""Move per-group state to a new plan, so that switching plans loses nothing.

Error-feedback memories (and a few compressors) keep state per group: a flat tensor the
size of the group's buffer (a residual, a velocity, a momentum).  When the scheduler
switches plans, each such tensor is cut into its parameters' pieces and the pieces are
concatenated in the new groups' order (zeros for a parameter that had no state).  The
sum of everything is unchanged, so error feedback stays exact across the switch.

State that is not shaped like its group (PowerSGD's low-rank matrices, a parameter
server's shard residuals held on other ranks) cannot move this way; :func:`regroup_state`
raises :class:`CannotRegroup` naming it, and the caller keeps the current plan.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

#: group name → [(parameter name, numel)] in buffer order
Layout = Dict[str, List[Tuple[str, int]]]


class CannotRegroup(Exception):
    """The state holds something that cannot follow its parameters into new groups."""


def _pieces(tensors: Dict[str, torch.Tensor], layout: Layout) -> Dict[str, torch.Tensor]:
    pieces = {}
    for group, value in tensors.items():
        offset = 0
        flat = value.reshape(-1)
        for param, numel in layout[group]:
            pieces[param] = flat.narrow(0, offset, numel)
            offset += numel
    return pieces


def regroup_tensors(tensors: Dict[str, torch.Tensor], old: Layout, new: Layout) -> Dict[str, torch.Tensor]:
    """Per-group flat tensors of ``old`` → per-group flat tensors of ``new``."""
    if not tensors:
        return {}
    pieces = _pieces(tensors, old)
    like = next(iter(tensors.values()))
    result = {}
    for group, params in new.items():
        parts = [pieces[p] if p in pieces else torch.zeros(n, dtype=like.dtype, device=like.device)
                 for p, n in params]
        if any(p in pieces for p, _ in params):
            result[group] = torch.cat(parts)
    return result


def _is_group_tensors(value: Any, old: Layout) -> bool:
    return (isinstance(value, dict) and value and all(k in old for k in value)
            and all(isinstance(v, torch.Tensor) for v in value.values()))


def regroup_state(state: Any, old: Layout, new: Layout, where: str = "state") -> Any:
    """Walk a state dict and regroup every {group name: tensor} mapping in it.

    Per-group counters (``{group: int}``, e.g. a step count seeding shared randomness)
    restart at zero for the new groups, identically on every rank.  Anything else keyed
    by group names raises :class:`CannotRegroup`.
    """
    if not isinstance(state, dict):
        return state
    if _is_group_tensors(state, old):
        sizes = {g: sum(n for _, n in params) for g, params in old.items()}
        wrong = [g for g, t in state.items() if t.numel() != sizes[g]]
        if wrong:
            raise CannotRegroup(f"{where} holds tensors for groups {wrong} that are not shaped like "
                                "the group's gradient buffer")
        return regroup_tensors(state, old, new)
    if state and all(k in old for k in state):
        if all(isinstance(v, int) for v in state.values()):
            return {}
        raise CannotRegroup(f"{where} holds per-group values of type "
                            f"{sorted({type(v).__name__ for v in state.values()})}")
    if any(isinstance(k, str) and k.split("/")[0] in old and k not in old for k in state):
        raise CannotRegroup(f"{where} holds state for parts of groups ({sorted(state)[:3]}...), "
                            "e.g. a parameter server's shards")
    return {k: regroup_state(v, old, new, f"{where}.{k}") for k, v in state.items()}
