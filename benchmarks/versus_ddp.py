#!/usr/bin/env python
"""mergecomp against PyTorch DDP FP32 in the same processes, timed in interleaved windows.

On a shared machine the speed of a run drifts by ±15% within minutes, so throughputs
taken by separate runs cannot tell a 5% difference apart.  Here every worker holds two
copies of the model, with the same initial weights and batch:

- one wrapped in ``DistributedDataParallel`` without a hook: FP32 allreduce of 25 MB
  buckets (``--bucket-cap-mb``), overlapped with backward by DDP's C++ reducer, SGD (with
  the DGC memory's momentum when mergecomp runs one, so both sides apply momentum);
- one trained through mergecomp's ``DistributedOptimizer`` around the same SGD, configured
  by the flags of ``compress_benchmark.py`` (``--compress --compressor dgc --scheduler auto``
  and so on).

After the warm-up of both and the settling of mergecomp's scheduler (its search steps are
reported, not timed), ``--rounds`` rounds each time one window of ``--window`` steps of
either, and a second window of DDP ("DDP again"), in an order rotated each round so none
always goes first.  Every window begins with one
untimed step (caches, allocator) and ``restart_step_clock()``, so the adaptive scheduler
does not take the other model's steps for a slow step of its own.  A window's time is its
slowest rank's.  The result is the median over rounds of

    speed ratio = DDP seconds per step / mergecomp seconds per step   (> 1: mergecomp faster)

and, as this measure's noise, the median of DDP's speed over its second window's: the
same configuration timed twice in each round, so whatever it is off 1 by, a difference
of that size between DDP and mergecomp is not resolved.

    python benchmarks/versus_ddp.py --nproc 2 --threads 1 --model lstm --batch-size 8 \\
        --compress --compressor efsignsgd --scheduler auto --rounds 8 --window 3
    python benchmarks/cluster.py --workers 2 --profile 1gbit -- \\
        python benchmarks/versus_ddp.py --model vgg16 --compress --compressor dgc --scheduler auto
    python benchmarks/versus_ddp.py --table results/*.json      # a markdown table of saved runs
"""
from __future__ import annotations

import copy
import os
import statistics
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # run as a script: make ``mergecomp`` importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compress_benchmark  # noqa: E402
from mergecomp import benchmarking  # noqa: E402

DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel's own default
DDP_AGAIN = "ddp again"  # the label of DDP's second window in every round: the noise control


def parse_args(argv=None):
    p = compress_benchmark.build_parser(__doc__)
    compress_benchmark.add_rounds_arguments(p, 8, "one DDP and one mergecomp window")
    p.add_argument("--bucket-cap-mb", type=float, default=DDP_BUCKET_CAP_MB,
                   help=f"DDP's bucket size in MB (default {DDP_BUCKET_CAP_MB}, DDP's own)")
    args = compress_benchmark.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    if args.bucket_cap_mb <= 0:
        p.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    return args


def momentum_of(optimizer) -> float:
    """The momentum mergecomp applies outside the wrapped SGD (the DGC memory's), which
    DDP's SGD then applies too, so both sides do the same work per step."""
    memory = optimizer.memory
    return float(getattr(memory, "momentum", 0.0)) if getattr(memory, "needs_plain_optimizer", False) else 0.0


def worker(args):
    work = benchmarking.prepare(args)
    device = work.device
    twin = copy.deepcopy(work.model)  # same initial weights, trained by DDP
    ddp = DistributedDataParallel(twin, device_ids=[device.index] if device.type == "cuda" else None,
                                  bucket_cap_mb=args.bucket_cap_mb)
    optimizer = compress_benchmark.build_optimizer(args, work)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum_of(optimizer))

    ddp_step = benchmarking.training_step(work, ddp, ddp_optimizer)
    mergecomp_step = benchmarking.training_step(work, work.model, optimizer)

    def synchronised(step):
        def run():
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers, device {device}")
    work.log(f"DDP: FP32 allreduce, {args.bucket_cap_mb:g} MB buckets, SGD momentum "
             f"{ddp_optimizer.defaults['momentum']:g}; mergecomp: "
             + (f"{optimizer.communicator!r}" if args.compress else "FP32 allreduce (no compression)")
             + f", scheduler {args.scheduler}")
    timed_ddp = benchmarking.make_timer(ddp_step, device)
    timed_ddp(max(1, args.num_warmup_batches))
    search_steps = compress_benchmark.warm_up_and_settle(
        optimizer, benchmarking.make_timer(mergecomp_step, device), args, work)

    mine = benchmarking.interleaved_windows({"ddp": synchronised(ddp_step), "mergecomp": synchronised(mergecomp_step),
                                             DDP_AGAIN: synchronised(ddp_step)},
                                            args.rounds, args.window, before={"mergecomp": optimizer.restart_step_clock})
    everyone = optimizer.backend.allgather_object(mine)
    slowest = {name: [max(r[name][i] for r in everyone) for i in range(args.rounds)] for name in mine}
    ratios = [d / m for d, m in zip(slowest["ddp"], slowest["mergecomp"])]
    noise = statistics.median(a / d for d, a in zip(slowest["ddp"], slowest[DDP_AGAIN]))
    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "device": str(device),
        "compressor": args.compressor if args.compress else "none", "compress": args.compress,
        "compress_ratio": args.compress_ratio, "memory": args.memory if args.compress else "none",
        "comm": args.comm if args.compress else "allreduce", "scheduler": args.scheduler,
        "fusion_num": args.fusion_num, "search_steps": search_steps, "groups": len(optimizer.plan),
        "compressed_groups": sum(g.send == "compress" for g in optimizer.plan.groups),
        "plan": optimizer.plan.digest(), "rounds": args.rounds, "window": args.window,
        "ddp_step_s": slowest["ddp"], "mergecomp_step_s": slowest["mergecomp"], "ratios": ratios,
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ddp_again_step_s": slowest[DDP_AGAIN], "ddp_versus_ddp_again": noise,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for i, (d, m) in enumerate(zip(slowest["ddp"], slowest["mergecomp"])):
        work.log(f"Round {i}: DDP {d * 1e3:.1f} ms/step, mergecomp {m * 1e3:.1f} ms/step, ratio {d / m:.3f}")
    work.log(f"DDP / mergecomp step time: median {result['ratio_median']:.3f} over {args.rounds} rounds "
             f"(min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}); > 1: mergecomp faster")
    work.log(f"DDP / DDP again: median {noise:.3f} (the same configuration twice: this measure's noise)")
    return benchmarking.finish(result, args.json, work)


def table(paths) -> str:
    """Markdown rows of saved results, one per file."""
    lines = ["| model | compressor | scheduler | groups (compressed) | search steps | DDP ms/step | "
             "mergecomp ms/step | DDP / mergecomp (median, min–max) | DDP / DDP again |",
             "|---|---|---|---|---:|---:|---:|---|---:|"]
    for r in benchmarking.saved_results(paths, "ratios", "benchmarks/versus_ddp.py"):
        lines.append(f"| {r['model']} | {r['compressor']} | {r['scheduler']} | {r['groups']} "
                     f"({r['compressed_groups']}) | {r['search_steps']} | "
                     f"{statistics.median(r['ddp_step_s']) * 1e3:.0f} | "
                     f"{statistics.median(r['mergecomp_step_s']) * 1e3:.0f} | "
                     f"{r['ratio_median']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                     + (f"{r['ddp_versus_ddp_again']:.3f} |" if "ddp_versus_ddp_again" in r else "– |"))
    return "\n".join(lines)


def main(argv=None):
    return compress_benchmark.run_or_table(parse_args(argv), worker, table)


if __name__ == "__main__":
    benchmarking.exit_with(main)
