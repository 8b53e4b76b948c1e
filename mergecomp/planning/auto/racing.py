"""Phase 2 of the ``auto`` scheduler: the measured check, in rounds of visits.

Every candidate (:mod:`.planning`) is installed in turn and run for ``check_steps`` + 1
steps (a *visit*; the first step after a switch is not counted: it allocates the new
plan's buffers).  After each round the contenders (:func:`.decisions.contenders`) race
again, for up to ``check_rounds`` rounds, so that a burst of load falls on one visit of a
candidate, not on all of its samples, and clearly slower plans stop costing steps.  The
visits are compared at one compute speed (:func:`.decisions.medians_at_common_speed`);
the lowest median wins (:func:`.decisions.winner`).  A candidate whose switch would lose
state (:class:`~mergecomp.runtime.regroup.CannotRegroup`) is skipped and reported.

During the counted steps the optimizer's phase listener times each group's finish and
the launch of each step's first group, and the forward passes are timed; when the check
is over the profile is refitted to them (:func:`.decisions.refit_profile`) and saved again
(``profile_out``).  The plan is chosen by measurement, so the refit changes no decision;
it makes the saved profile predict the run it came from.

Times are agreed on at the end of every visit (``allgather_object``: each step the
slowest rank's); rank 0 ranks the contenders and computes the figures (the speed
correction runs the cost model on its own profile) and broadcasts them.
"""
from __future__ import annotations

import statistics
from typing import Dict, List, Optional

from ...distributed.backends.expect import (INT, NUMBER, OBJECT, STRING, fields, index_below, list_of,
                                           object_of, optional, tuple_of)
from ...distributed.backends.serialize import header_error
from ..costmodel import phases_are_local
from ..profile import with_density
from ...plan import Plan
from ...plan import CannotRegroup
from . import decisions
from .instruments import ForwardTimer, PhaseSamples
from .phase import Candidate, Phase, Search
from .planning import plan_candidates
from .watching import Watching


class Checking(Phase):
    """The check: visit every candidate, race the contenders, choose (module docstring)."""

    name = "check"

    @classmethod
    def begin(cls, search: Search, context, live: PhaseSamples) -> Phase:
        """Start the check; it may end at once (every candidate skipped): the next phase."""
        return cls(search, context, live)._advance(context)

    def __init__(self, search: Search, context, live: PhaseSamples):
        super().__init__(search)
        settings, findings = search.settings, search.findings
        backend = context.backend
        if backend.rank == 0 and settings.profile_out:
            findings.profile.save(settings.profile_out)
        priced = with_density(findings.profile, context.density_scale)  # the controller's scales
        found = (plan_candidates(priced, settings, search.say, findings.carriers)
                 if backend.rank == 0 else None)
        sent = backend.broadcast_object(
            None if found is None else [[c.label, c.plan.to_dict(), c.predicted] for c in found], src=0,
            expect=list_of(tuple_of(STRING, OBJECT, optional(NUMBER))))
        try:
            self.candidates: List[Candidate] = [Candidate(label, Plan.from_dict(plan), predicted)
                                                for label, plan, predicted in sent]
        except ValueError as error:  # every rank reads the same bytes: every rank raises alike
            raise header_error(0, f"a candidate plan it broadcast does not read ({error})") from None
        #: Candidates (indices) still to visit in this round, and this round's field.
        self.queue: List[int] = list(range(len(self.candidates)))
        self.racing: List[int] = list(self.queue)
        #: Per candidate, its visits (see decisions.Visit).
        self.visits: Dict[int, List[decisions.Visit]] = {index: [] for index in self.queue}
        self.skipped: Dict[int, str] = {}
        self.round = 0
        findings.report = []
        self.live = live.attach(context)
        self.forward = ForwardTimer().attach(context)
        #: This rank's timed forward seconds of every counted step (for the refit).
        self.forwards: List[float] = []
        #: This visit's step seconds (the first one not counted) and counted steps' forwards.
        self.visit_steps: List[Optional[float]] = []
        self.visit_forwards: List[Optional[float]] = []

    # -- visits ---------------------------------------------------------------------------
    def after_step(self, context, seconds) -> Phase:
        forward = self.forward.lap()
        self.visit_steps.append(seconds)
        counted = len(self.visit_steps) > 1
        self.live.end_step(keep=counted)
        if counted:
            timed = seconds is not None and forward is not None
            self.visit_forwards.append(forward if timed else None)
            if timed:
                self.forwards.append(forward)
        if len(self.visit_steps) < self.search.settings.check_steps + 1:
            return self
        steps = len(self.visit_forwards)
        everyone = context.backend.allgather_object(
            (self.visit_steps[1:], self.visit_forwards),
            expect=tuple_of(list_of(optional(NUMBER), length=steps), list_of(optional(NUMBER), length=steps)))
        visit = decisions.slowest_rank_visit(everyone)
        index = self.queue.pop(0)
        if visit is not None:
            self.visits[index].append(visit)
        return self._advance(context)

    def _advance(self, context) -> Phase:
        """Install the next candidate of this round; at a round's end keep the contenders;
        after the last round, choose."""
        backend = context.backend
        while True:
            while self.queue:
                index = self.queue[0]
                try:
                    context.set_plan(self.candidates[index].plan)
                except CannotRegroup as reason:
                    self.skipped[index] = f"skipped: {reason}"
                    self.queue.pop(0)
                    continue
                self.visit_steps, self.visit_forwards = [], []
                return self
            self.round += 1
            field = self._contenders() if backend.rank == 0 else None
            self.queue = backend.broadcast_object(field, src=0, expect=list_of(index_below(len(self.candidates))))
            self.racing = list(self.queue)
            if self.round >= self.search.settings.check_rounds or len(self.queue) <= 1:
                return self._choose(context)

    def _medians(self, correct: bool) -> Dict[int, float]:
        """{candidate: median step seconds} of the measured candidates, at the visits' median
        compute speed when ``correct`` (and ``speed_correction``), else as timed."""
        settings = self.search.settings
        if correct and settings.speed_correction:
            plans = {index: candidate.plan for index, candidate in enumerate(self.candidates)}
            return decisions.medians_at_common_speed(self.visits, plans, self.search.findings.profile,
                                                     settings.speed_clamp)
        return decisions.medians_as_timed(self.visits)

    def _contenders(self) -> List[int]:
        medians = {index: seconds for index, seconds in self._medians(correct=True).items()
                   if index in self.racing}
        return decisions.contenders(medians, self.search.settings.contender_margin)

    # -- the end ----------------------------------------------------------------------------
    def _choose(self, context) -> Phase:
        search, settings, findings = self.search, self.search.settings, self.search.findings
        backend = context.backend
        lead = backend.rank == 0
        medians = list_of(tuple_of(index_below(len(self.candidates)), NUMBER))
        pairs = backend.broadcast_object(  # JSON keys are strings: the indices go as pairs
            [list(self._medians(correct=True).items()), list(self._medians(correct=False).items())]
            if lead else None, src=0, expect=tuple_of(medians, medians))
        figures, timed = ({int(index): seconds for index, seconds in sent} for sent in pairs)
        forwards = sorted(decisions.visit_forwards(self.visits))
        if forwards and settings.speed_correction:
            search.say(f"auto scheduler: the check's visits ran forward passes of {forwards[0] * 1e3:.1f} to "
                       f"{forwards[-1] * 1e3:.1f} ms; their steps are compared at the median, "
                       f"{statistics.median(forwards) * 1e3:.1f} ms")
        findings.report = [(label, plan, predicted, self.skipped.get(index) or figures[index])
                           for index, (label, plan, predicted) in enumerate(self.candidates)
                           if index in self.skipped or index in figures]
        findings.as_timed = {self.candidates[index].label: seconds for index, seconds in timed.items()}
        self.live.detach()
        self.forward.detach()
        findings.profile = self._refit(context)
        if lead and settings.profile_out:
            findings.profile.save(settings.profile_out)
        measured = [(m, label, plan) for label, plan, _, m in findings.report if isinstance(m, float)]
        if measured:
            choice = decisions.winner(measured, settings.compression_margin)
            (seconds, label, plan), fastest = choice.chosen, choice.fastest
            if choice.kept_fp32:
                search.say(f"auto scheduler: {fastest[1]} measured {fastest[0] * 1e3:.1f} ms, within "
                           f"{settings.compression_margin:.0%} of {label} ({seconds * 1e3:.1f} ms, all FP32): "
                           f"keeping FP32")
            try:
                context.set_plan(plan)
            except CannotRegroup as reason:  # on every rank alike: the same plans, the same state keys
                label, plan, seconds = self._kept(measured, context.plan)
                search.say(f"auto scheduler: {choice.chosen[1]} measured fastest, but the state of the "
                           f"plan running cannot follow it ({reason}); keeping {label}")
            findings.best = (label, plan, seconds)
        return Watching(search)

    @staticmethod
    def _kept(measured, plan):
        """(label, plan, seconds) of the running ``plan`` among the ``measured`` candidates."""
        for seconds, label, candidate in measured:
            if candidate.digest() == plan.digest():
                return label, plan, seconds
        return "the running plan", plan, min(seconds for seconds, _, _ in measured)

    def _refit(self, context):
        """The profile at the check's speed, with launch and finish lines timed in the run."""
        search, profile = self.search, self.search.findings.profile
        samples = object_of(list_of(tuple_of(INT, NUMBER)))  # {send: [(elements, seconds)]}
        everyone = context.backend.allgather_object(
            (self.live.samples, self.forwards),
            expect=tuple_of(fields(launch=samples, finish=samples), list_of(NUMBER)))
        refit = decisions.refit_profile(profile, [samples for samples, _ in everyone],
                                        [f for _, forwards in everyone for f in forwards],
                                        search.settings.live_forward_samples,
                                        compressed_local=phases_are_local(profile.communicator))
        if refit.forward is not None:
            search.say(f"auto scheduler: forward took {refit.forward * 1e3:.1f} ms in the check "
                       f"against {profile.forward_time * 1e3:.1f} ms profiled: processor-side costs "
                       f"scaled by {refit.forward / profile.forward_time:.2f}")
        lines = [f"{phase} {send}: {c.intercept * 1e3:.2f} ms + {c.slope * 1e9:.2f} ns/element"
                 for phase in refit.fitted for send, c in sorted(refit.fitted[phase].items())]
        if lines:
            search.say("auto scheduler: costs timed in the run: " + "; ".join(lines))
        return refit.profile
