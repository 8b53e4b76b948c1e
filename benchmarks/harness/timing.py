"""The timing loop: timed windows of steps, interleaved contenders, per-operator profiles
and the iterations a result reports."""
from __future__ import annotations

import functools
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from .workload import Workload, on_terminal


def make_timer(step: Callable[[], None], device: torch.device) -> Callable[[int], float]:
    """``timed(n)``: seconds for n calls of ``step``, the device synchronised at both ends."""
    def timed(batches: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(batches):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start
    return timed


def operator_profile(timed: Callable[[int], float], steps: int, device: torch.device, rows: int = 25) -> str:
    """A table of the operators ``steps`` more steps spend their time in, per step.

    Where the phases say *that* a step is slow, this says *in what*: torch's profiler
    around ``timed(steps)``, operators sorted by their own time (their children's
    excluded: on CUDA the device's, else the CPU's), so a compressor's elementwise passes
    show up beside the model's convolutions.  Collectives appear as the time this rank
    spends starting and waiting for them.
    """
    from torch.profiler import ProfilerActivity, profile
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        timed(steps)

    def own(event) -> float:  # ms per step
        return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / steps / 1e3

    events = sorted(prof.key_averages(), key=own, reverse=True)
    total = sum(own(e) for e in events)
    where = "device" if on_cuda else "CPU"
    lines = [f"Operators over {steps} step(s), by own {where} time per step (all operators: {total:.1f} ms):",
             f"| operator | calls per step | own {where} ms | share |", "|---|---:|---:|---:|"]
    for event in events[:rows]:
        lines.append(f"| {event.key} | {event.count / steps:g} | {own(event):.2f} | "
                     f"{own(event) / total if total else 0:.1%} |")
    return "\n".join(lines)


def interleaved_windows(steps: Dict[str, Callable[[], None]], rounds: int, window: int,
                        before: Optional[Dict[str, Callable[[], None]]] = None) -> Dict[str, List[float]]:
    """Per-round seconds per step of each named step function, timed in interleaved windows.

    On a shared machine speed drifts within minutes; comparing runs taken one after the
    other mixes that drift into the result.  Here each round runs one window of every
    configuration, the order rotated by one each round (AB, BA, ... for two), so all of
    them see the same conditions.  ``before[name]``, when given, runs before each of that
    name's windows (switching a plan, resetting a clock); then one untimed step (the other
    configurations left the caches and allocator cold) and ``window`` timed steps.
    Returns {name: [seconds per step, one per round]} on this rank.
    """
    names = list(steps)
    per_step: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            if before and name in before:
                before[name]()
            steps[name]()
            started = time.perf_counter()
            for _ in range(window):
                steps[name]()
            per_step[name].append((time.perf_counter() - started) / window)
    return per_step


def run_iterations(timed, work: Workload, args, counters: Callable[[], Dict[str, float]]) -> Dict[str, List[float]]:
    """``num_iters`` timed iterations of ``num_batches_per_iter`` training steps each.

    Returns one entry per iteration in each list: ``rates`` (samples/s), ``step_times``
    (seconds per training step), and for each key of ``counters()`` its increase per
    training step (bytes sent, ...).
    """
    series: Dict[str, List[float]] = {"rates": [], "step_times": []}
    work.progress.phase("timed", args.num_iters * args.num_batches_per_iter)
    iterations, write = _progress(args.num_iters,
                                  show=work.rank == 0 and on_terminal(sys.stderr, work.info.launcher))
    for i in iterations:
        before = counters()
        seconds = timed(args.num_batches_per_iter)
        after = counters()
        for key in before:
            series.setdefault(key, []).append((after[key] - before[key]) / args.num_batches_per_iter)
        series["step_times"].append(seconds / args.num_batches_per_iter)
        series["rates"].append(work.batch_size * args.num_batches_per_iter / seconds)
        if work.rank == 0:
            write(f"Iter #{i}: {series['rates'][-1]:.1f} {work.spec.unit}/sec per worker")
    return series


def _progress(iterations: int, show: bool):
    """``range(iterations)`` and a function that prints a line: with a progress bar on
    stderr when ``show`` (rank 0 on a person's terminal, :func:`on_terminal`: in logs and
    through mpirun's forwarding the bar's carriage returns garble lines), the bar's own
    ``write``, which keeps the bar below the lines.

    The bar gets a thread lock.  tqdm's default lock adds a multiprocessing semaphore,
    created by every bar even a disabled one; a rank ends without the interpreter's
    teardown (:func:`launch.exit_without_teardown`), so that semaphore is never released
    and the resource tracker reports it as leaked when the launching process exits.
    """
    if not show:
        return range(iterations), functools.partial(print, flush=True)
    import threading
    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())
    return tqdm(range(iterations), desc="iterations", file=sys.stderr, leave=False), tqdm.write
