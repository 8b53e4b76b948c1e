"""The headline's ``fsdp`` mode: ``mergecomp.fsdp`` against FSDP2's own gradient reduction."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import mergecomp
import mergecomp.ddp
from benchmarks import harness


# -------------------------------------------------------------------------------- fsdp --

FSDP_DOC = """mergecomp.fsdp against FSDP2's own gradient reduction: bytes on the wire and step time.

An MLP (``--depth`` linear layers of ``--width``, each one FSDP unit) takes ``--steps`` steps
per configuration, after ``--warmup``: FSDP2's own reduce-scatter in FP32 and with a bf16
reduce dtype (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``), then ``mergecomp.fsdp``
with each of ``--compressors`` (``name[:key=value...]``).  Per configuration: the bytes one
rank puts on the wire per step (counted by mergecomp from the payloads it sends; FSDP2's own
from the sizes its reduce-scatter moves, (W−1)/W of each unit's gradient), its ratio to
FSDP2's FP32 and bf16 reductions, and the median step time (a barrier before each step).
``--hsdp`` runs four ranks on a 2×2 mesh and compares the replicas' all-reduce, which is what
mergecomp compresses under HSDP.

``--ranks`` local gloo ranks are spawned (default 2; 4 with ``--hsdp``); under a launcher
(``benchmarks/cluster.py``, torchrun) the launched ranks run it.  Results go to ``--out`` as
``fsdp-bytes[-hsdp].json`` and ``.md``, and the folder's ``manifest.json`` gets the command,
commit, torch version and host.  Accuracy under FSDP2: ``python -m benchmarks.fsdp accuracy``.

    python benchmarks/headline.py fsdp --out benchmarks/results/DATE-fsdp
    python benchmarks/headline.py fsdp --hsdp --steps 5 --out benchmarks/results/DATE-fsdp
    python benchmarks/headline.py fsdp --table benchmarks/results/DATE-fsdp/fsdp-bytes.json
"""

FSDP_COMPRESSORS = ("none,bf16,topk:compress_ratio=0.01,randk:compress_ratio=0.01,qsgd,onebit,powersgd,"
                    "dgc:compress_ratio=0.01")


def parse_fsdp(argv):
    p = argparse.ArgumentParser(prog="headline.py fsdp", description=FSDP_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", default=FSDP_COMPRESSORS,
                   help="mergecomp's configurations, comma-separated name[:key=value...] specs")
    p.add_argument("--ranks", type=int, default=None, help="local gloo ranks to spawn (default 2; --hsdp: 4)")
    p.add_argument("--hsdp", action="store_true", help="a 2×2 mesh (4 ranks), the replicas' all-reduce compressed")
    p.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    p.add_argument("--depth", type=int, default=4, help="MLP layers of --width, each one FSDP unit (default 4)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step (default 32)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    p.add_argument("--out", default=None, help="a results folder (printed only when omitted)")
    p.add_argument("--table", nargs="+", default=None, metavar="JSON",
                   help="print the markdown table of saved fsdp-bytes JSON files and exit")
    args = p.parse_args(argv)
    if args.table:
        return args
    for flag in ("width", "depth", "batch", "steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be ≥ 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        p.error(f"--warmup must be ≥ 0, got {args.warmup}")
    if args.ranks is not None and (args.ranks < 2 or (args.hsdp and args.ranks != 4)):
        p.error(f"--ranks must be ≥ 2 (4 with --hsdp: a 2×2 mesh), got {args.ranks}")
    args.ranks = args.ranks or (4 if args.hsdp else 2)
    for spec in args.compressors.split(","):
        name, options = harness.parse_spec(spec)
        mergecomp.compressors.create(name, **options)  # unknown names and options fail before any rank
    return args


def fsdp_rank(args) -> List[Dict[str, Any]]:
    """One rank's rows: every configuration's bytes per step and median step time."""
    from benchmarks.harness import fsdp
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(1)
    mesh = fsdp.mesh(args.hsdp)
    configurations = [("fsdp2-fp32", None, {}, None), ("fsdp2-bf16-reduce", None, {}, torch.bfloat16)]
    configurations += [(spec, *harness.parse_spec(spec), None) for spec in args.compressors.split(",")]
    rows = []
    for label, name, options, reduce_dtype in configurations:
        model = fsdp.sharded_mlp(args.width, args.depth, mesh, reduce_dtype)
        state = mergecomp.fsdp.register(model, compressor=name, **options) if name else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        generator = torch.Generator().manual_seed(info.rank)
        times = []
        for step in range(args.warmup + args.steps):
            x = torch.randn(args.batch, args.width, generator=generator)
            dist.barrier()
            started = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= args.warmup:
                times.append(time.perf_counter() - started)
        steps = args.warmup + args.steps
        if state is not None:
            sent, own = state.wire_bytes / steps, state.uncompressed_bytes / steps
        else:
            sent = own = fsdp.own_reduce_bytes(model, 2 if reduce_dtype is not None else 4, args.hsdp)
        rows.append({"configuration": label, "bytes_per_step": sent, "step_ms": 1e3 * statistics.median(times),
                     "parameters": sum(p.numel() for p in model.parameters()), "own_reference_bytes": own})
    for row in rows:
        row["fsdp2_fp32_bytes_per_step"] = rows[0]["bytes_per_step"]
        row["ratio_to_fp32"] = row["bytes_per_step"] / rows[0]["bytes_per_step"]
        row["ratio_to_bf16"] = row["bytes_per_step"] / rows[1]["bytes_per_step"]
    return rows


def fsdp_table(rows: List[Dict[str, Any]], arguments: Dict[str, Any]) -> str:
    hsdp = arguments["hsdp"]
    what = "the replicas' all-reduce (HSDP, 2×2 mesh)" if hsdp else f"the reduce-scatter ({arguments['ranks']} ranks)"
    lines = [f"Bytes one rank sends per step for {what}; MLP {arguments['depth']}×{arguments['width']} "
             f"({rows[0]['parameters']:,} parameters), step time median of {arguments['steps']} on this host's CPU "
             "ranks.", "",
             "| configuration | kB/step | × FSDP2 fp32 | × FSDP2 bf16 | step ms |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['configuration']} | {row['bytes_per_step'] / 1e3:,.1f} | {row['ratio_to_fp32']:.4f} | "
                     f"{row['ratio_to_bf16']:.4f} | {row['step_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def fsdp_main(argv) -> int:
    args = parse_fsdp(argv)
    if args.table:
        print("\n".join(fsdp_table(saved["results"], saved["arguments"])
                        for saved in harness.saved_results(args.table, "results", "benchmarks/headline.py fsdp")))
        return 0
    launched = mergecomp.launch.detect().launcher not in ("single", "spawn")
    if launched:  # the launched ranks run it; rank 0 writes
        rows = fsdp_rank(args)
        if dist.get_rank() != 0:
            return 0
    else:
        rows = mergecomp.launch.spawn(fsdp_rank, args.ranks, (args,))[0]
    arguments = dict(vars(args), ranks=dist.get_world_size() if launched else args.ranks)
    table = fsdp_table(rows, arguments)
    print(table)
    if args.out:
        stem = "fsdp-bytes" + ("-hsdp" if args.hsdp else "")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, stem + ".json"), "w") as handle:
            json.dump({"arguments": arguments, "results": rows}, handle, indent=2)
        with open(os.path.join(args.out, stem + ".md"), "w") as handle:
            handle.write(table)
        harness.record_run(args.out, ["benchmarks/headline.py", "fsdp", *argv])
    return 0
