"""The headline's DDP modes: ``pair`` (mergecomp against one DDP hook, interleaved) and
``ddp`` (one DDP hook alone, timed as ``compress_benchmark.py``)."""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

import mergecomp
import mergecomp.ddp
from benchmarks import harness
from . import models
from benchmarks.harness import AllreduceCounter

from .contenders import DDP_BUCKET_CAP_MB


# -------------------------------------------------------------------------------- pair --

PAIR_DOC = """mergecomp against PyTorch DDP in the same processes, timed in interleaved windows.

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

    python benchmarks/headline.py pair --nproc 2 --threads 1 --model lstm --batch-size 8 \\
        --compress --compressor efsignsgd --scheduler auto --rounds 8 --window 3
    python benchmarks/headline.py pair --nproc 2 --model lstm --compress --compressor dgc \\
        --mergecomp-as ddp-hook --fusion-num 4 --ddp-hook fp16
    python benchmarks/cluster.py --workers 2 --profile 1gbit -- \\
        python benchmarks/headline.py pair --model vgg16 --compress --compressor dgc --scheduler auto
    python benchmarks/headline.py pair --table results/*.json      # a markdown table of saved runs
"""

DDP_AGAIN = "ddp again"  # the label of DDP's second window in every round: the noise control
PAIR_DDP_HOOKS = ("fp16", "bf16", "fp32", "powersgd")

def parse_pair(argv):
    p = harness.build_parser(PAIR_DOC)
    p.prog = "headline.py pair"
    harness.add_rounds_arguments(p, 8, "one DDP and one mergecomp window")
    p.add_argument("--bucket-cap-mb", type=float, default=DDP_BUCKET_CAP_MB,
                   help=f"DDP's bucket size in MB (default {DDP_BUCKET_CAP_MB}, DDP's own)")
    p.add_argument("--ddp-hook", choices=PAIR_DDP_HOOKS, default="fp16",
                   help="DDP's own communication hook, the baseline (default fp16: the 16-bit "
                        "allreduce a tuned user runs; bf16 needs NCCL; fp32 is no hook)")
    p.add_argument("--powersgd-rank", type=int, default=1, help="rank of DDP's PowerSGD hook (default 1)")
    p.add_argument("--mergecomp-as", choices=("optimizer", "ddp-hook"), default="optimizer",
                   help="mergecomp's DistributedOptimizer, or DDP with mergecomp's communication hook "
                        "(buckets from --fusion-num; an adaptive --scheduler needs the optimizer)")
    args = harness.parse_rounds_arguments(p, argv)
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


def ddp_with_own_hook(args, model, device):
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
        optimizer = harness.build_optimizer(args, work)
        text = (f"{optimizer.communicator!r}" if args.compress else "FP32 allreduce (no compression)") \
            + f", scheduler {args.scheduler}"
        return work.model, optimizer, text, optimizer, optimizer.memory, lambda: optimizer.backend.bytes_sent
    compressor = harness.build_compressor(args)
    if not args.compress:
        memory = mergecomp.memories.create("none")
    else:
        memory = mergecomp.memories.create(args.memory) if args.memory else mergecomp.memories.recommended(compressor)
    model = DistributedDataParallel(work.model, device_ids=[work.device.index] if work.device.type == "cuda" else None,
                                    bucket_cap_mb_list=mergecomp.ddp.bucket_caps(work.model, args.fusion_num))
    state = mergecomp.ddp.register(model, compressor=compressor, memory=memory,
                                   communicator=(args.comm or compressor.recommended_communicator)
                                   if args.compress else "allreduce")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # as compress_benchmark's (no momentum)
    text = f"DDP with mergecomp's hook: {state.communicator!r}, {args.fusion_num} buckets"
    return model, optimizer, text, None, memory, lambda: state.backend.bytes_sent


def pair_worker(args):
    work = harness.prepare(args)
    device = work.device
    twin = copy.deepcopy(work.model)  # same initial weights, trained by DDP
    model, optimizer, mergecomp_text, facade, memory, mergecomp_bytes = mergecomp_side(args, work)
    ddp, ddp_text = ddp_with_own_hook(args, twin, device)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum_of(memory))

    ddp_step = harness.training_step(work, ddp, ddp_optimizer)
    mergecomp_step = harness.training_step(work, model, optimizer)

    def synchronised(step):
        def run():
            step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        return run

    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker, {work.size} workers, device {device}")
    work.log(f"Baseline: {ddp_text}, SGD momentum {ddp_optimizer.defaults['momentum']:g}; mergecomp: {mergecomp_text}")
    timed_ddp = harness.make_timer(ddp_step, device)
    timed_ddp(max(3, args.num_warmup_batches))
    if facade is not None:
        search_steps = harness.warm_up_and_settle(
            facade, harness.make_timer(mergecomp_step, device), args, work)
    else:
        harness.make_timer(mergecomp_step, device)(max(3, args.num_warmup_batches))
        search_steps = 0

    bytes_before = mergecomp_bytes()
    before = {"mergecomp": facade.restart_step_clock} if facade is not None else None
    mine = harness.interleaved_windows({"ddp": synchronised(ddp_step), "mergecomp": synchronised(mergecomp_step),
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
    return harness.finish(result, args.json, work)


def pair_table(paths) -> str:
    """Markdown rows of saved results, one per file."""
    lines = ["| model | compressor | mergecomp as | scheduler | groups (compressed) | search steps | "
             "DDP baseline | DDP ms/step | mergecomp ms/step | DDP / mergecomp (median, min–max) | DDP / DDP again |",
             "|---|---|---|---|---|---:|---|---:|---:|---|---:|"]
    for r in harness.saved_results(paths, "ratios", "benchmarks/headline.py pair"):
        # results written before the baseline could be chosen ran DDP without a hook (FP32)
        lines.append(f"| {r['model']} | {r['compressor']} | {r.get('mergecomp_as', 'optimizer')} | "
                     f"{r['scheduler']} | {r['groups']} "
                     f"({r['compressed_groups']}) | {r['search_steps']} | {r.get('ddp_hook', 'fp32')} | "
                     f"{statistics.median(r['ddp_step_s']) * 1e3:.0f} | "
                     f"{statistics.median(r['mergecomp_step_s']) * 1e3:.0f} | "
                     f"{r['ratio_median']:.3f} ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | "
                     + (f"{r['ddp_versus_ddp_again']:.3f} |" if "ddp_versus_ddp_again" in r else "– |"))
    return "\n".join(lines)


def pair_main(argv) -> int:
    return harness.run_or_table(parse_pair(argv), pair_worker, pair_table)


# --------------------------------------------------------------------------------- ddp --

DDP_DOC = """PyTorch DDP baselines, timed exactly like ``compress_benchmark.py``.

Compressed training is only worth its complexity if it beats what PyTorch already ships, so
this script measures DistributedDataParallel with the same models, synthetic batches, batch
sizes, timing loop (warm-up, then ``--num-iters`` iterations of ``--num-batches-per-iter``
steps) and ``--json`` schema as ``compress_benchmark.py``; a sweep can put both side by side.

Hooks (``--hook``):

- ``fp32``: ``default_hooks.allreduce_hook``, plain FP32 allreduce (DDP's default behaviour,
  routed through a Python hook so that its bytes can be counted).
- ``fp16``: ``default_hooks.fp16_compress_hook``, 16-bit allreduce.  The ``bf16`` hook refuses
  every backend but NCCL, so on gloo/CPU the 16-bit baseline is fp16.
- ``mergecomp``: mergecomp's own hook (``mergecomp.ddp``) with ``--compressor`` (and
  ``--memory``/``--comm``, else the compressor's recommendation), DDP's buckets set from
  ``--fusion-num`` by ``mergecomp.ddp.bucket_caps``; bytes from the hook state's backend
  counters (preflight and outcome included): DDP with mergecomp's compression, timed as
  DDP's own hooks are.
- ``powersgd``: ``powerSGD_hook.powerSGD_hook`` at ``--powersgd-rank`` (1, 4, ...), with error
  feedback and warm start.  PyTorch needs ``start_powerSGD_iter`` ≥ 2 for those, and the
  first ``start_powerSGD_iter`` steps are plain allreduce, so the warm-up must cover them:
  every timed step then runs PowerSGD.

DDP uses its default bucket size, 25 MB (``--bucket-cap-mb``).  ``bytes_per_step`` is counted,
not estimated: every tensor a hook hands to ``torch.distributed.all_reduce`` is added up
(for PowerSGD that is the rank-1 tensors allreduced uncompressed, then P, then Q).

Launch as ``compress_benchmark.py`` is launched: torchrun, ``--nproc N``, or the env://
variables RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT (what ``benchmarks/cluster.py`` sets).

    python benchmarks/headline.py ddp --nproc 2 --model vgg16 --hook powersgd --powersgd-rank 4
"""

DDP_HOOKS = ("fp32", "fp16", "powersgd", "mergecomp")


def parse_ddp(argv):
    p = argparse.ArgumentParser(prog="headline.py ddp", description=DDP_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_workload_arguments(p)
    p.add_argument("--hook", default="fp32", choices=DDP_HOOKS, help="DDP communication hook")
    p.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD matrix approximation rank")
    p.add_argument("--powersgd-start-iter", type=int, default=2,
                   help="steps of plain allreduce before PowerSGD starts (≥ 2; warm-up must cover them)")
    p.add_argument("--bucket-cap-mb", type=float, default=DDP_BUCKET_CAP_MB,
                   help=f"DDP bucket size in MB (default {DDP_BUCKET_CAP_MB}, DDP's own)")
    hook = p.add_argument_group("--hook mergecomp")
    hook.add_argument("--compressor", default=None, help="mergecomp compressor of the hook (required with it)")
    hook.add_argument("--memory", default=None, help="error feedback (default: the compressor's recommendation)")
    hook.add_argument("--comm", default=None, help="communicator (default: the compressor's recommendation)")
    hook.add_argument("--fusion-num", type=int, default=4,
                      help="DDP buckets from this mergecomp fusion-num (default 4)")
    args = p.parse_args(argv)
    harness.check_workload_arguments(p, args)
    if args.hook == "mergecomp":
        if not args.compressor:
            p.error("--hook mergecomp needs --compressor (e.g. dgc, topk, fp16)")
        if args.fusion_num < 1:
            p.error(f"--fusion-num must be ≥ 1 (DDP buckets), got {args.fusion_num}")
    elif any(v is not None for v in (args.compressor, args.memory, args.comm)):
        p.error(f"--compressor/--memory/--comm configure --hook mergecomp, not --hook {args.hook}")
    if args.bucket_cap_mb <= 0:
        p.error(f"--bucket-cap-mb must be > 0, got {args.bucket_cap_mb}")
    if args.hook == "powersgd":
        if args.powersgd_rank < 1:
            p.error(f"--powersgd-rank must be ≥ 1, got {args.powersgd_rank}")
        if args.powersgd_start_iter < 2:
            p.error(f"--powersgd-start-iter must be ≥ 2 (PyTorch requires it with error feedback "
                    f"and warm start), got {args.powersgd_start_iter}")
        if args.num_warmup_batches < args.powersgd_start_iter:
            p.error(f"--num-warmup-batches {args.num_warmup_batches} is less than "
                    f"--powersgd-start-iter {args.powersgd_start_iter}: the first timed steps "
                    f"would be plain allreduce; raise the warm-up to ≥ {args.powersgd_start_iter}")
    return args


class BucketCounter:
    """Wraps a hook to count its calls: one call per DDP bucket, so calls per step = groups.

    ``hook`` is the function to register (a plain function: DDP inspects its name).
    """

    def __init__(self, inner):
        self.calls = 0

        @functools.wraps(inner)
        def hook(state, bucket):
            self.calls += 1
            return inner(state, bucket)
        self.hook = hook


def register_hook(model: DistributedDataParallel, args):
    """Register the chosen hook; returns (a one-line description for the log, BucketCounter,
    the mergecomp hook state or None)."""
    if args.hook == "mergecomp":
        state = mergecomp.ddp.HookState(model, compressor=args.compressor, memory=args.memory or "auto",
                                        communicator=args.comm or "auto")
        hook = BucketCounter(mergecomp.ddp.hook)
        model.register_comm_hook(state, hook.hook)
        return (f"DDP with mergecomp's hook: {state.communicator!r}, buckets of fusion-num "
                f"{args.fusion_num}"), hook, state
    if args.hook == "fp32":
        state, hook = None, BucketCounter(default_hooks.allreduce_hook)
        text = "DDP FP32 allreduce (allreduce_hook)"
    elif args.hook == "fp16":
        state, hook = None, BucketCounter(default_hooks.fp16_compress_hook)
        text = "DDP 16-bit allreduce (fp16_compress_hook; bf16_compress_hook needs NCCL)"
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start_iter, random_seed=args.seed)
        hook = BucketCounter(powerSGD_hook.powerSGD_hook)
        text = (f"DDP PowerSGD rank {args.powersgd_rank} (powerSGD_hook, error feedback, warm "
                f"start, from step {args.powersgd_start_iter})")
    model.register_comm_hook(state, hook.hook)
    return text, hook, None


def ddp_worker(args):
    work = harness.prepare(args)
    device = work.device
    buckets = ({"bucket_cap_mb_list": mergecomp.ddp.bucket_caps(work.model, args.fusion_num)}
               if args.hook == "mergecomp" else {"bucket_cap_mb": args.bucket_cap_mb})
    model = DistributedDataParallel(work.model, device_ids=[device.index] if device.type == "cuda" else None,
                                    **buckets)
    exchange, buckets, state = register_hook(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    timed = harness.make_timer(harness.training_step(work, model, optimizer), device)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker")
    work.log(f"Workers: {work.size} ({work.info.launcher}), device: {device}, backend: {dist.get_backend()}")
    work.log(f"Exchange: {exchange}" + ("" if state is not None else f", bucket size {args.bucket_cap_mb:g} MB"))

    ring = 2 * (work.size - 1) / work.size  # every DDP collective is an allreduce
    with AllreduceCounter() as counter:
        timed(max(3 if state is not None else 1, args.num_warmup_batches))  # the hook's raw steps
        calls_before = buckets.calls
        if state is not None:  # mergecomp's backend counts its own bytes, as in compress_benchmark
            def counters():
                return {"bytes_sent": state.backend.bytes_sent, "wire_bytes": state.backend.wire_bytes}
        else:
            def counters():
                return {"bytes_sent": counter.bytes_sent, "wire_bytes": counter.bytes_sent * ring}
        series = harness.run_iterations(timed, work, args, counters)
        groups = (buckets.calls - calls_before) // (args.num_iters * args.num_batches_per_iter)

    def gather(obj):
        everyone = [None] * work.size
        dist.all_gather_object(everyone, obj)
        return everyone

    label = f"ddp-{args.hook}" + (f"-r{args.powersgd_rank}" if args.hook == "powersgd" else "") \
        + (f"-{args.compressor}" if args.hook == "mergecomp" else "")
    result = harness.report(work, series, gather, {
        "compress": args.hook != "fp32", "compressor": label, "compress_ratio": None,
        "memory": "ddp", "comm": "ddp-allreduce", "fusion_num": None, "scheduler": "ddp-buckets",
        "groups": groups, "plan": None, "hook": args.hook,
        "powersgd_rank": args.powersgd_rank if args.hook == "powersgd" else None,
        "bucket_cap_mb": args.bucket_cap_mb if state is None else None,
        "hook_compressor": args.compressor if state is not None else None,
        "hook_fusion_num": args.fusion_num if state is not None else None})
    return harness.finish(result, args.json, work)


def ddp_main(argv) -> int:
    args = parse_ddp(argv)
    models.get(args.model)  # fail fast on an unknown name, before any process starts
    harness.run_workers(ddp_worker, args)
    return 0
