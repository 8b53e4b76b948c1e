#!/usr/bin/env python
"""PyTorch DDP baselines, timed exactly like ``compress_benchmark.py``.

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

    python benchmarks/ddp_baseline.py --nproc 2 --model vgg16 --hook powersgd --powersgd-rank 4
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

if __package__ in (None, ""):  # run as a script: make ``mergecomp`` importable from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
import mergecomp.ddp  # noqa: E402
from mergecomp import benchmarking, models  # noqa: E402

HOOKS = ("fp32", "fp16", "powersgd", "mergecomp")
DEFAULT_BUCKET_CAP_MB = 25  # DistributedDataParallel's own default


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmarking.add_workload_arguments(p)
    p.add_argument("--hook", default="fp32", choices=HOOKS, help="DDP communication hook")
    p.add_argument("--powersgd-rank", type=int, default=1, help="PowerSGD matrix approximation rank")
    p.add_argument("--powersgd-start-iter", type=int, default=2,
                   help="steps of plain allreduce before PowerSGD starts (≥ 2; warm-up must cover them)")
    p.add_argument("--bucket-cap-mb", type=float, default=DEFAULT_BUCKET_CAP_MB,
                   help=f"DDP bucket size in MB (default {DEFAULT_BUCKET_CAP_MB}, DDP's own)")
    hook = p.add_argument_group("--hook mergecomp")
    hook.add_argument("--compressor", default=None, help="mergecomp compressor of the hook (required with it)")
    hook.add_argument("--memory", default=None, help="error feedback (default: the compressor's recommendation)")
    hook.add_argument("--comm", default=None, help="communicator (default: the compressor's recommendation)")
    hook.add_argument("--fusion-num", type=int, default=4,
                      help="DDP buckets from this mergecomp fusion-num (default 4)")
    args = p.parse_args(argv)
    benchmarking.check_workload_arguments(p, args)
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


class AllreduceCounter:
    """Counts the bytes of every tensor handed to ``torch.distributed.all_reduce``.

    The DDP hooks call ``dist.all_reduce`` through the module attribute, also from the
    callbacks of their futures (PowerSGD's Q step), so replacing the attribute sees them all.
    """

    def __init__(self):
        self.bytes_sent = 0
        self._original = dist.all_reduce

    def __enter__(self):
        def counting_all_reduce(tensor, *args, **kwargs):
            self.bytes_sent += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)
        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


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


def worker(args):
    work = benchmarking.prepare(args)
    device = work.device
    buckets = ({"bucket_cap_mb_list": mergecomp.ddp.bucket_caps(work.model, args.fusion_num)}
               if args.hook == "mergecomp" else {"bucket_cap_mb": args.bucket_cap_mb})
    model = DistributedDataParallel(work.model, device_ids=[device.index] if device.type == "cuda" else None,
                                    **buckets)
    exchange, buckets, state = register_hook(model, args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)

    timed = benchmarking.make_timer(benchmarking.training_step(work, model, optimizer), device)
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
        series = benchmarking.run_iterations(timed, work, args, counters)
        groups = (buckets.calls - calls_before) // (args.num_iters * args.num_batches_per_iter)

    def gather(obj):
        everyone = [None] * work.size
        dist.all_gather_object(everyone, obj)
        return everyone

    label = f"ddp-{args.hook}" + (f"-r{args.powersgd_rank}" if args.hook == "powersgd" else "") \
        + (f"-{args.compressor}" if args.hook == "mergecomp" else "")
    result = benchmarking.report(work, series, gather, {
        "compress": args.hook != "fp32", "compressor": label, "compress_ratio": None,
        "memory": "ddp", "comm": "ddp-allreduce", "fusion_num": None, "scheduler": "ddp-buckets",
        "groups": groups, "plan": None, "hook": args.hook,
        "powersgd_rank": args.powersgd_rank if args.hook == "powersgd" else None,
        "bucket_cap_mb": args.bucket_cap_mb if state is None else None,
        "hook_compressor": args.compressor if state is not None else None,
        "hook_fusion_num": args.fusion_num if state is not None else None})
    return benchmarking.finish(result, args.json, work)


def main(argv=None):
    args = parse_args(argv)
    models.get(args.model)  # fail fast on an unknown name, before any process starts
    benchmarking.run_workers(worker, args)
    return 0


if __name__ == "__main__":
    benchmarking.exit_with(main)
