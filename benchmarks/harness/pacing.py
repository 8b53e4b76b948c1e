"""The pace of a convergence run between its steps: the learning-rate schedule and the epochs.

Users train with a schedule (a cosine over the run is the common one for language models)
and call ``set_epoch`` at their own rhythm, which drives the epoch-scheduled parts of a
compressor (DGC's density warm-up runs over its first epochs).  A compressor that holds up
at a constant rate with one epoch per pass over the data can fall short at the end of a
cosine, where the steps are small and what error feedback holds back is released at a
fraction of the rate it was gathered at, or when epochs come every few dozen steps and a
warm-up finishes early.  :class:`Pacing` reproduces both:

- ``schedule``: ``constant``, or ``cosine`` (lr·½(1 + cos(π·t/T)) over the run's T steps,
  from the full rate to 0), on the user's optimizer (the one the wrapper shares its
  parameter groups with), stepped after every optimizer step;
- ``set_epoch_every``: ``set_epoch(t // N)`` before every N-th step (0: at the start of
  every pass over the data, as the benchmark always did).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

LR_SCHEDULES = ("constant", "cosine")


def schedule(optimizer: torch.optim.Optimizer, kind: str, steps: int):
    """The learning-rate schedule ``kind`` over ``steps`` steps of ``optimizer``: None for
    ``constant``, a ``LambdaLR`` for ``cosine``."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"the learning-rate schedule must be one of {LR_SCHEDULES}, got {kind!r}")
    if kind == "constant":
        return None
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"a cosine schedule needs the run's steps (a whole number ≥ 1), got {steps!r}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps)))


class Pacing:
    """One run's schedule and epochs.  ``before(step, data_epoch)`` before each step (``step``
    counts the steps done, ``data_epoch`` the passes over this rank's data so far);
    ``after()`` after each optimizer step."""

    def __init__(self, optimizer, kind: str, steps: int, set_epoch_every: int = 0):
        if isinstance(set_epoch_every, bool) or not isinstance(set_epoch_every, int) or set_epoch_every < 0:
            raise ValueError(f"set_epoch_every must be a whole number of steps ≥ 1 (0: once per pass "
                             f"over the data), got {set_epoch_every!r}")
        inner = getattr(optimizer, "optimizer", optimizer)  # the user's, inside the wrapper
        self.schedule = schedule(inner, kind, steps)
        self.every = set_epoch_every
        self.optimizer = optimizer
        self._epoch: Optional[int] = None

    def epoch_at(self, step: int, data_epoch: int) -> int:
        """The epoch to announce before step ``step``."""
        return step // self.every if self.every else data_epoch

    def before(self, step: int, data_epoch: int) -> None:
        epoch = self.epoch_at(step, data_epoch)
        if epoch != self._epoch:
            if hasattr(self.optimizer, "set_epoch"):
                self.optimizer.set_epoch(epoch)
            self._epoch = epoch

    def after(self) -> None:
        if self.schedule is not None:
            self.schedule.step()

    @property
    def epoch(self) -> Optional[int]:
        """The last epoch announced (None before the first step)."""
        return self._epoch
