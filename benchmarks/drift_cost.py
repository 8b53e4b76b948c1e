#!/usr/bin/env python
"""What the drift measure costs a training step.

The quality controller reads the drift (what error feedback holds back against the update
flowing in, :mod:`mergecomp.runtime.drift`) on one step in ``every`` (10 by default): one
read pass over each compressed group's residual and incoming update on that step, and two
numbers per group added to the step's outcome allreduce, which runs anyway.  This benchmark
times it on real models: for each task (the character LSTM and the character GPT of the
convergence benchmark, on the Python distribution's help text) and each compressor, the
same ranks train through ``mergecomp.DistributedOptimizer`` in alternating windows of
``--window`` steps (short, so that a busy host slows both windows of a pair alike), one with
the drift measured as shipped (``controller="off"``: measured,
not steered, so that both windows send the same bytes) and one with a meter that never
measures, for ``--rounds`` rounds.  Each window's mean step time is taken (a measured
window's one measured step included: the cost amortised as a run pays it); the cost is
the median over rounds of (measured − unmeasured) / unmeasured, and the cost of a measured
step alone is reported beside it.

    python benchmarks/drift_cost.py --out benchmarks/results/drift-cost
    python benchmarks/drift_cost.py --tasks char-lstm --compressors topk --rounds 2   # a rehearsal

The step times come from the same processes in the same minutes, alternating, so a busy
machine slows both alike; the ratio is what this benchmark claims, not the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
from mergecomp import launch  # noqa: E402
from mergecomp.runtime.drift import DriftMeter  # noqa: E402
from benchmarks.harness import lm  # noqa: E402
from benchmarks.harness.data import text  # noqa: E402
from benchmarks.harness.results import provenance  # noqa: E402

#: A meter whose first measured step lies beyond any run: the step as if there were no measure.
NEVER = 10 ** 12


def _worker(task_name: str, compressor: str, args) -> Dict[str, object]:
    launch.init_distributed()
    warnings.simplefilter("ignore")  # the unsteered lag's advice: this run means to leave it unsteered
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    corpus = text.load_text("pydoc", "char")
    task = lm.get_task(task_name)
    model = task.build(corpus.vocab_size)
    optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                               model=model, compressor=compressor, controller="off")
    lifecycle = optimizer.lifecycle
    meters = {"measured": lifecycle.meter, "unmeasured": DriftMeter(NEVER, None)}
    stream = iter(lm.TextStream(corpus, args.batch_size, task.bptt, rank, world))
    state = None

    def step():
        nonlocal state
        inputs, targets, _, starts = next(stream)
        if starts:
            state = None
        optimizer.zero_grad()
        loss, state = lm.training_loss(task, model, inputs, targets, state)
        loss.backward()
        optimizer.step()

    for _ in range(args.warmup):
        step()
    rounds: List[Dict[str, float]] = []
    measured_steps: List[float] = []
    for _ in range(args.rounds):
        means = {}
        for mode in ("measured", "unmeasured"):
            lifecycle.meter = meters[mode]
            seconds = []
            for _ in range(args.window):
                before = meters["measured"].reading
                start = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - start)
                if mode == "measured" and meters["measured"].reading is not before:
                    measured_steps.append(seconds[-1])
            # every rank agrees on the slowest rank's total (a step is as slow as its slowest rank)
            mean = torch.tensor([sum(seconds) / len(seconds)], dtype=torch.float64)
            torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.MAX)
            means[mode] = float(mean)
        rounds.append(means)
    lifecycle.meter = meters["measured"]
    ratios = [(r["measured"] - r["unmeasured"]) / r["unmeasured"] for r in rounds]
    unmeasured = statistics.median(r["unmeasured"] for r in rounds)
    return {"task": task_name, "compressor": compressor, "rounds": rounds,
            "cost": statistics.median(ratios), "unmeasured_step_s": unmeasured,
            "measured_step_alone": (statistics.median(measured_steps) - unmeasured) / unmeasured
            if measured_steps else None,
            "parameters": sum(p.numel() for p in model.parameters())}


def _table(rows: List[Dict[str, object]]) -> str:
    lines = ["| task | compressor | parameters | step (ms) | cost of the measure | a measured step's own cost |",
             "|---|---|---:|---:|---:|---:|"]
    for row in rows:
        alone = row["measured_step_alone"]
        lines.append(f"| {row['task']} | {row['compressor']} | {row['parameters']:,} | "
                     f"{row['unmeasured_step_s'] * 1e3:.1f} | {row['cost'] * 100:+.2f}% | "
                     + ("–" if alone is None else f"{alone * 100:+.1f}%") + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=["char-lstm", "char-gpt"], choices=sorted(lm.TASKS))
    p.add_argument("--compressors", nargs="+", default=["topk", "dgc", "powersgd"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--warmup", type=int, default=20, help="steps before timing (default 20)")
    p.add_argument("--rounds", type=int, default=40, help="alternations of the two windows (default 40)")
    p.add_argument("--window", type=int, default=10,
                   help="steps per window (default 10: one measured step in each measured window)")
    p.add_argument("--out", default=None, help="folder for drift-cost.json and drift-cost.md")
    args = p.parse_args(argv)
    for what in ("workers", "threads", "batch_size", "rounds", "window"):
        if getattr(args, what) < 1:
            p.error(f"--{what.replace('_', '-')} must be ≥ 1, got {getattr(args, what)}")
    started = provenance()
    rows = []
    for task in args.tasks:
        for compressor in args.compressors:
            row = launch.spawn(_worker, args.workers, args=(task, compressor, args), timeout_s=3600)[0]
            rows.append(row)
            print(f"{task} {compressor}: the measure costs {row['cost'] * 100:+.2f}% of a step "
                  f"({row['unmeasured_step_s'] * 1e3:.1f} ms unmeasured)", flush=True)
    print(_table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "drift-cost.json"), "w") as f:
            json.dump({"rows": rows, "settings": vars(args), "provenance": started}, f, indent=1)
        with open(os.path.join(args.out, "drift-cost.md"), "w") as f:
            f.write(_table(rows) + "\n")


if __name__ == "__main__":
    main()
