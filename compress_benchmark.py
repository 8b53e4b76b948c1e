#!/usr/bin/env python
r"""Synthetic-data training throughput with compressed gradient exchange.

The flags are MergeComp's (and Horovod's synthetic benchmark's), e.g.

    torchrun --nproc_per_node 2 compress_benchmark.py --compress --compressor dgc \
        --comm allgather --memory dgc --fusion-num 2 --model vgg16
    python compress_benchmark.py --nproc 2 --compress --compressor topk --comm allgather \
        --memory residual --model resnet20

A timed iteration is --num-batches-per-iter training steps (a step: forward, backward,
exchange, optimizer step).  After each iteration it prints the throughput per worker; at the
end the mean ± 1.96σ, the total for all workers, and the bytes each worker handed to the
collective backend per training step (counted from the payloads, not estimated) with the
compression ratio against FP32.  --log-dir DIR writes one row per training step of what
compression did (bytes, density, compression and wait time, dropped steps, error-feedback
norm) to DIR/steps.csv, and with --tensorboard to TensorBoard event files.
"""
from __future__ import annotations

import mergecomp
from benchmarks import harness
from benchmarks.harness import models
from benchmarks.harness import (build_optimizer, check_arguments, check_names,
                                    warm_up_and_settle)


def build_parser():
    """The flags, with this script's description."""
    return harness.build_parser(__doc__)


def parse_args(argv=None):
    p = build_parser()
    p.add_argument("--op-profile", type=int, default=0, metavar="N",
                   help="after the timed iterations, profile N more steps and print the operators "
                        "a step spends its time in, on rank 0 (default 0: off)")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write a row per training step (rank 0) to DIR/steps.csv: bytes sent, "
                        "density, compression and wait time, dropped steps, error-feedback norm")
    p.add_argument("--tensorboard", action="store_true",
                   help="with --log-dir: TensorBoard event files too (needs: pip install tensorboard)")
    args = p.parse_args(argv)
    check_arguments(p, args)
    if args.tensorboard:
        if not args.log_dir:
            p.error("--tensorboard writes into --log-dir: add --log-dir DIR")
        try:
            mergecomp.steplog.tensorboard_writer()
        except ImportError as error:
            p.error(str(error))
    if args.op_profile < 0:
        p.error(f"--op-profile must be ≥ 0 (the steps to profile; 0 is off), got {args.op_profile}")
    return args


def worker(args):
    work = harness.prepare(args)
    optimizer = build_optimizer(args, work)
    backend = optimizer.backend
    log = mergecomp.StepLog(args.log_dir, tensorboard=args.tensorboard) if args.log_dir else None
    if log is not None:
        optimizer.add_step_log(log)

    timed = harness.make_timer(harness.training_step(work, work.model, optimizer), work.device)
    work.log(f"Model: {args.model} ({work.num_params / 1e6:.2f}M parameters), batch size "
             f"{work.batch_size} per worker")
    work.log(f"Workers: {work.size} ({work.info.launcher}), device: {work.device}, backend: "
             f"{type(backend).__name__}")
    work.log(f"Exchange: {optimizer.communicator!r}" if args.compress
             else "Exchange: FP32 allreduce (no compression)")
    search_steps = warm_up_and_settle(optimizer, timed, args, work)

    series = harness.run_iterations(
        timed, work, args, lambda: {"bytes_sent": backend.bytes_sent, "wire_bytes": backend.wire_bytes})
    if args.op_profile:  # every rank steps (the collectives need them), rank 0 reports
        work.progress.phase("operator profile", args.op_profile)
        work.log(harness.operator_profile(timed, args.op_profile, work.device))
    result = harness.report(work, series, backend.allgather_object,
                            harness.exchange_fields(args, optimizer, search_steps))
    if log is not None:
        log.close()
        work.log(f"Step log: {log.log_dir}")
    return harness.finish(result, args.json, work)


def main(argv=None):
    args = parse_args(argv)
    if args.list:
        print("models:        ", ", ".join(models.available()))
        print("compressors:   ", ", ".join(mergecomp.compressors.available()))
        print("memories:      ", ", ".join(mergecomp.memories.available()))
        print("communicators: ", ", ".join(mergecomp.communicators.available()))
        print("schedulers:    ", ", ".join(mergecomp.schedulers.available()))
        return 0
    check_names(args)
    harness.run_workers(worker, args)
    return 0


if __name__ == "__main__":
    harness.exit_with(main)
