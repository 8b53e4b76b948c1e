"""The Scheduler contracts: turn the backward-ordered gradient list into a Plan, and, for
adaptive schedulers, keep choosing while the job trains."""
from __future__ import annotations

from typing import Optional, Sequence

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


class AdaptiveScheduler(Scheduler):
    """A scheduler that measures the running job and switches plans between steps.

    :class:`~mergecomp.optimizer.DistributedOptimizer` calls :meth:`after_step` on every
    rank after every ``step()`` of a scheduler whose ``adaptive`` is true (``binary`` and
    ``auto`` are).  What such a scheduler may do there, and must not:

    * **Decide alike on every rank.**  Times differ per rank; agree on them through
      ``optimizer.backend.allgather_object`` (e.g. the slowest rank's) at steps fixed in
      advance, or let rank 0 decide and ``broadcast_object`` the decision (both carry JSON
      values: ``plan.to_dict()``, not the Plan; lists of pairs, not int-keyed dicts).  Any collective
      it runs must run on every rank at the same step, in the same order.
    * **Use the optimizer's public surface only**: ``plan``, ``set_plan(plan)`` (between
      steps; it may raise :class:`~mergecomp.regroup.CannotRegroup`, on every rank alike),
      ``param_infos(order)``, ``named_parameters()``, ``backend``, ``communicator``,
      ``compressor``, and the listeners ``add_ready_listener(cb)`` /
      ``add_phase_listener(cb)``, whose handles it removes when it is done measuring.
    * **Not count its probes as training traffic**: collectives it runs for measurement
      go inside ``with optimizer.backend.uncounted():``.
    """

    adaptive = True

    def after_step(self, optimizer, seconds: Optional[float]) -> None:
        """Called after every ``step()`` on every rank.  ``seconds``: wall-clock time since
        the end of the previous step, on this rank; None for the first step and the one
        after ``optimizer.restart_step_clock()`` (a pause that is no training step)."""
        raise NotImplementedError(f"{type(self).__name__} must implement after_step()")

    @property
    def settled(self) -> bool:
        """True once the scheduler has chosen a plan by measurement (the same on every
        rank); a benchmark times the job from then on."""
        raise NotImplementedError(f"{type(self).__name__} must implement settled")


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
