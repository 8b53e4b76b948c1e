#!/usr/bin/env python
"""Replay traces: record a model's step, turn a profile into one, show one, and check that a
replayed step costs what the real one does.

    python benchmarks/replay.py record --model resnet50 --batch-size 8 --out resnet50.json
    python benchmarks/replay.py record --model resnet50 --compute-time 0.2 --out resnet50-gpu.json
    python benchmarks/replay.py from-profile profile.json --model resnet50 --out resnet50.json
    python benchmarks/replay.py show resnet50.json
    python benchmarks/replay.py compare --model resnet20 --batch-size 16 --nproc 2 \\
        --compress --compressor topk --compress-ratio 0.01 --fusion-num 2 --out DIR

A trace (:mod:`benchmarks.harness.replay.trace`) lists the model's trainable parameters in
the order their gradients become ready, with shapes, dtypes and ready times; every tool of
``compress_benchmark.py``'s flags then trains it with ``--replay TRACE`` instead of
``--model``: forward and backward wait the traced durations, the exchange runs for real.

``record`` times the real model here (``--threads`` torch threads, 1 by default, as one
worker of the emulated cluster gets); ``--compute-time S`` keeps the recorded order and
relative spacing and rescales forward + backward to S seconds: the documented GPU
assumption of ``simulator.py scaling`` is ``--compute-time 0.2`` for ResNet-50 (batch 64
on a V100-class GPU).  ``from-profile`` takes a mergecomp profile (``--profile-out``) of a
run of ``--model``.

``compare`` is the check that replaying is faithful: on the ranks of ``--nproc`` (or
under a launcher), each rank traces the real ``--model`` where it trains it, then trains
the real model and its replay with the same exchange, in interleaved
windows (``--rounds`` of ``--window`` steps: both see the same host), and reports each
one's step time, their ratio, and the host-bound indicator of each
(:mod:`benchmarks.harness.hostload`).  On a quiet host the replayed step is within 10% of
the real one; on a loaded host the indicator says the comparison is the host's.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

import torch

from benchmarks import harness
from benchmarks.harness import hostload, models
from benchmarks.harness.replay import ReplayModel, ReplayTrace, from_profile, record
from benchmarks.harness.replay.model import replay_batch, replay_loss
from mergecomp.distributed import launch
from mergecomp.planning.profile import Profile


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=f"one of {', '.join(models.available())}")
    p.add_argument("--compute-time", type=float, default=None, metavar="S",
                   help="rescale forward + backward to S seconds, keeping order and relative spacing")
    p.add_argument("--out", required=True, help="the trace's path (JSON)")


def _finish_trace(trace: ReplayTrace, args) -> int:
    if args.compute_time is not None:
        trace = trace.with_compute_time(args.compute_time)
    trace.save(args.out)
    print(describe(trace))
    return 0


def describe(trace: ReplayTrace) -> str:
    dtypes = sorted({p.dtype for p in trace.params})
    return (f"{trace.model}: {len(trace.params)} parameters, {trace.numel / 1e6:.2f}M elements "
            f"({trace.nbytes / 1e6:.1f} MB, {', '.join(dtypes)}); forward {trace.forward_time * 1e3:.1f} ms, "
            f"backward {trace.backward_time * 1e3:.1f} ms, optimizer step {trace.optimizer_step * 1e3:.1f} ms; "
            f"{trace.source}")


def record_main(argv) -> int:
    p = argparse.ArgumentParser(prog="replay.py record", description="Time a model's training step here: a replay trace.")
    _trace_args(p)
    p.add_argument("--batch-size", type=int, default=None, help="per worker (default: the model's)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an argument of the model's builder, e.g. d_model=768 (repeatable)")
    p.add_argument("--batch-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an argument of the model's batch, e.g. seq_len=128 (repeatable)")
    p.add_argument("--name", default=None, help="the model's name in the trace (default: --model)")
    args = p.parse_args(argv)
    for name in ("batch_size", "steps", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be ≥ 1, got {value}")
    build = _options(p, "--model-option", args.model_option)
    batch = _options(p, "--batch-option", args.batch_option)
    trace = trace_here(args.model, args.batch_size, args.steps, args.threads, args.seed, build, batch)
    if args.name or build or batch:
        trace = dataclasses.replace(trace, model=args.name or args.model,
                                    extra={**trace.extra, "model_options": build, "batch_options": batch})
    return _finish_trace(trace, args)


def _options(p, flag: str, pairs) -> dict:
    """KEY=VALUE pairs as a dict, values as Python literals where they parse."""
    options = {}
    for pair in pairs:
        try:
            options.update([harness.parse_spec(f"x:{pair}")[1].popitem()])
        except (ValueError, KeyError) as error:
            p.error(f"{flag} {pair!r}: {error}")
    return options


def trace_here(model: str, batch_size, steps: int, threads: int, seed: int = 42,
               build=None, batch=None) -> ReplayTrace:
    """The trace of ``model`` (built with ``build``, fed a batch with ``batch`` options)
    timed in this process with ``threads`` torch threads."""
    spec = models.get(model)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    batch_size = batch_size or spec.default_batch_size
    generator = torch.Generator().manual_seed(seed)
    return record(spec.build(**(build or {})), spec.batch(batch_size, generator=generator, **(batch or {})),
                  spec.loss, steps=steps, name=model, unit=spec.unit, batch_size=batch_size)


def from_profile_main(argv) -> int:
    p = argparse.ArgumentParser(prog="replay.py from-profile",
                                description="A replay trace from a mergecomp profile of a run of --model.")
    p.add_argument("profile", help="a profile saved with --profile-out")
    _trace_args(p)
    args = p.parse_args(argv)
    with torch.device("meta"):
        model = models.get(args.model).build()
    return _finish_trace(from_profile(Profile.load(args.profile), model, args.model), args)


def show_main(argv) -> int:
    p = argparse.ArgumentParser(prog="replay.py show", description="Describe a replay trace.")
    p.add_argument("trace")
    print(describe(ReplayTrace.load(p.parse_args(argv).trace)))
    return 0


# ----------------------------------------------------------------------------- compare --

def compare_worker(args):
    work = harness.prepare(args)
    # Each rank traces its real model where it trains it: beside the other ranks, on its share of the cores.
    trace = record(work.model, (work.inputs, work.targets), work.spec.loss, steps=args.trace_steps,
                   name=args.model, unit=work.spec.unit, batch_size=work.batch_size)
    work.log(describe(trace))
    replayed_model = ReplayModel(trace, seed=args.seed + work.rank).to(work.device)
    inputs, targets = replay_batch(1, device=work.device)
    replayed_spec = dataclasses.replace(work.spec, name=f"replay:{trace.model}", loss=replay_loss)
    replayed = dataclasses.replace(work, spec=replayed_spec, model=replayed_model, inputs=inputs, targets=targets)
    steps, loads, backend = {}, {}, None
    for label, w in (("real", work), ("replayed", replayed)):
        optimizer = harness.build_optimizer(args, w)
        backend = optimizer.backend
        timed = harness.make_timer(harness.training_step(w, w.model, optimizer), w.device)
        timed(max(1, args.num_warmup_batches))
        load = loads[label] = hostload.HostLoad()

        def step(timed=timed, load=load):
            load.start()
            timed(1)
            load.stop()
        steps[label] = step
    times = harness.interleaved_windows(steps, args.rounds, args.window)
    everyone = backend.allgather_object(
        (times, {label: load.summary() for label, load in loads.items()}))
    result = {}
    if work.rank == 0:
        for label in steps:
            per_round = [max(t[label][r] for t, _ in everyone) for r in range(args.rounds)]
            indicator = hostload.combine([s[label] for _, s in everyone])
            result[label] = {"step_s": statistics.median(per_round), "rounds_s": per_round, "host": indicator,
                             "host_bound": hostload.host_bound(indicator, args.max_core_wait)}
        result["ratio"] = result["replayed"]["step_s"] / result["real"]["step_s"]
        result.update(model=args.model, workers=work.size, trace=trace.to_dict(), compressor=args.compressor,
                      fusion_num=args.fusion_num, rounds=args.rounds, window=args.window)
        for label in steps:
            row = result[label]
            work.log(f"{label:<9} {row['step_s'] * 1e3:8.1f} ms per step (median of {args.rounds} rounds); "
                     f"core wait {row['host']['core_wait']:.3f}, workers' cores {row['host']['cpu_total']:.2f}"
                     + (f"  [{row['host_bound']}]" if row["host_bound"] else ""))
        work.log(f"replayed / real: {result['ratio']:.3f} ({result['ratio'] - 1:+.1%})")
    return harness.finish(result, None, work)


def compare_main(argv) -> int:
    p = harness.build_parser(__doc__)
    p.prog = "replay.py compare"
    harness.add_rounds_arguments(p, 6, "a window of the real model and one of its replay")
    p.add_argument("--max-core-wait", type=float, default=hostload.MAX_CORE_WAIT,
                   help=f"refuse a comparison whose core wait reaches this (default {hostload.MAX_CORE_WAIT})")
    p.add_argument("--trace-steps", type=int, default=5, help="timed steps of the trace (default 5)")
    p.add_argument("--out", default=None, help="folder for compare.json and its manifest")
    args = harness.parse_rounds_arguments(p, argv)
    if args.replay:
        p.error("compare traces --model itself; drop --replay")
    if args.controller is None:  # both arms send the configured density: the replay's repeated
        args.controller = "off"  # gradients would make the controller raise it in one arm only
    harness.check_names(args)
    started = harness.provenance()
    if args.nproc is not None:
        result = launch.spawn(compare_worker, args.nproc, args=(args,))[0]
    else:
        result = compare_worker(args)
    if args.out and result:
        os.makedirs(args.out, exist_ok=True)
        harness.save_with_provenance(os.path.join(args.out, "compare.json"), result, started)
        harness.record_run(args.out, sys.argv)
    return 0


MODES = {"record": record_main, "from-profile": from_profile_main, "show": show_main, "compare": compare_main}


def main(argv=None) -> int:
    return harness.run_mode("replay.py", __doc__, MODES, argv)


if __name__ == "__main__":
    harness.exit_with(main)
