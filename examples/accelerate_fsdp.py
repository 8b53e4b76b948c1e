#!/usr/bin/env python
"""A Hugging Face Accelerate loop on FSDP2 whose gradient reduction mergecomp compresses.

With Accelerate's FSDP plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``),
``accelerator.prepare`` shards the model with ``fully_shard``; mergecomp's one line comes
right after it:

    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.01)

On CPU ranks Accelerate does not use the plugin: its distributed type is then
``MULTI_CPU``, and ``prepare`` wraps the model in DistributedDataParallel (silently: no
error).  So here, when Accelerate did not shard, the script shards the model itself with
``fully_shard`` and lets Accelerate prepare only the optimizer and the data; the loop stays
Accelerate's (``accelerator.backward``).  Launch it on several processes:

    torchrun --nproc_per_node 2 examples/accelerate_fsdp.py --compressor topk
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_fsdp.py --compressor powersgd

Each epoch prints the training loss and the bytes this rank sent per step against what
FSDP's own reduce-scatter would have sent.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402

import mergecomp  # noqa: E402


def clusters(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian clusters, one per class: learnable, and the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2
    labels = torch.randint(0, classes, (samples,), generator=g)
    return TensorDataset(centres[labels] + torch.randn(samples, features, generator=g), labels)


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compressor", default="topk", help="a registered compressor name")
    parser.add_argument("--compress-ratio", type=float, default=0.01, help="the fraction top-k/rand-k/DGC send")
    parser.add_argument("--epochs", type=int, default=3, help="passes over the data")
    parser.add_argument("--samples", type=int, default=2048, help="training samples (the same on every rank)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--cpu", action=argparse.BooleanOptionalAction, default=not torch.cuda.is_available(),
                        help="CPU ranks (gloo); the default when no GPU is visible")
    args = parser.parse_args(argv)

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Linear"])
    # on CPU ranks Accelerate needs cpu=True to run several processes at all (else one)
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=args.cpu)
    if accelerator.num_processes < 2:
        parser.error("run it on several processes: torchrun --nproc_per_node 2 examples/accelerate_fsdp.py")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    data = DataLoader(clusters(args.samples, 32, 10, seed=0), batch_size=64, shuffle=True)
    if accelerator.distributed_type == DistributedType.FSDP:  # Accelerate shards (GPU ranks)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        model, optimizer, data = accelerator.prepare(model, optimizer, data)
    else:  # CPU ranks: Accelerate would wrap in DDP, so shard here and prepare the rest
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        optimizer, data = accelerator.prepare(optimizer, data)
    assert isinstance(model, FSDPModule), type(model)
    options = {"compress_ratio": args.compress_ratio} if args.compressor in ("topk", "randk", "dgc") else {}
    state = mergecomp.fsdp.register(model, compressor=args.compressor, **options)
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        for inputs, labels in data:
            inputs, labels = inputs.to(accelerator.device), labels.to(accelerator.device)
            loss = F.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        steps = max(1, state.steps)
        accelerator.print(f"epoch {epoch}  loss {loss.item():.4f}  sent {state.wire_bytes / steps / 1e3:.1f} kB/step "
                          f"(FSDP's own: {state.uncompressed_bytes / steps / 1e3:.1f} kB/step)  "
                          f"[{accelerator.distributed_type.value}]")
    return loss.item()


if __name__ == "__main__":
    main()
    # Accelerate leaves the process group up; tearing it down before the interpreter does
    # keeps gloo's threads from being destroyed while they still run (an abort at exit).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # nothing left in gloo's queue when its threads are joined
        torch.distributed.destroy_process_group()
