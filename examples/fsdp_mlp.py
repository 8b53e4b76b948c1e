#!/usr/bin/env python
"""An FSDP2 training loop whose gradient reduce-scatter mergecomp compresses.

The model is sharded with ``fully_shard`` (each layer, then the root); mergecomp's one line
comes after it:

    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.01)

Run it on CPU ranks (gloo) with torchrun, or let it start its own processes:

    .venv/bin/torchrun --nproc_per_node 2 examples/fsdp_mlp.py --compressor topk
    .venv/bin/python examples/fsdp_mlp.py --spawn 2 --compressor fp16

The data is a learnable synthetic regression.  Every few steps it prints the loss and the
bytes this rank sent per step against what FSDP's own reduce-scatter would have sent.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch.distributed.fsdp import fully_shard  # noqa: E402

import mergecomp  # noqa: E402


def build(width: int, depth: int, features: int) -> nn.Sequential:
    """An MLP whose every linear layer is one FSDP unit."""
    torch.manual_seed(0)
    layers, size = [], features
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    layers.append(nn.Linear(size, 1))
    model = nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def train(args: argparse.Namespace) -> float:
    """Train; return the last loss on this rank."""
    info = mergecomp.launch.init_distributed()
    model = build(args.width, args.depth, args.features)
    options = {"compress_ratio": args.compress_ratio} if args.compressor in ("topk", "randk", "dgc") else {}
    state = mergecomp.fsdp.register(model, compressor=args.compressor, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    teacher = torch.Generator().manual_seed(7)
    direction = torch.randn(args.features, 1, generator=teacher)
    data = torch.Generator().manual_seed(100 + info.rank)
    loss = torch.tensor(float("nan"))
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.features, generator=data)
        y = torch.tanh(x @ direction)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.rank == 0 and (step == 1 or step % args.print_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {loss.item():.4f}  sent {state.wire_bytes / step / 1e3:.1f} kB/step "
                  f"(FSDP's own: {state.uncompressed_bytes / step / 1e3:.1f} kB/step)", flush=True)
    return loss.item()


def _spawned(args: argparse.Namespace) -> float:
    return train(args)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compressor", default="topk", help="a registered compressor name (topk, fp16, qsgd, ...)")
    parser.add_argument("--compress-ratio", type=float, default=0.01, help="the fraction top-k/rand-k/DGC send")
    parser.add_argument("--steps", type=int, default=200, help="training steps")
    parser.add_argument("--lr", type=float, default=0.02, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--width", type=int, default=256, help="hidden width")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--features", type=int, default=32, help="input features")
    parser.add_argument("--print-every", type=int, default=50, help="steps between reports")
    parser.add_argument("--spawn", type=int, default=0, help="start this many local ranks (0: use torchrun's)")
    args = parser.parse_args(argv)
    if args.spawn:
        mergecomp.launch.spawn(_spawned, args.spawn, (args,))
    else:
        train(args)


if __name__ == "__main__":
    main()
