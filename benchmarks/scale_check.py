#!/usr/bin/env python
"""The simulator checked at 8 to 32 workers: compute replayed, links real.

    python benchmarks/scale_check.py traces --out DIR
    python benchmarks/scale_check.py run simulator --out DIR [--dry-run]
    python benchmarks/scale_check.py run claims --out DIR [--dry-run]
    python benchmarks/scale_check.py table simulator DIR
    python benchmarks/scale_check.py table claims DIR
    python benchmarks/scale_check.py real8 --out DIR [--dry-run]

``traces`` records the replayed models on this machine (``benchmarks/replay.py record``:
their real order and spacing, rescaled to a documented GPU compute time) into
``DIR/traces``.  ``run TABLE`` runs every cell of the table
(:mod:`benchmarks.harness.scalecheck`: models × node layouts × compressors), each one
``simulator.py rounds`` in the emulated cluster, and keeps its result, log and a line of
``DIR/cells.jsonl`` (the command, its exit code, its minutes, the load average before and
after); a cell whose result is there already is skipped (``--again`` reruns it).  Before
each cell it waits until the host's 1-minute load average is below ``--max-load`` (up to
``--wait-quiet`` seconds, then the cell is left for later): other work on the host makes
every plan host-bound.  ``table TABLE DIR`` prints the saved cells: ``simulator``,
predicted against measured with host-bound plans refused; ``claims``, the sparse
allreduce against the allgather, hierarchical against flat, and whether ``auto`` and
``optimal`` ran the fastest plan.  Each ``run`` appends its provenance to
``DIR/manifest.json``.

``real8`` is the check on a machine with a core per worker (16 cores: a GPU node's host):
8 real training processes of one thread each, flat and as 2 nodes of 4, behind 1 Gbit/s
links, the same ``simulator.py rounds`` as the 8-rank check of 2026-11-24, in about 5
minutes; it needs root and iproute2 for the links (no network, no pip), and says SKIPPED,
exiting 0, where the host cannot make them.  A GPU machine without iproute2 takes one
carried from here: ``make iproute2-bundle`` (``build/iproute2``, which the cluster finds),
sent along with the checkout.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

from benchmarks import harness, simulator
from benchmarks.harness import hostload, scalecheck
from benchmarks.harness.cluster import netns_support, parse_profile
from mergecomp.plan import Plan
from mergecomp.planning.costmodel import predict
from mergecomp.planning.profile import Profile, with_density

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def _load() -> float:
    return os.getloadavg()[0]


def _rel(path: str) -> str:
    """``path`` relative to the repository's root when it lies inside (commands run there):
    saved commands then name no folder of this machine."""
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, ROOT]) == ROOT
    return os.path.relpath(path, ROOT) if inside else path


#: This interpreter, as the commands name it (a virtual environment in the checkout: relative).
PYTHON = _rel(sys.executable)


def _run_logged(command, log_path: str, timeout_s: float) -> int:
    with open(log_path, "w") as log:
        try:
            return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            log.write(f"\nscale_check: stopped after {timeout_s:g} s\n")
            return 124


# ------------------------------------------------------------------------------ traces --

def traces_main(argv) -> int:
    p = argparse.ArgumentParser(prog="scale_check.py traces", description="Record the campaign's traces here.")
    p.add_argument("--out", required=True, help="the campaign's folder (traces go to OUT/traces)")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args(argv)
    folder = os.path.join(args.out, "traces")
    for model, how in scalecheck.TRACES.items():
        command = [PYTHON, os.path.join("benchmarks", "replay.py"), "record", *how["record"],
                   "--out", _rel(os.path.join(folder, f"{model}.json"))]
        print(" ".join(command), flush=True)
        if not args.dry_run:
            os.makedirs(folder, exist_ok=True)
            subprocess.run(command, check=True, cwd=ROOT)
    if not args.dry_run:
        harness.record_run(args.out, sys.argv)
    return 0


# --------------------------------------------------------------------------------- run --

def run_main(argv) -> int:
    p = argparse.ArgumentParser(prog="scale_check.py run", description="Run a table's cells in the emulated cluster.")
    p.add_argument("table", choices=sorted(scalecheck.TABLES))
    p.add_argument("--out", required=True, help="the campaign's folder (with traces/ from the traces mode)")
    p.add_argument("--models", default=",".join(scalecheck.TRACES), help="comma-separated (default: all)")
    p.add_argument("--only", default=None, help="comma-separated cell names to run (default: all of the table)")
    p.add_argument("--layouts", default=None,
                   help="replace the table's layouts, e.g. 4,2x2 (a smoke run at a small scale)")
    p.add_argument("--link-gbit", type=float, default=1.0, help="the emulated GPU cluster's link (default 1)")
    p.add_argument("--time-scale", type=float, default=8.0,
                   help="every replayed duration × this, the links ÷ it (default 8; see harness/scalecheck.py)")
    p.add_argument("--codecs", choices=("gpu", "real"), default="gpu", help="--replay-codecs (default gpu)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--cell-timeout", type=float, default=5400, help="seconds per cell (default 5400)")
    p.add_argument("--max-load", type=float, default=0.5,
                   help="start a cell only below this 1-minute load average (default 0.5; inf: always)")
    p.add_argument("--wait-quiet", type=float, default=1800, help="seconds to wait for it (default 1800)")
    p.add_argument("--again", action="store_true", help="rerun cells whose result exists")
    p.add_argument("--dry-run", action="store_true", help="print each cell's command, run nothing")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.window < 1 or not args.time_scale > 0 or not args.link_gbit > 0:
        p.error(f"--rounds and --window must be ≥ 1, --time-scale and --link-gbit > 0; got {args.rounds}, "
                f"{args.window}, {args.time_scale}, {args.link_gbit}")
    try:
        layouts = scalecheck.parse_layouts(args.layouts) if args.layouts else None
        todo = scalecheck.cells(args.table, [m.strip() for m in args.models.split(",") if m.strip()], layouts)
    except ValueError as error:
        p.error(str(error))
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        unknown = wanted - {c.name for c in todo}
        if unknown:
            p.error(f"--only names no cell of table {args.table}: {sorted(unknown)}; its cells: "
                    f"{', '.join(c.name for c in todo)}")
        todo = [c for c in todo if c.name in wanted]
    out = os.path.abspath(args.out)
    missing = sorted({c.model for c in todo if not os.path.exists(os.path.join(out, "traces", f"{c.model}.json"))})
    if missing and not args.dry_run:
        p.error(f"no trace of {missing} in {out}/traces: run 'scale_check.py traces --out {args.out}' first")
    if not args.dry_run:
        harness.record_run(out, sys.argv)
    for cell in todo:
        result = os.path.join(out, f"{cell.name}.json")
        command = scalecheck.command(cell, _rel(os.path.join(out, "traces", f"{cell.model}.json")), _rel(out),
                                     PYTHON, args.link_gbit, args.time_scale, args.codecs, args.rounds, args.window,
                                     args.cell_timeout)
        if args.dry_run:
            print(f"{cell.name}: " + " ".join(command))
            continue
        if os.path.exists(result) and not args.again:
            print(f"{cell.name}: done already ({result})", flush=True)
            continue
        waited = 0.0
        while _load() > args.max_load and waited < args.wait_quiet:
            time.sleep(30)
            waited += 30
        record = {"cell": cell.name, "command": command, "load_before": os.getloadavg()}
        if _load() > args.max_load:
            record["skipped"] = f"load average {_load():.2f} above {args.max_load} after {waited:.0f} s"
            print(f"{cell.name}: {record['skipped']}: left for later", flush=True)
        else:
            print(f"{cell.name}: running", flush=True)
            began = time.time()
            record["exit"] = _run_logged(command, os.path.join(out, f"{cell.name}.log"), args.cell_timeout + 60)
            record.update(minutes=(time.time() - began) / 60, load_after=os.getloadavg())
            print(f"{cell.name}: exit {record['exit']} after {record['minutes']:.1f} min", flush=True)
        with open(os.path.join(out, "cells.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


# ------------------------------------------------------------------------------- table --

def repredict(result: dict, latency_us) -> dict:
    """``result`` (a ``simulator.py rounds`` result) predicted again from what it saved — the
    measured profile and every round's compute — with the latency ``latency_us``
    (microseconds, or ``"profile"``): the network model changed, the measurements kept."""
    profile = Profile.from_dict(result["measured_profile"])
    link = argparse.Namespace(workers_per_node=result.get("workers_per_node", 1), intra_gbit=result.get("intra_gbit"),
                              link_rate=parse_profile(result["net_profile"]).rate_bps / 8, latency_us=latency_us)
    modelled = simulator.modelled_profile(profile, result["workers"], link, result["link_efficiency"])
    rounds = [simulator.round_profile(modelled, ranks) for ranks in result["round_compute"]]
    again = copy.deepcopy(result)
    again["latency_us"] = latency_us
    for row in again["plans"].values():
        plan = Plan.from_dict(row["plan"])
        scale = row.get("density_scale", 1.0)  # the quality controller's, as the run sent
        row["predicted_s"] = [predict(plan, with_density(p, scale)).iteration_time for p in rounds]
        row["error"] = statistics.median(p / m - 1 for p, m in zip(row["predicted_s"], row["measured_s"]))
    return again


def table_main(argv) -> int:
    p = argparse.ArgumentParser(prog="scale_check.py table", description="Print a table of the saved cells.")
    p.add_argument("table", choices=sorted(scalecheck.TABLES))
    p.add_argument("folder")
    p.add_argument("--max-core-wait", type=float, default=hostload.MAX_CORE_WAIT,
                   help=f"refuse plans whose core wait reaches this (default {hostload.MAX_CORE_WAIT})")
    p.add_argument("--latency-us", default=None,
                   help="predict again from the saved measurements with this latency (microseconds, or "
                        "'profile': each run's allreduce probe's); default: the predictions as saved")
    args = p.parse_args(argv)
    results = scalecheck.load(args.folder)
    if args.latency_us is not None:
        latency = args.latency_us
        if latency != "profile":
            try:
                latency = float(latency)
            except ValueError:
                p.error(f"--latency-us must be microseconds ≥ 0 or 'profile', got {latency!r}")
        results = {name: repredict(r, latency) for name, r in results.items()}
    if args.table == "claims":
        wanted = {f"{w}" if l == 1 else f"{n}x{l}" for n, l in scalecheck.TABLES["claims"] for w in [n * l]}
        results = {k: v for k, v in results.items() if k.rsplit("-", 1)[1] in wanted}
        print(scalecheck.claims_table(results, args.max_core_wait))
    else:
        print(scalecheck.simulator_table(results, args.max_core_wait))
    return 0


# ------------------------------------------------------------------------------- real8 --

REAL8_LAYOUTS = ((8, 1), (2, 4))


def real8_commands(out: str):
    """(name, command) of the 8-worker check with real compute: the model and plans of the
    2026-11-24 8-rank check, one thread per worker, 1 Gbit/s links."""
    for nodes, local in REAL8_LAYOUTS:
        name = f"mlp-fp16-{nodes}x{local}"
        yield name, [PYTHON, os.path.join("benchmarks", "cluster.py"), "--nodes", str(nodes),
                     "--workers-per-node", str(local), "--profile", "1gbit", "--timeout", "200", "--",
                     PYTHON, os.path.join("benchmarks", "simulator.py"), "rounds", "--threads", "1", "--no-cuda",
                     "--model", "mlp", "--batch-size", "64", "--num-warmup-batches", "2", "--compress",
                     "--compressor", "fp16", "--comm", "hierarchical",
                     "--plans", "fp32-2,compress:allreduce-2,compress-2", "--rounds", "4", "--window", "3",
                     "--json", _rel(os.path.join(out, f"{name}.json"))]


def real8_main(argv) -> int:
    p = argparse.ArgumentParser(prog="scale_check.py real8",
                                description="The 8-worker check with real compute, on a host with a core per worker.")
    p.add_argument("--out", required=True, help="folder for the results, logs and manifest")
    p.add_argument("--dry-run", action="store_true", help="check the prerequisites, print the commands, run nothing")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    cores = os.cpu_count() or 1
    problems = []
    if cores < 16:
        problems.append(f"{cores} cores: 8 workers and their exchange threads need 16")
    why = netns_support() if not args.dry_run or os.geteuid() == 0 else "not root"
    if why:
        problems.append(f"no emulated links: {why}")
    for name, command in real8_commands(out):
        print(f"{name}: " + " ".join(command))
    if problems:
        print("real8: SKIPPED: " + "; ".join(problems), flush=True)
        return 0
    if args.dry_run:
        print("real8: prerequisites met; about 5 minutes", flush=True)
        return 0
    os.makedirs(out, exist_ok=True)
    harness.record_run(out, sys.argv)
    failed = 0
    for name, command in real8_commands(out):
        code = _run_logged(command, os.path.join(out, f"{name}.log"), 230)
        print(f"{name}: exit {code}", flush=True)
        failed += code != 0
    if not failed:
        paths = [os.path.join(out, f"{name}.json") for name, _ in real8_commands(out)]
        print(simulator.rounds_table(paths))
    return 1 if failed else 0


MODES = {"traces": traces_main, "run": run_main, "table": table_main, "real8": real8_main}


def main(argv=None) -> int:
    return harness.run_mode("scale_check.py", __doc__, MODES, argv)


if __name__ == "__main__":
    harness.exit_with(main)
