"""Phase 1 of the ``auto`` scheduler: profile the live run.

**Profiling** (``profile_steps`` steps).  The whole model goes raw in one FP32 group while
a ready listener timestamps every gradient.  Backward is taken to start when
the first gradient arrives (the user owns the forward pass, so it cannot be timed apart);
everything before it counts as forward.  The wrapped optimizer's ``step()`` is timed
(``context.time_optimizer_steps()``: the profile's ``optimizer_step``, median), and a
phase listener times groups' launch and finish (kept for the refit after the check).
Codec, copy, collective and finish-phase probes (the last through the job's own
communicator, up to the whole model's size) then complete a
:class:`~mergecomp.planning.profile.Profile` (saved with ``profile_out``).

**Interference** (``interference_steps`` steps).  Each step launches a dummy allreduce at
its first gradient, sized from the measured allreduce cost to outlast backward; the
backward span (first to last gradient) of those steps against the profiled steps' gives
the profile's ``interference`` factor (:func:`~mergecomp.planning.profile.interference_factor`):
how much a collective in flight slows backward on this machine, which the cost model
cannot know from probes taken one at a time.  A thread waits on the dummy and notes when
it completes; a step counts only if that was after its last gradient (the step's own
group, queued behind the dummy, cannot tell).  The factor is the mean over ranks.

**Slowdown** (as many steps).  Each step launches a *short* dummy allreduce at its first
gradient (sized to a fraction of a backward span), counted when it was done before the
last gradient, and the same allreduce is then timed alone between steps (after a
barrier): the ratio of the two is the profile's ``collective_slowdown``
(:func:`~mergecomp.planning.profile.collective_slowdown_factor`), how much backward slows a
collective.  Each rank's duration includes waiting for the ranks that launched later, so
the shortest rank's median (the rank that waited least) is taken on both sides.

The dummy allreduces are measurement, not training traffic: they run inside
``backend.uncounted()``.  Every rank runs these steps in lockstep (the same collectives
at the same steps); the last one hands over to the check
(:class:`~mergecomp.planning.auto.racing.Checking`).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import List, Optional, Sequence

import torch

from ...distributed.backends.expect import INT, NUMBER, optional, tuple_of
from ..profile import LinearCost, Profile, TensorTiming, collective_slowdown_factor, interference_factor
from .instruments import DummyBesideBackward, PhaseSamples, ReadyTimes
from .phase import Phase, Search
from .planning import check_priceable, profiling_plan
from .racing import Checking
from ..costmodel import priced_collectives
from ..measure import profile_from_timeline


class Profiling(Phase):
    """Time the backward pass of the model in one raw FP32 group, then probe.

    Building it switches to the profiling plan; a switch that would lose state raises
    :class:`~mergecomp.runtime.regroup.CannotRegroup` before anything is attached."""

    name = "profile"

    def __init__(self, search: Search, context):
        super().__init__(search)
        check_priceable(context)
        plan = context.plan
        if any(g.send != "fp32" for g in plan.groups) or len(plan) != 1:
            context.set_plan(profiling_plan(context.param_infos(plan.order())))
        self.ready = ReadyTimes().attach(context)
        self.optimizer_steps = context.time_optimizer_steps()
        self.live = PhaseSamples().attach(context)
        self.steps = 0
        self.ready.restart()

    def after_step(self, context, seconds) -> Phase:
        self.ready.restart()
        self.steps += 1
        self.live.end_step(keep=self.steps > 1)
        if self.steps < self.search.settings.profile_steps:
            return self
        self.ready.detach()
        self.live.detach()
        self.optimizer_steps.detach()
        alone = self.ready.spans()
        self.search.findings.carriers = context.carriers()
        self.search.findings.profile = measure_profile(context, self.ready, self.optimizer_steps.seconds,
                                                       self.search.findings.carriers)
        if self.search.settings.interference_steps:
            return Interference(self.search, context, alone, self.live)
        return Checking.begin(self.search, context, self.live)


def measure_profile(context, ready: ReadyTimes, optimizer_steps: List[float],
                    carriers: Sequence[str] = ()) -> Profile:
    """Median ready times (first pass dropped as warm-up) → timeline → the probes → a full
    profile, with the collectives the ``carriers``' formulas need (the communicators of
    ``"compress:<name>"`` modes).  A collective: every rank calls it at the same step."""
    by_name = dict(context.named_parameters())
    medians = ready.medians()
    order = sorted(medians, key=medians.get)
    first = medians[order[0]] if order else 0.0
    timeline = [TensorTiming(n, by_name[n].numel(), by_name[n].numel() * by_name[n].element_size(),
                             str(by_name[n].dtype), str(by_name[n].device), medians[n] - first)
                for n in order]
    # Parameters without a gradient on this rank cannot be timed: they go last, at the end.
    end = timeline[-1].ready if timeline else 0.0
    timeline += [TensorTiming(n, p.numel(), p.numel() * p.element_size(), str(p.dtype),
                              str(p.device), end) for n, p in context.named_parameters() if n not in medians]
    # Probe up to the whole model (a plan's largest group), at most 2**24 elements:
    # costs of cache-sized buffers extrapolate badly to groups of tens of megabytes.
    total = sum(t.numel for t in timeline)
    largest = min(2 ** 24, max(2 ** 21, total))
    sizes = (2 ** 12, 2 ** 16, 2 ** 20, largest)
    # The finish phase allocates group-sized buffers: probe it at the model's own
    # scale too, between 2**20 elements and the whole model.
    finish_sizes = tuple(sorted({2 ** 12, 2 ** 16, 2 ** 20, max(2 ** 21, largest // 4), largest}))
    steps = optimizer_steps[1:] or optimizer_steps
    return profile_from_timeline(timeline, first, end, by_name[timeline[0].name].device,
                                 context.compressor.name, context.compressor,
                                 context.backend, context.communicator.name,
                                 compression_sizes=sizes, memory=context.memory,
                                 copy_sizes=(2 ** 14, 2 ** 18, 2 ** 22, 4 * largest),
                                 communicator_object=context.communicator, finish_sizes=finish_sizes,
                                 optimizer_step=statistics.median(steps) if steps else 0.0,
                                 extra_collectives=[kind for name in carriers for kind in priced_collectives(name)])


def dummy_bytes(allreduce: LinearCost, seconds: float, least: int, most: int) -> int:
    """Bytes whose allreduce lasts about ``seconds`` by the measured ``allreduce`` cost,
    within [``least``, ``most``]."""
    return int(min(most, max(least, (seconds - allreduce.intercept) / max(allreduce.slope, 1e-12))))


def dummy_tensor(context, profile: Profile, alone: List[float], spans: float, least: int,
                 most: int) -> torch.Tensor:
    """A zero tensor whose allreduce lasts about ``spans`` backward spans; rank 0 sizes it
    and broadcasts the size, so every rank allocates the same."""
    backend = context.backend
    nbytes = None
    if backend.rank == 0:
        nbytes = dummy_bytes(profile.collectives["allreduce"], spans * statistics.median(alone), least, most)
    nbytes = backend.broadcast_object(nbytes, src=0, expect=INT)
    return torch.zeros(max(1, nbytes // 4), device=context.named_parameters()[0][1].device)


class _DummyBesideBackwardPhase(Phase):
    """Steps with a dummy allreduce launched beside backward: each step's sample comes from
    :meth:`sample`, and after ``interference_steps`` steps :meth:`conclude` turns them into
    the profile's figure and names the next phase."""

    #: The settings field of the dummy's span (in backward spans) and its smallest size in bytes.
    span_setting, min_bytes = "", 0

    def __init__(self, search: Search, context, alone: List[float], live: PhaseSamples):
        super().__init__(search)
        settings = search.settings
        self.alone, self.live = alone, live
        tensor = dummy_tensor(context, search.findings.profile, alone, getattr(settings, self.span_setting),
                              self.min_bytes, settings.interference_max_bytes)
        self.dummy = DummyBesideBackward(context.backend, tensor).attach(context)
        self.overlapped: List[float] = []
        self.steps = 0

    def after_step(self, context, seconds) -> Phase:
        self.steps += 1
        dummy = self.dummy
        if dummy.join() and len(dummy.ready) > 1 and dummy.done:
            sample = self.sample(dummy)
            if sample is not None:
                self.overlapped.append(sample)
        if self.steps < self.search.settings.interference_steps:
            dummy.new_step()
            return self
        dummy.detach()
        return self.conclude(context)

    def sample(self, dummy: DummyBesideBackward) -> Optional[float]:
        """This step's figure, or None when the dummy did not overlap backward as needed."""
        raise NotImplementedError

    def conclude(self, context) -> Phase:
        """Record the figure in the profile; return the next phase."""
        raise NotImplementedError


class Interference(_DummyBesideBackwardPhase):
    """Steps with a long dummy allreduce beside backward: how much it slows backward."""

    name = "interfere"
    span_setting, min_bytes = "interference_span", 2 ** 20

    def sample(self, dummy):
        if dummy.done[0] > dummy.ready[-1]:
            return dummy.ready[-1] - dummy.ready[0]  # in flight to backward's end
        return None

    def conclude(self, context) -> Phase:
        mine = interference_factor(self.alone, self.overlapped) if self.overlapped else None
        factors = [f for f in context.backend.allgather_object(mine, expect=optional(NUMBER)) if f is not None]
        findings = self.search.findings
        if factors:
            findings.profile = dataclasses.replace(findings.profile, interference=statistics.mean(factors))
        else:
            self.search.say("auto scheduler: no interference step had its collective in flight to the "
                            "end of backward; the profile keeps interference 1.0")
        return Slowdown(self.search, context, self.alone, self.live)


class Slowdown(_DummyBesideBackwardPhase):
    """Steps with a short dummy allreduce under backward, then the same alone: how much
    backward slows a collective."""

    name = "slowdown"
    span_setting, min_bytes = "slowdown_span", 2 ** 16

    #: How many times the dummy allreduce is timed alone.
    alone_repeats = 3

    def sample(self, dummy):
        if dummy.done[0] < dummy.ready[-1]:
            return dummy.done[0] - dummy.started  # done under backward
        return None

    def conclude(self, context) -> Phase:
        dummy, backend = self.dummy, context.backend
        alone = []
        with backend.uncounted():
            for _ in range(self.alone_repeats):
                backend.barrier()
                began = time.perf_counter()
                backend.allreduce_async([dummy.tensor]).wait()
                alone.append(time.perf_counter() - began)
        mine = (statistics.median(alone), statistics.median(self.overlapped) if self.overlapped else None)
        everyone = backend.allgather_object(mine, expect=tuple_of(NUMBER, optional(NUMBER)))
        overlapped = [o for _, o in everyone if o is not None]
        findings = self.search.findings
        if overlapped:
            shortest_alone = min(a for a, _ in everyone)
            factor = collective_slowdown_factor([shortest_alone], [min(overlapped)])
            findings.profile = dataclasses.replace(findings.profile, collective_slowdown=factor)
            self.search.say(f"auto scheduler: a {dummy.nbytes / 1e6:.1f} MB allreduce took "
                            f"{min(overlapped) * 1e3:.1f} ms under backward, {shortest_alone * 1e3:.1f} ms "
                            f"alone: collective slowdown {factor:.2f}")
        else:
            self.search.say("auto scheduler: no slowdown step had its collective done before the end "
                            "of backward; the profile keeps collective_slowdown 1.0")
        return Checking.begin(self.search, context, self.live)
