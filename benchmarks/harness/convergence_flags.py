"""``benchmarks/convergence.py``'s flags for how the user trains: the optimizer and its
settings, the schedule, the epochs' rhythm, the language model's size, the quality
controller.  Kept here so that the benchmark's own module stays about its table.

:func:`add_arguments` adds them to a parser; :func:`resolve` fills in the defaults that
depend on the task and optimizer (the swept learning rates and AdamW's settings) and turns
every bad value into a parser error that names it.
"""
from __future__ import annotations

import argparse

from . import drift, lm, optimizers, pacing


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--optimizer", choices=optimizers.OPTIMIZERS, default="sgd",
                   help="the user's optimizer, dense's and every row's (default sgd, momentum "
                        "--momentum; adamw: --betas, --weight-decay, each task's swept defaults)")
    p.add_argument("--weight-decay", type=float, default=None,
                   help="the optimizer's weight decay (default: SGD 0, AdamW the task's swept value)")
    p.add_argument("--betas", default=None,
                   help="AdamW's betas as B1,B2 (default: the task's swept values)")
    p.add_argument("--lr-schedule", choices=pacing.LR_SCHEDULES, default="constant",
                   help="constant, or cosine over the run's steps (to 0 at the end)")
    p.add_argument("--set-epoch-every", type=int, default=0, metavar="N",
                   help="call set_epoch(step // N) every N steps (DGC's warm-up follows it); "
                        "default: at every pass over the data")
    p.add_argument("--embedding", type=int, default=0,
                   help="language models: the LSTM's embedding width (default: the task's)")
    p.add_argument("--hidden", type=int, default=0,
                   help="language models: the hidden width (LSTM) or model width (GPT) (default: the task's)")
    p.add_argument("--layers", type=int, default=0,
                   help="language models: layers (default: the task's)")
    p.add_argument("--controller", choices=drift.CHOICES, default=None,
                   help="the quality controller of DistributedOptimizer and DiLoCo, on or off; "
                        "horizon: on and told the run's --steps, so it may spend its budget early; "
                        "warm: every group starts at the largest scale; warm-horizon: both "
                        "(default: left out, the library's default)")


def resolve(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """Defaults that depend on the task and optimizer, and every value checked."""
    if args.lr is None:
        args.lr = optimizers.dense_lr(args.optimizer, args.task)
        if args.lr is None:
            p.error(f"--task {args.task} has no swept dense learning rate under --optimizer "
                    f"{args.optimizer} yet: sweep dense (--compressors none --lr ...) and pass "
                    f"the best as --lr")
    adamw = optimizers.adamw_settings(args.task)
    if args.betas is None:
        args.betas = tuple(adamw["betas"])
    else:
        if args.optimizer != "adamw":
            p.error(f"--betas {args.betas} is AdamW's; with --optimizer sgd use --momentum")
        try:
            args.betas = optimizers.parse_betas(args.betas)
        except ValueError as error:
            p.error(str(error))
    if args.weight_decay is None:
        args.weight_decay = adamw["weight_decay"] if args.optimizer == "adamw" else 0.0
    if not args.weight_decay >= 0:
        p.error(f"--weight-decay must be ≥ 0, got {args.weight_decay}")
    if args.set_epoch_every < 0:
        p.error(f"--set-epoch-every must be ≥ 1 (or 0: every pass over the data), got {args.set_epoch_every}")
    if args.task in lm.TASKS:
        try:
            lm.sized(lm.get_task(args.task), args.embedding, args.hidden, args.layers)
        except ValueError as error:
            p.error(str(error))
    elif args.embedding or args.hidden or args.layers:
        p.error(f"--embedding, --hidden and --layers size a language model; --task {args.task} "
                f"trains a fixed CNN")
    if args.controller in ("horizon", "warm-horizon") and args.task not in lm.TASKS:
        p.error(f"--controller {args.controller} tells the controller the run's steps; --task {args.task} "
                f"trains in epochs: use --controller on or warm")
    try:
        drift.check(args.controller)
        if args.diloco:
            import mergecomp
            drift.check(args.controller, mergecomp.DiLoCo)
    except ValueError as error:
        p.error(str(error))
