"""The loop's gradient clipping, moved before a momentum that the exchange carries.

A memory that takes SGD's momentum over (top-k's, GradDrop's, DGC's) runs it *before* the
exchange, so what reaches ``p.grad`` is a momentum, not a gradient.  A loop that clips
``p.grad`` after the exchange, as under DDP, then clips the momentum: each step up to
``lr / (1 − m)`` times the threshold, where dense heavy-ball momentum sums clipped
gradients and, with gradients that point different ways from step to step, takes steps
several times smaller.  Measured on a character transformer under ``SGD(lr=0.5,
momentum=0.9)`` with the averaged gradient clipped to 1, top-k at its defaults diverged
and DGC trailed dense; with each rank's gradient clipped before the momentum both trained
better (docs/results.md#loop-clip).

So once the loop is seen clipping (:class:`mergecomp.runtime.drift.ClipWatch`: the averages'
norm fell between the exchange and ``step()``, by a factor that is not a power of two), the
threshold it clipped at is handed to the memory (the same number on every rank: it is read
from the averages every rank holds), and from the next step the memory clips each rank's
gradient before its momentum: by the factor the whole model's clipping would take, its
norm estimated from this step's norms of the groups computed so far and the previous
step's of the groups still to come (groups are compressed one by one during backward;
the last one sees the whole of this step).  The mean of the ranks' clipped gradients is
then within the threshold, the momentum of clipped gradients is dense's, and the loop's own
clipping rarely has anything left to do.  A memory given ``clip_norm`` (explicit local
clipping) keeps it and does not follow the loop; one that takes an Adam's first moment
over does not either (Adam divides by its own scale, and its runs were measured without it).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from ..staging import StagedDict


class LoopClip:
    """The loop's clipping threshold (None until it is seen) and each group's last squared
    norm, staged with the memory's state (a dropped step leaves them as they were)."""

    def __init__(self):
        self.threshold: Optional[float] = None
        self.norms = StagedDict()  # group → this rank's squared gradient norm, last step

    def follow(self, threshold: float) -> None:
        if not (isinstance(threshold, float) and math.isfinite(threshold) and threshold > 0.0):
            raise ValueError(f"a clipping threshold must be a positive finite float, got {threshold!r}")
        self.threshold = threshold

    def scale(self, tensor: torch.Tensor, name: str) -> Optional[float]:
        """The factor ``tensor`` (group ``name``'s gradient on this rank) is multiplied by
        before the momentum, or None (no threshold yet, or short enough)."""
        if self.threshold is None:
            return None
        squared = float(torch.linalg.vector_norm(tensor, dtype=torch.float32)) ** 2
        self.norms[name] = squared
        total = sum(self.norms.values())  # this step's where computed, else the last step's
        if total <= self.threshold ** 2:
            return None
        return self.threshold / math.sqrt(total)

    def commit(self) -> None:
        """Keep this step's norms, and only them (a group no longer exchanged, after a plan
        switch, stops counting)."""
        this_step = {k: self.norms[k] for k in self.norms if self.norms.is_pending(k)}
        if this_step:
            self.norms.replace(this_step)

    def rollback(self) -> None:
        self.norms.rollback()

    def state_dict(self) -> Dict[str, Any]:
        """Empty until a threshold is seen (so states of runs that never clip are as before)."""
        if self.threshold is None:
            return {}
        return {"threshold": self.threshold, "norms": dict(self.norms.committed())}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.threshold = None
        self.norms.replace({})
        if state:
            self.follow(float(state["threshold"]))
            self.norms.replace({str(k): float(v) for k, v in state.get("norms", {}).items()})

    @staticmethod
    def check_state(state: Any, what: str) -> None:
        """ValueError naming what is wrong with a saved ``loop_clip`` state."""
        if not isinstance(state, dict) or set(state) - {"threshold", "norms"} or "threshold" not in state:
            raise ValueError(f"{what} loop_clip state must be a dict with 'threshold' (and 'norms'), got {state!r}")
        threshold = state["threshold"]
        if not (isinstance(threshold, float) and math.isfinite(threshold) and threshold > 0.0):
            raise ValueError(f"{what} loop_clip threshold must be a positive finite float, got {threshold!r}")
        norms = state.get("norms", {})
        if not isinstance(norms, dict) or not all(isinstance(v, float) and math.isfinite(v) and v >= 0.0
                                                  for v in norms.values()):
            raise ValueError(f"{what} loop_clip norms must map groups to finite squared norms ≥ 0, got {norms!r}")
