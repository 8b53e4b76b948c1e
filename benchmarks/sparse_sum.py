#!/usr/bin/env python
"""The finish phase of sparse payloads: the in-place sum against decode-then-aggregate.

The allgather communicator hands every rank's payload to ``compressor.decompress_sum``.
For the sparsifiers (top-k, DGC, GradDrop) that is one zeroed buffer and a scatter-add per
rank; before, each payload was decoded into a dense tensor of its own and the tensors
added (``aggregate``).  For each compressor, group size and rank count, the table gives
the median of both, timed alternately in the same run, and their ratio.  The payloads
are real: each "rank" compresses its own standard-normal gradient.

    python benchmarks/sparse_sum.py
    python benchmarks/sparse_sum.py --sizes 1M,15M --ranks 2,4,16 --compressors dgc
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.compressors import paired_median_ms, parse_size  # noqa: E402
from mergecomp import compressors  # noqa: E402


def payloads_of(compressor, numel: int, ranks: int):
    """Each rank's payload for its own gradient, and the (shared) decoding context."""
    payloads = []
    for rank in range(ranks):
        gradient = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        payload, ctx = compressor.compress(gradient, "group")
        payloads.append(payload)
    return payloads, ctx


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compressors", default="topk,dgc", help="sparsifiers to time (default topk,dgc)")
    p.add_argument("--compress-ratio", type=float, default=0.01)
    p.add_argument("--sizes", default="1M,5M,15M", help="group sizes in elements (default 1M,5M,15M)")
    p.add_argument("--ranks", default="2,3,4,8", help="payloads summed, one per rank (default 2,3,4,8)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per cell; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        p.error(f"--sizes takes counts like 1M,15M and --ranks integers like 2,4; got {args.sizes!r}, {args.ranks!r}")
    if any(n < 1 for n in sizes) or any(r < 1 for r in ranks) or args.reps < 1 or args.threads < 1:
        p.error(f"sizes, ranks, --reps and --threads must be ≥ 1, got {sizes}, {ranks}, {args.reps}, {args.threads}")
    torch.set_num_threads(args.threads)
    print("| compressor | elements | ranks | decode + aggregate ms | in-place sum ms | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.compressors.split(","):
        if not getattr(compressors.create(name), "sums_in_place", False):
            p.error(f"compressor {name!r} does not sum in place; choose among topk, dgc, graddrop")
        compressor = compressors.create(name, compress_ratio=args.compress_ratio)
        for numel in sizes:
            for count in ranks:
                payloads, ctx = payloads_of(compressor, numel, count)

                def dense():
                    return compressor.aggregate([compressor.decompress(x, ctx).reshape(-1) for x in payloads])

                in_place_ms, dense_ms = paired_median_ms(lambda: compressor.decompress_sum(payloads, ctx), dense,
                                                         torch.device("cpu"), args.reps)
                print(f"| {name} | {numel:,} | {count} | {dense_ms:.2f} | {in_place_ms:.2f} | "
                      f"{dense_ms / in_place_ms:.2f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
