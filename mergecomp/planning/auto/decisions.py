"""The ``auto`` scheduler's decisions, as pure functions of what was measured.

No process group, no optimizer: the phases gather the numbers (the slowest rank's, or
pooled over ranks) and call these, and the tests call them directly.

**Contenders** (:func:`contenders`).  After a round of visits, the faster half of the
field by median (at least two) stays in the race, plus any candidate within a margin of
the fastest.  Halving, not a margin alone, because one visit of a few steps on a shared
machine can be far off: a margin would drop the true best on one bad visit, while half
the field keeps it unless it measured slower than half of the others.

**The speed correction** (:func:`medians_at_common_speed`).  A shared host's compute speed
drifts within a minute, and a visit that fell in a slow minute would lose to its own plan
visited in a fast one.  Each visit's forward passes (which no collective of the step
overlaps, whatever the plan) give the host's speed during that visit; against the median
of all visits' forwards, the cost model says how much of the plan's step time moves with
that speed (:func:`~mergecomp.planning.profile.scaled_compute`: processor-side costs scale,
collectives do not), and that is taken off the visit's steps.  A visit's forward far from
the median is a pause in that one forward pass (a collection, a page fault), not the
host's speed, and is clamped.

**The winner** (:func:`winner`).  The lowest median wins, except that a lossy plan (one
that compresses or casts a group) must beat the fastest all-FP32 plan by more than a
margin: a few percent is inside what one check can resolve on a shared machine, and
compression that does not clearly pay should not be bought with accuracy.

**The refitted profile** (:func:`refit_profile`).  After the check, the profile is
rescaled to the speed the processor ran at during the check (the median forward over
ranks against the profiled one), and lines fitted to the launch and finish phases timed
in the run replace the probes' (see :mod:`mergecomp.planning.costmodel`).
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..costmodel import predict
from ...plan import Plan
from ..profile import FINISH_SENDS, LinearCost, Profile, fit_live_costs, scaled_compute

#: One visit of a candidate: its counted step seconds (each the slowest rank's) and the
#: median forward seconds of those steps (None: no forward was timed).
Visit = Tuple[List[float], Optional[float]]
#: A measured candidate: (median seconds, label, plan).
Measured = Tuple[float, str, Plan]


# ------------------------------------------------------------------------------ one visit
def slowest_rank_visit(everyone: Sequence[Tuple[Sequence[Optional[float]], Sequence[Optional[float]]]]
                       ) -> Optional[Visit]:
    """One visit from every rank's (step seconds, forward seconds): each step its slowest
    rank's, leaving out the steps some rank did not time (None: the first step, or one after
    ``restart_step_clock()``); None when no step is left."""
    steps = [max(step) for step in zip(*(s for s, _ in everyone)) if None not in step]
    forwards = [max(step) for step in zip(*(f for _, f in everyone)) if None not in step]
    if not steps:
        return None
    return steps, statistics.median(forwards) if forwards else None


# ------------------------------------------------------------------------------ the field
def contenders(medians: Mapping[int, float], margin: float) -> List[int]:
    """Of the candidates (index → median seconds) still in the race, the faster half (at
    least two) plus any within ``margin`` (0.15: 15%) of the fastest; in index order."""
    if not medians:
        return []
    ranked = sorted(medians, key=lambda index: (medians[index], index))
    keep = set(ranked[:max(2, (len(ranked) + 1) // 2)])
    fastest = medians[ranked[0]]
    keep.update(index for index in ranked if medians[index] <= fastest * (1 + margin))
    return sorted(keep)


def visit_forwards(visits: Mapping[int, Sequence[Visit]]) -> List[float]:
    """The median forward seconds of every visit that timed one."""
    return [forward for candidate in visits.values() for _, forward in candidate if forward]


def medians_as_timed(visits: Mapping[int, Sequence[Visit]]) -> Dict[int, float]:
    """{candidate: median of all its counted steps} for the candidates measured."""
    return {index: statistics.median([s for seconds, _ in candidate for s in seconds])
            for index, candidate in visits.items() if any(seconds for seconds, _ in candidate)}


def step_time_at_speed(plan: Plan, profile: Profile, forward: float, reference: float, clamp: float) -> float:
    """The cost model's step seconds of ``plan`` at the compute speed a visit's ``forward``
    shows (clamped to within ``clamp`` times the ``reference`` forward)."""
    forward = min(max(forward, reference / clamp), reference * clamp)
    return predict(plan, scaled_compute(profile, forward / profile.forward_time)).iteration_time


def medians_at_common_speed(visits: Mapping[int, Sequence[Visit]], plans: Mapping[int, Plan],
                            profile: Optional[Profile], clamp: float) -> Dict[int, float]:
    """{candidate: median of its counted steps, each visit's corrected to the median compute
    speed of all visits} (see the module docstring).  Without a timed forward, or a
    profile with a forward time, the steps as timed; a visit without a timed forward is
    taken as timed."""
    forwards = visit_forwards(visits)
    if not forwards or profile is None or not profile.forward_time > 0:
        return medians_as_timed(visits)
    reference = statistics.median(forwards)
    figures = {}
    for index, candidate in visits.items():
        plan = plans[index]
        at_reference = step_time_at_speed(plan, profile, reference, reference, clamp)
        steps = []
        for seconds, forward in candidate:
            shift = step_time_at_speed(plan, profile, forward, reference, clamp) - at_reference if forward else 0.0
            steps.extend(s - shift for s in seconds)
        if steps:
            figures[index] = statistics.median(steps)
    return figures


# ------------------------------------------------------------------------------ the winner
def is_lossless(plan: Plan) -> bool:
    """Every group travels as FP32: nothing compressed or cast."""
    return all(group.send == "fp32" for group in plan.groups)


class Choice(NamedTuple):
    """The plan chosen, and the fastest measured (the same row unless FP32 was kept)."""

    chosen: Measured
    fastest: Measured

    @property
    def kept_fp32(self) -> bool:
        return self.chosen is not self.fastest


def winner(measured: Sequence[Measured], margin: float) -> Choice:
    """The fastest measured (seconds, label, plan) — the first of equals, in the order given
    — unless it is lossy and the fastest all-FP32 one measured within ``margin`` (0.05: 5%)
    of it: then that FP32 one."""
    if not measured:
        raise ValueError("winner() needs at least one measured candidate")
    fastest = min(measured, key=lambda row: row[0])
    lossless = [row for row in measured if is_lossless(row[2])]
    if lossless and not is_lossless(fastest[2]):
        best_raw = min(lossless, key=lambda row: row[0])
        if best_raw[0] <= fastest[0] * (1 + margin):
            return Choice(best_raw, fastest)
    return Choice(fastest, fastest)


# ------------------------------------------------------------------------------ watching
def slowest_typical_step(medians: Sequence[Optional[float]]) -> Optional[float]:
    """The slowest of the ranks' median step seconds over a watch window (None: a rank that
    timed no step); None if no rank timed one."""
    timed = [seconds for seconds in medians if seconds is not None]
    return max(timed) if timed else None


def drifted(seconds: float, chosen: float, drift: float) -> bool:
    """Steps of ``seconds`` are more than ``drift`` (0.25: 25%) slower than the ``chosen``
    plan measured."""
    return seconds > (1 + drift) * chosen


# ------------------------------------------------------------------------------ the profile
class Refit(NamedTuple):
    """The refitted profile, the check's median forward it was rescaled to (None: too few
    timed), and the lines fitted per phase and send mode."""

    profile: Profile
    forward: Optional[float]
    fitted: Dict[str, Dict[str, LinearCost]]


def refit_profile(profile: Profile, samples_by_rank: Sequence[Mapping[str, Mapping[str, Sequence[Tuple[int, float]]]]],
                  forwards: Sequence[float], least_forwards: int, compressed_local: bool) -> Refit:
    """``profile`` at the speed the check ran at, with its launch and finish lines fitted to
    the samples timed in the run.

    ``samples_by_rank``: every rank's ``{"launch"|"finish": {send: [(elements, seconds)]}}``,
    pooled.  ``forwards``: the check's timed forward passes, pooled over ranks; with at least
    ``least_forwards`` of them (and a profiled forward) every processor-side time is scaled
    by their median over the profile's forward.  ``compressed_local``: whether the
    communicator's launch and finish are local work (False for PS: its samples of
    compressed groups are left out, the probes price them).
    """
    forward = None
    if len(forwards) >= least_forwards and profile.forward_time > 0:
        forward = statistics.median(forwards)
        profile = scaled_compute(profile, forward / profile.forward_time)
    fitted = {}
    for phase in ("launch", "finish"):
        pooled: Dict[str, List[Tuple[int, float]]] = {}
        for samples in samples_by_rank:
            for send, pairs in samples.get(phase, {}).items():
                if (send == "compress" and not compressed_local) or send not in FINISH_SENDS:
                    continue  # "compress:<name>" modes: priced by their communicator's formula
                pooled.setdefault(send, []).extend(pairs)
        fitted[phase] = fit_live_costs(pooled)
    refitted = dataclasses.replace(profile, finish={**profile.finish, **fitted["finish"]},
                                   launch={**profile.launch, **fitted["launch"]})
    return Refit(refitted, forward, fitted)
