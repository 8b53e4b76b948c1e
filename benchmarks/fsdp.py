#!/usr/bin/env python
"""mergecomp.fsdp against uncompressed FSDP2: accuracy on real data.

``accuracy``: scikit-learn's digits with the convergence benchmark's CNN, split and sharded as there
(two ranks, 32 images each per step), ``--epochs`` epochs of SGD with momentum under
FSDP2, for uncompressed FSDP2 and each of ``--compressors`` (``name[:key=value...]``); test
accuracy per epoch (``--hsdp``: four ranks on a 2×2 mesh, the replicas' all-reduce
compressed).  Bytes and step time against FSDP2's own reduce-scatter are the headline's:
``benchmarks/headline.py fsdp``.

Results go to ``--out`` as ``fsdp-accuracy[-hsdp].json`` and a markdown table; the folder's
``manifest.json`` gets the command, commit, torch version and host.  It imports the
convergence benchmark's model and data, so it runs as a module from the repository root:

    .venv/bin/python -m benchmarks.fsdp accuracy --epochs 20 --out benchmarks/results/DATE-fsdp
    .venv/bin/python -m benchmarks.fsdp accuracy --hsdp --epochs 20 --out benchmarks/results/DATE-fsdp

``lm``: the convergence benchmark's character LSTM under FSDP2, against the same task under
the wrapper (:mod:`benchmarks.harness.fsdp_lm`; ``lm --help``):

    .venv/bin/python -m benchmarks.fsdp lm --steps 600 --seeds 0,1 \\
        --reference benchmarks/results/2026-11-24-lm-convergence/char-lstm/convergence.json --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import mergecomp
from benchmarks import harness
from benchmarks.harness import fsdp_lm
from benchmarks.harness import fsdp

ACCURACY_COMPRESSORS = "topk:compress_ratio=0.01,powersgd"


# ----------------------------------------------------------------------------- accuracy

def _accuracy_rank(args: argparse.Namespace) -> Dict[str, Any]:
    from benchmarks.convergence import DigitsCNN, accuracy, load_digits_split, shard
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split()
    x_mine, y_mine = shard(x_train, y_train, info.rank, info.world_size)
    mesh = fsdp.mesh(args.hsdp)
    results = {}
    specs = [(spec, *harness.parse_spec(spec)) for spec in args.compressors.split(",")]
    for label, name, options in [("fsdp2", None, {})] + specs:
        torch.manual_seed(args.seed)
        model = DigitsCNN()
        fsdp.shard(model.features, mesh)
        fsdp.shard(model.classifier, mesh)
        fsdp.shard(model, mesh)
        state = mergecomp.fsdp.register(model, compressor=name, **options) if name else None
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        order = torch.Generator().manual_seed(args.seed)
        curve = []
        for _ in range(args.epochs):
            permutation = torch.randperm(len(x_mine), generator=order)
            for start in range(0, len(x_mine) - args.batch + 1, args.batch):
                batch = permutation[start:start + args.batch]
                loss = nn.functional.cross_entropy(model(x_mine[batch]), y_mine[batch])
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            curve.append(accuracy(model, x_test, y_test))
        steps = max(1, state.steps) if state is not None else 1
        results[label] = {"test_accuracy": curve, "final": curve[-1],
                          "bytes_per_step": state.wire_bytes / steps if state is not None else None,
                          "fsdp2_bytes_per_step": state.uncompressed_bytes / steps if state is not None else None,
                          "dropped": state.dropped if state is not None else 0}
    return results


def _accuracy_table(results: Dict[str, Any], args: argparse.Namespace) -> str:
    mesh = "a 2×2 HSDP mesh (the replicas' all-reduce compressed)" if args.hsdp else f"{args.ranks} ranks"
    lines = [f"digits CNN under FSDP2, {mesh}, {args.epochs} epochs, SGD lr {args.lr} momentum 0.9, "
             f"batch {args.batch} per rank, seed {args.seed}.", "",
             "| run | final test accuracy | best | kB/step sent | FSDP2's own kB/step |", "|---|---:|---:|---:|---:|"]
    for label, row in results.items():
        sent = "—" if row["bytes_per_step"] is None else f"{row['bytes_per_step'] / 1e3:.1f}"
        own = "—" if row["fsdp2_bytes_per_step"] is None else f"{row['fsdp2_bytes_per_step'] / 1e3:.1f}"
        lines.append(f"| {label} | {row['final']:.4f} | {max(row['test_accuracy']):.4f} | {sent} | {own} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main

def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["lm"]:  # the language-model task: its own flags (benchmarks/harness/fsdp_lm.py)
        return fsdp_lm.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp", description=__doc__.split("\n")[1],
                                     epilog="bytes and step time: benchmarks/headline.py fsdp")
    parser.add_argument("mode", choices=("accuracy", "lm"), help="digits accuracy, or the char-LSTM (lm --help for its flags); bytes and time: headline.py fsdp")
    parser.add_argument("--compressors", default=ACCURACY_COMPRESSORS,
                        help=f"comma-separated name[:key=value...] specs (default {ACCURACY_COMPRESSORS})")
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (HSDP: 4)")
    parser.add_argument("--hsdp", action="store_true", help="a 2×2 mesh (4 ranks), the replicas' all-reduce compressed")
    parser.add_argument("--batch", type=int, default=32, help="images per rank and step (default 32)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs (default 20)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order (default 0)")
    parser.add_argument("--out", default=None, help="a results folder (printed only when omitted)")
    args = parser.parse_args(argv)
    if args.hsdp:
        args.ranks = 4
    for spec in args.compressors.split(","):
        name, options = harness.parse_spec(spec)
        mergecomp.compressors.create(name, **options)  # unknown names and options fail before any rank
    results = mergecomp.launch.spawn(_accuracy_rank, args.ranks, (args,))[0]
    table, stem = _accuracy_table(results, args), "fsdp-accuracy" + ("-hsdp" if args.hsdp else "")
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, stem + ".json"), "w") as handle:
            json.dump({"arguments": vars(args), "results": results}, handle, indent=2)
        with open(os.path.join(args.out, stem + ".md"), "w") as handle:
            handle.write(table)
        harness.record_run(args.out, ["-m", "benchmarks.fsdp", *argv])


if __name__ == "__main__":
    if not __package__:
        sys.exit("benchmarks/fsdp.py imports the convergence benchmark's model and data: run it as a module "
                 "from the repository root, python -m benchmarks.fsdp " + " ".join(sys.argv[1:]))
    harness.exit_with(main)
