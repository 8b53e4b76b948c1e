"""The ``auto`` scheduler: profile the real run, plan by DP, keep what measures fastest.

It drives the optimizer between steps (``after_step``), in three phases that every rank
runs in lockstep — the same step counts, collectives at the same steps, rank 0 deciding
and broadcasting:

1. **profile** (``profile_steps`` steps, then ``interference_steps`` twice): the whole
   model goes raw in one FP32 group while the optimizer's hooks timestamp every gradient;
   probes complete a :class:`~mergecomp.profile.Profile` (saved with ``profile_out``), and
   steps with a dummy allreduce beside backward measure how much a collective slows
   backward and backward slows a collective
   (:class:`~mergecomp.schedulers.live_profile.LiveProfiling`, where the details are).
2. **check** (in rounds of ``check_steps`` + 1 steps per candidate): three plans from the DP
   — the optimum, the best plan without compression, the best plan compressing every group,
   each free to send tensors over ``chunk_mb`` in pieces when that is set —
   MergeComp's fixed plans for each of ``fusion_candidates`` (by default the whole sweep
   0, 1, 2, 3, 4, 6, 8 a user would otherwise run by hand: the neighbours a cost model is
   most likely to misjudge) and DDP's plan (raw FP32 buckets of 25 MB,
   :class:`~mergecomp.schedulers.bucket.BucketScheduler`), duplicates dropped, each run for
   real (the first step after a switch not counted).  The candidates are visited in turn,
   and again in up to ``check_rounds`` rounds, each later round only for the contenders:
   the faster half by median so far (at least two), plus any within ``contender_margin`` of
   the fastest.  Halving, not a margin alone, because one visit of three steps on a shared
   machine can be off by a third: a margin would drop the true best on one bad visit, while
   half the field keeps it unless it was measured slower than half of the others.  A burst of
   load then falls on one visit of a candidate, not on all of its samples, and clearly
   slower plans stop costing steps.  Visits are compared at one compute speed: the host's
   speed drifts by 20% and more within a minute on a shared machine, and a visit that fell in
   a slow minute would otherwise lose to its own plan visited in a fast one.  Each counted
   step's forward pass is timed (end of the last step to the first gradient; the slowest
   rank's); a visit's median forward against the median of all visits' is its speed, and the
   cost model says how much of the plan's step time moves with that speed
   (:func:`~mergecomp.simulate.scaled_compute`: processor-side costs scale, collectives do
   not), which is taken off the visit's steps (``speed_correction``; on the LSTM at 1 Gbit/s
   forward explained half the variance of 3-step visits, though in the benchmark's runs
   the corrected ranking did no measurably better than the ranking as timed, which the
   report shows beside it).  The lowest median over all of a
   candidate's corrected steps wins,
   so a mispredicting cost model cannot make training slower than the best uncompressed
   plan, DDP's buckets or the best fixed fusion-num it measured — except that a lossy plan
   (one that compresses or casts) must beat the fastest all-FP32 candidate by more than
   ``compression_margin`` (5%), or the FP32 one is kept: compression that does not clearly
   pay is not worth its accuracy cost.  A candidate whose switch would lose
   state (:class:`~mergecomp.regroup.CannotRegroup`) is skipped and logged.
   During the profiled steps and the counted check steps, the optimizer's
   ``phase_listener`` times each group's finish phase and the launch of each step's first
   group (the only one launched with no collective of the step in flight); once the check
   is over, lines fitted to those samples, pooled over ranks
   (:func:`~mergecomp.profile.fit_live_costs`), replace the probes' ``finish`` and give
   the profile's ``launch`` costs.  The counted check steps' forward passes (end of the
   last step to the first gradient: no collective of the step is in flight yet, whatever
   the plan) are timed too; their median over ranks against the profile's forward time is
   the speed the processor ran at during the check, and every processor-side time of the
   profile is scaled by it (:func:`~mergecomp.simulate.scaled_compute`) — on a shared
   machine the five profiled steps can run 30% faster or slower than the minutes after
   them.  The profile is then saved again (``profile_out``).  The plan is chosen by
   measurement, so this changes no decision; it makes the saved profile predict the run
   it came from.
3. **watch**: every ``watch_every`` steps the median step time (max over ranks) is compared
   with the winner's; after two windows in a row more than ``drift`` slower, it profiles
   and checks again.

Iteration times are wall-clock between the ends of consecutive ``step()`` calls, the
maximum over ranks.  The search cost is ``profile_steps + 2·interference_steps`` steps plus
``(check_steps + 1)`` per visit: one per candidate in the first round (at most 11) and one
per contender in each later one (about half as many each round), plus the probes.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from . import register
from .base import Scheduler
from .bucket import BucketScheduler
from .fixed import FixedScheduler
from .live_profile import LiveProfiling
from .optimal import checked_chunk_mb
from ..plan import ParamInfo, Plan


@register("auto")
class OnlineOptimalScheduler(LiveProfiling, Scheduler):
    """Profile → DP → measured check → watch (see the module docstring)."""

    adaptive = True

    #: The profile is rescaled to the check's compute speed only from this many timed
    #: forward passes (pooled over ranks) or more.
    live_forward_samples = 3
    #: A visit's forward further than this factor from the check's median is a pause in
    #: that forward pass (a collection, a page fault), not the host's speed: clamped.
    speed_clamp = 2.0

    def __init__(self, profile_steps: int = 5, check_steps: int = 3, watch_every: int = 50,
                 drift: float = 0.25, allow_half: bool = False, profile_out: Optional[str] = None,
                 log: Optional[Callable[[str], None]] = print, interference_steps: int = 3,
                 check_rounds: int = 3, contender_margin: float = 0.15,
                 fusion_candidates: Sequence[int] = (0, 1, 2, 3, 4, 6, 8),
                 compression_margin: float = 0.05, speed_correction: bool = True,
                 chunk_mb: Optional[float] = None):
        for what, value, least in (("profile_steps", profile_steps, 2), ("check_steps", check_steps, 1),
                                   ("watch_every", watch_every, 1), ("interference_steps", interference_steps, 0),
                                   ("check_rounds", check_rounds, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"auto scheduler {what} must be an integer ≥ {least}, got {value!r}")
        if not drift > 0:
            raise ValueError(f"auto scheduler drift must be a fraction > 0 (0.25 = 25% slower), got {drift!r}")
        fusion_candidates = tuple(fusion_candidates)
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in fusion_candidates):
            raise ValueError(f"auto scheduler fusion_candidates must be integers ≥ 0 (fusion-nums, 0 = "
                             f"layer-wise), got {fusion_candidates!r}")
        if not contender_margin >= 0:
            raise ValueError(f"auto scheduler contender_margin must be a fraction ≥ 0 (0.15 = within 15% of "
                             f"the fastest), got {contender_margin!r}")
        if isinstance(compression_margin, bool) or not isinstance(compression_margin, (int, float)) \
                or not 0 <= compression_margin < 1:
            raise ValueError(f"auto scheduler compression_margin must be a fraction in [0, 1) (0.05: a "
                             f"lossy plan must measure 5% faster than the best FP32 plan), got {compression_margin!r}")
        if not isinstance(speed_correction, bool):
            raise ValueError(f"auto scheduler speed_correction must be True or False, got {speed_correction!r}")
        self.chunk_mb = checked_chunk_mb(chunk_mb, "auto scheduler chunk_mb")
        self.compression_margin = float(compression_margin)
        self.speed_correction = speed_correction
        self.profile_steps, self.check_steps, self.watch_every = profile_steps, check_steps, watch_every
        self.check_rounds, self.contender_margin = check_rounds, float(contender_margin)
        self.fusion_candidates = fusion_candidates
        self.interference_steps = interference_steps
        self.drift, self.allow_half, self.profile_out = float(drift), bool(allow_half), profile_out
        self._log = log
        self.phase = "start"
        self.profile = None
        self.steps = 0
        #: (label, plan, predicted seconds, measured seconds or a reason it was skipped)
        self.report: List[Tuple[str, Plan, float, object]] = []
        #: {label: median step seconds as timed}: the report's figures before the speed correction.
        self.as_timed: Dict[str, float] = {}
        self.best: Optional[Tuple[str, Plan, float]] = None
        self._ready: Dict[str, List[float]] = {}
        self._step_start: Optional[float] = None
        self._samples: List[float] = []
        self._candidates: List[Tuple[str, Plan, float]] = []
        self._queue: List[int] = []  # candidates (indices) still to visit in this round
        self._race: Optional[List[int]] = None  # candidates of this round (None: all)
        #: Per candidate, its visits: (counted step seconds, the visit's forward seconds or
        #: None), each step and forward its slowest rank's.
        self._windows: Dict[int, List[Tuple[List[float], Optional[float]]]] = {}
        self._window_forwards: List[Optional[float]] = []  # this rank's, this visit's counted steps
        self._skipped: Dict[int, str] = {}
        self._round = 0
        self._strikes = 0
        self._alone: List[float] = []
        self._overlapped: List[float] = []
        self._dummy = None
        self._span: List[float] = []
        #: Live phase samples: {"launch"|"finish": {send: [(elements, seconds), ...]}}.
        self._live: Dict[str, Dict[str, List[Tuple[int, float]]]] = {}
        #: Forward seconds of the counted check steps (this rank), and the current step's.
        self._forwards: List[float] = []
        self._first_ready: Optional[float] = None
        self._pending: List[Tuple[str, str, int, float]] = []

    @property
    def settled(self) -> bool:
        """True once a plan was chosen by measurement (watching for drift from then on)."""
        return self.phase == "watch"

    # -- Scheduler --------------------------------------------------------------------
    def plan(self, params) -> Plan:
        """The profiling plan: the whole model, raw FP32, one group."""
        return self._raw_plan(params)

    @staticmethod
    def _raw_plan(params) -> Plan:
        return FixedScheduler(1, send="fp32").plan(params)

    # -- driving ------------------------------------------------------------------------
    def after_step(self, optimizer, seconds: Optional[float]) -> None:
        """Called by the optimizer after every ``step()`` on every rank."""
        self.steps += 1
        self._rank = optimizer.backend.rank
        getattr(self, f"_{self.phase}")(optimizer, seconds)

    def _start(self, optimizer, seconds):
        self.phase = "profile"
        self._ready = {}
        self._samples = []
        if any(g.send != "fp32" for g in optimizer.plan.groups) or len(optimizer.plan) != 1:
            optimizer.set_plan(self._raw_plan(self._params(optimizer)))
        optimizer.ready_listener = self._on_ready
        self._time_optimizer_steps(optimizer.optimizer)
        self._live, self._pending = {"launch": {}, "finish": {}}, []
        optimizer.phase_listener = self._on_phase
        self._step_start = time.perf_counter()

    def _on_phase(self, phase: str, group, seconds: float) -> None:
        if phase == "finish" or group.index == 0:
            self._pending.append((phase, group.send, group.numel, seconds))

    def _keep_phases(self, keep: bool) -> None:
        """Keep (or drop) the phase samples of the step that just ended."""
        if keep:
            for phase, send, numel, seconds in self._pending:
                self._live[phase].setdefault(send, []).append((numel, seconds))
        self._pending = []

    def _on_first_ready(self, name: str) -> None:
        """Check phase: note only when the step's first gradient arrived (its forward)."""
        if self._first_ready is None:
            self._first_ready = time.perf_counter() - self._step_start

    def _planned(self, optimizer):
        if optimizer.backend.rank == 0 and self.profile_out:
            self.profile.save(self.profile_out)
        candidates = self._plan_candidates(optimizer) if optimizer.backend.rank == 0 else None
        self._candidates = optimizer.backend.broadcast_object(candidates, src=0)
        self._queue = list(range(len(self._candidates)))
        self._windows = {index: [] for index in self._queue}
        self._skipped, self._round = {}, 0
        self._race = list(self._queue)
        self.report = []
        self.phase = "check"
        self._pending = []
        optimizer.phase_listener = self._on_phase
        self._forwards, self._first_ready = [], None
        optimizer.ready_listener = self._on_first_ready
        self._step_start = time.perf_counter()
        self._next_candidate(optimizer)

    def _plan_candidates(self, optimizer) -> List[Tuple[str, Plan, float]]:
        from ..costmodel import predict
        from .optimal import OptimalScheduler
        params = self.profile.params()
        found = []
        for label, kwargs in (("optimal", {"allow_half": self.allow_half}),
                              ("no compression", {"allow_compress": False, "allow_half": self.allow_half}),
                              ("all compressed", {"sends": ("compress",)})):
            try:
                plan = OptimalScheduler(self.profile, chunk_mb=self.chunk_mb, **kwargs).plan(params)
            except ValueError as error:  # e.g. a send mode the profile cannot price
                self._say(f"auto scheduler: no '{label}' candidate: {error}")
                continue
            if all(plan.digest() != p.digest() for _, p, _ in found):
                found.append((label, plan, predict(plan, self.profile).iteration_time))
        fixed = [(f"fusion-num {groups}", FixedScheduler(groups, send="compress")) for groups in self.fusion_candidates]
        for label, scheduler in fixed + [("DDP buckets", BucketScheduler(send="fp32"))]:
            plan = scheduler.plan(params)
            if all(plan.digest() != p.digest() for _, p, _ in found):
                found.append((label, plan, predict(plan, self.profile).iteration_time))
        return found

    def _next_candidate(self, optimizer):
        from ..regroup import CannotRegroup
        while self._queue:
            index = self._queue[0]
            try:
                optimizer.set_plan(self._candidates[index][1])
            except CannotRegroup as reason:
                self._skipped[index] = f"skipped: {reason}"
                self._queue.pop(0)
                continue
            self._samples, self._window_forwards = [], []
            return
        self._round += 1
        # Rank 0 decides: the speed correction runs the cost model on its own profile.
        lead = optimizer.backend.rank == 0
        self._queue = optimizer.backend.broadcast_object(self._contenders() if lead else None, src=0)
        self._race = list(self._queue)
        if self._round < self.check_rounds and len(self._queue) > 1:
            self._next_candidate(optimizer)
            return
        figures, timed = optimizer.backend.broadcast_object(
            (self._at_check_speed(), self._at_check_speed(correct=False)) if lead else None, src=0)
        self._say_speeds()
        self.report = [(label, plan, predicted, self._skipped.get(index) or figures[index])
                       for index, (label, plan, predicted) in enumerate(self._candidates)
                       if index in self._skipped or index in figures]
        self.as_timed = {self._candidates[index][0]: seconds for index, seconds in timed.items()}
        self._choose(optimizer)

    def _contenders(self) -> List[int]:
        """Of the candidates still in the race (all, before the first round), the faster half
        by median at the check's speed (at least two), plus any within ``contender_margin``
        of the fastest; in candidate order."""
        medians = {index: seconds for index, seconds in self._at_check_speed().items()
                   if self._race is None or index in self._race}
        if not medians:
            return []
        ranked = sorted(medians, key=lambda index: (medians[index], index))
        keep = set(ranked[:max(2, (len(ranked) + 1) // 2)])
        fastest = medians[ranked[0]]
        keep.update(index for index in ranked if medians[index] <= fastest * (1 + self.contender_margin))
        return sorted(keep)

    def _check(self, optimizer, seconds):
        forward, self._first_ready = self._first_ready, None
        self._step_start = time.perf_counter()
        self._samples.append(seconds)
        self._keep_phases(len(self._samples) > 1)
        if len(self._samples) > 1:
            timed = seconds is not None and forward is not None
            self._window_forwards.append(forward if timed else None)
            if timed:
                self._forwards.append(forward)
        if len(self._samples) < self.check_steps + 1:
            return
        everyone = optimizer.backend.allgather_object((self._samples[1:], self._window_forwards))
        index = self._queue.pop(0)
        steps = [max(step) for step in zip(*(s for s, _ in everyone))  # each step: its slowest rank
                 if None not in step]  # untimed: restart_step_clock()
        forwards = [max(step) for step in zip(*(f for _, f in everyone)) if None not in step]
        if steps:
            self._windows[index].append((steps, statistics.median(forwards) if forwards else None))
        self._next_candidate(optimizer)

    def _at_check_speed(self, correct: bool = True) -> Dict[int, float]:
        """{candidate: median of its counted steps, each visit's corrected to the check's
        median compute speed} for the measured candidates (see the module docstring);
        with ``correct=False`` (or ``speed_correction`` off) the steps as timed."""
        forwards = self._visit_forwards()
        profile = self.profile
        reference = statistics.median(forwards) if forwards else None
        correct = correct and self.speed_correction and reference is not None and profile is not None \
            and profile.forward_time > 0
        figures = {}
        for index, visits in self._windows.items():
            plan, steps = self._candidates[index][1] if correct else None, []
            at_reference = self._predicted_at(plan, reference, reference) if correct else 0.0
            for seconds, forward in visits:
                shift = self._predicted_at(plan, forward, reference) - at_reference if correct and forward else 0.0
                steps.extend(s - shift for s in seconds)
            if steps:
                figures[index] = statistics.median(steps)
        return figures

    def _visit_forwards(self) -> List[float]:
        """The median forward seconds of every visit that timed one."""
        return [forward for visits in self._windows.values() for _, forward in visits if forward]

    def _say_speeds(self) -> None:
        forwards = sorted(self._visit_forwards())
        if forwards and self.speed_correction:
            self._say(f"auto scheduler: the check's visits ran forward passes of {forwards[0] * 1e3:.1f} to "
                      f"{forwards[-1] * 1e3:.1f} ms; their steps are compared at the median, "
                      f"{statistics.median(forwards) * 1e3:.1f} ms")

    def _predicted_at(self, plan: Plan, forward: float, reference: float) -> float:
        """The cost model's step time of ``plan`` at the compute speed a visit's ``forward``
        shows (clamped to ``speed_clamp`` around the ``reference`` forward)."""
        from ..costmodel import predict
        from ..simulate import scaled_compute
        forward = min(max(forward, reference / self.speed_clamp), reference * self.speed_clamp)
        return predict(plan, scaled_compute(self.profile, forward / self.profile.forward_time)).iteration_time

    def _live_costs(self, optimizer):
        """The profile at the speed the check ran at, with the launch and finish lines
        fitted to the live samples of every rank (see the module docstring)."""
        from ..profile import fit_live_costs
        from ..simulate import scaled_compute
        everyone = optimizer.backend.allgather_object((self._live, self._forwards))
        forwards = [f for _, rank_forwards in everyone for f in rank_forwards]
        self._forwards = []
        profile = self.profile
        if len(forwards) >= self.live_forward_samples and profile.forward_time > 0:
            forward = statistics.median(forwards)
            speed = forward / profile.forward_time
            profile = scaled_compute(profile, speed)
            self._say(f"auto scheduler: forward took {forward * 1e3:.1f} ms in the check "
                      f"against {self.profile.forward_time * 1e3:.1f} ms profiled: processor-side costs "
                      f"scaled by {speed:.2f}")
        fitted = {}
        for phase in ("launch", "finish"):
            pooled: Dict[str, List[Tuple[int, float]]] = {}
            for samples, _ in everyone:
                for send, pairs in samples.get(phase, {}).items():
                    if send == "compress" and profile.communicator not in ("allreduce", "allgather"):
                        continue  # the PS finish phase runs collectives: not a local cost
                    pooled.setdefault(send, []).extend(pairs)
            fitted[phase] = fit_live_costs(pooled)
        self._live = {"launch": {}, "finish": {}}
        lines = [f"{phase} {send}: {c.intercept * 1e3:.2f} ms + {c.slope * 1e9:.2f} ns/element"
                 for phase in fitted for send, c in sorted(fitted[phase].items())]
        if lines:
            self._say("auto scheduler: costs timed in the run: " + "; ".join(lines))
        return dataclasses.replace(profile, finish={**profile.finish, **fitted["finish"]},
                                   launch={**profile.launch, **fitted["launch"]})

    def _choose(self, optimizer):
        optimizer.phase_listener = None
        optimizer.ready_listener = None
        self._pending = []
        self.profile = self._live_costs(optimizer)
        if optimizer.backend.rank == 0 and self.profile_out:
            self.profile.save(self.profile_out)
        measured = [(m, label, plan) for label, plan, p, m in self.report if isinstance(m, float)]
        if measured:
            seconds, label, plan = self._winner(measured)
            optimizer.set_plan(plan)
            self.best = (label, plan, seconds)
        self._say(self.describe(optimizer))
        self.phase = "watch"
        self._samples = []
        self._strikes = 0

    def _winner(self, measured: List[Tuple[float, str, Plan]]) -> Tuple[float, str, Plan]:
        """The fastest measured (seconds, label, plan), unless it is lossy (compresses or
        casts a group) and the fastest all-FP32 plan measured within ``compression_margin``
        of it: then that FP32 plan.  A few percent is inside what one check can resolve on
        a shared machine, and compression that does not clearly pay should not be bought
        with accuracy (the loopback benchmark: a compressed plan measured 2% faster in the
        check ran 10% slower than DDP afterwards)."""
        fastest = min(measured, key=lambda row: row[0])
        lossless = [row for row in measured if all(g.send == "fp32" for g in row[2].groups)]
        if lossless and fastest not in lossless:
            best_raw = min(lossless, key=lambda row: row[0])
            if best_raw[0] <= fastest[0] * (1 + self.compression_margin):
                self._say(f"auto scheduler: {fastest[1]} measured {fastest[0] * 1e3:.1f} ms, within "
                          f"{self.compression_margin:.0%} of {best_raw[1]} ({best_raw[0] * 1e3:.1f} ms, all FP32): "
                          f"keeping FP32")
                return best_raw
        return fastest

    def _watch(self, optimizer, seconds):
        # Windows close by step count, never by valid samples, so every rank calls the
        # allgather below at the same step even when some steps were not timed (None: the
        # first step, or one after ``restart_step_clock()``).  The median ignores one slow
        # step (an evaluation or a checkpoint the caller did not announce).
        self._samples.append(seconds)
        if len(self._samples) < self.watch_every or self.best is None:
            return
        timed = [s for s in self._samples if s is not None]
        self._samples = []
        typical = [s for s in optimizer.backend.allgather_object(statistics.median(timed) if timed else None)
                   if s is not None]
        if not typical:
            return
        median = max(typical)
        self._strikes = self._strikes + 1 if median > (1 + self.drift) * self.best[2] else 0
        if self._strikes >= 2:
            from ..regroup import CannotRegroup
            try:
                self._start(optimizer, None)
            except CannotRegroup as reason:
                self._say(f"auto scheduler: steps drifted but the plan cannot change ({reason})")
                self._strikes = 0
                return
            self._say(f"auto scheduler: steps take {median * 1e3:.1f} ms against {self.best[2] * 1e3:.1f} ms "
                      "measured for the chosen plan; profiling again")

    # -- reporting ------------------------------------------------------------------------
    def _params(self, optimizer) -> List[ParamInfo]:
        return optimizer.param_infos(optimizer.plan.order())

    def describe(self, optimizer=None) -> str:
        lines = ["auto scheduler: candidates (predicted vs measured step time, at the check's median speed)"]
        for label, plan, predicted, measured in self.report:
            compressed = sum(g.send == "compress" for g in plan.groups)
            sliced = sum(g.slices is not None for g in plan.groups)
            pieces = f", {sliced} with pieces of tensors" if sliced else ""
            shown = f"{measured * 1e3:9.1f} ms" if isinstance(measured, float) else measured
            if isinstance(measured, float) and label in self.as_timed and self.speed_correction:
                shown += f" (as timed {self.as_timed[label] * 1e3:.1f} ms)"
            lines.append(f"  {label:<15} {len(plan):>3} groups ({compressed} compressed{pieces})  "
                         f"predicted {predicted * 1e3:9.1f} ms  measured {shown}")
        if self.best is not None:
            lines.append(f"  chosen: {self.best[0]} (plan {self.best[1].digest()}); search took "
                         f"{self.steps} steps")
        return "\n".join(lines)

    def _say(self, text: str) -> None:
        if self._log is not None and getattr(self, "_rank", 0) == 0:
            self._log(text)

    def __repr__(self):
        return (f"OnlineOptimalScheduler(profile_steps={self.profile_steps}, check_steps={self.check_steps}, "
                f"check_rounds={self.check_rounds}, fusion_candidates={self.fusion_candidates}, "
                f"watch_every={self.watch_every}, drift={self.drift})")
