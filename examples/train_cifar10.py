#!/usr/bin/env python
"""Train a ResNet on CIFAR-10 with Deep Gradient Compression, following its recipe.

    python examples/train_cifar10.py --data-dir data/cifar10 --nproc 2
    torchrun --nproc_per_node 4 examples/train_cifar10.py --data-dir data/cifar10
    python examples/train_cifar10.py --data-dir data/cifar10 --nproc 2 --checkpoint

``--data-dir`` holds the CIFAR-10 python version (``cifar-10-batches-py/`` or its files;
docs/examples.md says where to get it: nothing here downloads).  Every worker trains on its
own shard of each epoch (a DistributedSampler), with random crops of the 4-pixel-padded
image and horizontal flips, normalised per channel by the training set's statistics.

The recipe of Lin et al., "Deep Gradient Compression", ICLR 2018 (and of the authors'
CIFAR-10 configuration): the ``dgc`` compressor at 0.1% density with the ``dgc`` memory
(momentum correction with momentum 0.9 and momentum factor masking, so the optimizer is
plain SGD); the density warm-up 25% → 6.25% → 1.56% → 0.39% → 0.1% over the first 4 epochs
(``optimizer.set_epoch``); a learning-rate warm-up from ``--lr`` to ``--lr`` × workers over
the first 5 epochs (the linear scaling rule of Goyal et al., 2017), then a cosine decay to
0; weight decay 1e-4, batch 128 per worker, 200 epochs.

Each epoch prints the training loss, the test accuracy and the bytes each worker sent
per step.  ``--checkpoint [DIR]`` saves one file per rank after every epoch (the DGC
momentum and velocity are per rank; alone, in runs/cifar10); running the same command again
resumes from them.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
from torch.nn import functional as F
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import exchange  # noqa: E402  (the examples' shared flags; it puts the repository on the path)
from benchmarks import harness  # noqa: E402
from mergecomp import launch
from benchmarks.harness.data import cifar  # noqa: E402
from benchmarks.harness.models import count_parameters  # noqa: E402
from benchmarks.harness.models.resnet import CifarResNet  # noqa: E402

#: Where ``--checkpoint`` without a folder saves: under runs/, which git ignores.
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "runs", "cifar10")


def learning_rate(args, progress: float, world_size: int) -> float:
    """The rate at ``progress`` epochs: linear warm-up from ``lr`` to ``lr`` × workers,
    then a cosine decay to 0 at the last epoch."""
    peak = args.lr * world_size
    if progress < args.lr_warmup_epochs:
        return args.lr + (peak - args.lr) * progress / args.lr_warmup_epochs
    decay_epochs = args.epochs - args.lr_warmup_epochs
    return peak * exchange.cosine((progress - args.lr_warmup_epochs) / decay_epochs)


def train(args) -> dict:
    info, device = exchange.start_worker(args)
    log = print if info.rank == 0 else (lambda *a, **k: None)
    data = cifar.load_cifar10(args.data_dir)
    mean, std = cifar.channel_statistics(data.train.images)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = CifarResNet(args.depth, num_classes=len(data.label_names)).to(device)
    optimizer = exchange.build_optimizer(model, args, lr=args.lr, weight_decay=args.weight_decay)
    sampler = DistributedSampler(range(len(data.train)), num_replicas=info.world_size,
                                 rank=info.rank, shuffle=True, seed=args.seed)
    steps_per_epoch = math.ceil(len(sampler) / args.batch_size)
    num_params = count_parameters(model)
    log(f"CIFAR-10 from {data.folder}: {len(data.train):,} training images "
        f"({len(data.train_files)} batches), {len(data.test):,} test images; channel mean "
        f"{_triple(mean)}, std {_triple(std)}")
    log(f"Model: ResNet-{args.depth} ({num_params / 1e6:.2f}M parameters); {info.world_size} "
        f"worker(s) ({info.launcher}) on {device.type}, batch {args.batch_size} per worker, "
        f"{steps_per_epoch} steps per epoch")
    log(f"Exchange: {optimizer.communicator!r}, {args.fusion_num} fusion group(s); "
        f"{_describe_sgd(optimizer, args)}")
    log(f"Learning rate: {args.lr:g} → {args.lr * info.world_size:g} over "
        f"{args.lr_warmup_epochs:g} epochs, then cosine to 0 at epoch {args.epochs}", flush=True)

    checkpoint = Checkpoint(args.checkpoint, info, _config(args, optimizer, info)) \
        if args.checkpoint else None
    first_epoch = checkpoint.resume(model, optimizer, device, log) if checkpoint else 0
    traffic = exchange.Traffic(optimizer.backend)
    result = {"epochs_run": 0}
    for epoch in range(first_epoch, args.epochs):
        started = time.perf_counter()
        sampler.set_epoch(epoch)
        optimizer.set_epoch(epoch)  # DGC's density warm-up follows the epoch
        generator = torch.Generator().manual_seed(args.seed * 1_000_003 + epoch * 1009 + info.rank)
        order = torch.tensor(list(sampler), dtype=torch.int64)
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for step in range(steps_per_epoch):
            batch = order[step * args.batch_size:(step + 1) * args.batch_size]
            lr = learning_rate(args, epoch + step / steps_per_epoch, info.world_size)
            for group in optimizer.param_groups:
                group["lr"] = lr
            images = data.train.images[batch].to(device, non_blocking=True)
            labels = data.train.labels[batch].to(device, non_blocking=True)
            inputs = cifar.normalize(cifar.random_crop_flip(images, generator), mean, std)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            loss.backward()  # groups are compressed and sent while backward runs
            optimizer.step()
            loss_sum += loss.detach() * labels.numel()
        handed, wire = traffic.read()
        correct, tested = evaluate(model, data.test, mean, std, args.eval_batch_size, info, device)
        totals = exchange.all_sum([float(loss_sum), len(order), correct, tested,
                                   handed / steps_per_epoch, wire / steps_per_epoch], device)
        result = {"epochs_run": result["epochs_run"] + 1, "epoch": epoch,
                  "train_loss": totals[0] / totals[1], "test_accuracy": totals[2] / totals[3],
                  "bytes_per_step": totals[4] / info.world_size,
                  "wire_bytes_per_step": totals[5] / info.world_size}
        log(f"epoch {epoch}: train loss {result['train_loss']:.4f}, test accuracy "
            f"{result['test_accuracy']:.4f}, lr {lr:.4f}{exchange.density_text(optimizer)}, "
            f"{exchange.traffic_line(result['bytes_per_step'], result['wire_bytes_per_step'], num_params, info.world_size)}, "
            f"{time.perf_counter() - started:.1f} s", flush=True)
        if checkpoint:
            checkpoint.save(model, optimizer, epoch)
        if epoch == args.stop_after_epoch:
            log(f"stopping after epoch {epoch} as asked"
                + ("; run again with the same --checkpoint to continue" if checkpoint else ""),
                flush=True)
            break
    if result["epochs_run"] == 0:
        correct, tested = evaluate(model, data.test, mean, std, args.eval_batch_size, info, device)
        correct, tested = exchange.all_sum([correct, tested], device)
        result["test_accuracy"] = correct / tested
        log(f"nothing left to train ({args.epochs} epochs done); test accuracy "
            f"{result['test_accuracy']:.4f}", flush=True)
    launch.shutdown()
    return result


@torch.no_grad()
def evaluate(model, split, mean, std, batch_size, info, device):
    """(correct, images) on this rank's share of ``split``: every world_size-th image from
    ``rank``, no padding, so the sums over ranks count every test image once."""
    model.eval()
    indices = torch.arange(info.rank, len(split), info.world_size)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    for start in range(0, indices.numel(), batch_size):
        batch = indices[start:start + batch_size]
        images = cifar.normalize(split.images[batch].to(device), mean, std)
        correct += (model(images).argmax(1) == split.labels[batch].to(device)).sum()
    return float(correct), indices.numel()


class Checkpoint:
    """One file per rank, ``DIR/rank{r}.pt``, rewritten after every epoch.

    The previous epoch's file is kept as ``rank{r}.previous.pt``: if the job stopped while
    some ranks had saved epoch e and others not, every rank resumes from epoch e - 1.
    Loaded with ``torch.load(..., weights_only=True)``: the state holds tensors and plain
    Python values only (the optimizer's state_dict included: its plan is a dict).
    """

    def __init__(self, folder: str, info, config: dict):
        self.folder, self.info, self.config = folder, info, config
        self.latest = os.path.join(folder, f"rank{info.rank}.pt")
        self.previous = os.path.join(folder, f"rank{info.rank}.previous.pt")

    def save(self, model, optimizer, epoch: int) -> None:
        os.makedirs(self.folder, exist_ok=True)
        state = {"epoch": epoch, "world_size": self.info.world_size, "config": self.config,
                 "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        partial = self.latest + ".partial"
        torch.save(state, partial)
        if os.path.exists(self.latest):
            os.replace(self.latest, self.previous)
        os.replace(partial, self.latest)  # a crash mid-save leaves the older files whole

    def resume(self, model, optimizer, device, log) -> int:
        """Load the newest epoch every rank has saved; return the first epoch to train."""
        states = {}
        for path in (self.latest, self.previous):
            if os.path.isfile(path):
                state = torch.load(path, map_location=device, weights_only=True)
                states[state["epoch"]] = state
        everyone = optimizer.backend.allgather_object(sorted(states))
        if not any(everyone):
            log(f"no checkpoint in {self.folder} yet: training from scratch", flush=True)
            return 0
        common = set(everyone[0]).intersection(*everyone[1:])
        if not common:
            raise RuntimeError(f"the checkpoints in {self.folder} have no epoch in common across "
                               f"ranks (saved epochs per rank: {everyone}); were they written by "
                               f"another job? Use a new --checkpoint folder")
        state = states[max(common)]
        if state["world_size"] != self.info.world_size:
            raise ValueError(f"{self.latest} was written by {state['world_size']} workers, this "
                             f"job has {self.info.world_size}: the DGC state is per rank; resume "
                             f"with {state['world_size']} workers or use a new --checkpoint folder")
        if state["config"] != self.config:
            changed = {k: (state["config"].get(k), v) for k, v in self.config.items()
                       if state["config"].get(k) != v}
            raise ValueError(f"{self.latest} was written with other settings (saved, now): "
                             f"{changed}; use the same flags or a new --checkpoint folder")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # SGD state, plan, DGC momentum/velocity
        log(f"resumed from {self.folder} after epoch {state['epoch']}", flush=True)
        return state["epoch"] + 1


def _config(args, optimizer, info) -> dict:
    """The settings a resumed run must share with the run that saved."""
    return {"depth": args.depth, "exchange": repr(optimizer.communicator),
            "fusion_num": args.fusion_num, "batch_size": args.batch_size, "lr": args.lr,
            "lr_warmup_epochs": args.lr_warmup_epochs, "epochs": args.epochs,
            "weight_decay": args.weight_decay, "seed": args.seed}


def _describe_sgd(optimizer, args) -> str:
    group = optimizer.param_groups[0]
    memory_momentum = getattr(optimizer.memory, "momentum", None)
    if not memory_momentum:
        return f"SGD momentum {group['momentum']:g}, weight decay {group['weight_decay']:g}"
    decay = f"weight decay {group['weight_decay']:g}"
    if args.weight_decay:
        decay += (f" (= {args.weight_decay:g} / (1 - {memory_momentum:g}): applied after the "
                  f"exchange, outside the momentum)")
    return f"momentum {memory_momentum:g} in the memory, SGD without; {decay}"


def _triple(values) -> str:
    return "(" + ", ".join(f"{v:.4f}" for v in values.tolist()) + ")"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", required=True,
                   help="folder with cifar-10-batches-py/ or its data_batch_*, test_batch, batches.meta")
    p.add_argument("--depth", type=int, default=20, help="ResNet depth 6n+2: 20, 32, 44, 56, 110")
    p.add_argument("--epochs", type=int, default=200, help="passes over the training set (default 200)")
    p.add_argument("--batch-size", type=int, default=128, help="per worker (default 128)")
    p.add_argument("--eval-batch-size", type=int, default=1000,
                   help="images per worker when testing (default 1000)")
    p.add_argument("--lr", type=float, default=0.1,
                   help="learning rate of one worker; the job's peak is lr × workers (default 0.1)")
    p.add_argument("--lr-warmup-epochs", type=float, default=5.0,
                   help="epochs to rise from --lr to --lr × workers (default 5)")
    p.add_argument("--weight-decay", type=float, default=1e-4,
                   help="the paper's weight decay, applied after the exchange (default 1e-4)")
    p.add_argument("--seed", type=int, default=42,
                   help="seeds the model, the sampler and the augmentation (default 42)")
    p.add_argument("--checkpoint", nargs="?", const=DEFAULT_CHECKPOINT, default=None, metavar="DIR",
                   help="save one file per rank here after every epoch and resume from it when "
                        "it holds one (alone: runs/cifar10 in the repository, which git ignores)")
    p.add_argument("--stop-after-epoch", type=int, default=None,
                   help="stop after this epoch, as if interrupted (run again to resume)")
    exchange.add_exchange_arguments(p, compressor="dgc", compress_ratio=0.001, momentum=0.9)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "eval_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if not 0 <= args.lr_warmup_epochs < args.epochs:
        p.error(f"--lr-warmup-epochs must be in [0, --epochs={args.epochs}), got {args.lr_warmup_epochs}")
    if args.weight_decay < 0:
        p.error(f"--weight-decay must be ≥ 0, got {args.weight_decay}")
    if args.depth < 8 or (args.depth - 2) % 6:
        p.error(f"--depth must be 6n+2 with n ≥ 1 (20, 32, 44, 56, 110), got {args.depth}")
    try:
        cifar.find_folder(args.data_dir)
    except FileNotFoundError as error:
        p.error(str(error))
    exchange.check_exchange_arguments(p, args)
    return args


def main(argv=None) -> int:
    exchange.run(train, parse_args(argv))
    return 0


if __name__ == "__main__":
    harness.exit_with(main)
