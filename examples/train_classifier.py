#!/usr/bin/env python
"""Train a classifier with compressed gradient exchange: the whole API in one script.

    torchrun --nproc_per_node 2 examples/train_classifier.py --compressor dgc --epochs 4
    python examples/train_classifier.py --nproc 2 --compressor topk --checkpoint --stop-after-epoch 2
    python examples/train_classifier.py --nproc 2 --compressor topk --checkpoint --resume

The data is a learnable synthetic task (Gaussian clusters, one per class), split across
ranks by a DistributedSampler, so the script runs anywhere; swap in your own Dataset.  It
shows: wrapping your optimizer, an LR scheduler on the wrapped optimizer, gradient
clipping on the averaged gradients (right after ``backward()``, as under DDP), telling DGC the
epoch (``set_epoch``), and per-rank checkpoints that resume exactly (residuals included;
``--checkpoint`` alone keeps them in runs/train_classifier, which git ignores).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
from mergecomp import launch  # noqa: E402

#: Where ``--checkpoint`` without a folder saves: under runs/, which git ignores.
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "runs", "train_classifier")


def synthetic_clusters(samples: int, features: int, classes: int, draw: int) -> TensorDataset:
    """Class c is a Gaussian around its own random centre: learnable, not trivial.

    The centres are fixed; ``draw`` seeds the samples (one draw for training, another for test).
    """
    centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1000 + draw)
    labels = torch.randint(0, classes, (samples,), generator=g)
    inputs = centres[labels] + torch.randn(samples, features, generator=g) * 2.5
    return TensorDataset(inputs, labels)


def build_optimizer(model, args):
    """The user's optimizer, wrapped.  DGC and SIGNUM keep the momentum themselves."""
    owns_momentum = args.compressor in ("dgc", "signum")
    base = torch.optim.SGD(model.parameters(), lr=args.lr, weight_decay=1e-4,
                           momentum=0.0 if owns_momentum else 0.9)
    kwargs = {"compress_ratio": args.compress_ratio} if args.compressor in ("topk", "randk", "dgc") else {}
    return mergecomp.DistributedOptimizer(
        base, model.named_parameters(),
        compressor=mergecomp.compressors.create(args.compressor, **kwargs),
        schedule=args.fusion_num)  # memory and communicator: the compressor's recommendation


def train(args):
    info = launch.init_distributed()
    torch.manual_seed(0)  # the same initial model on every rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
    data = synthetic_clusters(4096, 32, 10, draw=0)
    test = synthetic_clusters(1024, 32, 10, draw=1)
    sampler = DistributedSampler(data, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = build_optimizer(model, args)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    path = os.path.join(args.checkpoint, f"rank{info.rank}.pt") if args.checkpoint else None
    first_epoch = 0
    if args.resume:
        state = torch.load(path, weights_only=True)  # tensors and plain values only
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # residuals, plan, compressor state too
        schedule.load_state_dict(state["schedule"])
        first_epoch = state["epoch"] + 1

    for epoch in range(first_epoch, args.epochs):
        sampler.set_epoch(epoch)
        optimizer.set_epoch(epoch)  # DGC's density warm-up follows the epoch
        model.train()
        for inputs, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(inputs), labels).backward()  # p.grad: the average
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=5.0)
            optimizer.step()
        schedule.step()
        accuracy = evaluate(model, test)
        if info.rank == 0:
            print(f"epoch {epoch}: test accuracy {accuracy:.3f}, lr {schedule.get_last_lr()[0]:.4f}", flush=True)
        if path:
            os.makedirs(args.checkpoint, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "schedule": schedule.state_dict(), "epoch": epoch}, path)
        if epoch == args.stop_after_epoch:
            break  # as if interrupted: --resume continues from this checkpoint
    accuracy = evaluate(model, test)
    launch.shutdown()
    return accuracy


@torch.no_grad()
def evaluate(model, dataset) -> float:
    model.eval()
    inputs, labels = dataset.tensors
    return (model(inputs).argmax(1) == labels).float().mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressor", default="topk", help=f"one of {', '.join(mergecomp.compressors.available())}")
    p.add_argument("--compress-ratio", type=float, default=0.01,
                   help="fraction of the elements a sparsifier sends (default 0.01)")
    p.add_argument("--fusion-num", type=int, default=2,
                   help="groups the gradients are fused into; 0: one per tensor (default 2)")
    p.add_argument("--epochs", type=int, default=4, help="passes over the data (default 4)")
    p.add_argument("--batch-size", type=int, default=64, help="per worker")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--checkpoint", nargs="?", const=DEFAULT_CHECKPOINT, default=None, metavar="DIR",
                   help="folder for per-rank checkpoints (alone: runs/train_classifier in the "
                        "repository, which git ignores)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--stop-after-epoch", type=int, default=None,
                   help="stop after this epoch, as if interrupted (then --resume)")
    p.add_argument("--nproc", type=int, default=None, help="spawn this many local workers")
    args = p.parse_args(argv)
    mergecomp.compressors.get(args.compressor)  # fail fast on a bad name
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint (and the folder of the interrupted run, if it gave one)")
    if args.nproc and launch.detect().launcher == "single":
        launch.spawn(train, args.nproc, args=(args,))
    else:
        train(args)


if __name__ == "__main__":
    main()
