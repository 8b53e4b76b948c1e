"""The runtime: what happens in a step, whichever entry point drives it.

:class:`~mergecomp.runtime.step.StepLifecycle` is one step's exchange from the preflight to
the messages; the entry points (:mod:`mergecomp.runtime.reducer` for the wrapper, :mod:`mergecomp.ddp`
for the DDP hook) decide which groups a step sends and where the averages go.
"""
from .step import NONFINITE_POLICIES, InFlight, Listeners, StepLifecycle, check_nonfinite_policy

__all__ = ["NONFINITE_POLICIES", "InFlight", "Listeners", "StepLifecycle", "check_nonfinite_policy"]
