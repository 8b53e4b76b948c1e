"""The Scheduler contract: turn the backward-ordered gradient list into a Plan."""
from __future__ import annotations

from typing import Sequence

from ..plan import ParamInfo, Plan


class Scheduler:
    """Base class of schedulers.

    ``plan(params)`` receives the trainable parameters in the order their gradients
    became ready in the first backward pass and returns a :class:`Plan`.  It runs on
    rank 0 only; the optimizer broadcasts the result, so a scheduler may use local
    measurements without breaking the same-collectives-on-every-rank rule.
    """

    name = "scheduler"

    def plan(self, params: Sequence[ParamInfo]) -> Plan:
        raise NotImplementedError(f"{type(self).__name__} must implement plan()")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def split_by_type(params: Sequence[ParamInfo]):
    """Cut the ordered list wherever dtype or device changes: a fused buffer has one of each."""
    runs, current = [], []
    for p in params:
        if current and (p.dtype, p.device) != (current[-1].dtype, current[-1].device):
            runs.append(current)
            current = []
        current.append(p)
    if current:
        runs.append(current)
    return runs
