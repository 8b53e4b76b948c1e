"""The ``binary`` scheduler: MergeComp's published search for a two-group split.

MergeComp (Wang et al., 2021) observes that two groups capture most of the benefit of
merging and finds the split point by binary search on *measured* iteration times.  The
search needs the running training loop, so this scheduler proposes candidate plans and is
told how long each took::

    scheduler = BinarySearchScheduler(steps=10, warmup=2)
    optimizer = DistributedOptimizer(opt, model.named_parameters(), schedule=scheduler, ...)
    # the first step() calls scheduler.plan(params), which returns the first candidate
    while training:
        started = time.perf_counter()
        ... forward, backward, optimizer.step() ...
        seconds = max(backend.allgather_object(time.perf_counter() - started))
        if not scheduler.done:
            scheduler.report(optimizer.plan, seconds)
            if scheduler.propose().digest() != optimizer.plan.digest():
                optimizer.set_plan(scheduler.propose())   # between steps, on every rank
    # once done, scheduler.best is installed and stays

Every rank may drive its own copy: the search is deterministic, so ranks that report the
same times (the maximum over ranks, as above) propose the same plans in the same order.

**The search.**  Tensors 0..n−1 in backward order; split s puts [0, s) in the first group
and [s, n) in the second (s = 1 .. n−1).  Assuming the time is unimodal in s, it bisects
on the sign of T(m+1) − T(m): ``lo, hi = 1, n−1``; while lo < hi, m = ⌊(lo+hi)/2⌋, if
T(m) ≤ T(m+1) then hi = m else lo = m+1.  That is at most 2⌈log₂(n−1)⌉ measured
candidates (a measured split is never measured again).  Each candidate is measured over
``warmup + steps`` reports; the warm-up ones (buffers being allocated for the new plan)
are dropped and the rest averaged.  ``best`` is the fastest candidate measured.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from . import register
from ..distributed.backends.expect import NUMBER
from .base import AdaptiveScheduler, SchedulerContext, split_by_type
from ..plan import Group, ParamInfo, Plan, SEND_MODES


@register("binary")
class BinarySearchScheduler(AdaptiveScheduler):
    """Two groups, split point by binary search on measured times (see the module docstring).

    An :class:`~mergecomp.schedulers.base.AdaptiveScheduler`: under
    :class:`~mergecomp.optimizer.DistributedOptimizer` it reports each step's time (the
    slowest rank's) and switches plans by itself; driven by hand, call ``report`` and
    ``propose`` as in the module docstring."""

    def __init__(self, steps: int = 10, warmup: int = 1, send: str = "compress"):
        for what, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"binary scheduler {what} must be an integer ≥ {least}, got {value!r}")
        if send not in SEND_MODES:
            raise ValueError(f"send must be one of {SEND_MODES}, got {send!r}")
        self.steps, self.warmup, self.send = steps, warmup, send
        self._params: List[ParamInfo] = []
        self._lo = self._hi = 1
        self._samples: Dict[int, List[float]] = {}
        self.measured: Dict[int, float] = {}

    @property
    def settled(self) -> bool:
        """True once the search ended and ``best`` is installed (same on every rank)."""
        return bool(self._params) and self.done

    # --------------------------------------------------------------- optimizer driving --
    def after_step(self, context: SchedulerContext, seconds) -> None:
        """Driven by DistributedOptimizer after each step, on every rank (see the module docstring).

        Only rank 0 ran :meth:`plan`; the other ranks start their (deterministic) copy of
        the search from the broadcast plan, whose groups list the tensors in backward order.
        """
        if seconds is None:
            return
        if not self._params:
            self.plan(context.param_infos(context.plan.order()))
        if self.done:
            return
        self.report(context.plan, max(context.backend.allgather_object(seconds, expect=NUMBER)))
        following = self.best if self.done else self.propose()
        if following.digest() != context.plan.digest():
            context.set_plan(following)

    # ------------------------------------------------------------------------- search --
    def plan(self, params: Sequence[ParamInfo]) -> Plan:
        """Start the search over ``params`` (backward order); return the first candidate."""
        self._params = list(params)
        if not self._params:
            raise ValueError("binary scheduler got no parameters to plan")
        self._lo, self._hi = 1, max(1, len(self._params) - 1)
        self._samples, self.measured = {}, {}
        return self.propose()

    @property
    def done(self) -> bool:
        self._require_started()
        return len(self._params) < 2 or self._next_split() is None

    def propose(self) -> Plan:
        """The plan to run next: the candidate still being measured, or ``best`` when done."""
        self._require_started()
        split = self._next_split()
        return self.best if split is None else self.plan_for(split)

    def report(self, plan: Plan, seconds: float) -> None:
        """One measured iteration time of ``plan`` (which must be the current proposal)."""
        self._require_started()
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"reported iteration time must be a positive number of seconds, got {seconds!r}")
        split = self._next_split()
        if split is None:
            raise ValueError("the binary search is done; use scheduler.best instead of reporting more times")
        if plan.digest() != self.plan_for(split).digest():
            raise ValueError(f"reported plan {plan.digest()} is not the current candidate "
                             f"{self.plan_for(split).digest()} (split {split}); report the times of "
                             "scheduler.propose()")
        samples = self._samples.setdefault(split, [])
        samples.append(float(seconds))
        if len(samples) == self.warmup + self.steps:
            kept = samples[self.warmup:]
            self.measured[split] = sum(kept) / len(kept)
            self._bisect()

    @property
    def best(self) -> Plan:
        """The fastest measured candidate (the first candidate if none is measured yet)."""
        self._require_started()
        if len(self._params) < 2:
            return self.plan_for(len(self._params))
        if not self.measured:
            return self.plan_for(self._candidate())
        return self.plan_for(min(self.measured, key=lambda s: (self.measured[s], s)))

    def plan_for(self, split: int) -> Plan:
        """Groups [0, split) and [split, n), each further cut where dtype/device changes."""
        parts = [self._params[:split], self._params[split:]]
        groups = [Group(tuple(p.name for p in run), self.send)
                  for part in parts if part for run in split_by_type(part)]
        return Plan(groups)

    # ------------------------------------------------------------------------ helpers --
    def _candidate(self) -> int:
        """The split to compare against its right neighbour at this step of the bisection."""
        return (self._lo + self._hi) // 2

    def _next_split(self) -> Optional[int]:
        """The split that must be measured next, or None when the search has converged."""
        if self._lo >= self._hi:
            return None if self._lo in self.measured else self._lo
        middle = self._candidate()
        for split in (middle, middle + 1):
            if split not in self.measured:
                return split
        return None  # unreachable: _bisect narrows as soon as both are measured

    def _bisect(self) -> None:
        while self._lo < self._hi:
            middle = self._candidate()
            if middle not in self.measured or middle + 1 not in self.measured:
                return
            if self.measured[middle] <= self.measured[middle + 1]:
                self._hi = middle
            else:
                self._lo = middle + 1

    def _require_started(self) -> None:
        if not self._params:
            raise ValueError("the binary scheduler has not started: the optimizer calls "
                             "scheduler.plan(params) at the first step(), or call it yourself")

    def __repr__(self):
        return f"BinarySearchScheduler(steps={self.steps}, warmup={self.warmup}, send={self.send!r})"
