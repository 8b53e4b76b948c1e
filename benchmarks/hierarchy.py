#!/usr/bin/env python
"""Hierarchical against flat: the same compressor, the same plan, on nodes of several workers.

Every worker holds one copy of the model per configuration (the same initial weights and
batch) and, for each compressor of ``--compressors``, trains it through
``mergecomp.DistributedOptimizer`` twice: ``flat-<c>`` with the compressor's recommended
communicator over all ranks, and ``hier-<c>`` with ``communicator="hierarchical"`` (dense
allreduce inside a node, the same communicator between nodes on a 1/L shard, allgather of
the shards inside the node).  Both run the fixed plan of ``--fusion-num`` groups, every
group compressed.  ``bound`` is the zero-cost bound (no exchange).  After warm-up,
``--rounds`` rounds each run one window of ``--window`` steps of every configuration, the
order rotated each round, a barrier and one untimed step before each window; a window's
time is its slowest rank's.  Reported per configuration: the median step time and
throughput, and ``hier-<c>``'s speed-up over ``flat-<c>`` (the median of per-round ratios).

The node layout is the launcher's (LOCAL_WORLD_SIZE); the emulated cluster sets it:

    python benchmarks/cluster.py --nodes 2 --workers-per-node 2 --profile 1gbit -- \\
        python benchmarks/hierarchy.py --model vgg16 --threads 1 --batch-size 8 --json vgg16.json
    python benchmarks/hierarchy.py --table vgg16.json lstm.json
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import headline  # noqa: E402  (the interleaved timing of benchmarks/headline.py)

import mergecomp  # noqa: E402
from mergecomp.bench import harness  # noqa: E402


def parse(argv=None):
    p = harness.build_parser(__doc__)
    harness.add_rounds_arguments(p, 8, "one window of every configuration")
    p.add_argument("--compressors", default="dgc,fp16", help="compressors, comma-separated (default dgc,fp16)")
    p.add_argument("--link", default="", help="what the links are, recorded in the result (e.g. '1gbit between')")
    p.set_defaults(threads=1, fusion_num=4)
    args = harness.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    args.compressors = [c for c in args.compressors.split(",") if c]
    for name in args.compressors:
        mergecomp.compressors.get(name)  # an unknown name fails before any rank starts
    if args.fusion_num < 1:
        p.error(f"--fusion-num must be ≥ 1 here (groups of the fixed plan), got {args.fusion_num}")
    return args


def build(args, work):
    loss = work.spec.loss
    configurations = {}

    def train_step(model, optimizer):
        def step():
            optimizer.zero_grad()
            loss(model(work.inputs), work.targets).backward()
            optimizer.step()
        return step

    local = copy.deepcopy(work.model)
    configurations["bound"] = headline.Configuration("bound", train_step(local, headline.sgd(local, False, args.lr)),
                                                     lambda: 0.0)
    for name in args.compressors:
        for kind in ("flat", "hier"):
            model = copy.deepcopy(work.model)
            compressor = mergecomp.compressors.create(name)
            memory = mergecomp.memories.create(compressor.recommended_memory)
            optimizer = mergecomp.DistributedOptimizer(
                headline.sgd(model, headline._owns_momentum(compressor, memory), args.lr), model=model,
                compressor=compressor, memory=memory, schedule=args.fusion_num,
                communicator="hierarchical" if kind == "hier" else "auto")
            configurations[f"{kind}-{name}"] = headline.Configuration(
                f"{kind}-{name}", train_step(model, optimizer), lambda o=optimizer: o.backend.bytes_sent,
                before=optimizer.restart_step_clock, optimizer=optimizer)
    return configurations


def worker(args):
    work = harness.prepare(args)
    warnings.simplefilter("ignore", UserWarning)
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", work.size))
    configurations = build(args, work)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch {work.batch_size} per worker, "
             f"{work.size} workers in {work.size // local_size} node(s) of {local_size}; configurations: "
             + ", ".join(configurations))
    for configuration in configurations.values():
        for _ in range(max(3, args.num_warmup_batches)):
            configuration.step()
    per_step, bytes_per_step, phases = headline.timed_rounds(configurations, args)
    gathered = [None] * work.size
    dist.all_gather_object(gathered, per_step)
    slowest = {name: [max(r[name][i] for r in gathered) for i in range(args.rounds)] for name in configurations}
    result = {"model": args.model, "batch_size": work.batch_size, "workers": work.size, "workers_per_node": local_size,
              "threads": args.threads, "num_params": work.num_params, "rounds": args.rounds, "window": args.window,
              "groups": args.fusion_num, "link": args.link, "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "configurations": {}}
    for name, rounds in slowest.items():
        step_s = statistics.median(rounds)
        entry = {"step_s": step_s, "step_s_rounds": rounds, "throughput": work.size * work.batch_size / step_s,
                 "scaling_vs_bound": statistics.median(b / s for b, s in zip(slowest["bound"], rounds)),
                 "bytes_per_step": bytes_per_step[name]}
        if phases[name]["launch"]:
            entry["phases_s"] = {key: statistics.median(values) for key, values in phases[name].items() if values}
        if name.startswith("hier-"):
            flat = slowest["flat-" + name[len("hier-"):]]
            entry["versus_flat_rounds"] = [f / s for f, s in zip(flat, rounds)]
            entry["versus_flat"] = statistics.median(entry["versus_flat_rounds"])
        result["configurations"][name] = entry
    work.log(table_of(result))
    return harness.finish(result, args.json, work)


def table_of(result) -> str:
    lines = [f"{result['model']}, {result['workers']} workers ({result['workers_per_node']} per node), "
             f"{result['link'] or 'links as launched'}: median of {result['rounds']} rounds of {result['window']} steps",
             "| configuration | ms/step | throughput | × bound | × flat | kB/step |", "|---|---:|---:|---:|---:|---:|"]
    for name, entry in result["configurations"].items():
        versus = f"{entry['versus_flat']:.2f}" if "versus_flat" in entry else ""
        lines.append(f"| {name} | {entry['step_s'] * 1e3:.0f} | {entry['throughput']:.1f} | "
                     f"{entry['scaling_vs_bound']:.2f} | {versus} | {entry['bytes_per_step'] / 1e3:,.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse(argv)
    if args.table:
        print("\n\n".join(table_of(r) for r in harness.saved_results(args.table, "configurations",
                                                                         "benchmarks/hierarchy.py")))
        return 0
    harness.run_workers(worker, args)
    return 0


if __name__ == "__main__":
    harness.exit_with(main)
