"""Language-model accuracy under FSDP2 (``benchmarks/fsdp.py lm``): uncompressed against
mergecomp.fsdp's compressors.

The convergence benchmark's ``char-lstm`` task (:mod:`benchmarks.harness.lm`: a 2-layer
character LSTM on the Python help text, validation loss in nats per character) on local
gloo ranks, trained under FSDP2 instead of DistributedOptimizer, at the settings of
benchmarks/convergence.py: SGD with momentum 0.9 at the dense learning rate, 16 rows × 64
characters per rank, the gradient norm clipped to ``--clip``.  The embedding, the LSTM and
the decoder are FSDP units, the root a fourth.  Rows:

- ``fsdp2``: FSDP2's own reduce-scatter, the averaged gradient clipped
  (``clip_grad_norm_`` over the sharded gradients);
- ``topk`` (``--topk-ratio``) with error feedback: as under the wrapper, each rank clips
  before the residual is added (``residual`` memory with ``clip_norm = clip / √N``); FSDP's
  exchange encodes each unit's gradient chunk by chunk, so the clip applies per chunk;
- ``powersgd`` (rank 2, its own error feedback): the averaged gradient clipped.

The validation loss of each run is compared with the same task, compressors, steps and
seeds under DistributedOptimizer, read from ``--reference`` (a convergence.py result), as
the gap of each compressor to its own family's uncompressed run.

    .venv/bin/python -m benchmarks.fsdp lm --steps 600 --seeds 0,1 \\
        --reference benchmarks/results/2026-11-24-lm-convergence/char-lstm/convergence.json \\
        --out benchmarks/results/DATE-fsdp-lm

Each finished run is appended to ``runs.jsonl`` in ``--out`` at once; the table covers every
seed all of whose runs are there, so seeds can be run one job at a time
(``--table`` re-reads the folder without training).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import mergecomp
from benchmarks.harness import lm
from benchmarks.harness.data import text

RUNS = ("fsdp2", "topk", "powersgd")
#: One JSON line per finished run, in the --out folder.
RUNS_FILE = "runs.jsonl"


def shard(model: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard
    for child in (model.embedding, model.lstm, model.decoder):
        fully_shard(child)
    fully_shard(model)


def compression(run: str, args, world_size: int) -> Optional[Dict[str, Any]]:
    if run == "fsdp2":
        return None
    if run == "topk":
        memory = mergecomp.memories.create("residual", clip_norm=args.clip / math.sqrt(world_size))
        return {"compressor": "topk", "compress_ratio": args.topk_ratio, "memory": memory}
    return {"compressor": mergecomp.compressors.create("powersgd", rank=2)}  # the reference rows' rank


def train(run: str, seed: int, args, corpus, rank: int, world_size: int) -> Dict[str, Any]:
    task = lm.get_task("char-lstm")
    torch.manual_seed(seed)
    model = task.build(corpus.vocab_size)
    shard(model)
    options = compression(run, args, world_size)
    state = mergecomp.fsdp.register(model, **options) if options else None
    clip_averaged = run != "topk"
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    stream = lm.TextStream(corpus, 16, task.bptt, rank, world_size)
    valid = text.validation_rows(corpus.valid, 16, 512)
    curve = [{"step": 0, "valid_loss": lm.validation_loss(task, model, valid)}]
    hidden, done, began = None, 0, time.perf_counter()
    for inputs, targets, _, first in stream:
        if done == args.steps:
            break
        if first:
            hidden = None
        optimizer.zero_grad()
        loss, hidden = lm.training_loss(task, model, inputs, targets, hidden)
        loss.backward()
        if clip_averaged:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        done += 1
        if done % args.eval_every == 0 or done == args.steps:
            curve.append({"step": done, "valid_loss": lm.validation_loss(task, model, valid)})
    steps = max(1, done)
    return {"run": run, "seed": seed, "steps": done, "valid_loss": curve[-1]["valid_loss"], "curve": curve,
            "seconds": time.perf_counter() - began,
            "bytes_per_step": state.wire_bytes / steps if state else None,
            "fsdp2_bytes_per_step": state.uncompressed_bytes / steps if state else None,
            "dropped": state.dropped if state else 0,
            "parameters": sum(p.numel() for p in model.parameters())}


def worker(args) -> List[Dict[str, Any]]:
    info = mergecomp.launch.init_distributed()
    torch.set_num_threads(1)
    # the LSTM unit returns a view; nothing here changes it in place, which is what that warns of
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    corpus = text.load_text("pydoc", "char")
    results = []
    for seed in args.seeds:
        for run in args.runs:
            results.append(train(run, seed, args, corpus, info.rank, info.world_size))
            if info.rank == 0:
                print(f"{run} seed {seed}: validation loss {results[-1]['valid_loss']:.4f} "
                      f"({results[-1]['seconds']:.0f} s)", flush=True)
                if args.out:  # each run kept as it ends: a long job cut short keeps what it did
                    with open(os.path.join(args.out, RUNS_FILE), "a") as handle:
                        handle.write(json.dumps(dict(results[-1], arguments=settings(args))) + "\n")
    return results


def settings(args) -> Dict[str, Any]:
    """What a run's result depends on, besides its seed: runs to be tabled together agree."""
    return {"ranks": args.ranks, "steps": args.steps, "lr": args.lr, "clip": args.clip, "topk_ratio": args.topk_ratio}


REFERENCE_LABELS = {"fsdp2": "none", "topk": "topk", "powersgd": "powersgd"}


def reference_losses(path: Optional[str], seeds: List[int]) -> Dict[str, List[float]]:
    """The same runs under DistributedOptimizer, from a convergence.py result (rank 0's)."""
    if not path:
        return {}
    with open(path) as handle:
        runs = json.load(handle)["runs"]
    found = {}
    for ours, theirs in REFERENCE_LABELS.items():
        losses = [r["valid_loss"] for seed in seeds for r in runs
                  if r["label"] == theirs and r["seed"] == seed and r.get("rank", 0) == 0]
        if len(losses) == len(seeds):
            found[ours] = losses
    return found


def table_of(results: List[Dict[str, Any]], reference: Dict[str, List[float]], args) -> str:
    by_run = {run: [r for r in results if r["run"] == run] for run in args.runs}
    mean = {run: statistics.fmean(r["valid_loss"] for r in rows) for run, rows in by_run.items()}
    ddp = {run: statistics.fmean(losses) for run, losses in reference.items()}
    lines = [f"char-lstm ({results[0]['parameters']:,} parameters) under FSDP2, {args.ranks} ranks, SGD lr "
             f"{args.lr:g} momentum 0.9, 16 rows × 64 per rank, clip {args.clip:g}, {args.steps} steps, seeds "
             f"{', '.join(map(str, args.seeds))}; validation loss in nats per character (mean over seeds); gap: "
             "percent of the same family's uncompressed loss, positive is worse.", "",
             "| run | FSDP2 loss | per seed | gap to FSDP2 | kB/step sent (FSDP2's own) | wrapper loss | "
             "gap to dense (wrapper) |", "|---|---:|---|---:|---:|---:|---:|"]
    for run, rows in by_run.items():
        gap = "—" if run == "fsdp2" else f"{100 * (mean[run] / mean['fsdp2'] - 1):+.1f}%"
        sent = ("—" if rows[0]["bytes_per_step"] is None else
                f"{statistics.fmean(r['bytes_per_step'] for r in rows) / 1e3:,.1f} "
                f"({statistics.fmean(r['fsdp2_bytes_per_step'] for r in rows) / 1e3:,.1f})")
        wrapper = "—" if run not in ddp else f"{ddp[run]:.4f}"
        wrapper_gap = ("—" if run == "fsdp2" or run not in ddp or "fsdp2" not in ddp
                       else f"{100 * (ddp[run] / ddp['fsdp2'] - 1):+.1f}%")
        seeds = ", ".join(f"{r['valid_loss']:.4f}" for r in rows)
        lines.append(f"| {run} | {mean[run]:.4f} | {seeds} | {gap} | {sent} | {wrapper} | {wrapper_gap} |")
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fsdp lm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--lr", type=float, default=2.0, help="the dense learning rate of convergence.py")
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    parser.add_argument("--reference", default=None, help="convergence.py's convergence.json, the same task")
    parser.add_argument("--out", default=None, help="a results folder: runs.jsonl gains a line per run, "
                        "fsdp-lm.json and .md the table of every seed complete in it")
    parser.add_argument("--table", action="store_true", help="only table the runs already in --out")
    args = parser.parse_args(argv)
    if args.table and not args.out:
        parser.error("--table reads the runs of --out: give --out")
    args.runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(args.runs) - set(RUNS))
    if unknown or "fsdp2" not in args.runs:
        parser.error(f"--runs must name fsdp2 and any of {RUNS}, got {args.runs}")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if args.steps < 1 or args.eval_every < 1 or args.ranks < 2 or not args.seeds:
        parser.error("--steps and --eval-every must be ≥ 1, --ranks ≥ 2, --seeds not empty")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if not args.table:
        mergecomp.launch.spawn(worker, args.ranks, (args,))
    if not args.out:
        return
    results = [json.loads(line) for line in open(os.path.join(args.out, RUNS_FILE)) if line.strip()]
    mismatched = [r for r in results if r["arguments"] != results[0]["arguments"]]
    if mismatched:
        raise SystemExit(f"{RUNS_FILE} holds runs of different settings ({results[0]['arguments']} and "
                         f"{mismatched[0]['arguments']}): table them apart")
    args.seeds = sorted({r["seed"] for r in results})
    args.runs = [run for run in RUNS if any(r["run"] == run for r in results)]
    for key, value in results[0]["arguments"].items():
        setattr(args, key, value)
    complete = [seed for seed in args.seeds if all(any(r["run"] == run and r["seed"] == seed for r in results)
                                                   for run in args.runs)]
    args.seeds = complete
    results = [r for r in results if r["seed"] in complete]
    reference = reference_losses(args.reference, args.seeds)
    table = table_of(results, reference, args)
    print(table)
    with open(os.path.join(args.out, "fsdp-lm.json"), "w") as handle:
        json.dump({"arguments": vars(args), "results": results, "reference": reference}, handle, indent=2)
    with open(os.path.join(args.out, "fsdp-lm.md"), "w") as handle:
        handle.write(table)
