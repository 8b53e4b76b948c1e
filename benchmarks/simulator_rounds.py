#!/usr/bin/env python
"""The simulator against the emulated cluster, with the compute timed in the same rounds.

    python benchmarks/cluster.py --workers 4 --profile 1gbit -- python benchmarks/simulator_rounds.py \\
        --threads 1 --model vgg16 --batch-size 8 --compressor dgc --compress-ratio 0.01 \\
        --plans auto,fp32-4,compress-4 --rounds 8 --window 3 --json vgg16-dgc-4.json
    python benchmarks/simulator_rounds.py --table vgg16-dgc-*.json

What ``benchmarks/simulator_check.py`` validates is the simulator's network and overlap
model: the compute side (forward, when each gradient is ready, the codecs) comes from the
run's own profile.  On a shared host that profile is minutes older than the timed window,
and the host's compute speed drifts by up to 50% in between, which no network model can
predict.  Here one training run does it all, so that the compute a prediction uses was
timed beside the steps it predicts:

1. ``--scheduler auto`` profiles the live run and settles as usual; its profile, with the
   collectives replaced by the α-β model at the link's rate
   (:func:`mergecomp.simulate.network_collectives`, link efficiency from the profile's
   allreduce probe), is the simulator's input — the *saved-profile* prediction.
2. Then ``--rounds`` rounds run one window of ``--window`` steps of every plan of
   ``--plans`` (``auto``: the plan the scheduler chose; ``fp32-K`` / ``compress-K``: K
   groups balanced by bytes, all raw FP32 or all compressed) and one *compute* window:
   the whole model in one raw FP32 group, launched when the last gradient is ready, so no
   collective runs during forward or backward.  Its steps time each gradient's ready time
   and the optimizer's step, per rank; the order of the windows rotates each round.
3. Each round's prediction takes the profile's compute from that round's compute window:
   each gradient's ready time is the median over ranks (the profile is one rank's
   medians), forward ends at the first of them; codec, copy, memory, launch and finish
   costs are scaled by the median rank's backward time in the window over the profile's.
   The interference and collective slowdown factors stay as the profile measured them.

A window's time is its slowest rank's mean step.  Every step's phases are timed as
``benchmarks/phase_timing.py`` times them, and each plan's are printed next to the phases
predicted from its median round.  The error of a plan is the median over
rounds of its predicted over its measured step time, minus one; the saved-profile error is
the profile's single prediction against the median measured step.  ``--json`` saves both
with every round's numbers, the profile and each round's compute (to predict again offline);
``--table`` prints the saved results as one markdown table.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from typing import Dict, List

if __package__ in (None, ""):  # run as a script: make ``mergecomp`` importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compress_benchmark  # noqa: E402
import mergecomp  # noqa: E402
from benchmarks.cluster import parse_profile  # noqa: E402
from benchmarks.phase_timing import Recorder, install  # noqa: E402
from benchmarks.simulator_check import parse_plans, phase_table  # noqa: E402
from mergecomp import benchmarking  # noqa: E402
from mergecomp.costmodel import predict  # noqa: E402
from mergecomp.profile import Profile, scaled_compute  # noqa: E402
from mergecomp.simulate import measured_link_efficiency, network_collectives  # noqa: E402

COMPUTE = "compute"  # the label of the compute window


def parse_args(argv=None):
    p = compress_benchmark.build_parser(__doc__)
    p.set_defaults(scheduler="auto", compress=True)
    p.add_argument("--plans", default="auto,fp32-4,compress-4",
                   help="plans to predict and time: auto (the scheduler's choice), fp32-K, fp16-K, "
                        "bf16-K, compress-K (default auto,fp32-4,compress-4)")
    compress_benchmark.add_rounds_arguments(p, 8, "one window per plan and a compute window")
    p.add_argument("--net-profile", default=os.environ.get("MERGECOMP_NET_PROFILE"),
                   help="the network profile of the links (default: the one benchmarks/cluster.py "
                        "runs this worker behind)")
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="per-message latency the simulator assumes (default 50)")
    p.add_argument("--link-efficiency", default="profile",
                   help="fraction of the line rate the simulated collectives reach, or 'profile' "
                        "(default): the fraction the run's own allreduce probe reached")
    args = compress_benchmark.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    if args.scheduler != "auto":
        p.error(f"--scheduler must be auto (its live profile is the simulator's input), got {args.scheduler!r}")
    try:
        args.plans = parse_plans(args.plans)
    except ValueError as error:
        p.error(str(error))
    if not args.latency_us >= 0:
        p.error(f"--latency-us must be ≥ 0, got {args.latency_us}")
    if args.link_efficiency != "profile":
        try:
            args.link_efficiency = float(args.link_efficiency)
        except ValueError:
            p.error(f"--link-efficiency must be a fraction in (0, 1] or 'profile', got {args.link_efficiency!r}")
        if not 0 < args.link_efficiency <= 1:
            p.error(f"--link-efficiency must be a fraction in (0, 1] or 'profile', got {args.link_efficiency}")
    if not args.net_profile:
        p.error("no network profile: run under benchmarks/cluster.py --profile NAME, or pass --net-profile")
    try:
        link = parse_profile(args.net_profile)
    except ValueError as error:
        p.error(str(error))
    if not link.shaped:
        p.error(f"network profile {args.net_profile!r} is not rate-limited; the simulator needs a link rate")
    args.link_rate = link.rate_bps / 8  # bytes per second
    return args


class ComputeClock:
    """Times when each gradient is ready, in seconds from the start of each step it runs;
    one list of steps per round.  (The optimizer step of the same steps is in the phase
    recorder's records.)"""

    def __init__(self, optimizer, step):
        self.optimizer, self.step, self.rounds = optimizer, step, []

    def new_round(self) -> None:
        self.rounds.append([])

    def __call__(self) -> None:
        ready = {}
        start = time.perf_counter()
        handle = self.optimizer.add_ready_listener(lambda name: ready.setdefault(name, time.perf_counter() - start))
        try:
            self.step()
        finally:
            handle.remove()
        self.rounds[-1].append(ready)

    def summaries(self, phases: List[dict], window: int) -> List[dict]:
        """Per round (its first, cold step dropped): the median over steps of each gradient's
        ready time, and of the optimizer step from ``phases``, the recorder's records of the
        compute windows' timed steps (``window`` per round, in order)."""
        out = []
        for r, steps in enumerate(self.rounds):
            steps = steps[1:] or steps
            names = set.intersection(*(set(s) for s in steps))
            optimizer_steps = [p["optimizer_step"] or 0.0 for p in phases[r * window:(r + 1) * window]]
            out.append({"ready": {n: statistics.median(s[n] for s in steps) for n in names},
                        "optimizer_step": statistics.median(optimizer_steps) if optimizer_steps else 0.0})
        return out


def round_profile(modelled: Profile, ranks: List[dict]) -> Profile:
    """``modelled`` with the compute of one round's window (``ranks``: each rank's summary).

    Each gradient's ready time (from the step's start) and the optimizer step are the
    median over ranks, forward ends at the first gradient: a typical rank, as the profile
    is one rank's medians.  (The slowest rank per gradient, tried first, composes the
    worst of several noisy 3-step medians: a step slower than any rank's typical one.)
    The other processor-side costs are scaled by the median rank's backward span over the
    profile's."""
    names = [t.name for t in modelled.timeline]
    at = {n: statistics.median(r["ready"].get(n, max(r["ready"].values())) for r in ranks) for n in names}
    forward = min(at.values())
    span = statistics.median(max(r["ready"].values()) - min(r["ready"].values()) for r in ranks)
    speed = span / modelled.backward_time if modelled.backward_time > 0 else 1.0
    timeline = sorted((dataclasses.replace(t, ready=at[t.name] - forward) for t in modelled.timeline),
                      key=lambda t: t.ready)
    return dataclasses.replace(scaled_compute(modelled, speed), timeline=timeline, forward_time=forward,
                               backward_time=timeline[-1].ready,
                               optimizer_step=statistics.median(r["optimizer_step"] for r in ranks))


def link_efficiency(profile: Profile, args):
    """``--link-efficiency``, or the fraction of the line rate the profile's allreduce
    probe reached; a string saying why when the profile cannot tell."""
    if args.link_efficiency != "profile":
        return args.link_efficiency
    try:
        return measured_link_efficiency(profile, args.link_rate)
    except ValueError as error:
        return str(error)


def fixed_plans(optimizer, specs) -> Dict[str, mergecomp.Plan]:
    """{label: plan} of ``--plans``, and the compute window's one raw group."""
    params = optimizer.param_infos(optimizer.plan.order())
    plans = {}
    for label, send, groups in specs:
        plans[label] = optimizer.plan if label == "auto" else \
            mergecomp.schedulers.create("fixed", fusion_num=groups, send=send).plan(params)
    plans[COMPUTE] = mergecomp.schedulers.create("fixed", fusion_num=1, send="fp32").plan(params)
    return plans


def window_phases(recorder: Recorder, marks) -> Dict[str, List[dict]]:
    """{label: the phase records of that label's timed steps}: ``marks`` lists (label, index
    of the window's first step in ``recorder.steps``); each window's first step is untimed."""
    phases: Dict[str, List[dict]] = {}
    ends = [start for _, start in marks[1:]] + [len(recorder.steps)]
    for (label, start), end in zip(marks, ends):
        phases.setdefault(label, []).extend(recorder.steps[start + 1:end])
    return phases


def worker(args):
    recorder = Recorder()
    install(recorder)  # phase timers around the optimizer's pieces, in this process
    work = benchmarking.prepare(args)
    optimizer = compress_benchmark.build_optimizer(args, work)
    step = benchmarking.training_step(work, work.model, optimizer)
    timed = benchmarking.make_timer(step, work.device)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers on {args.net_profile} links; "
             f"exchange {optimizer.communicator!r}")
    search_steps = compress_benchmark.warm_up_and_settle(optimizer, timed, args, work)
    profile = optimizer.scheduler.profile
    efficiency = optimizer.backend.broadcast_object(link_efficiency(profile, args) if work.rank == 0 else None, src=0)
    if isinstance(efficiency, str):  # every rank stops with rank 0's reason, none waits for the others
        raise ValueError(efficiency)
    plans = fixed_plans(optimizer, args.plans)
    optimizer.scheduler = mergecomp.schedulers.create("fixed")  # the run switches plans itself from here
    clock = ComputeClock(optimizer, step)
    marks = []

    def before(label):
        def switch():
            marks.append((label, len(recorder.steps)))
            optimizer.set_plan(plans[label])
            if label == COMPUTE:
                clock.new_round()
        return switch

    steps = {label: (clock if label == COMPUTE else (lambda: timed(1))) for label in plans}
    mine = benchmarking.interleaved_windows(steps, args.rounds, args.window,
                                            before={label: before(label) for label in plans})
    phases = window_phases(recorder, marks)
    everyone = optimizer.backend.allgather_object(
        (mine, clock.summaries(phases.get(COMPUTE, []), args.window), phases))
    if work.rank != 0:  # rank 0 predicts, from its profile
        return benchmarking.finish({}, None, work)
    measured = {label: [max(times[label][r] for times, _, _ in everyone) for r in range(args.rounds)]
                for label in plans}
    modelled = dataclasses.replace(profile, collectives=network_collectives(
        work.size, args.link_rate, args.latency_us * 1e-6, efficiency))
    rounds = [round_profile(modelled, [summaries[r] for _, summaries, _ in everyone]) for r in range(args.rounds)]
    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "compressor": args.compressor,
        "compress_ratio": args.compress_ratio, "net_profile": args.net_profile, "search_steps": search_steps,
        "rounds": args.rounds, "window": args.window, "link_efficiency": efficiency,
        "interference": profile.interference, "collective_slowdown": profile.collective_slowdown,
        "profile": {"forward_s": profile.forward_time, "backward_s": profile.backward_time},
        "compute": [{"forward_s": p.forward_time, "backward_s": p.backward_time,
                     "speed": p.backward_time / profile.backward_time if profile.backward_time > 0 else 1.0}
                    for p in rounds],
        "plans": {}, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        # What the predictions were made from, to predict again offline with another model:
        # the profile as measured (its collectives, not the α-β model's) and every rank's
        # compute summary of every round.
        "measured_profile": profile.to_dict(),
        "round_compute": [[summaries[r] for _, summaries, _ in everyone] for r in range(args.rounds)]}
    for label, plan in plans.items():
        if label == COMPUTE:
            continue
        saved = predict(plan, modelled).iteration_time
        predicted = [predict(plan, p).iteration_time for p in rounds]
        result["plans"][label] = {
            "groups": len(plan), "compressed": sum(g.send == "compress" for g in plan.groups),
            "plan": plan.to_dict(),
            "measured_s": measured[label], "predicted_s": predicted, "saved_profile_s": saved,
            "error": statistics.median(p / m - 1 for p, m in zip(predicted, measured[label])),
            "saved_profile_error": saved / statistics.median(measured[label]) - 1}
        row = result["plans"][label]
        row["phases"] = [rank_phases.get(label, []) for _, _, rank_phases in everyone]
        typical = sorted(range(args.rounds), key=predicted.__getitem__)[args.rounds // 2]
        work.log(f"{label:<12} {row['groups']} groups ({row['compressed']} compressed): measured "
                 f"{statistics.median(measured[label]) * 1e3:.1f} ms, predicted from each round's compute "
                 f"{statistics.median(predicted) * 1e3:.1f} ms (error {row['error']:+.1%}), from the saved "
                 f"profile {saved * 1e3:.1f} ms ({row['saved_profile_error']:+.1%})\n"
                 f"{label}'s phases, predicted from round {typical}'s compute (its median prediction):\n"
                 + phase_table(predict(plan, rounds[typical]), row["phases"]))
    return benchmarking.finish(result, args.json, work)


def table(paths) -> str:
    lines = ["| workers | plan | groups (compressed) | measured ms | predicted ms, same rounds | error | "
             "rounds within 15% | saved profile ms | saved-profile error | compute × profile |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    results = sorted(benchmarking.saved_results(paths, "plans", "benchmarks/simulator_rounds.py"),
                     key=lambda r: r["workers"])
    for r in results:
        speeds = [c["speed"] for c in r["compute"]]
        for label, row in r["plans"].items():
            within = sum(abs(p / m - 1) <= 0.15 for p, m in zip(row["predicted_s"], row["measured_s"]))
            lines.append(f"| {r['workers']} | {label} | {row['groups']} ({row['compressed']}) | "
                         f"{statistics.median(row['measured_s']) * 1e3:.1f} | "
                         f"{statistics.median(row['predicted_s']) * 1e3:.1f} | {row['error']:+.1%} | "
                         f"{within}/{len(row['measured_s'])} | {row['saved_profile_s'] * 1e3:.1f} | "
                         f"{row['saved_profile_error']:+.1%} | {min(speeds):.2f}–{max(speeds):.2f} |")
    return "\n".join(lines)


def main(argv=None):
    return compress_benchmark.run_or_table(parse_args(argv), worker, table)


if __name__ == "__main__":
    benchmarking.exit_with(main)
