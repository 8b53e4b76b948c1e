"""Whether the host, not the links, set a timed window: how long the workers' threads
waited for a core.

An emulated cluster puts many workers on few cores.  When the cores are oversubscribed, a
collective's ring steps wait for their threads to be scheduled, and the step measures the
host instead of the shaped links: a simulator checked against such a step is checked
against the wrong machine.  The kernel counts, per thread, the time it was runnable but
waiting on a run queue (``/proc/<pid>/task/<tid>/schedstat``, second field, with
``CONFIG_SCHED_INFO``); summed over a worker's threads and divided by the window's wall
time, it is the *core wait*: on average how many of the worker's threads were ready to run
and had no core.  A worker whose compute is replayed sleeps through it, so its threads
want a core only for the exchange; a core wait near zero says every one of them got one at
once.  :class:`HostLoad` measures it around timed steps, with the worker's processor time
and, host-wide, the share of time some task waited for a core (``/proc/pressure/cpu``)
and the share of the cores busy (``/proc/stat``), reported beside it.

:func:`host_bound` is the rule a report applies: a window whose slowest rank's core wait
reaches ``max_core_wait`` was set by the host, and its cell is refused.
"""
from __future__ import annotations

import os
import time
from typing import Callable, Dict, List, Optional, Tuple

#: The default refusal threshold: threads waiting for a core, on average, per worker.  At
#: 0.1 a worker's exchange lost about a tenth of the window to the queue: more than that
#: and a 15% check of the network model cannot tell the model's error from the host's.
MAX_CORE_WAIT = 0.1


def _thread_times(pid: str = "self") -> Dict[str, tuple]:
    """{thread id: (ns on a core, ns waiting for one)} of every thread of ``pid``."""
    times = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return times
    for tid in tids:
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                on_cpu, waiting, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        times[tid] = (int(on_cpu), int(waiting))
    return times


def _cpu_pressure() -> Optional[float]:
    """Microseconds some task waited for a core, since boot (None without PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            for line in f:
                if line.startswith("some"):
                    return float(line.rsplit("total=", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cpu_ticks() -> Optional[tuple]:
    """(busy, total) ticks of all cores since boot (None where /proc/stat is unreadable)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def available() -> Optional[str]:
    """None when this host reports per-thread run-queue waits; otherwise why not."""
    if not _thread_times():
        return ("this kernel reports no per-thread run-queue waits (/proc/self/task/*/schedstat, "
                "CONFIG_SCHED_INFO); the host-bound indicator cannot be measured here")
    return None


class HostLoad:
    """Sums, over the windows between :meth:`start` and :meth:`stop`, this process's
    wall time, its threads' processor time and their run-queue wait, and the host's CPU
    pressure and busy share: :meth:`summary` of one worker (module docstring)."""

    def __init__(self):
        self.wall = self.cpu = self.wait = 0.0
        self.pressure = 0.0
        self.busy = self.ticks = 0
        self._began = None

    def start(self) -> None:
        self._began = (time.perf_counter(), _thread_times(), _cpu_pressure(), _cpu_ticks())

    def stop(self) -> None:
        if self._began is None:
            raise RuntimeError("HostLoad.stop() without start()")
        wall0, threads0, pressure0, ticks0 = self._began
        wall1, threads1, pressure1, ticks1 = time.perf_counter(), _thread_times(), _cpu_pressure(), _cpu_ticks()
        self._began = None
        self.wall += wall1 - wall0
        for tid, (on_cpu, waiting) in threads1.items():
            before = threads0.get(tid, (0, 0))  # a thread started in the window counts from 0
            self.cpu += (on_cpu - before[0]) / 1e9
            self.wait += (waiting - before[1]) / 1e9
        if pressure0 is not None and pressure1 is not None:
            self.pressure += (pressure1 - pressure0) / 1e6
        if ticks0 is not None and ticks1 is not None:
            self.busy += ticks1[0] - ticks0[0]
            self.ticks += ticks1[1] - ticks0[1]

    def summary(self) -> Dict[str, float]:
        """Per second of the windows: ``core_wait`` (threads waiting for a core, on
        average), ``cpu`` (cores this process used), ``host_pressure`` (share of time some
        task of the host waited for a core; None without PSI), ``host_busy`` (share of the
        host's cores busy); ``wall_s`` the windows' seconds."""
        wall = self.wall or float("nan")
        return {"wall_s": self.wall, "core_wait": self.wait / wall, "cpu": self.cpu / wall,
                "host_pressure": self.pressure / wall if _cpu_pressure() is not None else None,
                "host_busy": self.busy / self.ticks if self.ticks else None, "cores": os.cpu_count()}


def watched(steps: Dict[str, Callable[[], None]]) -> Tuple[Dict[str, Callable[[], None]], Dict[str, "HostLoad"]]:
    """``steps`` (name → one step) each measured by a :class:`HostLoad` of its own: the
    wrapped steps, and the loads by name (for :func:`~benchmarks.harness.timing.interleaved_windows`)."""
    loads = {name: HostLoad() for name in steps}

    def wrap(step, load):
        def measured():
            load.start()
            try:
                step()
            finally:
                load.stop()
        return measured
    return {name: wrap(step, loads[name]) for name, step in steps.items()}, loads


def combine(ranks: List[Dict[str, float]]) -> Dict[str, float]:
    """One window's indicator over every rank's :meth:`HostLoad.summary`: the slowest
    rank's core wait (the ring steps wait for it), the mean over ranks otherwise, and the
    cores all ranks used together."""
    if not ranks:
        raise ValueError("combine needs at least one rank's summary")

    def mean(key):
        values = [r[key] for r in ranks if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    return {"core_wait": max(r["core_wait"] for r in ranks), "core_wait_mean": mean("core_wait"),
            "cpu_total": sum(r["cpu"] for r in ranks), "host_pressure": mean("host_pressure"),
            "host_busy": mean("host_busy"), "cores": ranks[0].get("cores"), "ranks": len(ranks)}


def host_bound(indicator: Optional[Dict[str, float]], max_core_wait: float = MAX_CORE_WAIT) -> Optional[str]:
    """Why ``indicator`` (:func:`combine`'s) says the host set the window, or None when the
    links did.  A window measured without the indicator cannot be vouched for: it is
    refused too."""
    if not max_core_wait > 0:
        raise ValueError(f"max_core_wait must be > 0 threads, got {max_core_wait!r}")
    if not indicator:
        return "no host-load measurement (run it again with this version)"
    wait = indicator["core_wait"]
    if wait >= max_core_wait:
        return (f"host-bound: a worker's threads waited for a core {wait:.2f} s per second "
                f"(threshold {max_core_wait:g}); {indicator['cpu_total']:.2f} of {indicator['cores']} cores busy "
                "with the workers")
    return None
