#!/usr/bin/env python
"""Which of mergecomp's files one steady-state training step runs code in, per entry point.

Two gloo ranks on loopback train a small model; after a few warm-up steps, rank 0 traces one
step (``sys.setprofile``: every Python function entered) and prints the package's files
whose code ran, with their line counts.  It is how "a top-k step crosses N files" is
counted, before and after a change to the layout.

    python tools/step_files.py                      # the wrapper, top-k
    python tools/step_files.py --entry ddp          # the DDP comm hook
    python tools/step_files.py --entry fsdp         # FSDP2's compressed reduce-scatter
    python tools/step_files.py --entry diloco       # one DiLoCo outer step (sync_every=1)
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _model():
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _step_function(entry: str, compressor: str):
    """A closure running one training step of ``entry`` with ``compressor``."""
    import torch
    import torch.distributed as dist
    import mergecomp

    model = _model()
    data = torch.randn(16, 32)
    target = torch.randint(0, 4, (16,))
    loss_fn = torch.nn.CrossEntropyLoss()
    if entry == "wrapper":
        optimizer = mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                                   model=model, compressor=compressor)
        forward = model
    elif entry == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        forward = DistributedDataParallel(model)
        mergecomp.ddp.register(forward, compressor=compressor)
        optimizer = torch.optim.SGD(forward.parameters(), lr=0.01)
    elif entry == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        mergecomp.fsdp.register(model, compressor=compressor)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        forward = model
    elif entry == "diloco":
        optimizer = mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.01), model=model,
                                     sync_every=1, compressor=compressor)
        forward = model
    else:
        raise ValueError(f"unknown entry point {entry!r}")

    def step():
        optimizer.zero_grad()
        loss_fn(forward(data), target).backward()
        optimizer.step()

    del dist
    return step


def _trace(step, package: str):
    ran = set()

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(package):
                ran.add(name)

    import threading
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return ran


def _rank(rank: int, world: int, port: int, entry: str, compressor: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import mergecomp
    package = os.path.dirname(os.path.abspath(mergecomp.__file__)) + os.sep
    step = _step_function(entry, compressor)
    for _ in range(4):
        step()
    ran = _trace(step, package)
    if rank == 0:
        results.put(sorted(os.path.relpath(path, os.path.dirname(package.rstrip(os.sep))) for path in ran))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entry", choices=["wrapper", "ddp", "fsdp", "diloco"], default="wrapper")
    parser.add_argument("--compressor", default="topk")
    args = parser.parse_args(argv)
    import torch.multiprocessing as mp
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_rank, args=(r, 2, port, args.entry, args.compressor, results))
             for r in range(2)]
    for proc in procs:
        proc.start()
    files = results.get(timeout=300)
    for proc in procs:
        proc.join()
    total = 0
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
            lines = sum(1 for _ in handle)
        total += lines
        print(f"{lines:6d}  {path}")
    print(f"{len(files)} files, {total} lines: one {args.compressor} step through the {args.entry}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
