"""The headline's ``hsdp`` mode: FSDP2's own replica all-reduce against mergecomp's compressed one.

Run on nodes of several workers (the emulated cluster, or torchrun on real nodes): the mesh
is :func:`mergecomp.fsdp.node_mesh`, so each node is a shard group (FSDP2's reduce-scatter
on the fast link inside the node) and the replicas of a shard sit on different nodes (the
all-reduce that :func:`mergecomp.fsdp.register` compresses crosses the slow link).

Every worker holds one copy of a wide MLP (``--depth`` linear layers of ``--width``, each
an FSDP unit, the same initial weights) per configuration: ``hsdp`` (FSDP2's own HSDP,
FP32), ``hsdp-<c>`` for each of ``--compressors`` (the replicas' all-reduce compressed,
error feedback as the compressor recommends), and ``bound`` (an unsharded copy, no
exchange: the compute alone).  ``--no-reshard-after-forward`` keeps each unit's gathered
parameters from forward to backward (one all-gather a step inside the node, not two).  The model is wide and the batch small on purpose: the
replicas' all-reduce moves bytes in proportion to the parameters, the compute grows with
the batch, so the inter-node link, not the host's CPU, sets the uncompressed step.

After warm-up, ``--rounds`` rounds each run one window of ``--window`` steps of every
configuration, the order rotated each round, a barrier and one untimed step before each
window (:mod:`benchmarks.harness.contenders`); a window's time is its slowest rank's.
Reported: the median step time per configuration, the bytes one rank sends between nodes
per step, and each compressed configuration's speed-up over ``hsdp``: the median of the
per-round ratios.

    python benchmarks/cluster.py --nodes 2 --workers-per-node 2 --profile 1gbit -- \\
        python benchmarks/headline.py hsdp --json hsdp.json
    python benchmarks/headline.py hsdp --table hsdp.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

import mergecomp
from benchmarks import harness
from .contenders import Configuration, timed_rounds


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def sharded(args, mesh) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    model = mlp(args.width, args.depth)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    return model


def replica_bytes(model: nn.Module, replicas: int) -> float:
    """What FSDP2's own replica all-reduce sends per step and rank: a ring all-reduce of the
    FP32 shard, 2·(R−1)/R of it for R replicas."""
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    return 2 * (replicas - 1) / replicas * shard


def build(args, mesh, inputs, targets):
    def step_of(model, optimizer):
        def step():
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
        return step

    replicas = mesh.size(0)
    configurations = {}
    local = mlp(args.width, args.depth)
    configurations["bound"] = Configuration(
        "bound", step_of(local, torch.optim.SGD(local.parameters(), lr=args.lr)), lambda: 0.0)
    model = sharded(args, mesh)
    own = replica_bytes(model, replicas)
    counter = {"steps": 0}

    def own_step(step=step_of(model, torch.optim.SGD(model.parameters(), lr=args.lr))):
        step()
        counter["steps"] += 1
    configurations["hsdp"] = Configuration("hsdp", own_step, lambda: own * counter["steps"])
    for spec in args.compressors:
        name, options = harness.parse_spec(spec)
        model = sharded(args, mesh)
        state = mergecomp.fsdp.register(model, compressor=name, **options)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        configurations[f"hsdp-{spec}"] = Configuration(
            f"hsdp-{spec}", step_of(model, optimizer), lambda s=state: s.wire_bytes)
    return configurations


def worker(args) -> int:
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", UserWarning)
    mesh = mergecomp.fsdp.node_mesh("cpu")
    generator = torch.Generator().manual_seed(info.rank)
    inputs = torch.randn(args.batch, args.width, generator=generator)
    targets = torch.randint(0, 10, (args.batch,), generator=generator)
    configurations = build(args, mesh, inputs, targets)
    for configuration in configurations.values():
        for _ in range(args.warmup):
            configuration.step()
    per_step, bytes_per_step, _ = timed_rounds(configurations, args)
    gathered = [None] * info.world_size
    dist.all_gather_object(gathered, per_step)
    slowest = {name: [max(r[name][i] for r in gathered) for i in range(args.rounds)] for name in configurations}
    result = {"width": args.width, "depth": args.depth, "batch": args.batch, "threads": args.threads,
              "reshard_after_forward": args.reshard_after_forward,
              "parameters": sum(p.numel() for p in mlp(args.width, args.depth).parameters()),
              "workers": info.world_size, "nodes": mesh.size(0), "workers_per_node": mesh.size(1),
              "rounds": args.rounds, "window": args.window, "link": args.link, "torch": torch.__version__,
              "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "configurations": {}}
    for name, rounds in slowest.items():
        entry = {"step_s": statistics.median(rounds), "step_s_rounds": rounds,
                 "inter_node_bytes_per_step": bytes_per_step[name]}
        if name.startswith("hsdp-"):
            entry["versus_hsdp_rounds"] = [h / s for h, s in zip(slowest["hsdp"], rounds)]
            entry["versus_hsdp"] = statistics.median(entry["versus_hsdp_rounds"])
        result["configurations"][name] = entry
    if info.rank == 0:
        print(table_of(result), flush=True)
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(result, handle, indent=2)
    dist.destroy_process_group()
    return 0


def table_of(result) -> str:
    lines = [f"MLP {result['depth']}×{result['width']} ({result['parameters']:,} parameters), batch "
             f"{result['batch']} per worker, {result['workers']} workers in {result['nodes']} nodes of "
             f"{result['workers_per_node']}, {result['link'] or 'links as launched'}: median of "
             f"{result['rounds']} rounds of {result['window']} steps, reshard_after_forward="
             f"{result.get('reshard_after_forward', True)}", "",
             "| configuration | ms/step | kB/step between nodes (one rank) | × hsdp (median) | per-round range |",
             "|---|---:|---:|---:|---|"]
    for name, entry in result["configurations"].items():
        ratio = entry.get("versus_hsdp")
        rounds = entry.get("versus_hsdp_rounds")
        sent = "—" if name == "bound" else f"{entry['inter_node_bytes_per_step'] / 1e3:,.0f}"
        speed = "—" if ratio is None else f"{ratio:.2f}"
        spread = "—" if rounds is None else f"{min(rounds):.2f}–{max(rounds):.2f}"
        lines.append(f"| {name} | {1e3 * entry['step_s']:.0f} | {sent} | {speed} | {spread} |")
    return "\n".join(lines)


def hsdp_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="headline.py hsdp", description=__doc__.split("\n")[0])
    parser.add_argument("--compressors", default="topk:compress_ratio=0.01,powersgd",
                        help="comma-separated name[:key=value...] (default topk at 1%% and powersgd)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="rows per worker and step")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                        help="fully_shard(reshard_after_forward=False): the unit's parameters stay gathered "
                             "from forward to backward, one all-gather per step instead of two")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration first")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--window", type=int, default=3)
    parser.add_argument("--link", default="", help="what the links are, recorded (e.g. '1 Gbit/s between nodes')")
    parser.add_argument("--json", default=None, help="rank 0 writes the result here")
    parser.add_argument("--table", nargs="+", default=None, help="print the tables of result files and stop")
    args = parser.parse_args(argv)
    if args.table:
        for path in args.table:
            with open(path) as handle:
                print(table_of(json.load(handle)) + "\n")
        return 0
    args.compressors = [c for c in args.compressors.split(",") if c]
    for spec in args.compressors:
        name, options = harness.parse_spec(spec)
        mergecomp.compressors.create(name, **options)  # unknown names and options fail before any rank
    for what in ("width", "depth", "batch", "threads", "rounds", "window"):
        if getattr(args, what) < 1:
            parser.error(f"--{what} must be ≥ 1, got {getattr(args, what)}")
    return worker(args)
