"""The ``auto`` scheduler: profile the real run, plan by DP, keep what measures fastest.

It changes the plan between steps (:meth:`~AutoScheduler.after_step`), in
three phases that every rank runs in lockstep — the same step counts, collectives at the
same steps, rank 0 deciding and broadcasting.  Each phase is an object in
:mod:`mergecomp.planning.auto` that returns the phase of the next step:

1. **profile** (:mod:`~mergecomp.planning.auto.profiling`): ``profile_steps`` steps with
   the whole model raw in one FP32 group while ready listeners timestamp every
   gradient, then probes, then ``interference_steps`` steps twice with a dummy allreduce
   beside backward (how much a collective slows backward, and backward a collective).
   The result is a :class:`~mergecomp.planning.profile.Profile` (saved with ``profile_out``).
2. **check** (:mod:`~mergecomp.planning.auto.racing`): the DP's plans, MergeComp's fixed
   plans for each of ``fusion_candidates`` and DDP's buckets
   (:mod:`~mergecomp.planning.auto.planning`), each run for real for ``check_steps``
   counted steps (the first step after a switch not counted), in up to ``check_rounds``
   rounds, each later round only for the contenders: the faster half (at least two),
   plus any within ``contender_margin`` of the fastest.  Visits are compared at one
   compute speed (``speed_correction``), and the lowest median wins — except that a lossy
   plan must beat the fastest all-FP32 plan by more than ``compression_margin``, or the
   FP32 one is kept (:mod:`~mergecomp.planning.auto.decisions` says why).  So a
   mispredicting cost model cannot make training slower than the best uncompressed plan,
   DDP's buckets or the best fixed fusion-num measured.  The profile is then refitted to
   the launch and finish costs and the compute speed timed in the check, and saved again.
3. **watch** (:mod:`~mergecomp.planning.auto.watching`): every ``watch_every`` steps the
   median step time (the slowest rank's) is compared with the winner's; after two windows
   in a row more than ``drift`` slower, it profiles and checks again.

Iteration times are wall-clock between the ends of consecutive ``step()`` calls.  The
search costs ``profile_steps + 2·interference_steps`` steps plus ``check_steps + 1`` per
visit: one per candidate in the first round (at most 11) and one per contender in each
later one (about half as many each round), plus the probes.

The scheduler sees the job through its
:class:`~mergecomp.schedulers.base.SchedulerContext` only; a communicator the cost model
cannot price (a plugin without a cost formula) is refused at the first step, on every
rank, with what to implement.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ...schedulers import register
from ...schedulers.base import AdaptiveScheduler, SchedulerContext
from ...plan import Plan, is_compressed
from ..profile import Profile
from .phase import Findings, Phase, ReportRow, Search, Starting
from .planning import profiling_plan
from .profiling import Profiling
from .settings import AutoSettings


@register("auto")
class AutoScheduler(AdaptiveScheduler):
    """Profile → DP → measured check → watch (see the module docstring).

    Args:
        profile_steps: steps timed for the profile (≥ 2; the first is a warm-up).
        check_steps: counted steps per visit of a candidate.
        watch_every: steps per drift window once settled.
        drift: a window this fraction slower than the chosen plan measured is a strike
            (two in a row: search again).
        allow_half: let the DP send raw FP16/BF16 groups.
        profile_out: save the profile here (JSON), after profiling and after the check.
        log: where the scheduler reports (rank 0 only); None for silence.
        interference_steps: steps for each of the interference and slowdown measurements
            (0: neither).
        check_rounds: rounds of visits; later rounds visit the contenders only.
        contender_margin: a candidate within this fraction of the fastest races on.
        fusion_candidates: MergeComp fusion-nums to measure beside the DP's plans.
        compression_margin: a lossy plan must measure this fraction faster than the best
            FP32 plan to be chosen.
        speed_correction: compare the check's visits at one compute speed.
        chunk_mb: let the DP send tensors larger than this many MB in pieces.
    """

    def __init__(self, profile_steps: int = 5, check_steps: int = 3, watch_every: int = 50,
                 drift: float = 0.25, allow_half: bool = False, profile_out: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = print, interference_steps: int = 3,
                 check_rounds: int = 3, contender_margin: float = 0.15,
                 fusion_candidates: Sequence[int] = (0, 1, 2, 3, 4, 6, 8),
                 compression_margin: float = 0.05, speed_correction: bool = True,
                 chunk_mb: Optional[float] = None):
        self.settings = AutoSettings(
            profile_steps=profile_steps, check_steps=check_steps, watch_every=watch_every, drift=drift,
            allow_half=allow_half, profile_out=profile_out, interference_steps=interference_steps,
            check_rounds=check_rounds, contender_margin=contender_margin,
            fusion_candidates=tuple(fusion_candidates), compression_margin=compression_margin,
            speed_correction=speed_correction, chunk_mb=chunk_mb)
        self._search = Search(self.settings, Findings(), log)
        self._search.profile = lambda context: Profiling(self._search, context)
        self._phase: Phase = Starting(self._search)
        #: Steps seen (``after_step`` calls), the search's included.
        self.steps = 0

    # -- what it found ----------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """The current phase: ``start``, ``profile``, ``interfere``, ``slowdown``, ``check``
        or ``watch``."""
        return self._phase.name

    @property
    def settled(self) -> bool:
        """True once a plan was chosen by measurement (watching for drift from then on)."""
        return self._phase.settled

    @property
    def profile(self) -> Optional[Profile]:
        """The live run's profile (after the check: refitted to it); None before profiling."""
        return self._search.findings.profile

    @property
    def report(self) -> List[ReportRow]:
        """The last check's (label, plan, predicted seconds, measured seconds or why skipped)."""
        return self._search.findings.report

    @property
    def as_timed(self) -> Dict[str, float]:
        """{label: median step seconds as timed}: the report's figures before the speed correction."""
        return self._search.findings.as_timed

    @property
    def best(self) -> Optional[Tuple[str, Plan, float]]:
        """(label, plan, measured seconds) of the chosen plan; None before the first check."""
        return self._search.findings.best

    # -- Scheduler --------------------------------------------------------------------------
    def plan(self, params) -> Plan:
        """The profiling plan: the whole model, raw FP32, one group."""
        return profiling_plan(params)

    def after_step(self, context: SchedulerContext, seconds: Optional[float]) -> None:
        """Called by the wrapper after every ``step()`` on every rank: the current phase
        measures the step and says which phase runs the next one."""
        self.steps += 1
        self._search.rank = context.backend.rank
        settled = self._phase.settled
        self._phase = self._phase.after_step(context, seconds)
        if self._phase.settled and not settled:
            self._search.say(self.describe())

    # -- reporting ----------------------------------------------------------------------------
    def describe(self) -> str:
        """The last check's candidates and the plan chosen, as the scheduler logs them."""
        return describe_findings(self._search.findings, self.steps, self.settings.speed_correction)

    def __repr__(self):
        s = self.settings
        return (f"AutoScheduler(profile_steps={s.profile_steps}, check_steps={s.check_steps}, "
                f"check_rounds={s.check_rounds}, fusion_candidates={s.fusion_candidates}, "
                f"watch_every={s.watch_every}, drift={s.drift})")


def describe_findings(findings: Findings, steps: int, speed_correction: bool = True) -> str:
    """The check's report as text: one line per candidate (groups, predicted and measured
    step time, and the time as timed beside the speed-corrected one), then the choice and
    the ``steps`` the search took."""
    lines = ["auto scheduler: candidates (predicted vs measured step time, at the check's median speed)"]
    for label, plan, predicted, measured in findings.report:
        compressed = sum(is_compressed(g.send) for g in plan.groups)
        sliced = sum(g.slices is not None for g in plan.groups)
        pieces = f", {sliced} with pieces of tensors" if sliced else ""
        shown = f"{measured * 1e3:9.1f} ms" if isinstance(measured, float) else measured
        if isinstance(measured, float) and label in findings.as_timed and speed_correction:
            shown += f" (as timed {findings.as_timed[label] * 1e3:.1f} ms)"
        groups = "group " if len(plan) == 1 else "groups"
        lines.append(f"  {label:<15} {len(plan):>3} {groups} ({compressed} compressed{pieces})  "
                     f"predicted {predicted * 1e3:9.1f} ms  measured {shown}")
    if findings.best is not None:
        lines.append(f"  chosen: {findings.best[0]} (plan {findings.best[1].digest()}); search took "
                     f"{steps} steps")
    return "\n".join(lines)
