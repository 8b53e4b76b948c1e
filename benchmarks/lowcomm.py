#!/usr/bin/env python
"""Low-communication training on real data: DiLoCo, streaming DiLoCo, a sparse pseudo-gradient
and DeMo against dense SGD, on the digits CNN of ``benchmarks/convergence.py``.

Every row trains the same CNN on N local gloo workers, each on its own shard, for the same
epochs and seeds; dense is ``DistributedOptimizer`` around SGD (lr 0.05, momentum 0.9, the
convergence benchmark's dense settings).  DiLoCo rows keep that SGD as the inner optimizer
and add the outer step every H inner steps; the DeMo row is the wrapper with the ``demo``
compressor and memory, SGD without momentum at its recipe's learning rate.  Each row reports
test accuracy (mean and range over the seeds) and the bytes each worker handed to the
collectives per inner step, agreement checks included.

    python benchmarks/lowcomm.py --workers 4 --epochs 30 --seeds 0 1 --out benchmarks/results/DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402
from mergecomp import compressors, launch  # noqa: E402
from mergecomp.bench.harness import provenance  # noqa: E402
from benchmarks.convergence import DigitsCNN, accuracy, load_digits_split, shard  # noqa: E402

LR, MOMENTUM, BATCH = 0.05, 0.9, 32

#: (label, kind, arguments): "dense" and "demo" use the wrapper, "diloco" the DiLoCo entry point.
ROWS = [
    ("dense SGD (allreduce every step)", "dense", {}),
    ("DiLoCo H=8", "diloco", dict(sync_every=8)),
    ("DiLoCo H=32", "diloco", dict(sync_every=32)),
    ("streaming DiLoCo H=8, 2 fragments, overlap 1", "diloco", dict(sync_every=8, fragments=2, overlap=1)),
    ("DiLoCo H=8, top-k 3% + residual", "diloco", dict(sync_every=8, compressor=("topk", dict(compress_ratio=0.03)),
                                                        memory="residual")),
    ("DeMo (chunk 64, top-4), every step", "demo", dict(chunk=64, topk=4)),
]


def build(kind: str, arguments: Dict[str, Any], model: nn.Module):
    if kind == "dense":
        return mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
                                              model=model)
    if kind == "demo":
        compressor = compressors.create("demo", **arguments)
        lr = compressor.recipe.learning_rate(LR, MOMENTUM)
        return mergecomp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr), model=model,
                                              compressor=compressor)
    arguments = dict(arguments)
    if isinstance(arguments.get("compressor"), tuple):
        name, kwargs = arguments["compressor"]
        arguments["compressor"] = compressors.create(name, **kwargs)
    return mergecomp.DiLoCo(torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), model=model,
                            **arguments)


def train(kind, arguments, seed, epochs, data, rank, world_size) -> Dict[str, Any]:
    x_train, y_train, x_test, y_test = data
    x_shard, y_shard = shard(x_train, y_train, rank, world_size)
    torch.manual_seed(seed)
    model = DigitsCNN()
    optimizer = build(kind, arguments, model)
    backend = optimizer.backend
    loss_fn = nn.CrossEntropyLoss()
    steps_per_epoch, steps, sent = len(x_shard) // BATCH, 0, backend.bytes_sent
    for epoch in range(epochs):
        order = torch.randperm(len(x_shard), generator=torch.Generator().manual_seed(
            seed * 1_000_003 + epoch * 1009 + rank))
        for step in range(steps_per_epoch):
            batch = order[step * BATCH:(step + 1) * BATCH]
            optimizer.zero_grad()
            loss_fn(model(x_shard[batch]), y_shard[batch]).backward()
            optimizer.step()
            steps += 1
    if kind == "diloco":  # evaluate the anchor, the weights every rank shares
        for fragment in optimizer.fragments:
            fragment.write(fragment.anchor)
    else:
        optimizer.remove_hooks()
    return dict(seed=seed, accuracy=accuracy(model, x_test, y_test), steps=steps,
                bytes_per_step=(backend.bytes_sent - sent) / max(1, steps))


def worker(rows, seeds, epochs) -> List[Dict[str, Any]]:
    info = launch.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    data = load_digits_split()
    results = []
    for label, kind, arguments in rows:
        for seed in seeds:
            began = time.perf_counter()
            run = train(kind, arguments, seed, epochs, data, info.rank, info.world_size)
            results.append(dict(label=label, seconds=time.perf_counter() - began, **run))
    launch.shutdown()
    return results


def table(runs: List[Dict[str, Any]], workers: int, epochs: int, seeds) -> str:
    lines = [f"Digits CNN, {workers} workers (gloo), batch {BATCH} per worker, {epochs} epochs, seeds "
             f"{', '.join(map(str, seeds))}; inner/dense optimizer SGD lr {LR} momentum {MOMENTUM}; outer SGD "
             "lr 0.7 Nesterov momentum 0.9; DiLoCo rows evaluate the shared anchor.", "",
             "| method | test accuracy % (mean) | min–max | bytes/inner step/worker | × less than dense |",
             "|---|---:|---:|---:|---:|"]
    labels = list(dict.fromkeys(r["label"] for r in runs))
    dense = statistics.mean(r["bytes_per_step"] for r in runs if r["label"] == labels[0])
    for label in labels:
        mine = [r for r in runs if r["label"] == label]
        accs = [100 * r["accuracy"] for r in mine]
        sent = statistics.mean(r["bytes_per_step"] for r in mine)
        lines.append(f"| {label} | {statistics.mean(accs):.1f} | {min(accs):.1f}–{max(accs):.1f} | "
                     f"{sent:,.0f} | {dense / sent:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", default=None, help="folder for lowcomm.json, lowcomm.md and manifest.json")
    args = parser.parse_args(argv)
    runs = launch.spawn(worker, args.workers, args=(ROWS, args.seeds, args.epochs))[0]
    text = table(runs, args.workers, args.epochs, args.seeds)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "lowcomm.json"), "w") as f:
            json.dump(runs, f, indent=1)
        with open(os.path.join(args.out, "lowcomm.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "manifest.json"), "w") as f:
            json.dump(provenance(sys.argv if argv is None else ["benchmarks/lowcomm.py"] + list(argv)), f, indent=1)


if __name__ == "__main__":
    main()
