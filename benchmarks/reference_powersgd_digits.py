#!/usr/bin/env python
"""The digits cell of ``convergence.py`` trained by plain DDP with PyTorch's own PowerSGD hooks.

A reference that shares no code with mergecomp's compressors: the same data, shards, model,
seeds, batch order and SGD (lr 0.05, momentum 0.9) as ``benchmarks/convergence.py`` on the
digits, but the gradients travel through ``torch.nn.parallel.DistributedDataParallel`` with
PyTorch's ``powerSGD_hook`` (``--hook layer``: one factorisation per layer) or the batched
algorithm written out below in plain torch (``--hook batched``: each DDP bucket as one square
matrix; PyTorch's own ``batched_powerSGD_hook`` fails an assertion in its orthogonalisation
in torch 2.13, so it is not called).  Where mergecomp's ``powersgd`` or ``batched_powersgd``
and this reference land apart, the implementation differs from the paper's; where they land
together, the accuracy is the algorithm's at that grouping.

    python -m benchmarks.reference_powersgd_digits --hook batched --rank 2 --seeds 0,1,2

Both compress from the first step, as mergecomp does (PyTorch's hook runs ``--start-iter``
steps of plain allreduce first; the default here is its minimum, 2).  ``--bucket-mb`` sets
DDP's bucket size: the whole model (38,282 parameters) fits one bucket of the default 25 MB,
so ``batched`` then factors every layer laid end to end in one matrix; a tiny bucket
(``--bucket-mb 0.00001``) gives each layer's tensors buckets of their own.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

if not __package__:  # the convergence benchmark is a sibling module: import it through the package
    sys.exit("benchmarks/reference_powersgd_digits.py imports the convergence benchmark's task: run it as a module from "
             "the repository root: .venv/bin/python -m benchmarks.reference_powersgd_digits ...")
from benchmarks import convergence  # noqa: E402  the task's data, model, shards and accuracy
from mergecomp import launch  # noqa: E402
from benchmarks.harness import save_with_provenance  # noqa: E402


class BatchedPowerSGD:
    """Vogels et al. (2019), Algorithm 1, on each DDP bucket viewed as one ⌈√n⌉ × ⌈√n⌉
    matrix (zero padded), as PyTorch's ``batched_powerSGD_hook`` does: Q (warm started,
    orthonormalised), P = M·Q, allreduce P, orthonormalise, Q = Mᵀ·P, allreduce Q, divide by
    the workers, the average is P·Qᵀ; each rank keeps M − P·Qᵀ as its error feedback."""

    def __init__(self, rank: int, seed: int):
        self.rank, self.seed = rank, seed
        self.queries, self.errors = {}, {}

    def __call__(self, bucket):
        buffer, index = bucket.buffer(), bucket.index()
        n, world = buffer.numel(), dist.get_world_size()
        side = math.ceil(math.sqrt(n))
        matrix = torch.zeros(side * side, dtype=buffer.dtype)
        matrix[:n] = buffer
        if index in self.errors:
            matrix += self.errors[index]
        matrix = matrix.view(side, side)
        query = self.queries.get(index)
        if query is None:
            generator = torch.Generator().manual_seed(self.seed * 1009 + index)
            query = torch.randn(side, self.rank, generator=generator, dtype=buffer.dtype)
        p = matrix @ torch.linalg.qr(query).Q
        dist.all_reduce(p)
        p = torch.linalg.qr(p).Q
        q = matrix.t() @ p
        dist.all_reduce(q)
        q /= world
        average = p @ q.t()
        self.errors[index] = (matrix - average).reshape(-1)
        self.queries[index] = q
        buffer.copy_(average.reshape(-1)[:n])
        future = torch.futures.Future()
        future.set_result(buffer)
        return future


def batched_powersgd_hook(state: BatchedPowerSGD, bucket):
    """DDP's comm hook: ``state`` factors, exchanges and decodes the bucket."""
    return state(bucket)


def train(options: dict) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    info = launch.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    rank, world = info.rank, info.world_size
    x_train, y_train, x_test, y_test = convergence.load_digits_split()
    x_shard, y_shard = convergence.shard(x_train, y_train, rank, world)
    results = []
    for seed in options["seeds"]:
        torch.manual_seed(seed)
        model = convergence.DigitsCNN()
        ddp = DDP(model, bucket_cap_mb=options["bucket_mb"])
        if options["hook"] == "batched":
            ddp.register_comm_hook(BatchedPowerSGD(options["rank"], seed), batched_powersgd_hook)
        elif options["hook"] == "layer":
            state = powersgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=options["rank"],
                start_powerSGD_iter=options["start_iter"], use_error_feedback=True,
                warm_start=True, random_seed=seed)
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=options["lr"], momentum=options["momentum"])
        loss_fn = nn.CrossEntropyLoss()
        steps_per_epoch = len(x_shard) // options["batch_size"]
        curve = []
        for epoch in range(options["epochs"]):
            order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(
                seed * 1_000_003 + epoch * 1009 + rank))
            for step in range(steps_per_epoch):
                batch = order[step * options["batch_size"]:(step + 1) * options["batch_size"]]
                optimizer.zero_grad()
                loss_fn(ddp(x_shard[batch]), y_shard[batch]).backward()
                optimizer.step()
            curve.append(convergence.accuracy(model, x_test, y_test))
        results.append(dict(seed=seed, test_accuracy=curve[-1], curve=curve))
        dist.barrier()
    launch.shutdown()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", choices=("batched", "layer", "none"), default="batched",
                   help="batched PowerSGD (plain torch, below), PyTorch's powerSGD_hook (per "
                        "layer), or none (DDP's allreduce)")
    p.add_argument("--rank", type=int, default=2, help="approximation rank (default 2)")
    p.add_argument("--start-iter", type=int, default=2,
                   help="--hook layer: steps of plain allreduce before compressing (PyTorch "
                        "needs ≥ 2 with error feedback or warm start; default 2)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket size (default 25)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=convergence.DENSE_LR["digits"])
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", default=None, help="a JSON file for the runs")
    args = p.parse_args(argv)
    if args.rank < 1 or args.start_iter < 2 or args.workers < 1 or args.epochs < 1:
        p.error(f"--rank ≥ 1, --start-iter ≥ 2, --workers ≥ 1 and --epochs ≥ 1, got {args.rank}, "
                f"{args.start_iter}, {args.workers}, {args.epochs}")
    options = dict(hook=args.hook, rank=args.rank, start_iter=args.start_iter,
                   bucket_mb=args.bucket_mb, seeds=[int(s) for s in args.seeds.split(",")],
                   epochs=args.epochs, lr=args.lr, momentum=args.momentum, batch_size=args.batch_size)
    runs = launch.spawn(train, args.workers, args=(options,))[0]
    accs = [r["test_accuracy"] for r in runs]
    spread = f" ± {100 * statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
    print(f"DDP + {args.hook} PowerSGD hook, rank {args.rank}, start {args.start_iter}, bucket "
          f"{args.bucket_mb:g} MB, {args.workers} workers: test accuracy "
          f"{100 * statistics.fmean(accs):.1f}{spread} % (seeds: "
          f"{', '.join(f'{100 * a:.1f}' for a in accs)})")
    if args.out:
        save_with_provenance(args.out, {"options": options, "workers": args.workers, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
