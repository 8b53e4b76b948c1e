"""The headline's ``exchanges`` mode: communicators side by side on this cluster."""
from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Dict

import torch
import torch.distributed as dist

import mergecomp
import mergecomp.ddp
from benchmarks import harness
from . import models

from .contenders import Configuration, owns_momentum, phase_text, sgd, timed_rounds, train_step


# --------------------------------------------------------------------------- exchanges --

EXCHANGES_DOC = """Which exchange is faster on this cluster, and how many bytes does each send per rank?

Every worker holds one copy of the model per configuration (the same initial weights and
batch) and, for each compressor of ``--compressors``, trains it through
``mergecomp.DistributedOptimizer`` once per contender of ``--contenders``: ``flat`` (the
compressor's recommended communicator over all ranks) or a communicator's name with its
options (``hierarchical``, ``hierarchical:inner=ps``, ``allgather``, ``sparse_allreduce``,
``sparse_allreduce:keep=2``).  The configuration ``<contender>-<compressor>`` runs the fixed
plan of ``--fusion-num`` groups, every group compressed, with the compressor's recommended
memory.  ``bound`` is the zero-cost bound (plain SGD, no exchange).

After warm-up, ``--rounds`` rounds each run one window of ``--window`` steps of every
configuration (``harness.interleaved_windows``: the order rotated each round, a barrier and
one untimed step before each window); a window's time is its slowest rank's.  Reported per
configuration: the median step time and throughput, the ratio to the bound and to the first
contender (each the median of per-round ratios: > 1 is faster), the bytes each rank handed
to collectives and put on the wire per step (the backend's counters: ``bytes_sent``, and
``wire_bytes``, what ring and all-to-all algorithms transmit; mean and largest over ranks),
the first contender's wire bytes over this one's, and the optimizer's phases.

The node layout is the launcher's (LOCAL_WORLD_SIZE); the emulated cluster sets it:

    python benchmarks/cluster.py --nodes 2 --workers-per-node 2 --profile 1gbit -- \\
        python benchmarks/headline.py exchanges --model vgg16 --batch-size 8 \\
        --compressors efsignsgd,dgc,fp16 --contenders flat hierarchical --json vgg16.json
    python benchmarks/cluster.py --workers 8 --profile 1gbit -- \\
        python benchmarks/headline.py exchanges --model mlp --width 1024 --fusion-num 1 \\
        --compressors topk:compress_ratio=0.01 --contenders allgather sparse_allreduce \\
        --rounds 6 --window 10 --json topk.json
    python benchmarks/headline.py exchanges --nproc 2 --model mlp --width 256 \\
        --compressors topk:compress_ratio=0.01 --contenders allgather sparse_allreduce
    python benchmarks/headline.py exchanges --table vgg16.json topk.json
"""

FLAT = "flat"


def parse_exchanges(argv):
    p = harness.build_parser(EXCHANGES_DOC)
    p.prog = "headline.py exchanges"
    harness.add_rounds_arguments(p, 8, "one window of every configuration")
    p.add_argument("--compressors", default="dgc,fp16",
                   help="compressors, comma-separated, each name[:key=value...] (default dgc,fp16)")
    p.add_argument("--contenders", nargs="+", default=[FLAT, "hierarchical"], metavar="EXCHANGE",
                   help="'flat' (the compressor's recommended communicator) or a communicator "
                        "name[:key=value...]; the first is the reference (default: flat hierarchical)")
    p.add_argument("--width", type=int, default=None,
                   help="--model mlp: its width (default 1024; 4.2M parameters)")
    p.add_argument("--link", default="", help="what the links are, recorded in the result (e.g. '1gbit between')")
    p.set_defaults(threads=1, fusion_num=4)
    args = harness.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    if args.fusion_num < 1:
        p.error(f"--fusion-num must be ≥ 1 here (groups of the fixed plan), got {args.fusion_num}")
    if args.width is not None and (args.model != "mlp" or args.width < 1):
        p.error(f"--width {args.width} sizes --model mlp (a width ≥ 1); --model {args.model} has no width")
    args.model_options = {"width": args.width} if args.width is not None else {}
    args.compressors = [c for c in args.compressors.split(",") if c]
    if not args.compressors or len(set(args.contenders)) != len(args.contenders):
        p.error(f"give ≥ 1 compressor and distinct contenders, got --compressors {','.join(args.compressors)!r} "
                f"and --contenders {' '.join(args.contenders)}")
    models.get(args.model)  # unknown names fail here, before any rank starts
    for compressor in args.compressors:
        for contender in args.contenders:
            exchange_components(compressor, contender, harness.NoProcessGroup(args.nproc or 2))
    return args


def exchange_components(compressor_spec: str, contender: str, backend):
    """(compressor, memory, communicator) of one configuration, built on ``backend``: the
    communicator's construction refuses what it cannot carry, before any rank starts."""
    from mergecomp import arguments
    name, options = harness.parse_spec(compressor_spec)
    compressor = mergecomp.compressors.create(name, **options)
    communicator, communicator_options = (None, {}) if contender == FLAT else harness.parse_spec(contender)
    compressor, memory, communicator = arguments.resolve(compressor, "auto", communicator)
    communicator = mergecomp.communicators.create(communicator, compressor=compressor, memory=memory,
                                                  backend=backend, **communicator_options)
    return compressor, memory, communicator


def exchanges_worker(args):
    from mergecomp.distributed.backends import default_backend
    work = harness.prepare(args)
    warnings.simplefilter("ignore", UserWarning)

    local = copy.deepcopy(work.model)
    bound = train_step(work, local, sgd(local, False, args.lr))
    configurations = {"bound": Configuration("bound", bound, lambda: 0.0)}
    described = {}
    for compressor_spec in args.compressors:
        for contender in args.contenders:
            model, backend = copy.deepcopy(work.model), default_backend()
            compressor, memory, communicator = exchange_components(compressor_spec, contender, backend)
            optimizer = mergecomp.DistributedOptimizer(
                sgd(model, owns_momentum(compressor, memory), args.lr), model=model, compressor=compressor,
                memory=memory, communicator=communicator, schedule=args.fusion_num, backend=backend)
            name = f"{contender}-{compressor_spec}"
            described[name] = (repr(communicator), f"{args.contenders[0]}-{compressor_spec}")
            configurations[name] = Configuration(
                name, train_step(work, model, optimizer), lambda b=backend: b.bytes_sent,
                before=optimizer.restart_step_clock, optimizer=optimizer, wire_bytes=lambda b=backend: b.wire_bytes)
    local_size = work.info.local_world_size
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch {work.batch_size} per worker, "
             f"{work.size} workers in {work.size // local_size} node(s) of {local_size}; configurations: "
             + ", ".join(configurations))
    for configuration in configurations.values():
        for _ in range(max(3, args.num_warmup_batches)):
            configuration.step()
    wire: Dict[str, float] = {}
    per_step, sent, phases = timed_rounds(configurations, args, wire_out=wire)
    everyone = [None] * work.size
    dist.all_gather_object(everyone, (per_step, sent, wire))
    slowest = {name: [max(r[0][name][i] for r in everyone) for i in range(args.rounds)] for name in configurations}
    result = {"model": args.model, "model_options": args.model_options, "batch_size": work.batch_size,
              "workers": work.size, "workers_per_node": local_size, "threads": args.threads,
              "num_params": work.num_params, "rounds": args.rounds, "window": args.window, "groups": args.fusion_num,
              "link": args.link, "compressors": args.compressors, "contenders": args.contenders,
              "reference": args.contenders[0], "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "configurations": {}}
    for name, rounds in slowest.items():
        step_s = statistics.median(rounds)
        ranks_sent, ranks_wire = [r[1][name] for r in everyone], [r[2][name] for r in everyone]
        entry = {"step_s": step_s, "step_s_rounds": rounds, "throughput": work.size * work.batch_size / step_s,
                 "scaling_vs_bound": statistics.median(b / s for b, s in zip(slowest["bound"], rounds)),
                 "bytes_per_step": statistics.mean(ranks_sent), "bytes_per_step_max": max(ranks_sent),
                 "wire_bytes_per_step": statistics.mean(ranks_wire), "wire_bytes_per_step_max": max(ranks_wire)}
        if name in described:
            entry["communicator"], base = described[name]
            entry["phases_s"] = {key: statistics.median(values) for key, values in phases[name].items() if values}
            entry["versus_reference_rounds"] = [r / s for r, s in zip(slowest[base], rounds)]
            entry["versus_reference"] = statistics.median(entry["versus_reference_rounds"])
            own_wire = entry["wire_bytes_per_step"]
            entry["reference_wire_over_this"] = (statistics.mean(r[2][base] for r in everyone) / own_wire
                                                 if own_wire else None)
        result["configurations"][name] = entry
    work.log(exchanges_table_of(result))
    return harness.finish(result, args.json, work)


def exchanges_table_of(result) -> str:
    """Markdown of one result; reads those of the earlier flat-against-hierarchical runs too
    (their reference is ``flat``, their ratio ``versus_flat``, no wire bytes)."""
    reference = result.get("reference", FLAT)
    lines = [f"{result['model']}, {result['workers']} workers ({result['workers_per_node']} per node), "
             f"{result['link'] or 'links as launched'}: median of {result['rounds']} rounds of {result['window']} steps",
             f"| configuration | ms/step | throughput | × bound | × {reference} | wire kB/rank/step (max) | "
             f"{reference}'s wire ÷ this | kB/step to collectives | compress / wait / decode ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, entry in result["configurations"].items():
        versus = entry.get("versus_reference", entry.get("versus_flat"))
        wire = (f"{entry['wire_bytes_per_step'] / 1e3:,.1f} ({entry['wire_bytes_per_step_max'] / 1e3:,.1f})"
                if "wire_bytes_per_step" in entry else "")
        fewer = entry.get("reference_wire_over_this")
        lines.append(f"| {name} | {entry['step_s'] * 1e3:.0f} | {entry['throughput']:.1f} | "
                     f"{entry['scaling_vs_bound']:.2f} | {'' if versus is None else f'{versus:.2f}'} | {wire} | "
                     f"{'' if fewer is None else f'{fewer:.2f}'} | {entry['bytes_per_step'] / 1e3:,.1f} | "
                     f"{phase_text(entry.get('phases_s'))} |")
    return "\n".join(lines)


def exchanges_main(argv) -> int:
    args = parse_exchanges(argv)
    if args.table:
        print("\n\n".join(exchanges_table_of(r) for r in harness.saved_results(
            args.table, "configurations", "benchmarks/headline.py exchanges")))
        return 0
    harness.run_workers(exchanges_worker, args)
    return 0
