#!/usr/bin/env python
"""The headline: mergecomp against what a tuned user runs, and against the zero-cost bound.

Compression is only worth its complexity if it beats DDP with a 16-bit hook (what a tuned
user runs) and gets close to the *zero-cost bound*: the same workers computing the same
steps with no exchange at all, i.e. as if compression and communication cost nothing
(Agarwal et al., MLSys 2022; Espresso, EuroSys 2023).  Every worker here holds one copy of
the model per configuration, all with the same initial weights and batch:

* ``bound``: plain SGD, no exchange (each rank alone, at the same time as the others);
* ``solo``: rank 0 runs the bound's step while the other ranks wait (one worker alone on
  the host, the denominator of the scaling factor);
* ``ddp-fp32``: DistributedDataParallel, no hook (FP32 allreduce of 25 MB buckets, C++);
* ``ddp-fp16``: DDP's ``fp16_compress_hook`` (``bf16_compress_hook`` needs NCCL);
* ``ddp-powersgd``: DDP's ``powerSGD_hook`` (rank ``--powersgd-rank``, error feedback, warm
  start; one bucket: its later rounds are launched from future callbacks, which can reorder
  collectives across buckets on gloo);
* ``auto-<c>``: ``mergecomp.DistributedOptimizer(compressor=c, schedule="auto")`` for each
  of ``--compressors`` (its recommended memory and communicator), settled before timing;
* ``hook-<c>``: DDP with ``mergecomp.ddp``'s hook for each of ``--hook-compressors``, its
  buckets set by ``mergecomp.ddp.bucket_caps(model, --hook-groups)``;
* ``diloco:<spec>``: ``mergecomp.DiLoCo`` around the same SGD for each of ``--diloco``
  (``benchmarks/harness/lowcomm.py``'s specs: ``H=8``, ``H=8:fragments=2:overlap=1``,
  ``H=8:compressor=sparseloco``); ``--window`` must be a multiple of every H, so that each
  window holds the same number of exchanges whatever its phase.

Warm-up ends, for mergecomp's configurations, once ``auto`` has settled and the quality
controller (on by default) is in its steady state: past its front (the first hundred steps,
in which it may spend a run's extra bytes at once) and its byte budget spent, so the timed
steps are a long run's, at most ``byte_budget`` times the configured bytes; the log says
how many steps that took.  Then ``--rounds`` rounds each run one window of ``--window`` steps of every
configuration, the order rotated each round, a barrier and one untimed step before each
window; a window's time is its slowest rank's.  Per configuration, the median over rounds
gives the step time, and from it: throughput, the scaling factor against one worker
(solo step time / step time) and against the bound (bound step time / step time), the ratio
to ``ddp-fp16`` (its step time / this one's: > 1 is faster) and bytes handed to collectives
per step.  For mergecomp's optimizer the phases are timed too: compression on the compute
core (gather, error feedback, compression, collective start, summed over groups), the wait
for collectives after backward, and decoding (decode, aggregate, average, write-back).

    python benchmarks/headline.py --nproc 2 --threads 1 --model lstm --rounds 5
    python benchmarks/cluster.py --workers 2 --profile 1gbit -- \\
        python benchmarks/headline.py --model vgg16 --threads 1 --json cell.json
    python benchmarks/headline.py --table results/*.json
    python benchmarks/headline.py --summary results/*.json [--ours auto-dgc]
    python benchmarks/headline.py --campaign DIR     # every cell below, resumable (needs root for links)

The campaign runs, for each model of ``--campaign-models`` (vgg16, the LSTM LM and the
transformer LM), each link of ``--campaign-links`` (1gbit and 10gbit on the emulated cluster,
loopback unshaped) and each worker count of ``--campaign-workers`` (2 and 4), one cell:
``benchmarks/cluster.py --workers N --profile LINK -- python benchmarks/headline.py ...``,
its result in ``DIR/<model>-<link>-<N>.json`` and its log beside it; a cell whose result
exists is skipped, so an interrupted campaign goes on where it stopped.

More modes, named by the first word:

    python benchmarks/headline.py pair ...        # mergecomp against one DDP hook, interleaved windows
    python benchmarks/headline.py exchanges ...   # communicators side by side (flat, hierarchical,
                                                  # sparse_allreduce...): step time, bytes per rank
    python benchmarks/headline.py fsdp ...        # mergecomp.fsdp against FSDP2's own reduction
    python benchmarks/headline.py hsdp ...        # HSDP's replica all-reduce: FSDP2's own or compressed
    python benchmarks/headline.py ddp ...         # one DDP hook alone, timed as compress_benchmark.py

``headline.py MODE --help`` tells each in full.
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
import warnings
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import mergecomp
import mergecomp.ddp
from benchmarks import harness
from benchmarks.harness import lowcomm
from benchmarks.harness.contenders import (MOMENTUM, Configuration, DDP_BUCKET_CAP_MB, counted, owns_momentum,
                                        phase_text, settle, sgd, timed_rounds, train_step)
from benchmarks.harness.ddp_baselines import ddp_main, pair_main
from benchmarks.harness.exchanges import exchanges_main
from benchmarks.harness.fsdp_bytes import fsdp_main
from benchmarks.harness.hsdp_timing import hsdp_main
from benchmarks.harness import (AllreduceCounter, HEADLINE_BASELINE as BASELINE,
                                    HEADLINE_LINKS as CAMPAIGN_LINKS, HEADLINE_MODELS as CAMPAIGN_MODELS)

def parse_matrix(argv):
    p = harness.build_parser(__doc__)
    harness.add_rounds_arguments(p, 8, "one window of every configuration")
    p.add_argument("--compressors", default="fp16,dgc,efsignsgd,powersgd",
                   help="compressors of the auto-scheduled mergecomp optimizer, comma-separated")
    p.add_argument("--hook-compressors", default="fp16,dgc",
                   help="compressors of mergecomp's DDP hook, comma-separated ('' for none)")
    p.add_argument("--hook-groups", type=int, default=4, help="DDP buckets for mergecomp's hook (default 4)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="DDP PowerSGD hook's rank (default 1)")
    p.add_argument("--diloco", nargs="+", default=[], metavar="SPEC",
                   help="DiLoCo configurations (H=8, H=8:fragments=2:overlap=1, H=8:compressor=sparseloco, ...); "
                        "--window must be a multiple of each H")
    p.add_argument("--link", default="loopback",
                   help="what the workers' links are, recorded in the result (e.g. the cluster's --profile)")
    p.add_argument("--summary", nargs="+", default=None, metavar="JSON",
                   help="print one row per saved cell (--ours against the bound and DDP) and exit")
    p.add_argument("--ours", default="auto-dgc",
                   help="the mergecomp configuration --summary reports (default auto-dgc)")
    campaign = p.add_argument_group("campaign (every cell, each in its own emulated cluster)")
    campaign.add_argument("--campaign", metavar="DIR", default=None, help="run every cell, results into DIR")
    campaign.add_argument("--campaign-models", default=",".join(CAMPAIGN_MODELS))
    campaign.add_argument("--campaign-links", default=",".join(CAMPAIGN_LINKS))
    campaign.add_argument("--campaign-workers", default="2,4")
    campaign.add_argument("--cell-timeout", type=float, default=3600, help="seconds per cell (default 3600)")
    p.set_defaults(threads=1)
    args = harness.parse_rounds_arguments(p, argv)
    if args.table or args.summary:
        return args
    args.compressors = [c for c in args.compressors.split(",") if c]
    args.hook_compressors = [c for c in args.hook_compressors.split(",") if c]
    for name in args.compressors + args.hook_compressors:
        mergecomp.compressors.get(name)  # an unknown name fails here, before any rank starts
    if args.hook_groups < 1 or args.powersgd_rank < 1:
        p.error("--hook-groups and --powersgd-rank must be ≥ 1")
    try:
        args.diloco_specs = [lowcomm.parse(text) for text in args.diloco]
    except ValueError as error:
        p.error(str(error))
    uneven = [spec.label for spec in args.diloco_specs if args.window % spec.sync_every]
    if uneven:
        p.error(f"--window {args.window} is not a multiple of H for {uneven}: a window would hold more "
                f"exchanges in one round than in another; use a --window that every H divides")
    return args


def build_configurations(args, work) -> Dict[str, Configuration]:
    base = work.model
    configurations: Dict[str, Configuration] = {}

    local = copy.deepcopy(base)
    local_step = train_step(work, local, sgd(local, False, args.lr))
    configurations["bound"] = Configuration("bound", local_step, lambda: 0.0)
    configurations["solo"] = Configuration("solo", local_step if work.rank == 0 else (lambda: None), lambda: 0.0)

    numel = work.num_params
    for hook_name in ("fp32", "fp16", "powersgd"):
        model = copy.deepcopy(base)
        if hook_name == "powersgd":
            ddp = DistributedDataParallel(model, bucket_cap_mb=10 ** 6)  # one bucket, see the docstring
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                                start_powerSGD_iter=2, random_seed=args.seed)
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            counter = AllreduceCounter()
            inner = train_step(work, ddp, sgd(ddp, False, args.lr))

            def step(inner=inner, counter=counter):
                with counter:
                    inner()
            configurations["ddp-powersgd"] = Configuration("ddp-powersgd", step, lambda c=counter: c.bytes_sent)
            continue
        ddp = DistributedDataParallel(model, bucket_cap_mb=DDP_BUCKET_CAP_MB)
        if hook_name == "fp16":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        per_step = numel * (4 if hook_name == "fp32" else 2)  # what DDP hands to allreduce
        configurations[f"ddp-{hook_name}"] = counted(f"ddp-{hook_name}",
                                                      train_step(work, ddp, sgd(ddp, False, args.lr)),
                                                      per_step)

    for name in args.compressors:
        model = copy.deepcopy(base)
        compressor = mergecomp.compressors.create(name)
        memory = mergecomp.memories.recommended(compressor)
        optimizer = mergecomp.DistributedOptimizer(sgd(model, owns_momentum(compressor, memory), args.lr),
                                                   model=model, compressor=compressor, memory=memory,
                                                   schedule="auto")
        configurations[f"auto-{name}"] = Configuration(
            f"auto-{name}", train_step(work, model, optimizer), lambda o=optimizer: o.backend.bytes_sent,
            before=optimizer.restart_step_clock, optimizer=optimizer)

    for name in args.hook_compressors:
        model = copy.deepcopy(base)
        ddp = DistributedDataParallel(model, bucket_cap_mb_list=mergecomp.ddp.bucket_caps(model, args.hook_groups))
        state = mergecomp.ddp.register(ddp, compressor=name)
        optimizer = sgd(ddp, owns_momentum(state.compressor, state.memory), args.lr)
        state.check_optimizer(optimizer)  # a memory that takes SGD's momentum over does it now
        configurations[f"hook-{name}"] = Configuration(
            f"hook-{name}", train_step(work, ddp, optimizer), lambda s=state: s.backend.bytes_sent,
            entry_point=state)

    for spec in getattr(args, "diloco_specs", ()):
        model = copy.deepcopy(base)
        optimizer, _ = lowcomm.build(spec, torch.optim.SGD(model.parameters(), lr=args.lr, momentum=MOMENTUM), model)
        configurations[spec.label] = Configuration(spec.label, train_step(work, model, optimizer),
                                                   lambda o=optimizer: o.backend.bytes_sent)
    return configurations


def matrix_worker(args):
    work = harness.prepare(args)
    warnings.simplefilter("ignore", UserWarning)
    configurations = build_configurations(args, work)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size {work.batch_size} "
             f"per worker, {work.size} workers, {args.threads} thread(s) each; configurations: "
             + ", ".join(configurations))
    search = settle(configurations, args, work)
    per_step, bytes_per_step, phases = timed_rounds(configurations, args)
    gathered = [None] * work.size
    dist.all_gather_object(gathered, per_step)
    slowest = {name: [max(r[name][i] for r in gathered) for i in range(args.rounds)] for name in configurations}
    step_s = {name: statistics.median(v) for name, v in slowest.items()}
    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "threads": args.threads,
        "unit": work.spec.unit, "num_params": work.num_params, "rounds": args.rounds, "window": args.window,
        "link": args.link, "torch": torch.__version__,
        "configurations": {}, "search_steps": search, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for name in configurations:
        entry = {"step_s": step_s[name], "step_s_rounds": slowest[name], "bytes_per_step": bytes_per_step[name]}
        if name != "solo":
            entry["throughput"] = work.size * work.batch_size / step_s[name]
            entry["scaling_vs_one_worker"] = step_s["solo"] / step_s[name]
            entry["scaling_vs_bound"] = step_s["bound"] / step_s[name]
            entry["versus_ddp_fp16"] = step_s[BASELINE] / step_s[name]
            entry["versus_ddp_fp16_rounds"] = [b / s for b, s in zip(slowest[BASELINE], slowest[name])]
        optimizer = configurations[name].optimizer
        if optimizer is not None:
            entry["phases_s"] = {key: statistics.median(values) for key, values in phases[name].items() if values}
            entry["plan"] = optimizer.plan.describe(optimizer.param_infos()).splitlines()[0]
            entry["groups"] = len(optimizer.plan)
            entry["compressed_groups"] = sum(g.send == "compress" for g in optimizer.plan.groups)
        result["configurations"][name] = entry
    work.log(table_of(result))
    return harness.finish(result, args.json, work)


def table_of(result: Dict[str, Any]) -> str:
    lines = [f"{result['model']}, {result['workers']} workers, {result['link']}: "
             f"median of {result['rounds']} rounds of {result['window']} steps",
             "| configuration | ms/step | throughput | × one worker | × bound | × ddp-fp16 | kB/step | phases (compress / wait / decode ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, entry in result["configurations"].items():
        if name == "solo":
            lines.append(f"| solo (one worker alone) | {entry['step_s'] * 1e3:.0f} | | | | | | |")
            continue
        phases = phase_text(entry.get("phases_s"))
        lines.append(f"| {name} | {entry['step_s'] * 1e3:.0f} | {entry['throughput']:.1f} | "
                     f"{entry['scaling_vs_one_worker']:.2f} | {entry['scaling_vs_bound']:.2f} | "
                     f"{entry['versus_ddp_fp16']:.2f} | {entry['bytes_per_step'] / 1e3:,.1f} | {phases} |")
    return "\n".join(lines)


def matrix_table(paths) -> str:
    return "\n\n".join(table_of(r) for r in harness.saved_results(paths, "configurations",
                                                                         "benchmarks/headline.py"))


def per_round_ratio(numerator: Dict[str, Any], denominator: Dict[str, Any]) -> float:
    """The median over rounds of ``numerator``'s step time over ``denominator``'s in the same
    round (> 1: ``denominator`` is faster).  Both ran in the same round, minutes apart at
    most, so the machine's drift between rounds cancels in each ratio, which it does not in
    a ratio of the two medians (taken from different rounds)."""
    return statistics.median(a / b for a, b in zip(numerator["step_s_rounds"], denominator["step_s_rounds"]))


def summary(paths, ours: str) -> str:
    """One row per cell: ``ours`` against DDP's 16-bit hook, the zero-cost bound and the
    fastest DDP configuration of the cell (by median step time), with DDP fp16 against the
    bound for scale and ``ours``' phases.  Every ratio is the same statistic, the median of
    per-round ratios (:func:`per_round_ratio`; the rounds interleaved)."""
    lines = ["| model | link | workers | × ddp-fp16 | × bound | × best DDP (which) | ddp-fp16 × bound "
             "| compress / wait / decode ms |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    results = list(harness.saved_results(paths, "configurations", "benchmarks/headline.py"))
    def rank(value, known):  # the campaign's order first, anything else after it by name
        return (known.index(value) if value in known else len(known), value)

    results.sort(key=lambda r: (rank(r["link"], CAMPAIGN_LINKS), rank(r["model"], CAMPAIGN_MODELS), r["workers"]))
    for result in results:
        cell = f"{result['model']}, {result['link']}, {result['workers']} workers"
        configurations = result["configurations"]
        if ours not in configurations:
            raise ValueError(f"{cell} has no configuration {ours!r}; it has {', '.join(configurations)} "
                             f"(pass one of them as --ours)")
        entry = configurations[ours]
        ddps = {name: c for name, c in configurations.items() if name.startswith("ddp-")}
        best = min(ddps, key=lambda name: ddps[name]["step_s"])
        baseline, bound = configurations[BASELINE], configurations["bound"]
        lines.append(f"| {result['model']} | {result['link']} | {result['workers']} | "
                     f"{per_round_ratio(baseline, entry):.2f} | {per_round_ratio(bound, entry):.2f} | "
                     f"{per_round_ratio(ddps[best], entry):.2f} ({best}) | {per_round_ratio(bound, baseline):.2f} | "
                     f"{phase_text(entry.get('phases_s'))} |")
    return "\n".join(lines)


CAMPAIGN_BATCH = {"vgg16": 8, "lstm": 8, "transformer": 8}


def run_campaign(args) -> int:
    """Every (model, link, workers) cell in its own cluster, skipping cells already measured."""
    import subprocess
    os.makedirs(args.campaign, exist_ok=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cells = [(model, link, int(workers)) for link in args.campaign_links.split(",")
             for model in args.campaign_models.split(",") for workers in args.campaign_workers.split(",")]
    for model, link, workers in cells:
        stem = os.path.join(args.campaign, f"{model}-{link}-{workers}")
        if os.path.exists(stem + ".json"):
            print(f"{stem}.json exists: skipped", flush=True)
            continue
        cell = [sys.executable, os.path.join(root, "benchmarks", "headline.py"), "--model", model,
                "--batch-size", str(args.batch_size or CAMPAIGN_BATCH.get(model, 8)), "--threads", "1",
                "--link", link, "--rounds", str(args.rounds), "--window", str(args.window),
                "--compressors", ",".join(args.compressors), "--hook-compressors", ",".join(args.hook_compressors),
                "--json", stem + ".json"]
        command = [sys.executable, os.path.join(root, "benchmarks", "cluster.py"), "--workers", str(workers),
                   "--profile", link, "--timeout", str(args.cell_timeout), "--", *cell]
        print(f"cell {model} {link} x{workers}: {' '.join(command)}", flush=True)
        began = time.time()
        with open(stem + ".log", "w") as log:
            log.write(" ".join(command) + "\n")
            log.flush()
            done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=root)
        print(f"cell {model} {link} x{workers}: exit {done.returncode} after {time.time() - began:.0f} s",
              flush=True)
    return 0


def matrix_main(argv) -> int:
    args = parse_matrix(argv)
    if args.table:
        print(matrix_table(args.table))
        return 0
    if args.summary:
        print(summary(args.summary, args.ours))
        return 0
    if args.campaign:
        return run_campaign(args)
    harness.run_workers(matrix_worker, args)
    return 0


MODES = {"matrix": matrix_main, "pair": pair_main, "exchanges": exchanges_main, "fsdp": fsdp_main,
         "hsdp": hsdp_main, "ddp": ddp_main}


def main(argv=None) -> int:
    return harness.run_mode("headline.py", __doc__, MODES, argv, default="matrix")


if __name__ == "__main__":
    harness.exit_with(main)
