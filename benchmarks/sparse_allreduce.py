#!/usr/bin/env python
"""Top-k through the allgather and through the sparse allreduce, side by side in one run.

    python benchmarks/sparse_allreduce.py --workers 8 --profile 1gbit --json out.json

Starts the workers once on the emulated cluster (:mod:`mergecomp.bench.cluster`); every
worker builds the same MLP twice, one copy trained with top-k through ``allgather``, the
other through ``sparse_allreduce``, and times them in alternating rounds (so both see the
same links and the same load on the host).  Per communicator it reports the median step
time over rounds and the bytes each rank sent per step, as the backend counts them
(``wire_bytes``: what the ring/all-to-all algorithms transmit; ``bytes_sent``: what was
handed to the collectives).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

COMMUNICATORS = ("allgather", "sparse_allreduce")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--profile", default="1gbit", help="cluster profile (default 1gbit)")
    parser.add_argument("--ratio", type=float, default=0.01, help="top-k density (default 0.01)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (3 layers; default 1024)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per communicator")
    parser.add_argument("--steps", type=int, default=10, help="steps per timed round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import mergecomp
    from mergecomp import compressors

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    runs = {}
    for name in COMMUNICATORS:
        torch.manual_seed(0)
        w = args.width
        model = nn.Sequential(nn.Linear(w, 2 * w), nn.ReLU(), nn.Linear(2 * w, w), nn.ReLU(), nn.Linear(w, 10))
        opt = mergecomp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
            compressor=compressors.create("topk", compress_ratio=args.ratio), memory="residual",
            communicator=name, schedule=1)
        runs[name] = (model, opt)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step(model, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for name in COMMUNICATORS:
        for _ in range(args.warmup):
            step(*runs[name])
    times = {name: [] for name in COMMUNICATORS}
    wire = {name: [] for name in COMMUNICATORS}
    sent = {name: [] for name in COMMUNICATORS}
    for _ in range(args.rounds):
        for name in COMMUNICATORS:
            model, opt = runs[name]
            backend = opt.backend
            dist.barrier()
            wire0, sent0, start = backend.wire_bytes, backend.bytes_sent, time.perf_counter()
            for _ in range(args.steps):
                step(model, opt)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's round
            times[name].append(elapsed.item() / args.steps)
            wire[name].append((backend.wire_bytes - wire0) / args.steps)
            sent[name].append((backend.bytes_sent - sent0) / args.steps)
    numel = sum(p.numel() for p in runs[COMMUNICATORS[0]][0].parameters())
    mine = {name: {"step_s": times[name], "wire_bytes_per_step": statistics.mean(wire[name]),
                   "bytes_sent_per_step": statistics.mean(sent[name])} for name in COMMUNICATORS}
    everyone = [None] * size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        result = {"workers": size, "profile": os.environ.get("MERGECOMP_NET_PROFILE"), "ratio": args.ratio,
                  "params": numel, "dense_bytes": 4 * numel, "batch": args.batch, "rounds": args.rounds,
                  "steps_per_round": args.steps, "communicators": {}}
        for name in COMMUNICATORS:
            per_rank = [r[name]["wire_bytes_per_step"] for r in everyone]
            result["communicators"][name] = {
                "step_ms_median": 1e3 * statistics.median(times[name]),
                "step_ms_rounds": [1e3 * t for t in times[name]],
                "wire_bytes_per_rank_step_mean": statistics.mean(per_rank),
                "wire_bytes_per_rank_step_max": max(per_rank),
                "bytes_sent_per_rank_step_mean": statistics.mean(r[name]["bytes_sent_per_step"] for r in everyone)}
        gather, sparse = (result["communicators"][n] for n in COMMUNICATORS)
        result["fewer_wire_bytes"] = gather["wire_bytes_per_rank_step_mean"] / sparse["wire_bytes_per_rank_step_mean"]
        result["speedup"] = gather["step_ms_median"] / sparse["step_ms_median"]
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from mergecomp.bench.cluster import Cluster
    command = [sys.executable, os.path.abspath(__file__), "--worker"] + \
        [f"--{k}={v}" for k, v in (("ratio", args.ratio), ("width", args.width), ("batch", args.batch),
                                   ("rounds", args.rounds), ("steps", args.steps), ("warmup", args.warmup))]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with Cluster(args.workers, args.profile) as cluster:
        results = cluster.run(command, timeout_s=args.timeout, cwd=root)
    if not results.ok:
        print(results.failure, file=sys.stderr)
        for r in results:
            print(f"--- rank {r.rank} (exit {r.returncode}) {r.note}\n{r.stderr[-3000:]}", file=sys.stderr)
        return 1
    line = next(l for l in results[0].stdout.splitlines() if l.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
