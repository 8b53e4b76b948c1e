"""Refusing a second momentum.

DGC's memory (momentum correction) and SIGNUM (sign of momentum) keep the momentum
themselves.  If the wrapped optimizer also had one — SGD's ``momentum`` or Adam's first
moment ``betas[0]`` — gradients would be smoothed twice, silently.  Components that own
the momentum call :func:`refuse_optimizer_momentum` from their ``check_optimizer``.
"""
from __future__ import annotations

from typing import List, Tuple


def optimizer_momentum(optimizer) -> List[Tuple[int, str, float]]:
    """(group index, setting, value) for every parameter group that carries a momentum."""
    found = []
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        momentum = group.get("momentum", 0) or 0
        if momentum > 0:
            found.append((index, "momentum", momentum))
        betas = group.get("betas")
        if betas and betas[0] > 0:
            found.append((index, "betas[0]", betas[0]))
    return found


def refuse_optimizer_momentum(optimizer, component: str, advice: str) -> None:
    """ValueError naming the group and setting when ``optimizer`` has its own momentum."""
    found = optimizer_momentum(optimizer)
    if found:
        index, setting, value = found[0]
        raise ValueError(
            f"{component} applies momentum itself, but parameter group {index} of "
            f"{type(optimizer).__name__} has {setting}={value}, which would apply a second one. "
            f"{advice}")
