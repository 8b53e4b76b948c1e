"""Timers the ``auto`` scheduler attaches to a running job, through its context's listeners.

Each one is attached with ``attach(context)`` (it returns itself; ``context``: the
:class:`~mergecomp.schedulers.base.SchedulerContext`) and removed with ``detach()``, which
removes its ``add_ready_listener``/``add_phase_listener`` handle, so nothing the user set
is replaced, and nothing stays attached once a phase has handed over.  (The wrapped
optimizer's own ``step()`` is timed by the context: ``time_optimizer_steps()``.)  Times are ``time.perf_counter()`` seconds; a step's
clock is restarted by the phase at the end of every ``step()`` (between steps: the
forward pass of the next step is what runs until its first gradient).
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Dict, List, Optional, Tuple

import torch


class ReadyTimes:
    """When each gradient became ready, in seconds since the step clock was restarted."""

    def __init__(self):
        #: {parameter name: [seconds, one per backward pass]}
        self.times: Dict[str, List[float]] = {}
        self._started = time.perf_counter()
        self._handle = None

    def attach(self, context) -> "ReadyTimes":
        self._handle = context.add_ready_listener(self._on_ready)
        return self

    def restart(self) -> None:
        self._started = time.perf_counter()

    def _on_ready(self, name: str) -> None:
        self.times.setdefault(name, []).append(time.perf_counter() - self._started)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def spans(self) -> List[float]:
        """First-to-last gradient seconds of each timed step (the first one dropped as a
        warm-up, unless it is the only one)."""
        steps = min(len(times) for times in self.times.values())
        spans = [max(t[i] for t in self.times.values()) - min(t[i] for t in self.times.values())
                 for i in range(steps)]
        return spans[1:] or spans

    def medians(self) -> Dict[str, float]:
        """Each gradient's median ready time (the first pass dropped as a warm-up)."""
        return {name: statistics.median(times[1:] or times) for name, times in self.times.items()}


class ForwardTimer:
    """Seconds from the restart of the step clock to the step's first gradient: the forward
    pass (no collective of the step is in flight yet, whatever the plan)."""

    def __init__(self):
        self._started = time.perf_counter()
        self._first: Optional[float] = None
        self._handle = None

    def attach(self, context) -> "ForwardTimer":
        self._handle = context.add_ready_listener(self._on_ready)
        self.lap()
        return self

    def _on_ready(self, name: str) -> None:
        if self._first is None:
            self._first = time.perf_counter() - self._started

    def lap(self) -> Optional[float]:
        """The forward seconds of the step that just ended (None: no gradient arrived), and
        a restarted clock for the next one."""
        forward, self._first = self._first, None
        self._started = time.perf_counter()
        return forward

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


class PhaseSamples:
    """Groups' launch and finish seconds, timed inside the optimizer (its phase listener).

    The launch is kept for each step's first group only: it is the one launched with no
    collective of the step in flight, so its time carries no interference the cost model
    counts again.  A step's samples are kept or dropped when it ends (``end_step``): the
    first step after a plan switch allocates the new plan's buffers.
    """

    def __init__(self):
        #: {"launch"|"finish": {send mode: [(elements, seconds), ...]}}
        self.samples: Dict[str, Dict[str, List[Tuple[int, float]]]] = {"launch": {}, "finish": {}}
        self._pending: List[Tuple[str, str, int, float]] = []
        self._handle = None

    def attach(self, context) -> "PhaseSamples":
        self._pending = []
        self._handle = context.add_phase_listener(self._on_phase)
        return self

    def _on_phase(self, phase: str, group, seconds: float) -> None:
        if phase == "finish" or group.index == 0:
            self._pending.append((phase, group.send, group.numel, seconds))

    def end_step(self, keep: bool) -> None:
        """Keep (or drop) the samples of the step that just ended."""
        if keep:
            for phase, send, numel, seconds in self._pending:
                self.samples[phase].setdefault(send, []).append((numel, seconds))
        self._pending = []

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._pending = []


class DummyBesideBackward:
    """Each step, an allreduce of ``tensor`` launched at the first gradient, beside backward.

    The launch goes through ``backend.uncounted()`` (measurement, not training traffic); a
    thread waits on it and notes when it completed.  After the step, ``ready`` holds when
    each gradient arrived, ``started`` when the allreduce was launched and ``done`` (one
    entry, or none) when it completed.
    """

    def __init__(self, backend, tensor: torch.Tensor):
        self.backend = backend
        self.tensor = tensor
        self.ready: List[float] = []
        self.done: List[float] = []
        self.started = 0.0
        self._thread: Optional[threading.Thread] = None
        self._handle = None

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def attach(self, context) -> "DummyBesideBackward":
        self.new_step()
        self._handle = context.add_ready_listener(self._on_ready)
        return self

    def new_step(self) -> None:
        self.ready, self.done, self._thread = [], [], None

    def _on_ready(self, name: str) -> None:
        now = time.perf_counter()
        if self._thread is None:
            self.started = time.perf_counter()
            with self.backend.uncounted():
                work = self.backend.allreduce_async([self.tensor])
            self._thread = threading.Thread(target=self._wait, args=(work,), daemon=True)
            self._thread.start()
        self.ready.append(now)

    def _wait(self, work) -> None:
        work.wait()
        self.done.append(time.perf_counter())

    def join(self) -> bool:
        """Wait for this step's allreduce; False if none was launched (no gradient)."""
        if self._thread is None:
            return False
        self._thread.join()
        return True

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
