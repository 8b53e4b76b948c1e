"""DeMo's decoupled momentum: each rank's momentum is the error-feedback residual.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (2024),
Algorithm 1: m ← β·m + g; q = the momentum's fast components (the ``demo`` compressor);
m ← m − q; the ranks' q are gathered and averaged; the optimizer applies the average.

That is residual error feedback with a decaying residual (``residual`` memory, β < 1):
the residual is the momentum, and what was sent leaves it.  This class names it, with
DeMo's β, and refuses an optimizer with momentum of its own (the momentum would be applied
twice).  Nothing extra travels: the state is one momentum tensor per group, on this rank.
"""
from __future__ import annotations

from typing import Optional

from . import register
from .base import check_number
from .residual import ResidualMemory
from ..momentum import OWNS, refuse_optimizer_momentum


@register("demo")
class DeMoMemory(ResidualMemory):
    """m ← β·m + g is compressed; m − decode(payload) is kept (β = ``momentum``, 0.999 in the paper)."""

    needs_plain_optimizer = True
    momentum_role = OWNS

    def __init__(self, momentum: float = 0.999, clip_norm: Optional[float] = None):
        momentum = check_number(momentum, "demo memory momentum (β)", 0.0, 1.0, high_open=True,
                                advice="0.999 is the paper's; the optimizer's own momentum must be 0.")
        super().__init__(beta=momentum, gamma=1.0, clip_norm=clip_norm)
        self.momentum = momentum

    @staticmethod
    def check_optimizer(optimizer) -> None:
        """ValueError when ``optimizer`` has a momentum (SGD's or Adam's first moment)."""
        refuse_optimizer_momentum(
            optimizer, "the demo memory (DeMo's decoupled momentum)",
            "Use SGD with momentum=0 (weight decay is fine) and give the momentum to the memory, "
            "e.g. memories.create('demo', momentum=0.999).")

    def __repr__(self):
        clip = "" if self.clip_norm is None else f", clip_norm={self.clip_norm}"
        return f"DeMoMemory(momentum={self.momentum}{clip})"
