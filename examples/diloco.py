"""DiLoCo in a training script: local steps with your optimizer, an outer step every H.

    python examples/diloco.py --nproc 2                                   # DiLoCo, H = 16
    python examples/diloco.py --nproc 2 --fragments 2 --overlap 2         # streaming
    python examples/diloco.py --nproc 2 --compressor topk --compress-ratio 0.03 --memory residual

Each rank fits a small MLP to its own shard of a synthetic regression task with AdamW (the
inner optimizer); ``mergecomp.DiLoCo`` wraps it, so the loop is the usual
``zero_grad(); backward(); step()``.  Every ``--sync-every`` steps the ranks average their
weights' change (through the compressor, if any) and the outer Nesterov step applies it.
``--checkpoint DIR`` saves each rank's state at the end (one file per rank) and resumes
from it when it is there.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
from mergecomp import launch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--steps", type=int, default=160, help="inner steps (default 160)")
    p.add_argument("--sync-every", type=int, default=16, help="H, inner steps per outer step (default 16)")
    p.add_argument("--fragments", type=int, default=1, help="streaming fragments (default 1)")
    p.add_argument("--overlap", type=int, default=0, help="inner steps an exchange runs behind (default 0)")
    p.add_argument("--compressor", default="none", help="compressor of the pseudo-gradient (default none)")
    p.add_argument("--compress-ratio", type=float, default=None, help="a sparsifier's ratio")
    p.add_argument("--memory", default="auto", help="error feedback (default: the compressor's)")
    p.add_argument("--checkpoint", default=None, help="folder of per-rank checkpoints to resume from and save")
    return p.parse_args(argv)


def train(args):
    """One rank's training; returns the final loss on this rank's data."""
    info = launch.init_distributed(backend="gloo")
    rank, world_size = info.rank, info.world_size
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    x = torch.randn(512, 16, generator=generator)
    y = (x[:, :4].sum(dim=1, keepdim=True)).tanh()
    kwargs = {} if args.compress_ratio is None else {"compress_ratio": args.compress_ratio}
    opt = mergecomp.DiLoCo(torch.optim.AdamW(model.parameters(), lr=3e-3), model=model,
                           sync_every=args.sync_every, fragments=args.fragments, overlap=args.overlap,
                           compressor=mergecomp.compressors.create(args.compressor, **kwargs),
                           memory=args.memory)
    path = os.path.join(args.checkpoint, f"diloco.rank{rank}.pt") if args.checkpoint else None
    if path and os.path.exists(path):
        opt.load_state_dict(mergecomp.load(path))
    for _ in range(args.steps):
        batch = torch.randint(0, len(x), (32,), generator=generator)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
    if path:
        os.makedirs(args.checkpoint, exist_ok=True)
        mergecomp.save(opt.state_dict(), path)
    final = torch.nn.functional.mse_loss(model(x), y).item()
    if rank == 0:
        print(f"{opt.inner_steps} inner steps, {opt.outer_steps} outer steps on {world_size} ranks; "
              f"loss {final:.4f}")
    return final


def main(argv=None):
    args = parse_args(argv)
    launch.spawn(train, args.nproc, args=(args,))


if __name__ == "__main__":
    main()
