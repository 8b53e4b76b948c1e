#!/usr/bin/env python
"""Validate the simulator against the emulated cluster: predicted vs measured step time.

    python benchmarks/simulator_check.py --workers 2,3,4 --profile 1gbit --model vgg16 --compressor dgc

For each worker count N it runs ``compress_benchmark.py --scheduler auto`` on N workers
behind the shaped links, which profiles the run (``--profile-out``) and executes a plan
(``--plan-out``), measuring its step time.  The simulator's model — the profile's compute
timeline and codec costs, with the collectives replaced by the α-β network model at the
link's rate (:func:`mergecomp.simulate.network_collectives`) — then predicts that same
plan, and the table compares the two.  What it validates is the network and overlap model;
the compute side comes from the run itself (on a 2-core machine, 3 or 4 workers share the
cores, which a profile taken at N = 2 could not know), and so do the interference factor
and, with ``--link-efficiency profile`` (the default), the fraction of the line rate the
profile's allreduce probe reached.

``--plans`` (default ``auto``) adds fixed plans, so that every N has predicted-vs-measured
points for the *same* plans run after run (``auto`` picks by measurement, and picks
differently from run to run): ``fp32-K`` / ``compress-K`` is the fixed scheduler's plan of
K groups balanced by bytes (``--fusion-num K``), all raw FP32 or all compressed, built
from the auto run's profile and executed with ``--plan-in``.  The ``auto`` run always
happens (it measures the profile every prediction uses); its row is shown when ``auto``
is listed.

Windows: ``--num-iters`` × ``--batches-per-iter`` timed steps after the search (default
8 × 3 = 24 steps); at 1 Gbit/s single steps vary by ±20%, so 6 steps are not enough to
resolve a 15% error.  ``--out DIR`` keeps each run's profile, plan, result and log.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import shutil
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cluster import Cluster, parse_profile  # noqa: E402
from mergecomp.costmodel import predict  # noqa: E402
from mergecomp.plan import Plan  # noqa: E402
from mergecomp.profile import Profile, scaled_compute  # noqa: E402
from mergecomp.schedulers.fixed import FixedScheduler  # noqa: E402
from mergecomp.simulate import measured_link_efficiency, network_collectives  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_plans(text: str):
    """``auto,fp32-4,compress-4`` → [("auto", None, None), ("fp32-4", "fp32", 4), ...]."""
    specs = []
    for item in (x.strip() for x in text.split(",")):
        if item == "auto":
            specs.append(("auto", None, None))
            continue
        send, _, groups = item.partition("-")
        if send not in ("fp32", "fp16", "bf16", "compress") or not groups.isdigit() or int(groups) < 1:
            raise ValueError(f"--plans: {item!r} is neither 'auto' nor SEND-K with SEND one of "
                             "fp32, fp16, bf16, compress and K ≥ 1 groups (e.g. compress-4)")
        specs.append((item, send, int(groups)))
    if not specs or len({label for label, _, _ in specs}) != len(specs):
        raise ValueError(f"--plans must list distinct plans, got {text!r}")
    return specs


def measure(workers: int, profile: str, args, folder: str, label: str = "auto",
            plan_in: str = None) -> dict:
    tag = f"{workers}" if label == "auto" else f"{workers}_{label}"
    paths = {k: os.path.join(folder, f"{k}_{tag}.json") for k in ("profile", "plan", "result")}
    phases = os.path.join(folder, f"phases_{tag}")
    script = ["phase_timing.py", "--phases-out", phases] if args.phases else ["compress_benchmark.py"]
    script[0] = os.path.join(ROOT, "benchmarks" if args.phases else "", script[0])
    if plan_in is None:
        how = ["--scheduler", "auto", "--profile-out", paths["profile"]]
    else:
        how = ["--scheduler", "fixed", "--plan-in", plan_in]
    command = [sys.executable] + script + ["--model", args.model,
               "--batch-size", str(args.batch_size), "--compress", "--compressor", args.compressor,
               *how, "--plan-out", paths["plan"],
               "--json", paths["result"], "--threads", "1", "--no-cuda",
               "--num-warmup-batches", "2", "--num-batches-per-iter", str(args.batches_per_iter),
               "--num-iters", str(args.num_iters)]
    if args.compress_ratio is not None:
        command += ["--compress-ratio", str(args.compress_ratio)]
    with Cluster(num_workers=workers, profile=profile) as cluster:
        results = cluster.run(command, timeout_s=args.timeout_s, cwd=ROOT)
    with open(os.path.join(folder, f"log_{tag}.txt"), "w") as f:
        f.write(results[0].stdout + results[0].stderr if results else "")
    if not results.ok:
        raise RuntimeError(f"N={workers}, plan {label}: {results.failure}")
    with open(paths["result"]) as f:
        measured = json.load(f)
    run = {"plan": Plan.load(paths["plan"]), "measured": measured["iteration_time_s"], "phases": []}
    if plan_in is None:
        run["profile"] = Profile.load(paths["profile"])
    if args.phases:
        for rank in range(workers):
            with open(os.path.join(phases, f"phases_{rank}.json")) as f:
                run["phases"].append(json.load(f))
    return run


def window_compute_factor(profile: Profile, phases) -> float:
    """The timed window's forward time over the profile's: the median over ranks of each
    rank's median forward (to the first gradient).  Forward runs with no collective in
    flight, so its change is the host's compute speed alone."""
    import statistics
    forwards = [statistics.median(step["forward"] for step in steps) for steps in phases if steps]
    if not forwards or not profile.forward_time > 0:
        raise ValueError("no forward times to calibrate with: run with --phases and a profile "
                         f"whose forward time is positive (got {profile.forward_time!r})")
    return statistics.median(forwards) / profile.forward_time


def phase_table(prediction, phases) -> str:
    """Predicted vs measured phases (medians over steps, min–max over ranks)."""
    import statistics

    def spread(values):
        values = [v * 1e3 for v in values]
        return f"{min(values):.1f}–{max(values):.1f}" if len(values) > 1 else f"{values[0]:.1f}"

    def per_rank(pick):
        return [statistics.median(pick(step) for step in steps) for steps in phases if steps]

    hooks = [g for g in prediction.groups if g.launch < prediction.backward_end]
    predicted_encode = sum(g.encode_end - g.launch for g in hooks)
    finishes = [g.finish_end - g.finish_start for g in prediction.groups]
    rows = [("forward (to first gradient)", prediction.forward_time, per_rank(lambda s: s["forward"])),
            ("backward (first to last gradient)", prediction.backward_end, per_rank(lambda s: s["backward"])),
            ("encode in hooks, Σ", predicted_encode,
             per_rank(lambda s: sum(t for t, where in s["encode"] if where == "hook"))),
            ("finish (decode…write-back), Σ", sum(finishes), per_rank(lambda s: sum(s["finish"]))),
            ("after backward (synchronize)", prediction.iteration_time - prediction.forward_time
             - prediction.optimizer_step - prediction.backward_end, per_rank(lambda s: s["synchronize"])),
            ("optimizer step", prediction.optimizer_step, per_rank(lambda s: s["optimizer_step"] or 0.0)),
            ("step", prediction.iteration_time, per_rank(lambda s: s["step"]))]
    for g, predicted in enumerate(finishes):
        rows.append((f"  finish of group {g}", predicted,
                     per_rank(lambda s, g=g: s["finish"][g] if g < len(s["finish"]) else 0.0)))
    lines = ["| phase | predicted ms | measured ms (median over steps, range over ranks) |",
             "|---|---|---|"]
    for label, predicted, measured in rows:
        lines.append(f"| {label} | {predicted * 1e3:.1f} | {spread(measured) if measured else '–'} |")
    return "\n".join(lines)


def _lines(costs) -> str:
    return ", ".join(f"{send} {c.intercept * 1e3:.1f} ms + {c.slope * 1e9:.2f} ns/el"
                     for send, c in sorted(costs.items())) or "none"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--profile", default="1gbit", help="network profile of the emulated cluster")
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compressor", default="dgc")
    p.add_argument("--compress-ratio", type=float, default=0.01)
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="per-message latency the simulator assumes (the links add none: no netem here)")
    p.add_argument("--link-efficiency", default="profile",
                   help="fraction of the line rate the simulated collectives reach, or 'profile' "
                        "(default): the fraction the run's own allreduce probe reached")
    p.add_argument("--num-iters", type=int, default=8, help="timed iterations per run")
    p.add_argument("--batches-per-iter", type=int, default=3, help="steps per timed iteration")
    p.add_argument("--out", default=None, help="folder to keep profiles, plans, results and logs in")
    p.add_argument("--plans", default="auto",
                   help="plans to validate at each N: 'auto' (the plan --scheduler auto chose) and "
                        "fixed plans SEND-K (fp32-4: 4 raw FP32 groups; compress-4: 4 compressed "
                        "groups), comma-separated; default: auto")
    p.add_argument("--phases", action="store_true",
                   help="run the benchmark through benchmarks/phase_timing.py and print each "
                        "phase's predicted and measured time")
    p.add_argument("--calibrate-compute", action="store_true",
                   help="with --phases: also predict with the profile's processor-side times scaled "
                        "by the timed window's forward time over the profile's (the host's compute "
                        "speed drifts between the two; forward runs with no collective in flight), "
                        "so that the error left is the network and overlap model's")
    p.add_argument("--timeout-s", type=float, default=1200)
    args = p.parse_args(argv)
    if args.calibrate_compute and not args.phases:
        p.error("--calibrate-compute needs --phases (the timed window's forward time)")
    if args.num_iters < 1 or args.batches_per_iter < 1:
        p.error(f"--num-iters and --batches-per-iter must be ≥ 1, got {args.num_iters}, {args.batches_per_iter}")
    if args.link_efficiency != "profile":
        try:
            fixed = float(args.link_efficiency)
        except ValueError:
            p.error(f"--link-efficiency must be a fraction in (0, 1] or 'profile', got {args.link_efficiency!r}")
        if not 0 < fixed <= 1:
            p.error(f"--link-efficiency must be a fraction in (0, 1] or 'profile', got {fixed}")
    try:
        specs = parse_plans(args.plans)
    except ValueError as error:
        p.error(str(error))
    link = parse_profile(args.profile)
    if not link.shaped:
        p.error(f"profile {args.profile!r} is not rate-limited; the simulator needs a link rate")
    rate = link.rate_bps / 8  # bytes per second
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for workers in (int(w) for w in args.workers.split(",")):
            auto = measure(workers, args.profile, args, folder)
            profile = auto["profile"]
            efficiency = measured_link_efficiency(profile, rate) if args.link_efficiency == "profile" \
                else float(args.link_efficiency)
            modelled = dataclasses.replace(profile, collectives=network_collectives(
                workers, rate, args.latency_us * 1e-6, efficiency))
            print(f"N={workers}: interference {profile.interference:.2f}, collective slowdown "
                  f"{profile.collective_slowdown:.2f}, link efficiency {efficiency:.2f}, memory "
                  f"{profile.memory.intercept * 1e3:.2f} ms + {profile.memory.slope * 1e9:.2f} ns/element; "
                  f"live launch {_lines(profile.launch)}; finish {_lines(profile.finish)}", flush=True)
            for label, send, groups in specs:
                if label == "auto":
                    run = auto
                else:
                    plan = FixedScheduler(groups, send=send).plan(profile.params())
                    plan_in = os.path.join(folder, f"plan_in_{workers}_{label}.json")
                    plan.save(plan_in)
                    run = measure(workers, args.profile, args, folder, label, plan_in)
                prediction = predict(run["plan"], modelled)
                predicted = prediction.iteration_time
                speed = window_compute_factor(profile, run["phases"]) if args.calibrate_compute else None
                calibrated = (predict(run["plan"], scaled_compute(modelled, speed)).iteration_time
                              if speed else None)
                rows.append((workers, label, run["plan"], predicted, run["measured"], profile.interference,
                             profile.collective_slowdown, efficiency, speed, calibrated))
                print(f"N={workers}, plan {label}: predicted {predicted * 1e3:.1f} ms, measured "
                      f"{run['measured'] * 1e3:.1f} ms\n{prediction.describe()}", flush=True)
                if speed:
                    print(f"  window's compute speed: {speed:.2f} × the profile's; calibrated "
                          f"prediction {calibrated * 1e3:.1f} ms", flush=True)
                if args.phases:
                    print(phase_table(prediction, run["phases"]), flush=True)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for name in os.listdir(folder):
                source = os.path.join(folder, name)
                if os.path.isdir(source):
                    shutil.copytree(source, os.path.join(args.out, name), dirs_exist_ok=True)
                else:
                    shutil.copy(source, args.out)
    print(f"\n{args.model}, {args.compressor}, {args.profile} links; plans: {args.plans}\n")
    calibrate = " window compute × | calibrated ms | calibrated error |" if args.calibrate_compute else ""
    print("| workers | plan | groups, compressed | interference | collective slowdown | "
          "link efficiency | predicted ms | measured ms | error |" + calibrate)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if calibrate else ""))
    for (workers, label, plan, predicted, measured, interference, slowdown, efficiency,
         speed, calibrated) in rows:
        compressed = sum(g.send == "compress" for g in plan.groups)
        extra = (f" {speed:.2f} | {calibrated * 1e3:.1f} | {(calibrated - measured) / measured * 100:+.1f}% |"
                 if calibrate else "")
        print(f"| {workers} | {label} | {len(plan)}, {compressed} | {interference:.2f} | {slowdown:.2f} | "
              f"{efficiency:.2f} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
              f"{(predicted - measured) / measured * 100:+.1f}% |" + extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
