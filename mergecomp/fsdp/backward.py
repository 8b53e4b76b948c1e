"""One backward of an FSDP2 model as one step of the shared step lifecycle.

FSDP2 reduces a unit's gradient in the middle of backward and reads the result at once, so
each unit's exchange is launched *and finished* when FSDP calls it
(:meth:`~mergecomp.runtime.step.StepLifecycle.finish_now`); what the lifecycle settles
step-wide is settled when autograd finishes the backward (an autograd callback queued by
the first unit, which runs after FSDP's own end-of-backward callback, so FSDP's state is
final by then):

- the first unit begins the step: the preflight checks that every rank agrees on the
  configuration, the units and the step count before the first payload travels
  (:class:`~mergecomp.runtime.agreement.RanksDisagree` naming the difference);
- each unit's gradient is checked for NaN/Inf and zeroed before a compressor or a residual
  sees it;
- at the end one small allreduce settles the outcome on every rank: all units' compressor
  and error-feedback state is committed, or the backward is dropped whole (state as before
  it, every gradient of the model NaN, counted) and the policy speaks: a warning
  (``nonfinite="skip"``) or :class:`~mergecomp.runtime.agreement.NonFiniteGradient` raised
  from ``loss.backward()`` (``"raise"``), after FSDP has resharded its parameters.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..compressors.base import GroupLayout
from ..runtime import gate
from ..runtime.step import StepLifecycle


class BackwardStep:
    """Drives ``lifecycle`` for an FSDP2 ``model``: one lifecycle step per backward."""

    def __init__(self, model: torch.nn.Module, lifecycle: StepLifecycle, collective: str):
        self.model = model
        self.lifecycle = lifecycle
        #: The collective a rank without mergecomp runs where this one exchanges a unit
        #: (FSDP's ``"reduce_scatter"``, or under HSDP the replicas' ``"allreduce"``).
        self.collective = collective
        self._registration_checked = False
        self._queued = False

    @property
    def steps(self) -> int:
        """Backwards settled on this rank (committed or dropped): the step count ranks agree on."""
        return self.lifecycle.steps

    @property
    def dropped(self) -> int:
        """Backwards dropped because a gradient was non-finite on some rank."""
        return self.lifecycle.skipped_steps

    def exchange(self, index: int, buffer: torch.Tensor, layout: Optional[GroupLayout]) -> torch.Tensor:
        """Exchange unit ``index``'s ``buffer`` now and return the result (the step settles
        at the end of the backward)."""
        lifecycle = self.lifecycle
        if not self._registration_checked:
            self._check_registered(buffer)
        if not lifecycle.in_step:
            lifecycle.begin(self.steps, buffer.device)
            self._queue_end()
        try:
            flight = lifecycle.launch(index, buffer, layout, lend=True)
            return lifecycle.finish_now(flight)
        except BaseException:
            lifecycle.abort()
            raise

    def _check_registered(self, buffer: torch.Tensor) -> None:
        """Once, before the first exchange: a rank without mergecomp runs FSDP's own collective
        for this unit where this rank would run the preflight, so the first collective is
        shaped like FSDP's and pairs with it (:func:`mergecomp.runtime.gate.check_registered`)."""
        self._registration_checked = True
        gate.check_registered(
            self.lifecycle.communicator.backend, buffer, self.collective,
            "mergecomp.fsdp.register", f"FSDP's own {self.collective.replace('_', '-')}",
            "Call mergecomp.fsdp.register(model, ...) on every rank, with the same arguments, after "
            "fully_shard and before the first backward.")

    def _queue_end(self) -> None:
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self.end)
            self._queued = True
        except RuntimeError:  # outside a backward (a direct call): the caller ends the step
            self._queued = False

    def end(self) -> None:
        """Settle the step: commit every unit's state, or drop the whole backward."""
        self._queued = False
        lifecycle = self.lifecycle
        if not lifecycle.in_step:
            return
        try:
            outcome = lifecycle.end_step(_ignore)
        except BaseException:
            lifecycle.abort()
            raise
        lifecycle.count_step()
        if not outcome.finite:
            self._poison_gradients()
        lifecycle.close_step()

    def end_if_direct(self) -> None:
        """End a step begun outside a backward (a unit's collective called directly)."""
        if not self._queued:
            self.end()

    def _poison_gradients(self) -> None:
        with torch.no_grad():
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    grad = parameter.grad
                    (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))


def _ignore(flight, average, outcome) -> None:
    """Each unit's result was handed to FSDP when it finished; a dropped step is poisoned whole."""
