#!/usr/bin/env python
"""A Hugging Face Accelerate training loop whose DDP buckets mergecomp compresses.

The loop is Accelerate's own; mergecomp's one line comes after ``accelerator.prepare``, which
wraps the model in DistributedDataParallel when several processes run:

    state = mergecomp.ddp.register(model, compressor="topk", memory="residual")

Launch it as any Accelerate script on several processes; on a CPU machine Accelerate's
multi-process launcher is the one named ``--multi_gpu`` (``--cpu`` alone runs one process),
and the script's ``Accelerator(cpu=True)`` keeps the work on the CPU (gloo):

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_ddp.py --compressor topk
    torchrun --nproc_per_node 2 examples/accelerate_ddp.py --compressor dgc

The data is a learnable synthetic task (Gaussian clusters).  Each epoch prints the training
loss and the bytes mergecomp's hook handed to its collectives per step.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelerate import Accelerator  # noqa: E402

import mergecomp  # noqa: E402
import mergecomp.ddp  # noqa: E402
import mergecomp.momentum  # noqa: E402


def clusters(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=g), labels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressor", default="topk", help="mergecomp compressor (default topk)")
    p.add_argument("--memory", default="auto", help="error feedback (default: the compressor's recommendation)")
    p.add_argument("--comm", default="auto", help="communicator (default: the compressor's recommendation)")
    p.add_argument("--epochs", type=int, default=3, help="passes over the data (default 3)")
    p.add_argument("--batch-size", type=int, default=64, help="per process (default 64)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    args = p.parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        p.error("--epochs and --batch-size must be ≥ 1")

    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    compressor = mergecomp.compressors.create(args.compressor)
    memory = mergecomp.memories.recommended(compressor) if args.memory == "auto" else mergecomp.memories.create(args.memory)
    # SIGNUM and DeMo's memory keep a momentum of their own: the optimizer then has none (the
    # dgc memory, and top-k's default memory, take SGD's over instead).
    owns_momentum = any(mergecomp.momentum.role(c) == mergecomp.momentum.OWNS for c in (compressor, memory))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0 if owns_momentum else 0.9)
    loader = DataLoader(clusters(4096, 32, 10, seed=0), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if accelerator.num_processes < 2:
        p.error("run it on several processes: accelerate launch --multi_gpu --num_processes 2 ... "
                "(or torchrun --nproc_per_node 2 ...)")
    # prepare() wrapped the model in DistributedDataParallel: compress its buckets.
    state = mergecomp.ddp.register(model, compressor=compressor, memory=memory, communicator=args.comm,
                                   optimizer=optimizer)
    fp32 = 4 * sum(p.numel() for p in model.parameters())
    sent = steps = 0
    for epoch in range(args.epochs):
        state.set_epoch(epoch)  # DGC's density warm-up follows the epoch
        total, batches = 0.0, 0
        for inputs, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        per_step = (state.backend.bytes_sent - sent) / max(1, state.steps - steps)
        sent, steps = state.backend.bytes_sent, state.steps
        accelerator.print(f"epoch {epoch}: train loss {total / batches:.4f}, {per_step:,.0f} bytes/step through "
                          f"mergecomp's hook ({state.compressor!r}; FP32 allreduce: {fp32:,}), "
                          f"{state.steps} hook steps so far on {accelerator.num_processes} processes")
    # Every collective still in gloo's queue finishes first: a group destroyed (with DDP's
    # reducer, below) while its worker thread still holds a collective can wait on that
    # thread forever.
    torch.distributed.barrier()
    accelerator.end_training()
    # DDP holds the process group: drop both before the interpreter's teardown, which
    # otherwise destroys gloo's threads while they run.
    del model, optimizer, accelerator
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
