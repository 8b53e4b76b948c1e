"""The quality controller's switch and the drift trace of a convergence run.

mergecomp measures how far the compressed exchange lags dense (the *drift*: what error
feedback holds back against the gradient flowing in, in steps' worth of gradient, averaged
over ranks) and, by default, a controller raises a group's density or rank when the drift
is high, within a byte budget.  Whether that holds quality on a model nobody tuned for is
what the convergence benchmark measures, so every run records:

- ``drift_trace``: the step log's measurement rows (``mergecomp.StepLog`` attached on rank
  0, in a temporary folder of the run): step, drift, density scale (the bytes-weighted
  mean multiplier the controller applied) and the error-feedback norm;
- at every evaluation, ``drift`` (``optimizer.drift.lag``, None before a measurement)
  and ``density_scale`` beside the validation loss in the run's curve;
- ``controller_decisions``: the controller's history, ``[{"step", "scales": {group: scale}}]``,
  and ``controller_scales``, its scales at the end (absent when the controller is off).

A mergecomp without the drift measure (before it lands, or an older install) trains the
same way: the columns and attributes are read where they exist, and ``--controller on``
or ``off``, which such a mergecomp cannot honour, is refused before anything trains.
"""
from __future__ import annotations

import inspect
import shutil
import tempfile
from typing import Any, Dict, List, Optional

import mergecomp
from mergecomp.steplog import read_rows

#: ``--controller``'s choices; None (the flag left out) keeps the library's default.
#: ``horizon``: on, told the run's length (``DriftController(horizon=steps)``), so that it may
#: spend its whole budget early, where the lag is largest; ``warm``: every group starts at
#: the largest scale and comes down as the budget and the calm rule say
#: (``DriftController(start_scale=16)``); ``warm-horizon``: both.
CHOICES = ("on", "off", "horizon", "warm", "warm-horizon")
#: The choices that build a controller of their own: (start_scale, told the run's steps).
BUILT = {"horizon": (1.0, True), "warm": (16.0, False), "warm-horizon": (16.0, True)}
#: The entry points' keyword and its values.
KEYWORD = "controller"
VALUES = {"on": "auto", "off": "off"}


def supported(entry=None) -> bool:
    """Whether ``entry`` (``mergecomp.DistributedOptimizer`` by default, or ``mergecomp.DiLoCo``)
    takes the ``controller`` keyword: whether this mergecomp has the controller."""
    entry = mergecomp.DistributedOptimizer if entry is None else entry
    return KEYWORD in inspect.signature(entry).parameters


def check(choice: Optional[str], entry=None) -> None:
    """ValueError, saying what to do, for a choice this mergecomp cannot honour."""
    if choice is None:
        return
    if choice not in CHOICES:
        raise ValueError(f"--controller must be one of {CHOICES} (or left out for the library's "
                         f"default), got {choice!r}")
    entry = mergecomp.DistributedOptimizer if entry is None else entry
    if not supported(entry):
        raise ValueError(f"--controller {choice}: this mergecomp's {entry.__name__} takes no "
                         f"'controller' keyword (it has no drift controller); leave --controller "
                         f"out, or install a mergecomp that has it")


def keywords(choice: Optional[str], entry=None, steps: Optional[int] = None) -> Dict[str, Any]:
    """The entry point's keyword arguments for ``choice``: {} for the library's default;
    ``horizon`` and ``warm-horizon`` need the run's ``steps``."""
    check(choice, entry)
    if choice in BUILT:
        start_scale, told = BUILT[choice]
        if told and not steps:
            raise ValueError(f"--controller {choice} tells the controller the run's length: it needs a run "
                             f"counted in steps (a language model's --steps)")
        return {KEYWORD: mergecomp.DriftController(horizon=int(steps) if told else None, start_scale=start_scale)}
    return {} if choice is None else {KEYWORD: VALUES[choice]}


def reading(optimizer) -> Dict[str, Optional[float]]:
    """The drift and the controller's scale now: ``{"drift": lag or None, "density_scale":
    mean multiplier or None, "noise": an unbiased compressor's relative noise or None}``.  The scale here is the plain mean over the groups (the step
    log's column weighs each group by its bytes): the optimizer does not say the groups' sizes."""
    drift = getattr(optimizer, "drift", None)
    controller = getattr(optimizer, "controller", None)
    scales = getattr(controller, "scales", None) or {}
    return {"drift": None if drift is None or getattr(drift, "kind", "lag") != "lag" else float(drift.lag),
            "density_scale": (sum(scales.values()) / len(scales)) if scales else None,
            "noise": None if drift is None or getattr(drift, "kind", "lag") != "noise" else float(drift.lag)}


class Trace:
    """Rank 0's record of one run's drift: a step log in a temporary folder, read back at
    :meth:`finish`.  On other ranks, and for an optimizer without step logs, it records the
    evaluations' readings alone (on rank 0) or nothing."""

    def __init__(self, optimizer, rank: int):
        self.optimizer = optimizer
        self.rank = rank
        self.folder: Optional[str] = None
        self.log = None
        if rank == 0 and hasattr(optimizer, "add_step_log"):
            self.folder = tempfile.mkdtemp(prefix="convergence-steplog-")
            self.log = mergecomp.StepLog(self.folder)
            optimizer.add_step_log(self.log)

    def at_evaluation(self) -> Dict[str, Optional[float]]:
        """The reading to store beside an evaluation's validation loss."""
        return reading(self.optimizer)

    def finish(self) -> Dict[str, Any]:
        """``drift_trace``, ``controller_decisions`` and ``controller_scales`` for the run's
        record (rank 0; {} elsewhere); removes the temporary folder."""
        if self.rank != 0:
            return {}
        record: Dict[str, Any] = {"drift_trace": self._rows()}
        controller = getattr(self.optimizer, "controller", None)
        if controller is not None:
            record["controller_decisions"] = [
                {"step": int(step), "scales": {str(k): float(v) for k, v in scales.items()}}
                for step, scales in getattr(controller, "history", [])]
            record["controller_scales"] = {str(k): float(v)
                                           for k, v in (getattr(controller, "scales", None) or {}).items()}
        return record

    def _rows(self) -> List[Dict[str, Any]]:
        if self.log is None:
            return []
        try:
            self.log.close()
            rows = read_rows(self.folder)
        except (OSError, ValueError):
            rows = []  # a log that could not write (it warned once): no trace, the run stands
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
        return [{"step": row["step"], "drift": row["drift"], "density_scale": row.get("density_scale"),
                 "ef_norm": row.get("ef_norm"), "noise": row.get("noise")}
                for row in rows if row.get("drift") is not None or row.get("noise") is not None]
