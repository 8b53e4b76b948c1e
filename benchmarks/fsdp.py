#!/usr/bin/env python
"""mergecomp.fsdp against FSDP2's own gradient reduction: bytes on the wire, step time, accuracy.

Two modes, each on local gloo ranks (CPU):

``bytes``
    An MLP (``--depth`` linear layers of ``--width``, each one FSDP unit) takes ``--steps``
    steps per configuration: FSDP2's own reduce-scatter in FP32 and with a bf16 reduce
    dtype (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``), then ``mergecomp.fsdp``
    with each of ``--compressors``.  Per configuration: the bytes one rank puts on the wire
    per step (counted by mergecomp from the payloads it sends; FSDP's own from the sizes its
    reduce-scatter moves, (W−1)/W of the unit's gradient), and the median step time on this
    host.  ``--hsdp`` runs four ranks on a 2×2 mesh and compares the replicas' all-reduce.
``accuracy``
    scikit-learn's digits with the convergence benchmark's CNN, split and sharded as there
    (two ranks, 32 images each per step), ``--epochs`` epochs of SGD with momentum under
    FSDP2, for uncompressed FSDP2 and each of ``--compressors``; test accuracy per epoch
    (``--hsdp``: four ranks on a 2×2 mesh).

Results go to ``--out`` as ``fsdp-<mode>.json`` and a markdown table; the folder's
``manifest.json`` records the command, commit, torch version and host.

    .venv/bin/python benchmarks/fsdp.py bytes --out benchmarks/results/DATE-fsdp
    .venv/bin/python benchmarks/fsdp.py accuracy --epochs 20 --out benchmarks/results/DATE-fsdp
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mergecomp  # noqa: E402

BYTES_COMPRESSORS = "none,bf16,topk:compress_ratio=0.01,randk:compress_ratio=0.01,qsgd,onebit,powersgd,dgc:compress_ratio=0.01"
ACCURACY_COMPRESSORS = "topk:compress_ratio=0.01,powersgd"


def parse(spec: str):
    """``name[:key=value...]`` → (label, name, options)."""
    name, *pairs = spec.split(":")
    options = {}
    for pair in pairs:
        key, _, raw = pair.partition("=")
        try:
            options[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            options[key] = raw
    return spec, name, options


def _shard(module: nn.Module, mesh, reduce_dtype=None) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype) if reduce_dtype is not None else MixedPrecisionPolicy()
    fully_shard(module, mesh=mesh, mp_policy=policy)


def _mesh(hsdp: bool):
    if not hsdp:
        return None
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


# ----------------------------------------------------------------------------- bytes

def _mlp(width: int, depth: int, mesh, reduce_dtype=None) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    for layer in model:
        if isinstance(layer, nn.Linear):
            _shard(layer, mesh, reduce_dtype)
    _shard(model, mesh, reduce_dtype)
    return model


def _fsdp_own_bytes(model: nn.Module, element_size: int, hsdp: bool) -> int:
    """What FSDP2's own collective moves per step and rank: (W−1)/W of each unit's padded
    gradient for the reduce-scatter; under HSDP, the replicas' ring all-reduce of the shard."""
    world = torch.distributed.get_world_size()
    total = 0
    for parameter in model.parameters():
        shard = parameter.to_local().numel() * element_size
        if hsdp:
            total += 2 * shard * (2 - 1) // 2  # two replicas
        else:
            total += shard * (world - 1)
    return total


def _bytes_rank(args: argparse.Namespace) -> List[Dict[str, Any]]:
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(1)
    mesh = _mesh(args.hsdp)
    rows = []
    configurations = [("fsdp2-fp32", None, {}, None), ("fsdp2-bf16-reduce", None, {}, torch.bfloat16)]
    configurations += [(label, name, options, None) for label, name, options in map(parse, args.compressors.split(","))]
    for label, name, options, reduce_dtype in configurations:
        model = _mlp(args.width, args.depth, mesh, reduce_dtype)
        state = mergecomp.fsdp.register(model, compressor=name, **options) if name else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(info.rank)
        times = []
        for step in range(args.warmup + args.steps):
            x = torch.randn(args.batch, args.width, generator=generator)
            torch.distributed.barrier()
            started = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
        steps = args.warmup + args.steps
        if state is not None:
            sent, own = state.wire_bytes / steps, state.uncompressed_bytes / steps
        else:
            own = _fsdp_own_bytes(model, 2 if reduce_dtype is not None else 4, args.hsdp)
            sent = own
        rows.append({"configuration": label, "bytes_per_step": sent, "fsdp2_fp32_bytes_per_step": None,
                     "step_ms": 1e3 * statistics.median(times), "parameters": sum(p.numel() for p in model.parameters()),
                     "own_reference_bytes": own})
    fp32 = rows[0]["bytes_per_step"]
    for row in rows:
        row["fsdp2_fp32_bytes_per_step"] = fp32
        row["ratio_to_fp32"] = row["bytes_per_step"] / fp32
        row["ratio_to_bf16"] = row["bytes_per_step"] / rows[1]["bytes_per_step"]
    return rows


def _bytes_table(rows: List[Dict[str, Any]], args: argparse.Namespace) -> str:
    what = "the replicas' all-reduce (HSDP, 2×2 mesh)" if args.hsdp else f"the reduce-scatter ({args.ranks} ranks)"
    lines = [f"Bytes one rank sends per step for {what}; MLP {args.depth}×{args.width} "
             f"({rows[0]['parameters']:,} parameters), step time median of {args.steps} on this host's CPU ranks.", "",
             "| configuration | kB/step | × FSDP2 fp32 | × FSDP2 bf16 | step ms |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['configuration']} | {row['bytes_per_step'] / 1e3:,.1f} | {row['ratio_to_fp32']:.4f} | "
                     f"{row['ratio_to_bf16']:.4f} | {row['step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- accuracy

def _accuracy_rank(args: argparse.Namespace) -> Dict[str, Any]:
    from benchmarks.convergence import DigitsCNN, accuracy, load_digits_split, shard
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split()
    x_mine, y_mine = shard(x_train, y_train, info.rank, info.world_size)
    mesh = _mesh(args.hsdp)
    results = {}
    for label, name, options in [("fsdp2", None, {})] + list(map(parse, args.compressors.split(","))):
        torch.manual_seed(args.seed)
        model = DigitsCNN()
        _shard(model.features, mesh)
        _shard(model.classifier, mesh)
        _shard(model, mesh)
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

def _manifest(out: str, argv: List[str]) -> None:
    path = os.path.join(out, "manifest.json")
    manifest = json.load(open(path)) if os.path.exists(path) else {"runs": []}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = None
    manifest["runs"].append({"command": "benchmarks/fsdp.py " + " ".join(argv), "commit": commit,
                             "torch": torch.__version__, "host": platform.node(), "cpus": os.cpu_count(),
                             "python": platform.python_version()})
    with open(path, "w") as handle:
        json.dump(manifest, handle, indent=2)


def main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("bytes", "accuracy"))
    parser.add_argument("--compressors", default=None, help="comma-separated name[:key=value...] specs")
    parser.add_argument("--ranks", type=int, default=2, help="local gloo ranks (HSDP: 4)")
    parser.add_argument("--hsdp", action="store_true", help="a 2×2 mesh (4 ranks), the replicas' all-reduce compressed")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="bytes: timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20, help="accuracy: epochs")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="a results folder (printed only when omitted)")
    args = parser.parse_args(argv)
    if args.hsdp:
        args.ranks = 4
    if args.compressors is None:
        args.compressors = BYTES_COMPRESSORS if args.mode == "bytes" else ACCURACY_COMPRESSORS
    if args.mode == "bytes":
        rows = mergecomp.launch.spawn(_bytes_rank, args.ranks, (args,))[0]
        table, data, stem = _bytes_table(rows, args), rows, "fsdp-bytes" + ("-hsdp" if args.hsdp else "")
    else:
        results = mergecomp.launch.spawn(_accuracy_rank, args.ranks, (args,))[0]
        table, data, stem = _accuracy_table(results, args), results, "fsdp-accuracy" + ("-hsdp" if args.hsdp else "")
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, stem + ".json"), "w") as handle:
            json.dump({"arguments": vars(args), "results": data}, handle, indent=2)
        with open(os.path.join(args.out, stem + ".md"), "w") as handle:
            handle.write(table)
        _manifest(args.out, argv)


if __name__ == "__main__":
    main()
