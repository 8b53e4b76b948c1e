"""Phase 1 of the ``auto`` scheduler: profile the live run.

In ``profile_steps`` steps the whole model goes raw in one FP32 group while the
optimizer's hooks timestamp every gradient.  Backward is taken to start when the first
gradient arrives (the user owns the forward pass, so it cannot be timed apart);
everything before it counts as forward.  The wrapped optimizer's ``step()`` is timed
through torch's step hooks (the profile's ``optimizer_step``, median).  Codec, copy,
collective and finish-phase probes (the last through the job's own communicator, up
to the whole model's size) then complete a :class:`~mergecomp.profile.Profile` (saved
with ``profile_out``).

Then ``interference_steps`` more steps each launch a dummy allreduce at their first
gradient, sized from the measured allreduce cost to outlast backward; the backward
span (first to last gradient) of those steps against the profiled steps' gives the
profile's ``interference`` factor (:func:`~mergecomp.profile.interference_factor`):
how much a collective in flight slows backward on this machine, which the cost model
cannot know from probes taken one at a time.  A thread waits on the dummy and notes
when it completes; a step counts only if that was after its last gradient (the step's
own group, queued behind the dummy, cannot tell).  The factor is the mean over ranks.
The same number of steps then each launch a *short* dummy allreduce at their first
gradient (sized to 0.4 backward spans), counted when it was done before the last
gradient, and the same allreduce is timed alone between steps (after a barrier): the
ratio of the two is the profile's ``collective_slowdown``
(:func:`~mergecomp.profile.collective_slowdown_factor`), how much backward slows a
collective.  Each rank's duration includes waiting for the ranks that launched later,
so the shortest rank's median (the rank that waited least) is taken on both sides.

Every rank runs these steps in lockstep (the same collectives at the same steps); the
phase ends by handing over to the check (``_planned`` of the scheduler).
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import List

import torch


class LiveProfiling:
    """The profile phase of :class:`~mergecomp.schedulers.online.OnlineOptimalScheduler`.

    A mixin: the scheduler holds the state (``profile``, ``_samples``, ``_ready``,
    ``_step_start``, ``profile_steps``, ``interference_steps``) and the hand-over to the
    check (``_planned``); this class measures (see the module docstring)."""

    #: The dummy allreduce of an interference step lasts this many backward passes (by the
    #: measured allreduce cost), so that it is still in flight when backward ends.
    interference_span = 2.5
    #: ... but it never holds more than this many bytes.
    interference_max_bytes = 2 ** 28
    #: The short dummy allreduce of a slowdown step lasts this many backward spans (by the
    #: measured allreduce cost), so that it is done before backward ends.
    slowdown_span = 0.4

    def _time_optimizer_steps(self, inner) -> None:
        """Time the wrapped optimizer's ``step()`` through torch's step hooks."""
        self._inner_steps, began = [], []
        self._step_hooks = [
            inner.register_step_pre_hook(lambda *_: began.append(time.perf_counter())),
            inner.register_step_post_hook(
                lambda *_: self._inner_steps.append(time.perf_counter() - began.pop()))]

    def _stop_timing_optimizer_steps(self) -> None:
        for handle in getattr(self, "_step_hooks", ()):
            handle.remove()
        self._step_hooks = []

    def _on_ready(self, name: str) -> None:
        self._ready.setdefault(name, []).append(time.perf_counter() - self._step_start)

    def _profile(self, optimizer, seconds):
        self._step_start = time.perf_counter()
        self._samples.append(seconds)
        self._keep_phases(len(self._samples) > 1)
        if len(self._samples) < self.profile_steps:
            return
        optimizer.ready_listener = None
        optimizer.phase_listener = None
        self._stop_timing_optimizer_steps()
        self._alone = self._spans()
        self.profile = self._measure(optimizer)
        if self.interference_steps:
            self._start_interference(optimizer)
        else:
            self._planned(optimizer)

    def _spans(self) -> List[float]:
        """First-to-last gradient seconds of each profiled step (the first one dropped)."""
        steps = min(len(times) for times in self._ready.values())
        spans = [max(t[i] for t in self._ready.values()) - min(t[i] for t in self._ready.values())
                 for i in range(steps)]
        return spans[1:] or spans

    def _dummy_for(self, optimizer, spans: float, least_bytes: int) -> torch.Tensor:
        """A zero tensor whose allreduce lasts about ``spans`` backward spans (by the measured
        allreduce cost), between ``least_bytes`` and ``interference_max_bytes``; rank 0
        sizes it, so every rank allocates the same."""
        backend = optimizer.backend
        cost = self.profile.collectives["allreduce"]
        target = spans * statistics.median(self._alone)
        nbytes = None
        if backend.rank == 0:
            nbytes = int(min(self.interference_max_bytes,
                             max(least_bytes, (target - cost.intercept) / max(cost.slope, 1e-12))))
        nbytes = backend.broadcast_object(nbytes, src=0)
        return torch.zeros(max(1, nbytes // 4), device=optimizer.named_parameters()[0][1].device)

    def _start_interference(self, optimizer):
        backend = optimizer.backend
        self._dummy_tensor = self._dummy_for(optimizer, self.interference_span, 2 ** 20)
        self._overlapped, self._samples = [], []
        self._counters = (backend.bytes_sent, backend.collectives)
        self.phase = "interfere"
        self._begin_interference_step(optimizer)

    def _begin_interference_step(self, optimizer):
        self._span, self._dummy, self._dummy_done = [], None, []

        def waiter(work) -> None:
            work.wait()
            self._dummy_done.append(time.perf_counter())

        def listener(name: str) -> None:
            now = time.perf_counter()
            if self._dummy is None:
                self._dummy_started = time.perf_counter()
                self._dummy_nbytes = self._dummy_tensor.numel() * 4
                work = optimizer.backend.allreduce_async([self._dummy_tensor])
                self._dummy = threading.Thread(target=waiter, args=(work,), daemon=True)
                self._dummy.start()
            self._span.append(now)
        optimizer.ready_listener = listener

    def _interfere(self, optimizer, seconds):
        self._samples.append(seconds)
        if self._dummy is not None:
            self._dummy.join()
            if len(self._span) > 1 and self._dummy_done and self._dummy_done[0] > self._span[-1]:
                self._overlapped.append(self._span[-1] - self._span[0])
        if len(self._samples) < self.interference_steps:
            self._begin_interference_step(optimizer)
            return
        optimizer.ready_listener = None
        backend = optimizer.backend
        from ..profile import interference_factor
        mine = interference_factor(self._alone, self._overlapped) if self._overlapped else None
        factors = [f for f in backend.allgather_object(mine) if f is not None]
        if factors:
            self.profile = dataclasses.replace(self.profile, interference=statistics.mean(factors))
        else:
            self._say("auto scheduler: no interference step had its collective in flight to the "
                      "end of backward; the profile keeps interference 1.0")
        self._start_slowdown(optimizer)

    def _start_slowdown(self, optimizer):
        self._dummy_tensor = self._dummy_for(optimizer, self.slowdown_span, 2 ** 16)
        self._overlapped, self._samples = [], []
        self.phase = "slowdown"
        self._begin_interference_step(optimizer)

    def _slowdown(self, optimizer, seconds):
        self._samples.append(seconds)
        if self._dummy is not None:
            self._dummy.join()
            if len(self._span) > 1 and self._dummy_done and self._dummy_done[0] < self._span[-1]:
                self._overlapped.append(self._dummy_done[0] - self._dummy_started)
        if len(self._samples) < self.interference_steps:
            self._begin_interference_step(optimizer)
            return
        optimizer.ready_listener = None
        backend = optimizer.backend
        alone = []
        for _ in range(3):
            backend.barrier()
            began = time.perf_counter()
            backend.allreduce_async([self._dummy_tensor]).wait()
            alone.append(time.perf_counter() - began)
        backend.bytes_sent, backend.collectives = self._counters
        self._dummy = self._dummy_tensor = None
        mine = (statistics.median(alone),
                statistics.median(self._overlapped) if self._overlapped else None)
        everyone = backend.allgather_object(mine)
        overlapped = [o for _, o in everyone if o is not None]
        if overlapped:
            from ..profile import collective_slowdown_factor
            factor = collective_slowdown_factor([min(a for a, _ in everyone)], [min(overlapped)])
            self.profile = dataclasses.replace(self.profile, collective_slowdown=factor)
            self._say(f"auto scheduler: a {self._dummy_nbytes / 1e6:.1f} MB allreduce took "
                      f"{min(overlapped) * 1e3:.1f} ms under backward, "
                      f"{min(a for a, _ in everyone) * 1e3:.1f} ms alone: collective slowdown "
                      f"{factor:.2f}")
        else:
            self._say("auto scheduler: no slowdown step had its collective done before the end "
                      "of backward; the profile keeps collective_slowdown 1.0")
        self._planned(optimizer)

    def _measure(self, optimizer):
        """Median ready times (first pass dropped as warm-up) → timeline → full profile."""
        from ..probes import profile_from_timeline
        from ..profile import TensorTiming
        by_name = dict(optimizer.named_parameters())
        medians = {n: statistics.median(times[1:] or times) for n, times in self._ready.items()}
        order = sorted(medians, key=medians.get)
        first = medians[order[0]] if order else 0.0
        timeline = [TensorTiming(n, by_name[n].numel(), by_name[n].numel() * by_name[n].element_size(),
                                 str(by_name[n].dtype), str(by_name[n].device), medians[n] - first)
                    for n in order]
        # Parameters without a gradient on this rank cannot be timed: they go last, at the end.
        end = timeline[-1].ready if timeline else 0.0
        timeline += [TensorTiming(n, p.numel(), p.numel() * p.element_size(), str(p.dtype),
                                  str(p.device), end) for n, p in optimizer.named_parameters() if n not in medians]
        comm_name = optimizer.communicator.name
        # Probe up to the whole model (a plan's largest group), at most 2**24 elements:
        # costs of cache-sized buffers extrapolate badly to groups of tens of megabytes.
        total = sum(t.numel for t in timeline)
        largest = min(2 ** 24, max(2 ** 21, total))
        sizes = (2 ** 12, 2 ** 16, 2 ** 20, largest)
        # The finish phase allocates group-sized buffers: probe it at the model's own
        # scale too, between 2**20 elements and the whole model.
        finish_sizes = tuple(sorted({2 ** 12, 2 ** 16, 2 ** 20, max(2 ** 21, largest // 4), largest}))
        steps = self._inner_steps[1:] or self._inner_steps
        return profile_from_timeline(timeline, first, end, by_name[timeline[0].name].device,
                                     optimizer.compressor.name, optimizer.compressor,
                                     optimizer.backend, comm_name if comm_name in ("allreduce", "allgather", "ps") else "allgather",
                                     compression_sizes=sizes, memory=optimizer.communicator.memory,
                                     copy_sizes=(2 ** 14, 2 ** 18, 2 ** 22, 4 * largest),
                                     communicator_object=optimizer.communicator, finish_sizes=finish_sizes,
                                     optimizer_step=statistics.median(steps) if steps else 0.0)
