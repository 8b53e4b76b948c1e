"""When a low-communication run exchanges: which fragment, after which inner step.

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023) exchanges the whole model every H inner steps.  Streaming DiLoCo (Douillard
et al., "Streaming DiLoCo with overlapping communication", 2025) cuts the model into K
fragments, each still exchanged every H steps but at staggered offsets, so the bytes of one
outer step are spread over H instead of arriving at once; and it lets each exchange run
while the next ``overlap`` inner steps compute.

Here fragment f (of K) has offset o_f = ⌊f·H / K⌋; its exchange is launched after inner step
t whenever t > 0 and (t − o_f) mod H = 0 (fragment 0 at H, 2H, ...; fragment f first at
o_f), and finished after inner step t + ``overlap``.  At most one exchange is in flight at
a time (``overlap`` is at most the gap between consecutive offsets), so every rank finishes
what it launched, in launch order, before the next launch: the step lifecycle's contract.
"""
from __future__ import annotations

from typing import List, Sequence

from ..schedulers.fixed import balanced_cuts


def _positive_int(value, what: str, advice: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be an integer ≥ 1, got {value!r}. {advice}")
    return value


class SyncSchedule:
    """Fragment offsets and the inner steps at which each fragment's exchange starts and ends."""

    def __init__(self, sync_every: int, fragments: int = 1, overlap: int = 0):
        self.sync_every = _positive_int(sync_every, "sync_every (H, inner steps between two exchanges of a "
                                        "fragment)", "DiLoCo uses H in the hundreds; H = 1 exchanges every step.")
        self.fragments = _positive_int(fragments, "fragments (K)", "1 is DiLoCo; K > 1 streams K fragments.")
        if fragments > sync_every:
            raise ValueError(f"fragments={fragments} is more than sync_every={sync_every}: each fragment "
                             f"needs its own inner step to start its exchange; use fragments ≤ {sync_every}")
        self.offsets = [f * sync_every // fragments for f in range(fragments)]
        gaps = [b - a for a, b in zip(self.offsets, self.offsets[1:] + [self.offsets[0] + sync_every])]
        self.max_overlap = min(min(gaps), sync_every - 1)
        if isinstance(overlap, bool) or not isinstance(overlap, int) or not 0 <= overlap <= self.max_overlap:
            raise ValueError(
                f"overlap must be an integer in [0, {self.max_overlap}] (inner steps an exchange runs behind; "
                f"at most the {min(gaps)} steps between two fragments' exchanges and less than "
                f"sync_every={sync_every}, so one exchange is in flight at a time), got {overlap!r}")
        self.overlap = overlap

    def launching(self, step: int) -> List[int]:
        """The fragments whose exchange starts after inner step ``step`` (1-based)."""
        return [f for f, offset in enumerate(self.offsets)
                if step > 0 and step >= offset and (step - offset) % self.sync_every == 0]

    def finishing(self, step: int) -> List[int]:
        """The fragments whose exchange, launched ``overlap`` steps earlier, ends after ``step``."""
        return self.launching(step - self.overlap) if step - self.overlap > 0 else []

    def __repr__(self) -> str:
        return f"SyncSchedule(sync_every={self.sync_every}, fragments={self.fragments}, overlap={self.overlap})"


def fragment_cuts(numels: Sequence[int], fragments: int) -> List[int]:
    """Where to cut the parameters (in model order) into ``fragments`` contiguous runs of
    about equal size (the fixed scheduler's balanced cuts); ValueError when the model has
    too few parameters to make that many."""
    cuts = balanced_cuts(list(numels), fragments)
    if len(cuts) + 1 != fragments:
        raise ValueError(f"fragments={fragments} cannot be made from {len(numels)} parameter tensors "
                         f"({sum(numels)} elements; a tensor is never split and a larger one fills "
                         f"several shares): use fragments ≤ {len(cuts) + 1}")
    return cuts
