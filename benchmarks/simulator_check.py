#!/usr/bin/env python
"""Validate the simulator against the emulated cluster: predicted vs measured step time.

    python benchmarks/simulator_check.py --workers 2,3,4 --profile 1gbit --model vgg16 --compressor dgc

For each worker count N it runs ``compress_benchmark.py --scheduler auto`` on N workers
behind the shaped links, which profiles the run (``--profile-out``) and executes a plan
(``--plan-out``), measuring its step time.  The simulator's model — the profile's compute
timeline and codec costs, with the collectives replaced by the α-β network model at the
link's rate (:func:`mergecomp.simulate.network_collectives`) — then predicts that same
plan, and the table compares the two.  What it validates is the network and overlap model;
the compute side comes from the run itself (on a 2-core machine, 3 or 4 workers share the
cores, which a profile taken at N = 2 could not know).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.cluster import Cluster, parse_profile  # noqa: E402
from mergecomp.costmodel import predict  # noqa: E402
from mergecomp.plan import Plan  # noqa: E402
from mergecomp.profile import Profile  # noqa: E402
from mergecomp.simulate import network_collectives  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(workers: int, profile: str, args, folder: str) -> dict:
    paths = {k: os.path.join(folder, f"{k}_{workers}.json") for k in ("profile", "plan", "result")}
    command = [sys.executable, os.path.join(ROOT, "compress_benchmark.py"), "--model", args.model,
               "--batch-size", str(args.batch_size), "--compress", "--compressor", args.compressor,
               "--scheduler", "auto", "--profile-out", paths["profile"], "--plan-out", paths["plan"],
               "--json", paths["result"], "--threads", "1", "--no-cuda",
               "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "3"]
    if args.compress_ratio is not None:
        command += ["--compress-ratio", str(args.compress_ratio)]
    with Cluster(num_workers=workers, profile=profile) as cluster:
        results = cluster.run(command, timeout_s=args.timeout_s, cwd=ROOT)
    if not results.ok:
        raise RuntimeError(f"N={workers}: {results.failure}")
    with open(paths["result"]) as f:
        measured = json.load(f)
    return {"profile": Profile.load(paths["profile"]), "plan": Plan.load(paths["plan"]),
            "measured": measured["iteration_time_s"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--profile", default="1gbit", help="network profile of the emulated cluster")
    p.add_argument("--model", default="vgg16")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--compressor", default="dgc")
    p.add_argument("--compress-ratio", type=float, default=0.01)
    p.add_argument("--latency-us", type=float, default=50.0,
                   help="per-message latency the simulator assumes (the links add none: no netem here)")
    p.add_argument("--timeout-s", type=float, default=600)
    args = p.parse_args(argv)
    link = parse_profile(args.profile)
    if not link.shaped:
        p.error(f"profile {args.profile!r} is not rate-limited; the simulator needs a link rate")
    rate = link.rate_bps / 8  # bytes per second
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for workers in (int(w) for w in args.workers.split(",")):
            run = measure(workers, args.profile, args, folder)
            modelled = dataclasses.replace(run["profile"], collectives=network_collectives(
                workers, rate, args.latency_us * 1e-6))
            predicted = predict(run["plan"], modelled).iteration_time
            rows.append((workers, run["plan"], predicted, run["measured"]))
            print(f"N={workers}: predicted {predicted * 1e3:.1f} ms, measured {run['measured'] * 1e3:.1f} ms",
                  flush=True)
    print(f"\n{args.model}, {args.compressor}, {args.profile} links, plan chosen by --scheduler auto\n")
    print("| workers | plan (groups, compressed) | predicted ms | measured ms | error |")
    print("|---|---|---|---|---|")
    for workers, plan, predicted, measured in rows:
        compressed = sum(g.send == "compress" for g in plan.groups)
        print(f"| {workers} | {len(plan)}, {compressed} | {predicted * 1e3:.1f} | {measured * 1e3:.1f} | "
              f"{(predicted - measured) / measured * 100:+.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
