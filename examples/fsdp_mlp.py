#!/usr/bin/env python
"""An FSDP2 training loop whose gradient reduce-scatter mergecomp compresses.

The model is sharded with ``fully_shard`` (each layer, then the root); mergecomp's one line
comes after it:

    state = mergecomp.fsdp.register(model, compressor="topk", compress_ratio=0.01)

Run it on CPU ranks (gloo) with torchrun, or let it start its own processes:

    .venv/bin/torchrun --nproc_per_node 2 examples/fsdp_mlp.py --compressor topk
    .venv/bin/python examples/fsdp_mlp.py --spawn 2 --compressor fp16
    .venv/bin/python examples/fsdp_mlp.py --spawn 4 --hsdp 2 --compressor powersgd
    MERGECOMP_LOCAL_SIZE=2 .venv/bin/python examples/fsdp_mlp.py --spawn 4 --node-mesh
    .venv/bin/torchrun --nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        examples/fsdp_mlp.py --node-mesh        # on each of the two nodes

The data is a learnable synthetic regression.  Every few steps it prints the loss and the
bytes this rank sent per step against what FSDP's own collective would have sent (the
reduce-scatter; under HSDP the replicas' all-reduce).
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


def mesh_for(replicas: int):
    """None (a 1-D mesh over every rank), or a (replicas × ranks per replica) HSDP mesh."""
    if replicas <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    world = torch.distributed.get_world_size()
    if world % replicas:
        raise SystemExit(f"--hsdp {replicas} must divide the {world} ranks")
    return init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))


def build(width: int, depth: int, features: int, mesh=None) -> nn.Sequential:
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
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args: argparse.Namespace) -> float:
    """Train; return the last loss on this rank."""
    info = mergecomp.launch.init_distributed()
    mesh = mergecomp.fsdp.node_mesh("cpu") if args.node_mesh else mesh_for(args.hsdp)
    model = build(args.width, args.depth, args.features, mesh)
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
    parser.add_argument("--hsdp", type=int, default=0,
                        help="HSDP with this many replicas (a 2-D mesh; only the replicas' all-reduce is compressed)")
    parser.add_argument("--node-mesh", action="store_true",
                        help="HSDP over the launcher's nodes (mergecomp.fsdp.node_mesh): replicas across nodes, "
                             "shards inside a node")
    parser.add_argument("--spawn", type=int, default=0, help="start this many local ranks (0: use torchrun's)")
    args = parser.parse_args(argv)
    if args.spawn:
        mergecomp.launch.spawn(_spawned, args.spawn, (args,))
    else:
        train(args)


if __name__ == "__main__":
    main()
