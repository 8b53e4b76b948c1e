#!/usr/bin/env python
"""mergecomp against PyTorch DDP in the same processes, timed in interleaved windows.

On a shared machine the speed of a run drifts by ±15% within minutes, so throughputs
taken by separate runs cannot tell a 5% difference apart.  Here every worker holds two
copies of the model, with the same initial weights and batch:

- one wrapped in ``DistributedDataParallel`` with DDP's own hook ``--ddp-hook``: ``fp16``
  (the default: ``fp16_compress_hook``, the 16-bit allreduce a tuned user runs; ``bf16``
  where the backend is NCCL, which that hook requires), ``fp32`` (no hook: DDP's C++ FP32
  allreduce) or ``powersgd`` (``powerSGD_hook`` at ``--powersgd-rank``, one bucket: its
  later rounds are launched from future callbacks, which can reorder collectives across
  buckets on gloo); 25 MB buckets (``--bucket-cap-mb``), SGD (with the DGC memory's
  momentum when mergecomp runs one, so both sides apply momentum);
- one trained through mergecomp, configured by the flags of ``compress_benchmark.py``
  (``--compress --compressor dgc --scheduler auto`` and so on), ``--mergecomp-as``
  ``optimizer`` (its ``DistributedOptimizer`` around the same SGD) or ``ddp-hook``
  (``DistributedDataParallel`` with ``mergecomp.ddp``'s hook, buckets from
  ``mergecomp.ddp.bucket_caps`` of ``--fusion-num``): DDP with mergecomp's hook beside DDP
  with its own.

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
    python benchmarks/versus_ddp.py --nproc 2 --model lstm --compress --compressor dgc \\
        --mergecomp-as ddp-hook --fusion-num 4 --ddp-hook fp16
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
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # run as a script: make ``mergecomp`` importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compress_benchmark  # noqa: E402
import mergecomp.ddp  # noqa: E402
from mergecomp import benchmarking  # noqa: E402

DDP_BUCKET_CAP_MB = 25  # DistributedDataParallel's own default
DDP_AGAIN = "ddp again"  # the label of DDP's second window in every round: the noise control
DDP_HOOKS = ("fp16", "bf16", "fp32", "powersgd")


def parse_args(argv=None):
    p = compress_benchmark.build_parser(__doc__)
    compress_benchmark.add_rounds_arguments(p, 8, "one DDP and one mergecomp window")
    p.add_argument("--bucket-cap-mb", type=float, default=DDP_BUCKET_CAP_MB,
                   help=f"DDP's bucket size in MB (default {DDP_BUCKET_CAP_MB}, DDP's own)")
    p.add_argument("--ddp-hook", choices=DDP_HOOKS, default="fp16",
                   help="DDP's own communication hook, the baseline (default fp16: the 16-bit "
                        "allreduce a tuned user runs; bf16 needs NCCL; fp32 is no hook)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="rank of DDP's PowerSGD hook (default 1)")
    p.add_argument("--mergecomp-as", choices=("optimizer", "ddp-hook"), default="optimizer",
                   help="mergecomp's DistributedOptimizer, or DDP with mergecomp's communication hook "
                        "(buckets from --fusion-num; an adaptive --scheduler needs the optimizer)")
    args = compress_benchmark.parse_rounds_arguments(p, argv)
    if args.table:
        return args
    if args.bucket_cap_mb <= 0:
        p.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    if args.powersgd_rank < 1:
        p.error(f"--powersgd-rank must be ≥ 1, got {args.powersgd_rank}")
    if args.mergecomp_as == "ddp-hook" and args.scheduler != "fixed":
        p.error(f"--mergecomp-as ddp-hook takes its buckets from --fusion-num; --scheduler {args.scheduler} "
                "re-plans while training, which DDP's fixed buckets cannot follow: use --mergecomp-as optimizer")
    return args


def momentum_of(memory) -> float:
    """The momentum mergecomp applies outside the wrapped SGD (the DGC memory's), which
    DDP's SGD then applies too, so both sides do the same work per step."""
    return float(getattr(memory, "momentum", 0.0)) if getattr(memory, "needs_plain_optimizer", False) else 0.0


def ddp_baseline(args, model, device):
    """DDP around ``model`` with its own hook ``args.ddp_hook``; returns (DDP, description)."""
    device_ids = [device.index] if device.type == "cuda" else None
    if args.ddp_hook == "powersgd":
        ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=10 ** 6)
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2, random_seed=args.seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return ddp, f"DDP PowerSGD hook rank {args.powersgd_rank} (one bucket)"
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=args.bucket_cap_mb)
    if args.ddp_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.ddp_hook == "bf16":
        if dist.get_backend() != "nccl":
            raise ValueError(f"--ddp-hook bf16: DDP's bf16_compress_hook needs NCCL, this run uses "
                             f"{dist.get_backend()}; use --ddp-hook fp16")
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    what = "FP32 allreduce (no hook)" if args.ddp_hook == "fp32" else f"{args.ddp_hook} hook"
    return ddp, f"DDP {what}, {args.bucket_cap_mb:g} MB buckets"


def mergecomp_side(args, work):
    """mergecomp's configuration from the flags: (model to call, optimizer, description,
    the optimizer facade or None for the hook, the memory, bytes counter)."""
    if args.mergecomp_as == "optimizer":
        optimizer = compress_benchmark.build_optimizer(args, work)
        text = (f"{optimizer.communicator!r}" if args.compress else "FP32 allreduce (no compression)") \
            + f", scheduler {args.scheduler}"
        return work.model, optimizer, text, optimizer, optimizer.memory, lambda: optimizer.backend.bytes_sent
    compressor = compress_benchmark.build_compressor(args)
    memory = mergecomp.memories.create(args.memory or compressor.recommended_memory) if args.compress \
        else mergecomp.memories.create("none")
    model = DistributedDataParallel(work.model, device_ids=[work.device.index] if work.device.type == "cuda" else None,
                                    bucket_cap_mb_list=mergecomp.ddp.bucket_caps(work.model, args.fusion_num))
    state = mergecomp.ddp.register(model, compressor=compressor, memory=memory,
                                   communicator=(args.comm or compressor.recommended_communicator)
                                   if args.compress else "allreduce")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # as compress_benchmark's (no momentum)
    text = f"DDP with mergecomp's hook: {state.communicator!r}, {args.fusion_num} buckets"
    return model, optimizer, text, None, memory, lambda: state.backend.bytes_sent


def worker(args):
    work = benchmarking.prepare(args)
    device = work.device
    twin = copy.deepcopy(work.model)  # same initial weights, trained by DDP
    model, optimizer, mergecomp_text, facade, memory, mergecomp_bytes = mergecomp_side(args, work)
    ddp, ddp_text = ddp_baseline(args, twin, device)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum_of(memory))

    ddp_step = benchmarking.training_step(work, ddp, ddp_optimizer)
    mergecomp_step = benchmarking.training_step(work, model, optimizer)

    def synchronised(step):
        def run():
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers, device {device}")
    work.log(f"Baseline: {ddp_text}, SGD momentum {ddp_optimizer.defaults['momentum']:g}; mergecomp: {mergecomp_text}")
    timed_ddp = benchmarking.make_timer(ddp_step, device)
    timed_ddp(max(3, args.num_warmup_batches))
    if facade is not None:
        search_steps = compress_benchmark.warm_up_and_settle(
            facade, benchmarking.make_timer(mergecomp_step, device), args, work)
    else:
        benchmarking.make_timer(mergecomp_step, device)(max(3, args.num_warmup_batches))
        search_steps = 0

    bytes_before = mergecomp_bytes()
    before = {"mergecomp": facade.restart_step_clock} if facade is not None else None
    mine = benchmarking.interleaved_windows({"ddp": synchronised(ddp_step), "mergecomp": synchronised(mergecomp_step),
                                             DDP_AGAIN: synchronised(ddp_step)},
                                            args.rounds, args.window, before=before)
    bytes_per_step = (mergecomp_bytes() - bytes_before) / (args.rounds * (args.window + 1))
    everyone = [None] * work.size
    dist.all_gather_object(everyone, mine)
    slowest = {name: [max(r[name][i] for r in everyone) for i in range(args.rounds)] for name in mine}
    ratios = [d / m for d, m in zip(slowest["ddp"], slowest["mergecomp"])]
    noise = statistics.median(a / d for d, a in zip(slowest["ddp"], slowest[DDP_AGAIN]))
    plan = facade.plan if facade is not None else None
    result = {
        "model": args.model, "batch_size": work.batch_size, "workers": work.size, "device": str(device),
        "compressor": args.compressor if args.compress else "none", "compress": args.compress,
        "compress_ratio": args.compress_ratio, "memory": args.memory if args.compress else "none",
        "comm": args.comm if args.compress else "allreduce", "scheduler": args.scheduler,
        "fusion_num": args.fusion_num, "search_steps": search_steps,
        "groups": len(plan) if plan is not None else args.fusion_num,
        "compressed_groups": sum(g.send == "compress" for g in plan.groups) if plan is not None
        else (args.fusion_num if args.compress else 0),
        "plan": plan.digest() if plan is not None else None, "rounds": args.rounds, "window": args.window,
        "ddp_hook": args.ddp_hook, "mergecomp_as": args.mergecomp_as, "mergecomp_bytes_per_step": bytes_per_step,
        "ddp_step_s": slowest["ddp"], "mergecomp_step_s": slowest["mergecomp"], "ratios": ratios,
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "ddp_again_step_s": slowest[DDP_AGAIN], "ddp_versus_ddp_again": noise,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for i, (d, m) in enumerate(zip(slowest["ddp"], slowest["mergecomp"])):
        work.log(f"Round {i}: DDP ({args.ddp_hook}) {d * 1e3:.1f} ms/step, mergecomp {m * 1e3:.1f} ms/step, "
                 f"ratio {d / m:.3f}")
    work.log(f"DDP ({args.ddp_hook}) / mergecomp step time: median {result['ratio_median']:.3f} over {args.rounds} "
             f"rounds (min {result['ratio_min']:.3f}, max {result['ratio_max']:.3f}); > 1: mergecomp faster")
    work.log(f"DDP / DDP again: median {noise:.3f} (the same configuration twice: this measure's noise)")
    return benchmarking.finish(result, args.json, work)


def table(paths) -> str:
    """Markdown rows of saved results, one per file."""
    lines = ["| model | compressor | mergecomp as | scheduler | groups (compressed) | search steps | "
             "DDP baseline | DDP ms/step | mergecomp ms/step | DDP / mergecomp (median, min–max) | DDP / DDP again |",
             "|---|---|---|---|---|---:|---|---:|---:|---|---:|"]
    for r in benchmarking.saved_results(paths, "ratios", "benchmarks/versus_ddp.py"):
        # results written before the baseline could be chosen ran DDP without a hook (FP32)
        lines.append(f"| {r['model']} | {r['compressor']} | {r.get('mergecomp_as', 'optimizer')} | "
                     f"{r['scheduler']} | {r['groups']} "
                     f"({r['compressed_groups']}) | {r['search_steps']} | {r.get('ddp_hook', 'fp32')} | "
                     f"{statistics.median(r['ddp_step_s']) * 1e3:.0f} | "
                     f"{statistics.median(r['mergecomp_step_s']) * 1e3:.0f} | "
                     f"{r['ratio_median']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                     + (f"{r['ddp_versus_ddp_again']:.3f} |" if "ddp_versus_ddp_again" in r else "– |"))
    return "\n".join(lines)


def main(argv=None):
    return compress_benchmark.run_or_table(parse_args(argv), worker, table)


if __name__ == "__main__":
    benchmarking.exit_with(main)
