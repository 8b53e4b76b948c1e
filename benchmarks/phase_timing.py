#!/usr/bin/env python
"""``compress_benchmark.py`` with every phase of every step timed, for the simulator check.

    python benchmarks/phase_timing.py --phases-out DIR <compress_benchmark.py flags>

Runs the benchmark unchanged, with timers wrapped around the optimizer's pieces (in this
process only).  Once the scheduler has settled (or at once for a non-adaptive one), each
step records, per rank:

* ``forward``: from the previous step's end to the first gradient (zero_grad, forward,
  loss, and backward up to its first gradient — what the profile calls forward);
* ``backward``: from the first gradient to the end of the last gradient's hook, hook-side
  encoding included (the model's backward end);
* ``encode``: seconds of each group's launch (gather copy, memory, compression, collective
  start) and whether it ran in a hook or in ``step()``;
* ``wait`` and ``finish``: per group, seconds waiting for its collective, and seconds of
  the rest of ``Communicator.finish`` plus the write-back into ``p.grad``;
* ``synchronize``: from the end of backward to the last write-back;
* ``optimizer_step``: the wrapped optimizer's own ``step()``;
* ``step``: wall-clock between step ends.

Each rank writes ``DIR/phases_<rank>.json``.  ``benchmarks/simulator_check.py --phases``
reads them next to the cost model's prediction of the same phases.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.optim.optimizer import (register_optimizer_step_post_hook,  # noqa: E402
                                   register_optimizer_step_pre_hook)

import compress_benchmark  # noqa: E402
from mergecomp import optimizer as optimizer_module  # noqa: E402
from mergecomp import reducer as reducer_module  # noqa: E402
from mergecomp.communicators.base import Communicator  # noqa: E402


class Recorder:
    """Per-step phase times of one rank (see the module docstring)."""

    def __init__(self):
        self.steps = []
        self.current = None
        self.last_end = None
        self.active = False
        self.inner_began = None

    def begin_if_needed(self):
        if self.current is None:
            self.current = {"first": None, "last": None, "encode": [], "wait": [], "finish": [],
                            "optimizer_step": None}
        return self.current


def install(recorder: Recorder) -> None:
    Opt = optimizer_module.DistributedOptimizer

    def settled(opt) -> bool:
        scheduler = opt.scheduler
        return not getattr(scheduler, "adaptive", False) or scheduler.settled

    Red = reducer_module.Reducer
    on_ready = Red._on_gradient_ready

    def _on_gradient_ready(self, name):
        if not recorder.active:
            return on_ready(self, name)
        step = recorder.begin_if_needed()
        if step["first"] is None:
            step["first"] = time.perf_counter()
        result = on_ready(self, name)
        step["last"] = time.perf_counter()  # after the hook: its launch is part of backward
        return result

    launch = Red._launch

    def _launch(self, group):
        if not recorder.active:
            return launch(self, group)
        in_step = self._in_step
        start = time.perf_counter()
        result = launch(self, group)
        recorder.begin_if_needed()["encode"].append((time.perf_counter() - start, "step" if in_step else "hook"))
        return result

    finish = Communicator.finish

    def _finish(self, handle):
        if not recorder.active:
            return finish(self, handle)
        start = time.perf_counter()
        if handle.rounds is None:
            handle.work.wait()
        waited = time.perf_counter()
        result = finish(self, handle)
        recorder._finish_began = waited
        recorder.begin_if_needed()["wait"].append(waited - start)
        return result

    write_back = Red._write_back

    def _write_back(self, group, averaged, used):
        result = write_back(self, group, averaged, used)
        if recorder.active:
            recorder.begin_if_needed()["finish"].append(time.perf_counter() - recorder._finish_began)
            recorder.current["synchronized"] = time.perf_counter()
        return result

    synchronize = Red.synchronize

    def _synchronize(self, active=True):
        self._in_step = True
        try:
            return synchronize(self, active)
        finally:
            self._in_step = False

    step = Opt.step

    def _step(self, closure=None):
        recorder.active = settled(self)
        result = step(self, closure)
        now = time.perf_counter()
        if recorder.active and recorder.current is not None and recorder.last_end is not None:
            record = recorder.current
            if record["first"] is not None:
                recorder.steps.append({
                    "forward": record["first"] - recorder.last_end,
                    "backward": record["last"] - record["first"],
                    "encode": record["encode"], "wait": record["wait"], "finish": record["finish"],
                    "synchronize": record.get("synchronized", record["last"]) - record["last"],
                    "optimizer_step": record["optimizer_step"],
                    "step": now - recorder.last_end})
        recorder.current = None
        recorder.last_end = now
        recorder.active = settled(self)
        return result

    def pre(optimizer, args, kwargs):
        recorder.inner_began = time.perf_counter()

    def post(optimizer, args, kwargs):
        if recorder.active and recorder.inner_began is not None and not isinstance(optimizer, Opt):
            recorder.begin_if_needed()["optimizer_step"] = time.perf_counter() - recorder.inner_began

    Red._on_gradient_ready, Red._launch, Red._write_back = _on_gradient_ready, _launch, _write_back
    Red.synchronize, Opt.step, Communicator.finish = _synchronize, _step, _finish
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def recorded_worker(args):
    """compress_benchmark's worker with the timers installed (picklable, for --nproc)."""
    recorder = Recorder()
    install(recorder)
    result = _worker(args)
    rank = int(os.environ.get("RANK", "0"))
    folder = os.environ["MERGECOMP_PHASES_OUT"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"phases_{rank}.json"), "w") as f:
        json.dump(recorder.steps, f)
    return result


_worker = compress_benchmark.worker


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--phases-out" not in argv or argv.index("--phases-out") + 1 >= len(argv):
        raise SystemExit("phase_timing.py needs --phases-out DIR, then compress_benchmark.py's flags")
    at = argv.index("--phases-out")
    os.environ["MERGECOMP_PHASES_OUT"] = os.path.abspath(argv[at + 1])
    del argv[at:at + 2]
    compress_benchmark.worker = recorded_worker
    return compress_benchmark.main(argv)


if __name__ == "__main__":
    sys.exit(main())
