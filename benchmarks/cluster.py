#!/usr/bin/env python
"""Run a command on N workers behind emulated network links: the command line of
:mod:`benchmarks.harness.cluster` (one Linux network namespace per worker, shaped with tc).

    python benchmarks/cluster.py --workers 2 --profile 1gbit -- python train.py
    python benchmarks/cluster.py --nodes 2 --workers-per-node 2 --profile 1gbit -- python train.py
    python benchmarks/cluster.py --check --workers 2 --profile 1gbit --mbytes 100
    python benchmarks/cluster.py --list-profiles
    python benchmarks/cluster.py --cleanup        # namespaces left by a run killed with SIGKILL

The ``loopback`` profile runs the workers in the host namespace over 127.0.0.1, unshaped, and
needs neither root nor iproute2; every other profile needs root and iproute2.

``--nodes M --workers-per-node L``: M nodes of L workers; the workers of a node share its
namespace (unshaped between them: the fast link) and its shaped link to the others, and get
torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks.harness, run as a file

from benchmarks.harness.cluster import (PROFILES, Cluster, ClusterUnavailable, check_allreduce,
                                     cleanup_leftovers, format_results, load_profiles)
from benchmarks.harness.profiles import format_delay, format_rate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cluster.py", description="Run a command on N workers behind emulated network "
        "links (one Linux network namespace per worker, shaped with tc).",
        epilog="examples:\n  cluster.py --workers 2 --profile 1gbit -- python train.py\n"
               "  cluster.py --check --workers 2 --profile 1gbit --mbytes 100\n"
               "  cluster.py --list-profiles\n  cluster.py --cleanup",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=None,
                        help="number of workers (default 2, or nodes × workers per node)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="nodes, each a namespace behind one shaped link (default: one per worker)")
    parser.add_argument("--workers-per-node", type=int, default=None,
                        help="workers sharing a node's namespace and link (default 1)")
    parser.add_argument("--profile", default="loopback",
                        help="profile name or spec 'rate=500mbit,delay=1ms' (default loopback)")
    parser.add_argument("--profiles", metavar="FILE",
                        help="YAML/JSON file of extra profiles: name: {rate: .., delay: ..}")
    parser.add_argument("--timeout", type=float, default=600, help="seconds (default 600)")
    parser.add_argument("--list-profiles", action="store_true", help="print the profile table")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces left by crashed runs (mc<pid>-*, dead pid)")
    parser.add_argument("--all", action="store_true",
                        help="with --cleanup: also remove those of runs still alive")
    parser.add_argument("--check", action="store_true",
                        help="time a real gloo allreduce of --mbytes MB between the workers")
    parser.add_argument("--mbytes", type=float, default=100, help="--check size (default 100)")
    parser.add_argument("--iters", type=int, default=1, help="--check repetitions (default 1)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after '--': the command every worker runs")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        table = load_profiles(args.profiles) if args.profiles else PROFILES
        if args.list_profiles:
            print("\n".join(profile.describe() for profile in table.values()))
            print("rate: per-worker full-duplex link; delay: one-way, worker to worker")
            return 0
        if args.cleanup:
            if os.geteuid() != 0:
                print("cluster: --cleanup needs root (namespaces are root's)", file=sys.stderr)
                return 2
            removed = cleanup_leftovers(include_live=args.all)
            print(f"removed {len(removed)} namespace(s)" +
                  (": " + " ".join(removed) if removed else ""))
            return 0
        if not args.check and not command:
            print("cluster: give a command after '--', or --check, --list-profiles, --cleanup",
                  file=sys.stderr)
            return 2
        workers, per_node = _layout(args)
        with Cluster(workers, args.profile, table, workers_per_node=per_node) as cluster:
            where = ", ".join(cluster.addresses) if cluster.profile.shaped else "127.0.0.1"
            profile = cluster.profile
            rate = format_rate(profile.rate_bps) if profile.shaped else "unshaped"
            delay = format_delay(profile.delay_s)
            if profile.shaped and profile.delay_s > 0 and not cluster.delay_emulated:
                delay += " NOT emulated: no sch_netem"
            nodes = f" in {cluster.num_nodes} nodes" if per_node else ""
            print(f"cluster: {workers} workers{nodes}, profile {profile.name} (rate {rate}, "
                  f"delay {delay}) at {where}", file=sys.stderr, flush=True)
            if args.check:
                return _check(cluster, args)
            results = cluster.run(command, timeout_s=args.timeout)
            print(format_results(results))
            if not results.ok:
                print(f"cluster: FAILED: {results.failure}", file=sys.stderr)
                return 1
            return 0
    except (ValueError, ClusterUnavailable, RuntimeError) as err:
        print(f"cluster: {err}", file=sys.stderr)
        return 2


def _layout(args):
    """(workers, workers per node or None) from --workers, --nodes, --workers-per-node."""
    if args.nodes is None and args.workers_per_node is None:
        return (2 if args.workers is None else args.workers), None
    nodes = 1 if args.nodes is None else args.nodes
    per_node = 1 if args.workers_per_node is None else args.workers_per_node
    if nodes < 1 or per_node < 1:
        raise ValueError(f"--nodes and --workers-per-node must be ≥ 1, got {nodes} and {per_node}")
    if args.workers is not None and args.workers != nodes * per_node:
        raise ValueError(f"--workers {args.workers} contradicts --nodes {nodes} × --workers-per-node "
                         f"{per_node} = {nodes * per_node}; give one or the other")
    return nodes * per_node, per_node


def _check(cluster: Cluster, args) -> int:
    report = check_allreduce(cluster, args.mbytes, args.iters, args.timeout)
    mb = report["nbytes"] / 1e6
    for i, seconds in enumerate(report["seconds"]):
        print(f"allreduce {mb:g} MB x {cluster.num_workers} workers "
              f"[{cluster.profile.name}] iter {i}: {seconds:.3f} s "
              f"(data size / time = {format_rate(report['nbytes'] * 8 / seconds)}/s)")
    if report["expected_s"] is not None:
        best = min(report["seconds"])
        print(f"line rate: ring allreduce moves 2(N-1)/N x {mb:g} MB per worker at "
              f"{format_rate(cluster.profile.rate_bps)} -> {report['expected_s']:.3f} s; "
              f"measured best {best:.3f} s = {best / report['expected_s']:.2f}x line rate")
        if best > 1.5 * report["expected_s"]:
            print(f"note: more than 1.5x the line-rate time: this host's CPU, not the emulated "
                  f"link, limits {format_rate(cluster.profile.rate_bps)}; use a slower profile "
                  f"or read these numbers as host-bound")
    else:
        print("line rate: unshaped (loopback), no expectation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
