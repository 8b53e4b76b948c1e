#!/usr/bin/env python
"""The simulator against the emulated cluster: predicted against measured step times.

Four modes: three ask whether :mod:`mergecomp.planning.simulate`'s prediction is right, the
fourth uses it for clusters larger than the one at hand:

    python benchmarks/simulator.py check --workers 2,3,4 --profile 1gbit --model vgg16 --compressor dgc
    python benchmarks/cluster.py --workers 4 --profile 1gbit -- python benchmarks/simulator.py rounds \\
        --threads 1 --model vgg16 --batch-size 8 --compressor dgc --compress-ratio 0.01 \\
        --plans auto,fp32-4,compress-4 --rounds 8 --window 3 --json vgg16-dgc-4.json
    python benchmarks/simulator.py rounds --table vgg16-dgc-*.json
    python benchmarks/simulator.py phases --phases-out DIR <compress_benchmark.py flags>
    python benchmarks/simulator.py scaling --workers 16,32,64,128,256 --link 10gbit,25gbit,100gbit

``check``: separate runs per worker count, each in its own emulated cluster, compared with
the prediction from that run's profile.  ``rounds``: one run that times the plans and the
compute in interleaved rounds, so each prediction uses compute timed beside the steps it
predicts.  ``phases``: ``compress_benchmark.py``'s run with every phase of every step timed
(what ``check --phases`` reads).  ``scaling``: predictions from 16 to 256 workers and for
published settings, with a documented per-GPU profile (:mod:`benchmarks.harness.scaling`).
``simulator.py MODE --help`` tells each in full.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import mergecomp
from benchmarks import harness
from benchmarks.harness import hostload, scaling
from benchmarks.harness.cluster import Cluster, parse_profile
from mergecomp.planning.costmodel import predict
from mergecomp.plan import COMPRESS_VIA, SEND_MODES, Plan, is_compressed, send_communicator, valid_sends
from mergecomp.planning.profile import Profile, scaled_compute, with_density
from mergecomp.schedulers.fixed import FixedScheduler
from mergecomp.planning.optimal import OptimalScheduler
from mergecomp.planning.simulate import measured_latency, measured_link_efficiency, node_profile
from mergecomp.runtime.regroup import CannotRegroup

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
COMPUTE = "compute"  # the label of the rounds' compute window


# ------------------------------------------------------------------------------ phases --

PHASES_DOC = """``compress_benchmark.py`` with every phase of every step timed.

    python benchmarks/simulator.py phases --phases-out DIR <compress_benchmark.py flags>
    python benchmarks/simulator.py scaling --workers 16,32,64,128,256 --link 10gbit,25gbit,100gbit

The run is ``compress_benchmark.py``'s, timed through the optimizer's public listeners
(ready, phase and step) and the wrapped optimizer's step hooks.  Once the scheduler has
settled (or at once for a non-adaptive one), each step records, per rank:

* ``forward``: from the previous step's end to the first gradient (zero_grad, forward,
  loss, and backward up to its first gradient: what the profile calls forward);
* ``backward``: from the first gradient to the end of the last launch made from a gradient
  hook (hook-side encoding included: the model's backward end);
* ``encode``: seconds of each group's launch (gather copy, memory, compression, collective
  start) and whether it ran in a hook or in ``step()``;
* ``wait`` and ``finish``: per group, seconds waiting for its collective, and seconds of
  decoding, averaging and the write-back into ``p.grad``;
* ``synchronize``: from the end of backward to the last write-back;
* ``optimizer_step``: the wrapped optimizer's own ``step()``;
* ``step``: wall-clock between step ends.

Each rank writes ``DIR/phases_<rank>.json``; ``simulator.py check --phases`` reads them next
to the cost model's prediction of the same phases.
"""


class PhaseRecorder:
    """Per-step phase times of one rank (see ``PHASES_DOC``), from the listeners of
    ``optimizer`` (a :class:`mergecomp.DistributedOptimizer`): no library code is wrapped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.steps: List[dict] = []
        self._record = None
        self._backward_done = None
        self._last_end = None
        self._inner_began = None
        optimizer.add_ready_listener(self._on_ready)
        optimizer.add_phase_listener(self._on_phase)
        optimizer.optimizer.register_step_pre_hook(self._before_inner_step)
        optimizer.optimizer.register_step_post_hook(self._after_inner_step)

    def _settled(self) -> bool:
        scheduler = self.optimizer.scheduler
        return not getattr(scheduler, "adaptive", False) or scheduler.settled

    def _on_ready(self, name) -> None:
        if self._record is not None:
            now = time.perf_counter()
            if self._record["first"] is None:
                self._record["first"] = now
            self._record["last"] = max(self._record["last"] or now, now)

    def _on_phase(self, phase, group, seconds) -> None:
        record = self._record
        if record is None:
            return
        now = time.perf_counter()
        if phase == "launch":
            in_step = self._backward_done is not None
            record["encode"].append((seconds, "step" if in_step else "hook"))
            if not in_step:  # a launch from a hook is part of backward
                record["last"] = now
        elif phase == "finish":
            record["wait"].append(getattr(group, "wait_seconds", 0.0))
            record["finish"].append(seconds)
            record["synchronized"] = now

    def _before_inner_step(self, optimizer, args, kwargs) -> None:
        self._inner_began = time.perf_counter()

    def _after_inner_step(self, optimizer, args, kwargs) -> None:
        if self._record is not None and self._inner_began is not None:
            self._record["optimizer_step"] = time.perf_counter() - self._inner_began

    def training_step(self, work, model):
        """``harness.training_step`` of ``model``, recording each settled step."""
        def step() -> None:
            record = {"first": None, "last": None, "encode": [], "wait": [], "finish": [],
                      "optimizer_step": None, "synchronized": None} if self._settled() else None
            self._record, self._backward_done = record, None
            self.optimizer.zero_grad()
            work.spec.loss(model(work.inputs), work.targets).backward()
            self._backward_done = time.perf_counter()
            self.optimizer.step()
            work.progress.step()
            now = time.perf_counter()
            if record is not None and record["first"] is not None and self._last_end is not None:
                self.steps.append({
                    "forward": record["first"] - self._last_end,
                    "backward": record["last"] - record["first"],
                    "encode": record["encode"], "wait": record["wait"], "finish": record["finish"],
                    "synchronize": (record["synchronized"] or record["last"]) - record["last"],
                    "optimizer_step": record["optimizer_step"],
                    "step": now - self._last_end})
            self._record, self._last_end = None, now
        return step


def phases_worker(args):
    """``compress_benchmark.py``'s run, timed step by step; writes this rank's phases."""
    work = harness.prepare(args)
    optimizer = harness.build_optimizer(args, work)
    recorder = PhaseRecorder(optimizer)
    backend = optimizer.backend
    timed = harness.make_timer(recorder.training_step(work, work.model), work.device)
    work.log(f"Model: {args.model}, {work.size} workers, exchange {optimizer.communicator!r}")
    search_steps = harness.warm_up_and_settle(optimizer, timed, args, work)
    series = harness.run_iterations(
        timed, work, args, lambda: {"bytes_sent": backend.bytes_sent, "wire_bytes": backend.wire_bytes})
    result = harness.report(work, series, backend.allgather_object,
                            harness.exchange_fields(args, optimizer, search_steps))
    os.makedirs(args.phases_out, exist_ok=True)
    with open(os.path.join(args.phases_out, f"phases_{work.rank}.json"), "w") as f:
        json.dump(recorder.steps, f)
    return harness.finish(result, args.json, work)


def phases_main(argv) -> int:
    p = harness.build_parser(PHASES_DOC)
    p.prog = "simulator.py phases"
    p.add_argument("--phases-out", required=True, metavar="DIR",
                   help="folder for each rank's phases_<rank>.json")
    args = p.parse_args(argv)
    harness.check_arguments(p, args)
    args.phases_out = os.path.abspath(args.phases_out)
    harness.check_names(args)
    harness.run_workers(phases_worker, args)
    return 0


# ------------------------------------------------------------------------------- check --

CHECK_DOC = """Validate the simulator against the emulated cluster: predicted vs measured step time.

    python benchmarks/simulator.py check --workers 2,3,4 --profile 1gbit --model vgg16 --compressor dgc

For each worker count N it runs ``compress_benchmark.py --scheduler auto`` on N workers
behind the shaped links, which profiles the run (``--profile-out``) and executes a plan
(``--plan-out``), measuring its step time.  The simulator's model — the profile's compute
timeline and codec costs, with the collectives replaced by the α-β network model at the
link's rate (:func:`mergecomp.planning.simulate.network_collectives`) — then predicts that same
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

``--workers-per-node L`` runs each N as N/L emulated nodes of L workers and predicts that
layout (see ``simulator.py rounds --help``, "Node layouts"); ``--comm hierarchical`` makes
the profile measure the intra-node costs the prediction uses.

Windows: ``--num-iters`` × ``--batches-per-iter`` timed steps after the search (default
8 × 3 = 24 steps); at 1 Gbit/s single steps vary by ±20%, so 6 steps are not enough to
resolve a 15% error.  ``--out DIR`` keeps each run's profile, plan, result and log.
"""


def parse_plans(text: str):
    """``auto,fp32-4,compress:allgather-4`` → [("auto", None, None), ("fp32-4", "fp32", 4), ...]."""
    specs = []
    for item in (x.strip() for x in text.split(",")):
        if item in ("auto", "optimal"):
            specs.append((item, None, None))
            continue
        send, _, groups = item.rpartition("-")
        known = send in ("fp32", "fp16", "bf16", "compress") or (send.startswith(COMPRESS_VIA) and send in valid_sends())
        if not known or not groups.isdigit() or int(groups) < 1:
            raise ValueError(f"--plans: {item!r} is neither 'auto' nor SEND-K with SEND one of "
                             "fp32, fp16, bf16, compress, compress:<communicator> and K ≥ 1 groups "
                             "(e.g. compress-4, compress:allgather-4), nor 'optimal'")
        specs.append((item, send, int(groups)))
    if not specs or len({label for label, _, _ in specs}) != len(specs):
        raise ValueError(f"--plans must list distinct plans, got {text!r}")
    return specs


def optimal_plan(profile: Profile, params, specs) -> Plan:
    """The optimal scheduler's plan of the live ``profile`` (as measured: the auto scheduler's
    'optimal' candidate), free to send compressed groups by the job's communicator or by any
    communicator a ``compress:<name>-K`` plan of ``specs`` names."""
    via = tuple(dict.fromkeys(send_communicator(send) for _, send, _ in specs
                              if send is not None and send_communicator(send) is not None))
    return OptimalScheduler(profile, communicators=via).plan(params)


def fixed_plan(params, groups: int, send: str) -> Plan:
    """The fixed scheduler's plan of ``groups`` groups balanced by bytes, every group sent
    ``send`` (``compress:<communicator>`` too: the groups of a compressed plan, re-labelled)."""
    plan = FixedScheduler(groups, send=send if send in SEND_MODES else "compress").plan(params)
    return plan if send in SEND_MODES else Plan([dataclasses.replace(g, send=send) for g in plan.groups])


def measure(workers: int, profile: str, args, folder: str, label: str = "auto",
            plan_in: str = None) -> dict:
    tag = f"{workers}" if label == "auto" else f"{workers}_{label}"
    paths = {k: os.path.join(folder, f"{k}_{tag}.json") for k in ("profile", "plan", "result")}
    phases = os.path.join(folder, f"phases_{tag}")
    script = [HERE, "phases", "--phases-out", phases] if args.phases \
        else [os.path.join(ROOT, "compress_benchmark.py")]
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
    if args.comm:
        command += ["--comm", args.comm]
    with Cluster(num_workers=workers, profile=profile, workers_per_node=args.workers_per_node) as cluster:
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
    forwards = [statistics.median(step["forward"] for step in steps) for steps in phases if steps]
    if not forwards or not profile.forward_time > 0:
        raise ValueError("no forward times to calibrate with: run with --phases and a profile "
                         f"whose forward time is positive (got {profile.forward_time!r})")
    return statistics.median(forwards) / profile.forward_time


def phase_table(prediction, phases) -> str:
    """Predicted vs measured phases (medians over steps, min–max over ranks)."""

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


def check_main(argv) -> int:
    p = argparse.ArgumentParser(prog="simulator.py check", description=CHECK_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
                   help="plans to validate at each N: 'auto' (the plan --scheduler auto chose), "
                        "'optimal' (the DP's plan of auto's profile) and fixed plans SEND-K (fp32-4: "
                        "4 raw FP32 groups; compress-4: 4 compressed groups; compress:allgather-4: "
                        "by that communicator), comma-separated; default: auto")
    p.add_argument("--phases", action="store_true",
                   help="run the benchmark through 'simulator.py phases' and print each "
                        "phase's predicted and measured time")
    p.add_argument("--calibrate-compute", action="store_true",
                   help="with --phases: also predict with the profile's processor-side times scaled "
                        "by the timed window's forward time over the profile's (the host's compute "
                        "speed drifts between the two; forward runs with no collective in flight), "
                        "so that the error left is the network and overlap model's")
    p.add_argument("--workers-per-node", type=int, default=None,
                   help="run each N as N/L emulated nodes of L workers (fast inside a node, the "
                        "profile's link between) and predict that layout (default: one per node)")
    p.add_argument("--comm", default=None,
                   help="the job's communicator (default: the compressor's recommended); "
                        "hierarchical measures the intra-node costs the prediction uses")
    p.add_argument("--intra-gbit", type=float, default=None,
                   help="the intra-node link's rate in Gbit/s (default: as the profile measured it)")
    p.add_argument("--timeout-s", type=float, default=1200)
    args = p.parse_args(argv)
    if args.workers_per_node is not None and args.workers_per_node < 1:
        p.error(f"--workers-per-node must be ≥ 1, got {args.workers_per_node}")
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
            modelled = modelled_profile(profile, workers, argparse.Namespace(
                **dict(vars(args), link_rate=rate, workers_per_node=args.workers_per_node or 1)), efficiency)
            print(f"N={workers}: interference {profile.interference:.2f}, collective slowdown "
                  f"{profile.collective_slowdown:.2f}, link efficiency {efficiency:.2f}, memory "
                  f"{profile.memory.intercept * 1e3:.2f} ms + {profile.memory.slope * 1e9:.2f} ns/element; "
                  f"live launch {_lines(profile.launch)}; finish {_lines(profile.finish)}", flush=True)
            for label, send, groups in specs:
                if label == "auto":
                    run = auto
                else:
                    plan = optimal_plan(profile, profile.params(), specs) if label == "optimal" \
                        else fixed_plan(profile.params(), groups, send)
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
        compressed = sum(is_compressed(g.send) for g in plan.groups)
        extra = (f" {speed:.2f} | {calibrated * 1e3:.1f} | {(calibrated - measured) / measured * 100:+.1f}% |"
                 if calibrate else "")
        print(f"| {workers} | {label} | {len(plan)}, {compressed} | {interference:.2f} | {slowdown:.2f} | "
              f"{efficiency:.2f} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
              f"{(predicted - measured) / measured * 100:+.1f}% |" + extra)
    return 0


# ------------------------------------------------------------------------------ rounds --

ROUNDS_DOC = """The simulator against the emulated cluster, with the compute timed in the same rounds.

    python benchmarks/cluster.py --workers 4 --profile 1gbit -- python benchmarks/simulator.py rounds \\
        --threads 1 --model vgg16 --batch-size 8 --compressor dgc --compress-ratio 0.01 \\
        --plans auto,fp32-4,compress-4 --rounds 8 --window 3 --json vgg16-dgc-4.json
    python benchmarks/simulator.py rounds --table vgg16-dgc-*.json

What ``simulator.py check`` validates is the simulator's network and overlap
model: the compute side (forward, when each gradient is ready, the codecs) comes from the
run's own profile.  On a shared host that profile is minutes older than the timed window,
and the host's compute speed drifts by up to 50% in between, which no network model can
predict.  Here one training run does it all, so that the compute a prediction uses was
timed beside the steps it predicts:

1. ``--scheduler auto`` profiles the live run and settles as usual; its profile, with the
   collectives replaced by the α-β model at the link's rate
   (:func:`mergecomp.planning.simulate.network_collectives`, link efficiency from the profile's
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

**Node layouts.**  Under ``benchmarks/cluster.py --nodes M --workers-per-node L`` (or
with ``--workers-per-node L``) the prediction is for M nodes of L ranks: the profile's
collectives become :func:`mergecomp.planning.simulate.node_collectives` of that layout (the
profile link between nodes; inside a node ``--intra-gbit``, or by default the intra-node
costs the profile measured, which ``--comm hierarchical`` makes it measure: the emulated
nodes talk over a loopback whose speed is this host's processors).  ``compress:<name>-K``
plans send their compressed groups by communicator ``name`` (``compress:allgather-4``
beside ``--comm hierarchical``'s ``compress-4``: flat against hierarchical), and
``optimal`` is the DP's plan of the live profile, free to choose per group among the job's
communicator and those the ``compress:<name>`` plans name.  The hierarchical exchange's
per-shard error-feedback state cannot follow a plan change, so each window that leaves a
hierarchical plan starts the next one without it (timing only: a residual changes no
step's cost).

A window's time is its slowest rank's mean step.  Every step's phases are timed as
``simulator.py phases`` times them, and each plan's are printed next to the phases
predicted from its median round.  The error of a plan is the median over
rounds of its predicted over its measured step time, minus one; the saved-profile error is
the profile's single prediction against the median measured step.  ``--json`` saves both
with every round's numbers, the profile and each round's compute (to predict again offline);
``--table`` prints the saved results as one markdown table.

**Host-bound windows.**  Each window's steps are watched by the host-bound indicator
(:mod:`benchmarks.harness.hostload`): how long, per second, each rank's threads waited for
a core.  A plan whose slowest rank waited 0.1 s per second or more was timed on a host
that set its step, not on the links: the log and the table mark it ``host-bound``, and it
checks nothing.  Many ranks on few cores: replay the compute (``--replay TRACE``, see
``benchmarks/replay.py``) and slow the links until the indicator stays low.
"""


def parse_rounds(argv):
    p = harness.build_parser(ROUNDS_DOC)
    p.prog = "simulator.py rounds"
    p.set_defaults(scheduler="auto", compress=True)
    p.add_argument("--plans", default="auto,fp32-4,compress-4",
                   help="plans to predict and time: auto (the scheduler's choice), optimal (the "
                        "DP's plan of the live profile), fp32-K, fp16-K, bf16-K, compress-K, "
                        "compress:<communicator>-K (default auto,fp32-4,compress-4)")
    harness.add_rounds_arguments(p, 8, "one window per plan and a compute window")
    p.add_argument("--net-profile", default=os.environ.get("MERGECOMP_NET_PROFILE"),
                   help="the network profile of the links (default: the one benchmarks/cluster.py "
                        "runs this worker behind)")
    p.add_argument("--latency-us", default="50",
                   help="per-message latency the simulator assumes (default 50), or 'profile': the "
                        "run's own allreduce probe's, per ring step (planning.simulate.measured_latency)")
    p.add_argument("--link-efficiency", default="profile",
                   help="fraction of the line rate the simulated collectives reach, or 'profile' "
                        "(default): the fraction the run's own allreduce probe reached")
    p.add_argument("--workers-per-node", type=int, default=None,
                   help="ranks per node of the layout to predict (default: the launcher's "
                        "LOCAL_WORLD_SIZE, which benchmarks/cluster.py --nodes sets; else 1)")
    p.add_argument("--intra-gbit", type=float, default=None,
                   help="the intra-node link's rate in Gbit/s (default: the intra-node collectives "
                        "as the profile measured them; needs --comm hierarchical)")
    args = harness.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    if args.scheduler != "auto":
        p.error(f"--scheduler must be auto (its live profile is the simulator's input), got {args.scheduler!r}")
    try:
        args.plans = parse_plans(args.plans)
    except ValueError as error:
        p.error(str(error))
    if args.latency_us != "profile":
        try:
            args.latency_us = float(args.latency_us)
        except ValueError:
            p.error(f"--latency-us must be microseconds ≥ 0 or 'profile', got {args.latency_us!r}")
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
    if args.workers_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "1")
        args.workers_per_node = int(local) if local.isdigit() else 0
    if args.workers_per_node < 1:
        p.error(f"--workers-per-node must be ≥ 1, got {args.workers_per_node} (or LOCAL_WORLD_SIZE="
                f"{os.environ.get('LOCAL_WORLD_SIZE')!r})")
    if args.intra_gbit is not None and not args.intra_gbit > 0:
        p.error(f"--intra-gbit must be a rate > 0 Gbit/s, got {args.intra_gbit}")
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


def modelled_profile(profile: Profile, workers: int, args, efficiency: float) -> Profile:
    """The simulator's input: ``profile`` with its collectives replaced by the α-β model of
    the node layout (``--workers-per-node`` ranks per node behind the ``--net-profile``
    link; inside a node ``--intra-gbit``, or the intra-node costs the profile measured)."""
    local = args.workers_per_node
    if workers % local:
        raise ValueError(f"--workers-per-node {local} does not divide the {workers} workers")
    intra = None if args.intra_gbit is None else args.intra_gbit * 1e9 / 8
    latency = measured_latency(profile) if args.latency_us == "profile" else args.latency_us * 1e-6
    return node_profile(profile, workers // local, local, args.link_rate, latency,
                        efficiency, intra_bandwidth=intra)


def density_scale(optimizer) -> float:
    """How many times its configured density (or rank) the quality controller has the
    compressed groups send now (1 when it is off or raised nothing): the bytes a window
    sends, which its prediction must price (``with_density``)."""
    meter = getattr(getattr(optimizer, "lifecycle", None), "meter", None)
    return meter.density_scale() if meter is not None else 1.0


def switch_plan(optimizer, plan) -> None:
    """``optimizer.set_plan(plan)``; where the error-feedback state cannot follow the new
    groups (the hierarchical communicator's per-shard residuals), it is dropped first: a
    timing run switches plans every window, and a residual's loss changes no step's cost."""
    try:
        optimizer.set_plan(plan)
    except CannotRegroup:
        def without_shards(state):
            if not isinstance(state, dict):
                return state
            return {k: without_shards(v) for k, v in state.items() if not (isinstance(k, str) and "/shard" in k)}
        optimizer.communicator.load_state_dict(without_shards(optimizer.communicator.state_dict()))
        optimizer.set_plan(plan)


def fixed_plans(optimizer, specs) -> Dict[str, mergecomp.Plan]:
    """{label: plan} of ``--plans``, and the compute window's one raw group."""
    params = optimizer.param_infos(optimizer.plan.order())
    plans = {}
    for label, send, groups in specs:
        if label == "optimal":  # rank 0's, from its profile, as the auto scheduler plans
            plan = optimal_plan(optimizer.scheduler.profile, params, specs) if optimizer.backend.rank == 0 else None
            plans[label] = Plan.from_dict(optimizer.backend.broadcast_object(plan and plan.to_dict(), src=0))
        else:
            plans[label] = optimizer.plan if label == "auto" else fixed_plan(params, groups, send)
    plans[COMPUTE] = mergecomp.schedulers.create("fixed", fusion_num=1, send="fp32").plan(params)
    return plans


def window_phases(recorder: PhaseRecorder, marks) -> Dict[str, List[dict]]:
    """{label: the phase records of that label's timed steps}: ``marks`` lists (label, index
    of the window's first step in ``recorder.steps``); each window's first step is untimed."""
    phases: Dict[str, List[dict]] = {}
    ends = [start for _, start in marks[1:]] + [len(recorder.steps)]
    for (label, start), end in zip(marks, ends):
        phases.setdefault(label, []).extend(recorder.steps[start + 1:end])
    return phases


def rounds_worker(args):
    work = harness.prepare(args)
    optimizer = harness.build_optimizer(args, work)
    recorder = PhaseRecorder(optimizer)
    step = recorder.training_step(work, work.model)
    timed = harness.make_timer(step, work.device)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers on {args.net_profile} links; "
             f"exchange {optimizer.communicator!r}")
    search_steps = harness.warm_up_and_settle(optimizer, timed, args, work)
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
            switch_plan(optimizer, plans[label])
            if label == COMPUTE:
                clock.new_round()
        return switch

    scales: Dict[str, List[float]] = {}

    def plan_step(label):
        def step_once():
            timed(1)
            scales.setdefault(label, []).append(density_scale(optimizer))
        return step_once

    steps, loads = hostload.watched({label: (clock if label == COMPUTE else plan_step(label)) for label in plans})
    mine = harness.interleaved_windows(steps, args.rounds, args.window,
                                            before={label: before(label) for label in plans})
    phases = window_phases(recorder, marks)
    everyone = optimizer.backend.allgather_object(
        (mine, clock.summaries(phases.get(COMPUTE, []), args.window), phases,
         {label: load.summary() for label, load in loads.items()}))
    if work.rank != 0:  # rank 0 predicts, from its profile
        return harness.finish({}, None, work)
    measured = {label: [max(times[label][r] for times, _, _, _ in everyone) for r in range(args.rounds)]
                for label in plans}
    modelled = modelled_profile(profile, work.size, args, efficiency)
    rounds = [round_profile(modelled, [summaries[r] for _, summaries, _, _ in everyone]) for r in range(args.rounds)]
    host = {label: hostload.combine([load[label] for _, _, _, load in everyone]) for label in plans}
    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "compressor": args.compressor,
        "workers_per_node": args.workers_per_node, "communicator": optimizer.communicator.name,
        "intra_gbit": args.intra_gbit,
        "compress_ratio": args.compress_ratio, "net_profile": args.net_profile, "search_steps": search_steps,
        "rounds": args.rounds, "window": args.window, "link_efficiency": efficiency,
        "latency_us": args.latency_us,
        "interference": profile.interference, "collective_slowdown": profile.collective_slowdown,
        "profile": {"forward_s": profile.forward_time, "backward_s": profile.backward_time},
        "compute": [{"forward_s": p.forward_time, "backward_s": p.backward_time,
                     "speed": p.backward_time / profile.backward_time if profile.backward_time > 0 else 1.0}
                    for p in rounds],
        "replay": args.replay and {"trace": args.replay, "shrink": args.replay_shrink,
                                   "time_scale": args.replay_time_scale, "codecs": args.replay_codecs},
        "host_compute_window": host[COMPUTE],
        "plans": {}, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        # What the predictions were made from, to predict again offline with another model:
        # the profile as measured (its collectives, not the α-β model's) and every rank's
        # compute summary of every round.
        "measured_profile": profile.to_dict(),
        "round_compute": [[summaries[r] for _, summaries, _, _ in everyone] for r in range(args.rounds)]}
    for label, plan in plans.items():
        if label == COMPUTE:
            continue
        scale = statistics.median(scales.get(label) or [1.0])  # the same on every rank
        saved = predict(plan, with_density(modelled, scale)).iteration_time
        predicted = [predict(plan, with_density(p, scale)).iteration_time for p in rounds]
        result["plans"][label] = {
            "groups": len(plan), "compressed": sum(is_compressed(g.send) for g in plan.groups),
            "sends": {send: sum(g.send == send for g in plan.groups) for send in sorted({g.send for g in plan.groups})},
            "plan": plan.to_dict(), "density_scale": scale,
            "measured_s": measured[label], "predicted_s": predicted, "saved_profile_s": saved,
            "error": statistics.median(p / m - 1 for p, m in zip(predicted, measured[label])),
            "saved_profile_error": saved / statistics.median(measured[label]) - 1, "host": host[label]}
        row = result["plans"][label]
        row["phases"] = [rank_phases.get(label, []) for _, _, rank_phases, _ in everyone]
        typical = sorted(range(args.rounds), key=predicted.__getitem__)[args.rounds // 2]
        if scale != 1.0:
            work.log(f"{label}: the quality controller sent its compressed groups at {scale:.3g} times the "
                     f"configured density (the prediction prices that; --controller off keeps the setting)")
        work.log(f"{label:<12} {row['groups']} groups ({row['compressed']} compressed): measured "
                 f"{statistics.median(measured[label]) * 1e3:.1f} ms, predicted from each round's compute "
                 f"{statistics.median(predicted) * 1e3:.1f} ms (error {row['error']:+.1%}), from the saved "
                 f"profile {saved * 1e3:.1f} ms ({row['saved_profile_error']:+.1%}); core wait "
                 f"{host[label]['core_wait']:.3f}{' HOST-BOUND' if hostload.host_bound(host[label]) else ''}\n"
                 f"{label}'s phases, predicted from round {typical}'s compute (its median prediction):\n"
                 + phase_table(predict(plan, rounds[typical]), row["phases"]))
    return harness.finish(result, args.json, work)


def layout(result: dict) -> str:
    """``8`` for one rank per node, ``8 (2×4)`` for 2 nodes of 4."""
    local = result.get("workers_per_node", 1)
    return f"{result['workers']}" if local == 1 else f"{result['workers']} ({result['workers'] // local}×{local})"


def rounds_table(paths) -> str:
    lines = ["| workers | plan | groups (compressed) | measured ms | predicted ms, same rounds | error | "
             "rounds within 15% | saved profile ms | saved-profile error | compute × profile | core wait |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    results = sorted(harness.saved_results(paths, "plans", "benchmarks/simulator.py rounds"),
                     key=lambda r: (r["workers"], r.get("workers_per_node", 1)))
    for r in results:
        speeds = [c["speed"] for c in r["compute"]]
        for label, row in r["plans"].items():
            within = sum(abs(p / m - 1) <= 0.15 for p, m in zip(row["predicted_s"], row["measured_s"]))
            lines.append(f"| {layout(r)} | {label} | {row['groups']} ({row['compressed']}) | "
                         f"{statistics.median(row['measured_s']) * 1e3:.1f} | "
                         f"{statistics.median(row['predicted_s']) * 1e3:.1f} | {row['error']:+.1%} | "
                         f"{within}/{len(row['measured_s'])} | {row['saved_profile_s'] * 1e3:.1f} | "
                         f"{row['saved_profile_error']:+.1%} | {min(speeds):.2f}–{max(speeds):.2f} | "
                         f"{host_cell(row.get('host'))} |")
    return "\n".join(lines)


def host_cell(indicator) -> str:
    """The core wait of a plan's windows, marked when it refuses the row (older results: –)."""
    if not indicator:
        return "–"
    return f"{indicator['core_wait']:.3f}" + (" host-bound" if hostload.host_bound(indicator) else "")


def rounds_main(argv) -> int:
    return harness.run_or_table(parse_rounds(argv), rounds_worker, rounds_table)

def scaling_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="simulator.py scaling", description=scaling.__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--compute-time", type=float, default=0.2,
                        help="forward + backward seconds per iteration on one GPU (an assumption)")
    parser.add_argument("--workers", default="16,32,64,128,256")
    parser.add_argument("--link", default="10gbit,25gbit,100gbit", help=f"links among {sorted(scaling.LINKS)}")
    parser.add_argument("--latency", type=float, default=50.0, help="per-step latency in microseconds")
    parser.add_argument("--out", default=None, help="folder for scaling.json and scaling.md")
    args = parser.parse_args(argv)
    links = [name.strip() for name in args.link.split(",") if name.strip()]
    unknown = [name for name in links if name not in scaling.LINKS]
    if unknown or not links:
        parser.error(f"--link {args.link!r}: unknown link(s) {unknown}; known: {sorted(scaling.LINKS)}")
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        workers = []
    if not workers or min(workers) < 2:
        parser.error(f"--workers {args.workers!r}: give worker counts of at least 2, comma-separated (e.g. 16,32,64)")
    if args.compute_time <= 0 or args.latency < 0:
        parser.error(f"--compute-time must be > 0 and --latency ≥ 0, got {args.compute_time} and {args.latency}")
    base = scaling.gpu_profile(args.model, args.compute_time)
    cells = [dict(scaling.cell(base, n, link, latency), setting=label)
             for label, n, link, latency in scaling.SETTINGS]
    cells += [scaling.cell(base, n, link, args.latency * 1e-6) for link in links for n in workers]
    text = scaling.table(cells)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "scaling.json"), "w") as f:
            json.dump({"model": args.model, "compute_time": args.compute_time,
                       "codecs": {k: v.to_dict() for k, v in scaling.GPU_CODECS.items()},
                       "copy": scaling.GPU_COPY.to_dict(), "cells": cells}, f, indent=2)
        with open(os.path.join(args.out, "scaling.md"), "w") as f:
            f.write(text + "\n")
    return 0


MODES = {"check": check_main, "rounds": rounds_main, "phases": phases_main, "scaling": scaling_main}


def main(argv=None) -> int:
    return harness.run_mode("simulator.py", __doc__, MODES, argv)


if __name__ == "__main__":
    harness.exit_with(main)
