"""The Scheduler contracts: turn the backward-ordered gradient list into a Plan, and, for
adaptive schedulers, keep choosing while the job trains through a :class:`SchedulerContext`."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

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
    ``auto`` are), handing it a :class:`SchedulerContext`: the part of the job a scheduler
    may see and change, and nothing else.  What such a scheduler may do there, and must not:

    * **Decide alike on every rank.**  Times differ per rank; agree on them through
      ``context.backend.allgather_object`` (e.g. the slowest rank's) at steps fixed in
      advance, or let rank 0 decide and ``broadcast_object`` the decision (both carry JSON
      values: ``plan.to_dict()``, not the Plan; lists of pairs, not int-keyed dicts).  Any collective
      it runs must run on every rank at the same step, in the same order.
    * **Change the job through the context only**: ``context.set_plan(plan)`` (between
      steps; it may raise :class:`~mergecomp.runtime.regroup.CannotRegroup`, on every rank alike),
      and the listeners it adds, whose handles it removes when it is done measuring.
    * **Not count its probes as training traffic**: collectives it runs for measurement
      go inside ``with context.backend.uncounted():``.

    A plugin registers like the built-in ones (``@mergecomp.schedulers.register(name)`` or
    the ``mergecomp.schedulers`` entry-point group) and implements :meth:`plan`,
    :meth:`after_step` and :attr:`settled`.
    """

    adaptive = True

    def after_step(self, context: "SchedulerContext", seconds: Optional[float]) -> None:
        """Called after every ``step()`` on every rank.  ``context``: the job as the scheduler
        may see it (:class:`SchedulerContext`).  ``seconds``: wall-clock time since the end
        of the previous step, on this rank; None for the first step and the one after the
        optimizer's ``restart_step_clock()`` (a pause that is no training step)."""
        raise NotImplementedError(f"{type(self).__name__} must implement after_step()")

    @property
    def settled(self) -> bool:
        """True once the scheduler has chosen a plan by measurement (the same on every
        rank); a benchmark times the job from then on."""
        raise NotImplementedError(f"{type(self).__name__} must implement settled")


class SchedulerContext:
    """What an adaptive scheduler sees of the job it plans, and all it may change.

    The wrapper builds one and hands it to :meth:`AdaptiveScheduler.after_step` in place of
    itself, so that a scheduler cannot reach the optimizer, its state or the training loop
    by accident: whatever a scheduler needs is declared here.

    * The parameters: :meth:`param_infos`, :meth:`named_parameters`.
    * The plan: :attr:`plan`, :meth:`set_plan`.
    * Listeners, each returning a handle to ``remove()``: :meth:`add_ready_listener` (a
      gradient became ready), :meth:`add_phase_listener` (a group was launched or
      finished, with its seconds), :meth:`add_step_listener` (a step's exchange settled).
    * :meth:`time_optimizer_steps`: the wrapped optimizer's own ``step()`` seconds.
    * Read-only facts: :attr:`backend` (collectives to agree on measurements; its
      ``rank``), :attr:`compressor`, :attr:`memory` and :attr:`communicator` (the cost
      model prices and probes the job's own), and :meth:`carriers` (the other
      communicators a ``"compress:<name>"`` send mode may use), and :attr:`density_scale`
      (how many times their configured density the compressed groups send now: the
      quality controller's choice, which the cost model prices plans at).
    """

    __slots__ = ("_exchange", "_inner", "_backend", "_compressor", "_memory", "_communicator")

    def __init__(self, exchange, inner_optimizer, backend, compressor, memory, communicator):
        """``exchange``: the runtime object that owns the plan and the listeners (the
        wrapper's reducer); ``inner_optimizer``: the torch optimizer the wrapper steps."""
        self._exchange, self._inner = exchange, inner_optimizer
        self._backend, self._compressor = backend, compressor
        self._memory, self._communicator = memory, communicator

    # -- the parameters --------------------------------------------------------------------
    def param_infos(self, order: Optional[List[str]] = None) -> List[ParamInfo]:
        """What a scheduler knows of each trainable parameter, in ``order`` (parameter
        names; default: the current plan's order)."""
        return self._exchange.param_infos(order)

    def named_parameters(self) -> List[Tuple[str, torch.nn.Parameter]]:
        """The (name, parameter) pairs whose gradients are exchanged (to size and place
        measurement buffers; a scheduler must not change them)."""
        return list(self._exchange.params)

    # -- the plan ----------------------------------------------------------------------------
    @property
    def plan(self) -> Optional[Plan]:
        """The plan the next step runs."""
        return self._exchange.plan

    def set_plan(self, plan: Plan) -> None:
        """Run ``plan`` from the next step on (between steps, on every rank alike); may
        raise :class:`~mergecomp.runtime.regroup.CannotRegroup`, on every rank alike."""
        self._exchange.set_plan(plan)

    # -- listeners ---------------------------------------------------------------------------
    def add_ready_listener(self, callback: Callable[[str], None]):
        """``callback(name)`` whenever a parameter's gradient is ready; returns a handle."""
        return self._exchange.add_ready_listener(callback)

    def add_phase_listener(self, callback: Callable[[str, Any, float], None]):
        """``callback(phase, group, seconds)`` after each group's ``"launch"`` and
        ``"finish"`` (``group`` has ``index``, ``send``, ``numel``); returns a handle."""
        return self._exchange.add_phase_listener(callback)

    def add_step_listener(self, callback: Callable[[int, Any], None]):
        """``callback(step, outcome)`` when a step's exchange is settled; returns a handle."""
        return self._exchange.add_step_listener(callback)

    def time_optimizer_steps(self) -> "OptimizerStepTimer":
        """Start timing the wrapped optimizer's own ``step()``; ``detach()`` the timer to stop."""
        return OptimizerStepTimer(self._inner)

    # -- read-only facts ---------------------------------------------------------------------
    @property
    def backend(self):
        """The process group's backend: rank, size, and the collectives (object ones to
        agree on measurements; ``uncounted()`` around measurement traffic)."""
        return self._backend

    @property
    def compressor(self):
        """The job's compressor (its ``name`` picks the cost formula; the probes time it)."""
        return self._compressor

    @property
    def memory(self):
        """The job's error-feedback memory (the probes time its passes)."""
        return self._memory

    @property
    def communicator(self):
        """The job's communicator (the cost model prices its groups; the probes run it)."""
        return self._communicator

    @property
    def density_scale(self) -> float:
        """How many times their configured density (or rank) the compressed groups send now,
        weighted by their elements: the quality controller's choice (1 when it is off or
        raised nothing).  The same on every rank; the cost model prices plans with it."""
        meter = getattr(getattr(self._exchange, "lifecycle", None), "meter", None)
        return meter.density_scale() if meter is not None else 1.0

    def carriers(self) -> Tuple[str, ...]:
        """Registered communicators besides the job's that can carry its compressor and
        memory as ``"compress:<name>"`` send modes (they build, with the job's
        ``communicator_options``), and whose cost formula the cost model can use."""
        find = getattr(self._exchange, "carriers", None)
        return tuple(find()) if callable(find) else ()

    def __repr__(self) -> str:
        return (f"SchedulerContext(ranks={self._backend.size}, plan="
                f"{None if self.plan is None else self.plan.digest()})")


class OptimizerStepTimer:
    """Seconds of a torch optimizer's own ``step()``, through torch's step hooks, so that
    nothing the user registered is replaced (see :meth:`SchedulerContext.time_optimizer_steps`)."""

    def __init__(self, inner: torch.optim.Optimizer):
        #: One entry per ``step()`` since the timer started.
        self.seconds: List[float] = []
        began: List[float] = []
        self._handles = [
            inner.register_step_pre_hook(lambda *_: began.append(time.perf_counter())),
            inner.register_step_post_hook(lambda *_: self.seconds.append(time.perf_counter() - began.pop()))]

    def detach(self) -> None:
        """Stop timing (the seconds so far stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


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
