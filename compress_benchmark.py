#!/usr/bin/env python
"""Synthetic-data training throughput with compressed gradient exchange.

The flags are MergeComp's (and Horovod's synthetic benchmark's), e.g.

    torchrun --nproc_per_node 2 compress_benchmark.py --compress --compressor dgc \
        --comm allgather --memory dgc --fusion-num 2 --model vgg16
    python compress_benchmark.py --nproc 2 --compress --compressor topk --comm allgather \
        --memory residual --model resnet20

Per iteration it prints the throughput per worker, then mean ± 1.96σ, the total for all
workers, and the bytes each worker handed to the collective backend per training step
(counted from the payloads, not estimated) with the compression ratio against FP32.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

import mergecomp
from mergecomp import launch, models


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet20", help=f"one of {', '.join(models.available())}")
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: the model's)")
    p.add_argument("--compress", action="store_true", help="compress gradients (else FP32 allreduce)")
    p.add_argument("--compressor", default="none", help="compressor name (see --list)")
    p.add_argument("--compress-ratio", type=float, default=None,
                   help="fraction kept by sparsifiers (topk, randk, dgc, graddrop, ...)")
    p.add_argument("--memory", default=None,
                   help="error-feedback memory: none, residual, dgc (default: the compressor's recommended)")
    p.add_argument("--comm", default=None,
                   help="communicator: allreduce, allgather, ps (default: the compressor's recommended)")
    p.add_argument("--fusion-num", type=int, default=1,
                   help="0: one group per tensor, 1: one group, y: y groups balanced by bytes")
    p.add_argument("--scheduler", default="fixed",
                   help="fixed (--fusion-num), binary (MergeComp's search for a 2-group split), "
                        "optimal (DP over a saved --profile-in), auto (profile this run, DP, "
                        "measured check)")
    p.add_argument("--profile-in", default=None, help="a saved profile for --scheduler optimal")
    p.add_argument("--profile-out", default=None, help="save the profile --scheduler auto measures (JSON)")
    p.add_argument("--plan-in", default=None, help="execute this saved plan (JSON)")
    p.add_argument("--plan-out", default=None, help="save the plan used (JSON)")
    p.add_argument("--num-warmup-batches", type=int, default=10)
    p.add_argument("--num-batches-per-iter", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--no-cuda", action="store_true", help="train on the CPU even if CUDA is available")
    p.add_argument("--nproc", type=int, default=None,
                   help="spawn this many local workers (when not started by torchrun/mpirun/horovodrun)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: CPU cores / local workers)")
    p.add_argument("--json", default=None, help="write the result as JSON to this path (rank 0)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--list", action="store_true", help="list models and components, then exit")
    args = p.parse_args(argv)
    for name in ("num_warmup_batches",):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be ≥ 0, got {getattr(args, name)}")
    for name in ("num_batches_per_iter", "num_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if args.nproc is not None and args.nproc < 1:
        p.error(f"--nproc must be ≥ 1, got {args.nproc}")
    if args.batch_size is not None and args.batch_size < 1:
        p.error(f"--batch-size must be ≥ 1, got {args.batch_size}")
    if args.fusion_num < 0:
        p.error(f"--fusion-num must be ≥ 0, got {args.fusion_num}")
    return args


def build_compressor(args):
    """The compressor from the flags; --compress-ratio goes to those that take one."""
    if not args.compress:
        return mergecomp.compressors.create("none")
    cls = mergecomp.compressors.get(args.compressor)
    kwargs = {}
    if args.compress_ratio is not None:
        import inspect
        if "compress_ratio" not in inspect.signature(cls).parameters:
            raise ValueError(f"--compress-ratio was given but compressor {args.compressor!r} takes no "
                             "ratio; drop the flag or choose a sparsifier (topk, randk, dgc, ...)")
        kwargs["compress_ratio"] = args.compress_ratio
    return mergecomp.compressors.create(args.compressor, **kwargs)


def build_scheduler(args):
    """The scheduler from the flags (rank-independent: every rank builds the same one)."""
    name = args.scheduler
    send = "compress" if args.compress else "fp32"
    if name == "fixed":
        return mergecomp.schedulers.create("fixed", fusion_num=args.fusion_num, send=send)
    if name == "optimal":
        if not args.profile_in:
            raise ValueError("--scheduler optimal plans from a saved profile: pass --profile-in "
                             "PATH (written by --scheduler auto --profile-out PATH), or use "
                             "--scheduler auto to profile this run")
        return mergecomp.schedulers.create("optimal", profile=args.profile_in, allow_compress=args.compress)
    if name == "auto":
        return mergecomp.schedulers.create("auto", profile_out=args.profile_out)
    if name == "binary":
        return mergecomp.schedulers.create("binary", send=send)
    return mergecomp.schedulers.create(name)


def worker(args):
    device_name = "cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu"
    info = launch.init_distributed(device=device_name)
    device = torch.device("cuda", info.local_rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        cores = os.cpu_count() or 1
        torch.set_num_threads(args.threads or max(1, cores // max(1, info.local_world_size)))
    rank, size = info.rank, info.world_size
    torch.manual_seed(args.seed)

    spec = models.get(args.model)
    batch_size = args.batch_size or spec.default_batch_size
    model = spec.build().to(device)
    generator = torch.Generator(device=device).manual_seed(args.seed + rank)
    inputs, targets = spec.batch(batch_size, device=device, generator=generator)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    compressor = build_compressor(args)
    args.memory = args.memory or compressor.recommended_memory
    args.comm = args.comm or compressor.recommended_communicator
    plan = mergecomp.Plan.load(args.plan_in) if args.plan_in else None
    base = torch.optim.SGD(model.parameters(), lr=args.lr)
    optimizer = mergecomp.DistributedOptimizer(
        base, model.named_parameters(), compressor=compressor,
        memory=args.memory if args.compress else "none",
        communicator=args.comm if args.compress else "allreduce",
        scheduler=build_scheduler(args), plan=plan, compress=args.compress)
    backend = optimizer.backend

    def benchmark_step():
        optimizer.zero_grad()
        spec.loss(model(inputs), targets).backward()
        optimizer.step()

    def timed(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(batches):
            benchmark_step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"Model: {args.model} ({num_params / 1e6:.2f}M parameters), batch size {batch_size} per worker")
    log(f"Workers: {size} ({info.launcher}), device: {device}, backend: {type(backend).__name__}")
    log(f"Exchange: {optimizer.communicator!r}" if args.compress else "Exchange: FP32 allreduce (no compression)")

    timed(max(1, args.num_warmup_batches))  # at least one step: it records the plan
    search_steps = 0
    scheduler = optimizer.scheduler
    while getattr(scheduler, "adaptive", False) and not scheduler.settled:
        if search_steps >= 1000:
            raise RuntimeError(f"the {args.scheduler} scheduler did not settle within 1000 steps")
        timed(1)
        search_steps += 1
    if search_steps:
        log(f"Scheduler {args.scheduler} settled after {search_steps} steps beyond the warm-up")
    log(optimizer.plan.describe(optimizer._param_infos([n for g in optimizer.plan.groups for n in g.names])))
    if args.plan_out and rank == 0:
        optimizer.plan.save(args.plan_out)

    rates, bytes_per_step, wire_per_step, step_times = [], [], [], []
    from tqdm import tqdm
    # A progress bar on a terminal only: in logs its carriage returns garble the lines.
    progress = tqdm(range(args.num_iters), desc="iterations", file=sys.stderr, leave=False,
                    disable=rank != 0 or not sys.stderr.isatty())
    for i in progress:
        sent_before, wire_before = backend.bytes_sent, backend.wire_bytes
        seconds = timed(args.num_batches_per_iter)
        bytes_per_step.append((backend.bytes_sent - sent_before) / args.num_batches_per_iter)
        wire_per_step.append((backend.wire_bytes - wire_before) / args.num_batches_per_iter)
        step_times.append(seconds / args.num_batches_per_iter)
        rates.append(batch_size * args.num_batches_per_iter / seconds)
        progress.write(f"Iter #{i}: {rates[-1]:.1f} {spec.unit}/sec per worker") if rank == 0 else None

    # Every rank's throughput, so the reported mean is over workers, not rank 0's alone.
    everyone = backend.allgather_object((rates, bytes_per_step, wire_per_step))
    mean_rates = [statistics.mean(r) for r, _, _ in everyone]
    mean = statistics.mean(rates)
    conf = 1.96 * (statistics.stdev(rates) if len(rates) > 1 else 0.0)
    total = sum(mean_rates)
    sent = statistics.mean(statistics.mean(b) for _, b, _ in everyone)
    wire = statistics.mean(statistics.mean(w) for _, _, w in everyone)
    fp32_bytes = 4 * num_params
    fp32_wire = fp32_bytes * 2 * (size - 1) // size  # a ring allreduce of the FP32 gradient
    result = {
        "model": args.model, "unit": spec.unit, "compress": args.compress,
        "compressor": args.compressor if args.compress else "none",
        "compress_ratio": args.compress_ratio, "memory": args.memory if args.compress else "none",
        "comm": args.comm if args.compress else "allreduce", "fusion_num": args.fusion_num,
        "scheduler": args.scheduler, "search_steps": search_steps,
        "compressed_groups": sum(g.send == "compress" for g in optimizer.plan.groups), "groups": len(optimizer.plan), "plan": optimizer.plan.digest(),
        "workers": size, "launcher": info.launcher, "device": str(device), "batch_size": batch_size,
        "num_params": num_params, "rate_per_worker": mean, "rate_per_worker_ci": conf,
        "rate_total": total, "iteration_time_s": statistics.mean(step_times),
        "bytes_per_step": sent, "fp32_bytes_per_step": fp32_bytes,
        "compression_ratio": fp32_bytes / sent if sent else math.inf,
        "wire_bytes_per_step": wire, "fp32_wire_bytes_per_step": fp32_wire, "rates": rates,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    log(f"{spec.unit.capitalize()}/sec per worker: {mean:.1f} +-{conf:.1f}")
    log(f"Total {spec.unit}/sec on {size} worker(s): {total:.1f} +-{conf * size:.1f}")
    log(f"Bytes sent per worker per iteration: {sent:,.0f} ({sent / 1e6:.3f} MB); FP32 gradient: "
        f"{fp32_bytes:,} bytes; compression ratio {result['compression_ratio']:.1f}x")
    if size > 1:
        log(f"On the wire per worker per iteration (ring/direct algorithms): {wire:,.0f} bytes; "
            f"FP32 ring allreduce: {fp32_wire:,} bytes ({fp32_wire / wire if wire else math.inf:.1f}x)")
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result if rank == 0 else None


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        print("models:        ", ", ".join(models.available()))
        print("compressors:   ", ", ".join(mergecomp.compressors.available()))
        print("memories:      ", ", ".join(mergecomp.memories.available()))
        print("communicators: ", ", ".join(mergecomp.communicators.available()))
        print("schedulers:    ", ", ".join(mergecomp.schedulers.available()))
        return 0
    # Fail fast, before any process starts, on names that do not exist.
    models.get(args.model)
    mergecomp.schedulers.get(args.scheduler)
    if args.scheduler == "optimal" and not args.profile_in:
        build_scheduler(args)  # raises the explanation
    if args.compress:
        build_compressor(args)
        if args.memory:
            mergecomp.memories.get(args.memory)
        if args.comm:
            mergecomp.communicators.get(args.comm)
    if args.nproc is not None and launch.detect().launcher not in ("single", "spawn"):
        raise SystemExit(f"--nproc {args.nproc} was given but this process was started by "
                         f"{launch.detect().launcher}; use one or the other")
    if args.nproc is not None and launch.detect().launcher == "single":
        launch.spawn(worker, args.nproc, args=(args,))
    else:
        worker(args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
