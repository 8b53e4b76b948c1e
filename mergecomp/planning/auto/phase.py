"""The phases of the ``auto`` scheduler, and what a search has found.

A phase is an object with ``after_step(context, seconds)``, called on every rank after
every step, which returns the phase for the next step: itself, or the next one it built.
Every rank runs the same phase at the same step, so the collectives a phase runs (to
agree on times, to hand rank 0's decisions over) happen at the same steps everywhere.
Each phase attaches the instruments it needs when it begins and removes them when it
hands over.

    Starting ─► Profiling ─► Interference ─► Slowdown ─► Checking ─► Watching
                    ▲                                                    │
                    └──────────── steps drifted: profile again ──────────┘
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union

from ...plan import Plan
from ..profile import Profile
from .settings import AutoSettings


class Candidate(NamedTuple):
    """A plan the check runs: its label, the plan, the cost model's step seconds."""

    label: str
    plan: Plan
    predicted: float


#: One line of the check's report: label, plan, predicted seconds, and the measured
#: median seconds — or why the candidate was skipped.
ReportRow = Tuple[str, Plan, float, Union[float, str]]


@dataclass
class Findings:
    """What the search has found so far; the scheduler shows it (``profile``, ``report``,
    ``as_timed``, ``best``)."""

    #: The profile of the live run (after the check: at the check's speed, with the costs
    #: timed in the run).
    profile: Optional[Profile] = None
    #: The last check's candidates, in candidate order.
    report: List[ReportRow] = field(default_factory=list)
    #: {label: median step seconds as timed}: the report's figures before the speed correction.
    as_timed: Dict[str, float] = field(default_factory=dict)
    #: (label, plan, measured seconds) of the plan chosen.
    best: Optional[Tuple[str, Plan, float]] = None
    #: Communicators besides the job's that can carry its compressor and memory
    #: (``"compress:<name>"`` send modes the DP may choose group by group).
    carriers: Tuple[str, ...] = ()


@dataclass
class Search:
    """What every phase of one ``auto`` scheduler shares: its settings, its findings, and
    its log (rank 0 only)."""

    settings: AutoSettings
    findings: Findings
    log: Optional[Callable[[str], None]]
    #: This process's rank, set by the scheduler at every step (only rank 0 logs).
    rank: int = 0
    #: ``profile(context)``: the phase that profiles the run, where the search starts and
    #: where it goes back to when steps drift.  The scheduler sets it, so that the phases,
    #: each handing on to a later one, import no earlier one.
    profile: Optional[Callable[[Any], "Phase"]] = None

    def say(self, text: str) -> None:
        if self.log is not None and self.rank == 0:
            self.log(text)


class Phase:
    """One phase of the search (see the module docstring)."""

    #: Shown by the scheduler's ``phase``.
    name = "phase"
    #: True in the phase that runs the chosen plan.
    settled = False

    def __init__(self, search: Search):
        self.search = search

    def after_step(self, context, seconds: Optional[float]) -> "Phase":
        raise NotImplementedError(f"{type(self).__name__} must implement after_step()")


class Starting(Phase):
    """Before the first step's end: the scheduler's ``plan()`` gave the profiling plan."""

    name = "start"

    def after_step(self, context, seconds):
        return self.search.profile(context)
