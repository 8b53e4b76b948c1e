#!/usr/bin/env python
"""The quality grid: every compressor at its defaults, the quality controller on and off,
against dense, for tasks × optimizers × worker counts × seeds (:mod:`benchmarks.harness.grid`).

    python benchmarks/quality_grid.py run --tasks char-lstm word-lstm --optimizers sgd adamw \\
        --workers 4 --seeds 0 1 --out benchmarks/results/DATE-quality-grid --dry-run
    python benchmarks/quality_grid.py run ... --out DIR              # trains, one cell after another
    python benchmarks/quality_grid.py summarise DIR                 # summary.md per cell, grid.md

Each cell is a folder ``DIR/<task>-<optimizer>-<N>w-seed<S>/`` with ``on/`` and ``off/``
(``benchmarks/convergence.py``'s results with the controller on and off; ``--controllers
default`` runs ``default/`` alone, the flag left out, where mergecomp has no controller); a
cell whose results exist is skipped, so a stopped grid resumes where it stopped.
``--dry-run`` prints the commands and the CPU time they would take, and trains nothing.
Anything after ``--`` goes to every convergence.py command as it is (``-- --lr 0.5
--batch-size 12``).  The whole grid takes hours on a few cores: run it on a host with
``workers × jobs`` cores per cell, or a cell at a time.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

from benchmarks.harness import drift, grid, lm, optimizers

TASKS = ("digits",) + tuple(lm.TASKS)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train the grid's cells (or print them with --dry-run)")
    run.add_argument("--tasks", nargs="+", choices=TASKS, default=["char-lstm"])
    run.add_argument("--optimizers", nargs="+", choices=optimizers.OPTIMIZERS, default=["sgd", "adamw"])
    run.add_argument("--workers", nargs="+", type=int, default=[4])
    run.add_argument("--seeds", nargs="+", type=int, default=[0])
    run.add_argument("--steps", type=int, default=1500, help="language models' steps (default 1500)")
    run.add_argument("--eval-every", type=int, default=250)
    run.add_argument("--compressors", nargs="+", default=list(grid.COMPRESSORS), metavar="SPEC",
                     help="convergence.py specs (default: " + " ".join(grid.COMPRESSORS) + ")")
    run.add_argument("--controllers", nargs="+", choices=grid.STATES, default=list(grid.CONTROLLER_STATES),
                     help="controller states, one invocation each (default: on off; 'default' leaves "
                          "--controller out, for a mergecomp without the controller)")
    run.add_argument("--out", required=True, help="the grid's folder (one folder per cell inside)")
    run.add_argument("--dry-run", action="store_true", help="print the commands and the CPU time; train nothing")
    summarise = sub.add_parser("summarise", help="summary.md per cell and grid.md from a grid's folder")
    summarise.add_argument("out")
    args = p.parse_args(argv)
    args.passthrough = passthrough
    if args.command == "run":
        for flag in ("workers", "seeds"):
            bad = [v for v in getattr(args, flag) if v < (1 if flag == "workers" else 0)]
            if bad:
                p.error(f"--{flag} takes {'counts ≥ 1' if flag == 'workers' else 'seeds ≥ 0'}, got {bad}")
        if args.steps < 1 or args.eval_every < 1:
            p.error(f"--steps and --eval-every must be ≥ 1, got {args.steps} and {args.eval_every}")
        if len(set(args.controllers)) != len(args.controllers):
            p.error(f"--controllers names a state twice: {args.controllers}")
        unhonoured = [s for s in args.controllers if s != "default"]
        if unhonoured and not drift.supported():
            p.error(f"--controllers {' '.join(unhonoured)}: this mergecomp has no quality controller "
                    f"(DistributedOptimizer takes no 'controller' keyword); run --controllers default")
        missing = sorted({f"{t} under {o}" for t in args.tasks for o in args.optimizers
                          if optimizers.dense_lr(o, t) is None and "--lr" not in passthrough})
        if missing:
            p.error(f"no swept dense learning rate for {', '.join(missing)}: sweep dense first, or "
                    f"give one task and optimizer and pass -- --lr VALUE")
    return args


def _done(cell_folder: str, states) -> bool:
    return all(os.path.exists(os.path.join(cell_folder, state, "convergence.json")) for state in states)


def run(args) -> int:
    python = os.path.relpath(sys.executable) if os.path.abspath(sys.executable).startswith(os.getcwd()) \
        else sys.executable
    plan = grid.cells(args.tasks, args.optimizers, args.workers, args.seeds)
    total, unknown = 0.0, []
    batch = None
    if "--batch-size" in args.passthrough:
        batch = int(args.passthrough[args.passthrough.index("--batch-size") + 1])
    for cell in plan:
        folder = os.path.join(args.out, cell.name)
        lines = grid.commands(cell, args.out, args.steps, args.compressors, python, args.passthrough,
                              args.eval_every, args.controllers)
        seconds = grid.estimate_cpu_seconds(cell, args.steps, len(args.compressors), batch, len(args.controllers))
        done = _done(folder, args.controllers)
        if seconds is None:
            unknown.append(cell.task)
        else:
            total += seconds
        state = "done, skipped" if done else f"about {seconds / 3600:.1f} CPU-hours" if seconds else "not estimated"
        print(f"# {cell.name}: {state}")
        for line in lines:
            print(grid.shell(line))
        if args.dry_run or done:
            continue
        for line in lines:
            if subprocess.call(line) != 0:
                print(f"# {cell.name}: a command failed; its rows that trained are in its folder", file=sys.stderr)
    unknown_text = f" (not counted: {', '.join(sorted(set(unknown)))}, never measured)" if unknown else ""
    print(f"# {len(plan)} cells, about {total / 3600:.1f} CPU-hours{unknown_text}; "
          f"{'nothing trained (--dry-run)' if args.dry_run else 'python benchmarks/quality_grid.py summarise ' + args.out}")
    if not args.dry_run:
        print("\n".join(grid.summarise(args.out)))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "summarise":
        try:
            for path in grid.summarise(args.out):
                print(path)
        except (OSError, ValueError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
