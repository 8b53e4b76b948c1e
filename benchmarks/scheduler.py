#!/usr/bin/env python
"""A scheduler's plan against every fixed ``--fusion-num`` (and saved plans), in one run.

Is ``auto`` within 5% of the best fixed fusion-num?  Separate runs cannot say: on a shared
machine the same configuration drifts by ±15% between runs, and the best of seven noisy
cells is biased upwards.  Here one training run does it all: the scheduler (``--scheduler
auto`` by default, configured by the flags of ``compress_benchmark.py``) searches and
settles as usual, its search steps are reported; then the run is detached from it and
rounds of windows of ``--window`` steps switch between its plan, the plans of
``--fusion-nums`` (MergeComp's fixed groups, compressing every group) and any saved plans
(``--plans binary.json``, e.g. written by ``compress_benchmark.py --scheduler binary
--plan-out binary.json``), the order rotated each round.  Switching goes through
``set_plan``, so error-feedback state follows the parameters and the model keeps training.
Every window starts with one untimed step; a window's time is its slowest rank's.

A plan that is an earlier one (same digest: a fixed fusion-num that the scheduler chose,
or two fusion-nums that group a small model alike) is not run again: it is the same
configuration, and two labels for it would compare noise with noise.  It gets the earlier
plan's windows, so a scheduler that chose the best fixed plan measures exactly 1.0
against it.  The noise is measured on purpose instead: every round also runs a second
window of the scheduler's plan ("repeat"), at another place in the order, and the
scheduler's speed over that repeat is reported — what "5% slower" has to be read against.

Printed and saved (``--json``): each plan's median step time over rounds, and the median
over rounds of the scheduler's speed against the best fixed plan (best by median), against
each saved plan, against its repeat, and the search cost in steps.  The best of several
noisy medians is itself biased low, so the run also reports its *selection floor*
(:func:`selection_floor`): what a selector that timed every fixed plan in half of these
rounds scores on the other half, on average and how often under 0.95.  ``--table`` also names
the fixed plans that are the scheduler's own plan.

    python benchmarks/cluster.py --workers 2 --profile 1gbit -- python benchmarks/scheduler.py \\
        --threads 1 --model vgg16 --batch-size 8 --compress --compressor dgc --compress-ratio 0.01 \\
        --scheduler auto --plans binary.json --rounds 6 --window 3 --json vgg16-dgc.json
    python benchmarks/scheduler.py --table *.json

``scheduler.py report results.jsonl ...`` reads a sweep instead (see ``scheduler.py report
--help``): auto against the best fixed fusion-num and binary, cell by cell.
"""
from __future__ import annotations

import argparse
import itertools
from collections import defaultdict
import math
import os
import random
import statistics

import time
from typing import Dict, List, Optional


import sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import mergecomp
from benchmarks import harness

DEFAULT_FUSION_NUMS = "0,1,2,3,4,6,8"  # the sweep the scheduler is measured against
REPEAT = "repeat"  # the label of the scheduler's plan's second window in every round


def parse_args(argv=None):
    p = harness.build_parser(__doc__)
    p.set_defaults(scheduler="auto", compress=True)
    p.add_argument("--fusion-nums", default=DEFAULT_FUSION_NUMS,
                   help=f"fixed fusion-nums to compare with (default {DEFAULT_FUSION_NUMS})")
    p.add_argument("--plans", nargs="*", default=[], metavar="JSON", help="saved plans to compare with")
    harness.add_rounds_arguments(p, 6, "one window per plan")
    args = harness.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    try:
        args.fusion_nums = [int(x) for x in args.fusion_nums.split(",") if x.strip()]
    except ValueError:
        p.error(f"--fusion-nums must be comma-separated integers like 0,1,2,4, got {args.fusion_nums!r}")
    if any(k < 0 for k in args.fusion_nums):
        p.error(f"--fusion-nums must be ≥ 0, got {args.fusion_nums}")
    taken = {args.scheduler, REPEAT}
    for path in args.plans:
        if not os.path.isfile(path):
            p.error(f"--plans: no such file {path!r}; save one with compress_benchmark.py --plan-out")
        label = plan_label(path)
        if label in taken or label.startswith("fusion-num "):
            p.error(f"--plans: {path!r} would be labelled {label!r}, which another plan of this run already "
                    "has; rename the file")
        taken.add(label)
    return args


def plan_label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def candidate_plans(optimizer, args):
    """{label: plan}: the scheduler's choice first, then the fixed fusion-nums, then saved plans."""
    order = optimizer.plan.order()  # backward order
    params = optimizer.param_infos(order)
    plans = {args.scheduler: optimizer.plan}
    for k in args.fusion_nums:
        plans[f"fusion-num {k}"] = mergecomp.schedulers.create("fixed", fusion_num=k, send="compress").plan(params)
    for path in args.plans:
        plans[plan_label(path)] = mergecomp.Plan.load(path)
    return plans


def distinct_plans(plans) -> dict:
    """{label: earlier label with the same plan} for every plan that repeats an earlier one."""
    first, same = {}, {}
    for label, plan in plans.items():
        digest = plan.digest()
        if digest in first:
            same[label] = first[digest]
        else:
            first[digest] = label
    return same


def worker(args):
    work = harness.prepare(args)
    optimizer = harness.build_optimizer(args, work)

    timed = harness.make_timer(harness.training_step(work, work.model, optimizer), work.device)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers; exchange {optimizer.communicator!r}")
    search_steps = harness.warm_up_and_settle(optimizer, timed, args, work)
    plans = candidate_plans(optimizer, args)
    # From here the benchmark switches plans itself: an adaptive scheduler would take the
    # other plans' steps for drift and search again.
    optimizer.scheduler = mergecomp.schedulers.create("fixed")

    def switch_to(plan):
        return lambda: optimizer.set_plan(plan)

    same = distinct_plans(plans)
    runs = {label: plan for label, plan in plans.items() if label not in same}
    runs[REPEAT] = plans[args.scheduler]
    mine = harness.interleaved_windows({label: lambda: timed(1) for label in runs}, args.rounds,
                                            args.window, before={label: switch_to(plan) for label, plan in runs.items()})
    everyone = optimizer.backend.allgather_object(mine)
    slowest = {label: [max(r[label][i] for r in everyone) for i in range(args.rounds)] for label in runs}
    slowest.update({label: slowest[earlier] for label, earlier in same.items()})
    medians = {label: statistics.median(times) for label, times in slowest.items()}
    fixed = [label for label in plans if label.startswith("fusion-num ")]
    best_fixed = min(fixed, key=medians.get) if fixed else None
    chosen = slowest[args.scheduler]

    def speedup(label):  # the scheduler's speed over ``label``'s, round by round
        return statistics.median(other / mine for other, mine in zip(slowest[label], chosen))

    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "device": str(work.device),
        "compressor": args.compressor, "compress_ratio": args.compress_ratio, "memory": args.memory,
        "comm": args.comm, "scheduler": args.scheduler, "search_steps": search_steps,
        "rounds": args.rounds, "window": args.window,
        "plans": {label: {"groups": len(plan), "compressed": sum(g.send == "compress" for g in plan.groups),
                          "digest": plan.digest(), "step_s": slowest[label], "median_s": medians[label],
                          "same_as": same.get(label)}
                  for label, plan in plans.items()},
        "best_fixed": best_fixed,
        "versus_best_fixed": speedup(best_fixed) if best_fixed else None,
        "versus": {label: speedup(label) for label in plans if label != args.scheduler},
        "repeat": {"step_s": slowest[REPEAT], "median_s": statistics.median(slowest[REPEAT]),
                   "versus": speedup(REPEAT)},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    result["selection_floor"] = selection_floor(result)
    for label, plan in plans.items():
        versus = "" if label == args.scheduler else f"   {args.scheduler} is {result['versus'][label]:.3f}x as fast"
        if label in same:
            versus += f" (the same plan as {same[label]})"
        work.log(f"{label:<16} {len(plan):>3} groups ({result['plans'][label]['compressed']} compressed)  "
                 f"median {medians[label] * 1e3:8.1f} ms/step{versus}")
    work.log(f"{args.scheduler}'s plan again: median {result['repeat']['median_s'] * 1e3:8.1f} ms/step   "
             f"{args.scheduler} is {result['repeat']['versus']:.3f}x as fast (this measure's noise)")
    if best_fixed:
        work.log(f"{args.scheduler} against the best fixed plan ({best_fixed}): "
                 f"{result['versus_best_fixed']:.3f}x as fast (median over {args.rounds} rounds)")
    if result["selection_floor"]:
        floor = result["selection_floor"]
        work.log(f"a selector timing every fixed plan in half the rounds scores {floor['mean']:.3f} on the other "
                 f"half, under 0.95 in {floor['misses']:.0%} of {floor['splits']} splits (this measure's floor)")
    return harness.finish(result, args.json, work)


def selection_floor(result: dict, most_splits: int = 2000) -> Optional[dict]:
    """How well *any* selector can score on this measure: the noise floor of "within 5%".

    For each split of the rounds into two halves (every split, or a seeded sample of
    ``most_splits``), the distinct fixed plan fastest by median over one half is chosen and
    scored on the other half as ``versus_best_fixed`` scores the scheduler: the median
    over that half's rounds of its best fixed plan's step time over the chosen one's.  A
    selector that timed every fixed plan for as many rounds as the benchmark has left
    still loses to the best of several noisy medians.  Returns {"mean": the mean score,
    "misses": the fraction of splits scoring under 0.95, "splits": how many}, or None
    with fewer than 4 rounds or 2 distinct fixed plans."""
    by_digest = {}
    for label, plan in result["plans"].items():
        if label.startswith("fusion-num "):
            by_digest.setdefault(plan["digest"], plan["step_s"])
    rounds = min((len(times) for times in by_digest.values()), default=0)
    if rounds < 4 or len(by_digest) < 2:
        return None
    plans = list(by_digest.values())
    half = rounds // 2
    if math.comb(rounds, half) <= most_splits:
        splits = list(itertools.combinations(range(rounds), half))
    else:
        pick = random.Random(0)
        splits = [tuple(pick.sample(range(rounds), half)) for _ in range(most_splits)]
    def fastest(on):
        return min(plans, key=lambda times: statistics.median(times[r] for r in on))

    scores = []
    for chosen_on in splits:
        scored_on = [r for r in range(rounds) if r not in chosen_on]
        chosen, best = fastest(chosen_on), fastest(scored_on)
        scores.append(statistics.median(best[r] / chosen[r] for r in scored_on))
    return {"mean": statistics.mean(scores), "misses": sum(s < 0.95 for s in scores) / len(scores),
            "splits": len(scores)}


def same_plans(result: dict) -> list:
    """Labels of the fixed plans that are the scheduler's own plan (equal digests).

    Their windows and the scheduler's run the same configuration, so the ratio between
    them is this measure's noise, not a difference between plans."""
    mine = result["plans"][result["scheduler"]]["digest"]
    return [label for label, plan in result["plans"].items()
            if label != result["scheduler"] and label.startswith("fusion-num ") and plan["digest"] == mine]


def table(paths) -> str:
    """Markdown rows of saved results, one per file.

    "scheduler / repeat" is the scheduler's plan against its own second window (this
    measure's noise); "selection floor" is :func:`selection_floor` (what a selector that
    timed every fixed plan scores on this measure).  Results saved before repeats were run
    show "–" for the repeat, and measured each same plan again, so their "same plan as"
    carries that ratio instead."""
    lines = ["| model | compressor | scheduler: groups (compressed) | search steps | best fixed | "
             "scheduler / best fixed | same plan as | scheduler / repeat | selection floor (under 0.95) | "
             "scheduler / saved plans |",
             "|---|---|---|---:|---|---:|---|---:|---|---|"]
    for r in harness.saved_results(paths, "plans", "benchmarks/scheduler.py"):
        mine = r["plans"][r["scheduler"]]
        saved = ", ".join(f"{label} {value:.3f}" for label, value in r["versus"].items()
                          if not label.startswith("fusion-num "))
        repeat = f"{r['repeat']['versus']:.3f}" if "repeat" in r else "–"
        same = ", ".join(label if "repeat" in r else f"{label} ({r['versus'][label]:.3f})"
                         for label in same_plans(r))
        floor = selection_floor(r)
        floor = f"{floor['mean']:.3f} ({floor['misses']:.0%})" if floor else "–"
        lines.append(f"| {r['model']} | {r['compressor']} | {mine['groups']} ({mine['compressed']}) | "
                     f"{r['search_steps']} | {r['best_fixed']} | {r['versus_best_fixed']:.3f} | {same or '–'} | "
                     f"{repeat} | {floor} | {saved or '–'} |")
    return "\n".join(lines)


def plans_main(argv) -> int:
    return harness.run_or_table(parse_args(argv), worker, table)


# ------------------------------------------------------------------------------ report --

REPORT_DOC = """The scheduler benchmark's table: ``auto`` vs the best fixed fusion-num vs ``binary``.

    python benchmarks/scheduler.py report benchmarks/results/<dir>/results.jsonl [more.jsonl ...]

For every model, profile and compressor: the throughput of each fixed fusion-num cell, the
best of them, ``binary`` and ``auto`` (with the groups it chose, how many are compressed,
and the search cost in steps), and the ratios auto / best fixed and auto / binary.  When a
DDP FP32 cell of the same model and profile is present, auto / DDP FP32 too — on a fast
link that is the check that auto declines compression when it does not pay.
"""


def report_table(records: List[dict]) -> str:
    ok = [r for r in harness.latest(records).values() if r["status"] == "ok"]
    ddp: Dict[tuple, float] = {}
    cells: Dict[tuple, dict] = defaultdict(lambda: {"fixed": {}})
    for r in ok:
        cell, rate = r["cell"], r["result"]["rate_total"]
        place = (cell["model"], cell.get("profile"), cell.get("workers"))
        if cell["kind"] == "ddp" and cell["hook"] == "fp32":
            ddp[place] = rate
        if cell["kind"] != "mergecomp":
            continue
        row = cells[place + (cell["compressor"],)]
        scheduler = cell.get("scheduler", "fixed")
        if scheduler == "fixed":
            row["fixed"][cell["fusion_num"]] = rate
        else:
            row[scheduler] = r["result"]
    lines = ["| model | link | compressor | best fixed (fusion-num) | binary | auto | auto groups (compressed) | "
             "search steps | auto / best fixed | auto / binary | auto / DDP FP32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, profile, workers, compressor), row in sorted(cells.items()):
        best = max(row["fixed"].items(), key=lambda kv: kv[1]) if row["fixed"] else None
        auto, binary = row.get("auto"), row.get("binary")
        fp32 = ddp.get((model, profile, workers))

        def ratio(a, b):
            return f"{a / b:.3f}" if a and b else "—"

        auto_rate = auto["rate_total"] if auto else None
        binary_rate = binary["rate_total"] if binary else None
        cells_text = [
            f"{best[1]:.1f} ({best[0]})" if best else "—",
            f"{binary_rate:.1f}" if binary else "—",
            f"{auto_rate:.1f}" if auto else "—",
            f"{auto['groups']} ({auto['compressed_groups']})" if auto else "—",
            str(auto.get("search_steps", "—")) if auto else "—",
            ratio(auto_rate, best[1] if best else None), ratio(auto_rate, binary_rate),
            ratio(auto_rate, fp32)]
        lines.append(f"| {model} | {profile} ×{workers} | {compressor} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines)


def report_main(argv) -> int:
    p = argparse.ArgumentParser(prog="scheduler.py report", description=REPORT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="results.jsonl files written by benchmarks/sweep.py")
    args = p.parse_args(argv)
    records = []
    for path in args.results:
        if not os.path.exists(path):
            p.error(f"no such results file: {path}")
        records += harness.read_records(path)
    print(report_table(records))
    return 0


def main(argv=None) -> int:
    return harness.run_mode("scheduler.py", __doc__, {"plans": plans_main, "report": report_main}, argv,
                                 default="plans")


if __name__ == "__main__":
    harness.exit_with(main)
