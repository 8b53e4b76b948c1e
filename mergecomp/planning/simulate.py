"""Predict iteration time and scaling of FP32, FP16 and the optimal plan on an assumed network.

    python -m mergecomp.planning.simulate --model mypackage.models:build_model --compute-time 0.1 \\
        --compressor topk --compressor-arg compress_ratio=0.01 --topology allgather --bandwidth 10 --latency 50
    python -m mergecomp.planning.simulate --profile job.json --topology ring --json

The computation side comes from a saved :class:`~mergecomp.planning.profile.Profile` (its backward
timeline, codec and copy costs), or from a model (``--model MODULE:FACTORY``, a function that
builds the ``nn.Module``; the benchmarks' models are ``benchmarks.harness.models:<name>``) with an
assumed compute time: forward takes ``--forward-fraction`` of it (1/3 by default, since
backward costs about twice forward) and the gradients become ready evenly spaced over
backward, in reverse definition order — an assumption; profile the model for a real
timeline.  Codec and copy costs missing from the profile are measured here, on this
machine's CPU, by the same functions the profiler uses.

The network side is the α-β model (Thakur et al., 2005) for N workers, link bandwidth bw
and latency lat, with B the bytes one worker contributes:

* ring allreduce: 2(N−1)/N · B/bw + 2(N−1) · lat
* allgather (ring): (N−1) · B/bw + (N−1) · lat
* PS (colocated, sharded), two phases: alltoall of B in N shards,
  (N−1)/N · B/bw + (N−1) · lat, then allgather of the recompressed B/N shard,
  (N−1)/N · B/bw + (N−1) · lat.

**Link efficiency.**  TCP through a real (or emulated) link, and the library's copies and
reductions on a busy CPU, reach less than the line rate: ``--link-efficiency e`` runs
the model at ``e × bandwidth`` (1.0, the default: line rate).  ``--link-efficiency
profile`` takes e from the profile's own measured allreduce
(:func:`measured_link_efficiency`: the line-rate per-byte cost at the profile's world size
over the measured one), so a profile taken on the target network carries it; it falls
with more workers on a host whose cores the kernel's network stack shares with them.  The
profile's ``interference`` factor (how much a collective in flight slows backward) is used
as measured; it belongs to the host, and a different network or worker count changes it.

The scaling factor is the compute time (forward + backward, no communication) over the
predicted iteration time: 1.0 is linear scaling.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from typing import Dict, List, Optional, Sequence

import torch

from .. import compressors
from ..plan import COMPRESS_VIA, is_compressed
from .optimal import OptimalScheduler
from .costmodel import send_costs
from .measure import measure_compression_cost, measure_copy_cost
from .profile import LINK_KINDS, LinearCost, Profile, TensorTiming, scaled_compute

TOPOLOGIES = {"ring": "allreduce", "allgather": "allgather", "ps": "ps", "sparse_allreduce": "sparse_allreduce",
              "hierarchical": "hierarchical"}
DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64, 128, 256)


def network_collectives(world: int, bandwidth: float, latency: float,
                        efficiency: float = 1.0) -> Dict[str, LinearCost]:
    """α-β costs (seconds vs bytes per worker) of each collective kind; bandwidth in bytes/s,
    of which the collectives reach the fraction ``efficiency`` (0 < e ≤ 1)."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"a simulated job needs at least 2 workers, got {world!r}")
    if not bandwidth > 0 or not latency >= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s and latency ≥ 0 s, got {bandwidth!r}, {latency!r}")
    if isinstance(efficiency, bool) or not isinstance(efficiency, (int, float)) or not 0 < efficiency <= 1:
        raise ValueError(f"link efficiency must be a fraction of the line rate in (0, 1], got {efficiency!r}")
    bandwidth = bandwidth * efficiency
    steps = world - 1
    return {
        "allreduce": LinearCost(2 * steps * latency, 2 * steps / (world * bandwidth)),
        "allgather": LinearCost(steps * latency, steps / bandwidth),
        "alltoall": LinearCost(steps * latency, steps / (world * bandwidth)),
    }


def node_collectives(nodes: int, local: int, bandwidth: float, latency: float, efficiency: float = 1.0,
                     intra_bandwidth: Optional[float] = None, intra_latency: float = 0.0,
                     intra: Optional[Dict[str, LinearCost]] = None) -> Dict[str, LinearCost]:
    """α-β costs of every collective a job of ``nodes`` × ``local`` ranks runs, keyed as in
    ``Profile.collectives``: the flat kinds over all N = M·L ranks and the hierarchical
    communicator's links (``intra_*`` inside a node, ``inter_*`` between the peers of one
    local rank).  ``bandwidth`` (bytes/s, of which the collectives reach ``efficiency``) and
    ``latency`` are a node's link to the others; ``intra_bandwidth`` and ``intra_latency``
    the fast link inside a node, or ``intra`` the intra-node costs as measured (the
    emulated cluster's nodes talk over a loopback whose speed is the host's processors).

    Ranks are numbered node by node (rank = node·L + local rank), as torchrun and the
    emulated cluster number them, so:

    * **flat ring allreduce and allgather**: of the ring's N hops, M cross a node's link,
      one flow each; the slowest hop sets every step's pace, so the costs are those of N
      ranks on separate links: 2(N−1)/N · B/bw + 2(N−1)·lat and (N−1) · B/bw + (N−1)·lat;
    * **flat all-to-all**: each rank sends B/N to each other rank, (N−L)/N · B off its
      node, and the L ranks of a node share its link: L(N−L)/N · B/bw + (N−1)·lat;
    * **inter-node links**: the L peer groups (one per local rank) exchange at once, each
      over M ranks at bw/L: a ring allreduce 2(M−1)/M · B·L/bw + 2(M−1)·lat, an
      allgather (M−1) · B·L/bw + (M−1)·lat; free with one node;
    * **intra-node links**: ring collectives over L ranks at the intra-node rate; free
      with one rank per node.

    With L = 1 the flat kinds equal :func:`network_collectives`'.
    """
    for what, value in (("nodes", nodes), ("local", local)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"a node layout needs {what} ≥ 1 (an integer), got {value!r}")
    world = nodes * local
    if world < 2:
        raise ValueError(f"a simulated job needs at least 2 workers, got {nodes} node(s) × {local} rank(s)")
    if local > 1 and (intra is None) == (intra_bandwidth is None):
        raise ValueError("with several ranks per node, give the intra-node link either as a rate "
                         f"(intra_bandwidth, bytes/s) or as measured costs (intra), not {'both' if intra else 'neither'}")
    kinds = ("allreduce", "allgather")
    if local == 1:
        inside = {kind: LinearCost() for kind in kinds}
    elif intra is not None:
        missing = [f"intra_{kind}" for kind in kinds if f"intra_{kind}" not in intra]
        if missing:
            raise ValueError(f"the measured intra-node costs lack {missing} (have {sorted(intra)}); "
                             "profile with the hierarchical communicator, or give intra_bandwidth")
        inside = {kind: intra[f"intra_{kind}"] for kind in kinds}
    else:
        inside = network_collectives(local, intra_bandwidth, intra_latency)
    if nodes == 1:  # every collective stays inside the one node
        out = {kind: inside[kind] for kind in kinds}
        between = {kind: LinearCost() for kind in kinds}
    else:
        out = network_collectives(world, bandwidth, latency, efficiency)
        out["alltoall"] = LinearCost((world - 1) * latency, local * (world - local) / (world * bandwidth * efficiency))
        between = network_collectives(nodes, bandwidth / local, latency, efficiency)
    out.update({f"intra_{kind}": inside[kind] for kind in kinds})
    out.update({f"inter_{kind}": between[kind] for kind in kinds})
    return out


def node_profile(profile: Profile, nodes: int, local: int, bandwidth: float, latency: float,
                 efficiency: float = 1.0, intra_bandwidth: Optional[float] = None,
                 intra_latency: float = 0.0) -> Profile:
    """``profile`` on ``nodes`` × ``local`` ranks: its collectives replaced by
    :func:`node_collectives` (the intra-node ones kept as the profile measured them when
    ``intra_bandwidth`` is None), and its node layout (``hierarchy``) set to ``local`` ranks
    per node, so the hierarchical communicator's formula prices the layout."""
    intra = None
    if intra_bandwidth is None and local > 1:
        intra = {kind: profile.collectives[kind] for kind in LINK_KINDS
                 if kind.startswith("intra_") and kind in profile.collectives}
        if len(intra) < 2:
            raise ValueError(f"the profile has no measured intra-node collectives ({sorted(profile.collectives)}); "
                             "profile with communicator='hierarchical' on the node layout, or give the "
                             "intra-node link's rate")
    hierarchy = {"inner": "allgather", "gather": "allgather", **(profile.hierarchy or {}), "local_size": local}
    return dataclasses.replace(profile, world_size=nodes * local, hierarchy=hierarchy,
                               collectives=node_collectives(nodes, local, bandwidth, latency, efficiency,
                                                            intra_bandwidth, intra_latency, intra))


def measured_link_efficiency(profile: Profile, bandwidth: float) -> float:
    """The fraction of ``bandwidth`` (bytes/s) the profile's measured allreduce reached:
    the ring allreduce's line-rate seconds per byte, 2(N−1)/(N·bandwidth) at the profile's
    world size N, over the measured slope; at most 1.0 (a probe cannot beat the line)."""
    if profile.world_size < 2:
        raise ValueError(f"the profile was taken on {profile.world_size} worker; a link efficiency "
                         "needs a profile of at least 2 workers on the network in question")
    measured = profile.collectives.get("allreduce")
    if measured is None or not measured.slope > 0:
        raise ValueError(f"the profile has no measured allreduce cost per byte ({measured!r}); "
                         "re-profile with the auto scheduler, or give --link-efficiency a number")
    if not bandwidth > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    world = profile.world_size
    return min(1.0, 2 * (world - 1) / (world * bandwidth) / measured.slope)


def measured_latency(profile: Profile) -> float:
    """The per-step latency (seconds) the profile's measured allreduce shows: its intercept
    (the cost of a message too small to take any time on the wire) over the ring's
    2(N−1) steps.  On an emulated cluster whose workers share a few cores, a step's latency
    is the host's (waking the thread that receives, the kernel's network stack) rather than
    the wire's, and grows with the workers per core: an assumed wire latency misses it."""
    if profile.world_size < 2:
        raise ValueError(f"the profile was taken on {profile.world_size} worker; a latency needs a "
                         "profile of at least 2 workers on the network in question")
    measured = profile.collectives.get("allreduce")
    if measured is None:
        raise ValueError(f"the profile has no measured allreduce ({sorted(profile.collectives)}); "
                         "re-profile with the auto scheduler, or give the latency as a number")
    return measured.intercept / (2 * (profile.world_size - 1))


def model_profile(model: torch.nn.Module, compute_time: float, forward_fraction: float = 1 / 3) -> Profile:
    """A profile skeleton (timeline only) for ``model``'s trainable parameters."""
    if not compute_time > 0:
        raise ValueError(f"--compute-time must be > 0 seconds (forward + backward of one "
                         f"iteration), got {compute_time!r}")
    if not 0 <= forward_fraction < 1:
        raise ValueError(f"--forward-fraction must be in [0, 1), got {forward_fraction!r}")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad][::-1]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameter: nothing to exchange")
    backward = compute_time * (1 - forward_fraction)
    timeline = [TensorTiming(n, p.numel(), p.numel() * p.element_size(), str(p.dtype), str(p.device),
                             backward * (k + 1) / len(params)) for k, (n, p) in enumerate(params)]
    return Profile(world_size=1, timeline=timeline, forward_time=compute_time * forward_fraction,
                   backward_time=backward)


def build_model(spec: str) -> torch.nn.Module:
    """The module built by ``MODULE:FACTORY`` (a function of no arguments), for ``--model``."""
    module_name, sep, factory_name = spec.partition(":")
    if not sep or not module_name or not factory_name:
        raise ValueError(f"--model must be MODULE:FACTORY, a function that builds the model (e.g. "
                         f"mypackage.models:build_model, or benchmarks.harness.models:vgg16 from the "
                         f"repository), got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {spec!r}: cannot import {factory_name!r} from {module_name!r} ({error})") from None
    model = factory()
    if not hasattr(model, "named_parameters"):
        raise ValueError(f"--model {spec!r} built a {type(model).__name__}, not a torch.nn.Module")
    return model


def with_codecs(profile: Profile, compressor_name: str, compressor) -> Profile:
    """``profile`` with the compressor's, FP16's and the copy costs, measured where missing."""
    codecs = dict(profile.codecs)
    for name, make in ((compressor_name, lambda: compressor), ("fp16", lambda: compressors.create("fp16"))):
        if name not in codecs and name not in ("none", "fp32"):
            codecs[name] = measure_compression_cost(make(), sizes=(2 ** 12, 2 ** 16, 2 ** 19), repeats=3)
    copy = profile.copy if profile.copy != LinearCost() else measure_copy_cost()
    return dataclasses.replace(profile, codecs=codecs, copy=copy, compressor=compressor_name)


def simulate(base: Profile, workers: Sequence[int], bandwidth: float, latency: float,
             topology: str, summable: bool = True, efficiency: float = 1.0,
             chunk_mb: Optional[float] = None, via: Sequence[str] = (), local_size: int = 1,
             intra_bandwidth: Optional[float] = None) -> List[dict]:
    """One row per worker count: predicted times, scaling factors and the optimal plan's shape.

    ``base`` carries the timeline, codecs (the configured compressor and fp16) and copy
    cost; ``bandwidth`` is in bytes/s, ``latency`` in seconds, ``efficiency`` the fraction
    of the bandwidth the collectives reach; ``chunk_mb`` lets the optimal plan send large
    tensors in pieces (:class:`~mergecomp.planning.optimal.OptimalScheduler`).
    ``via``: other communicators the optimal plan may send compressed groups by, group
    by group (``"compress:<name>"``, e.g. ``sparse_allreduce`` beside the allgather); each
    also gets a row of its own, the best plan whose compressed groups all go by it.
    ``local_size``: ranks per node (each worker count a whole number of nodes): ``bandwidth``
    is then a node's link to the others and ``intra_bandwidth`` the link inside a node (None:
    ``base``'s measured intra-node collectives), priced by :func:`node_collectives`; the
    ``hierarchical`` topology's inner exchange is the allreduce for a summable compressor,
    else the allgather.
    """
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; choose one of {sorted(TOPOLOGIES)}")
    if topology == "ring" and not summable:
        raise ValueError(f"compressor {base.compressor!r} is not summable, so a ring allreduce "
                         "cannot carry it; use --topology allgather or ps")
    compute = base.forward_time + base.backward_time
    rows = []
    for world in workers:
        # A compressed group's measured finish phase holds for the profile's own world size
        # and communicator (allgather decodes one payload per rank); elsewhere it is priced
        # by the formula ("compress:<name>" modes name their communicator: the world size
        # alone decides).  Raw groups' finish (allreduce) does not depend on the world size.
        # Launch costs and the collective slowdown measured in the run carry over as they
        # are: they describe this machine's processors, not the network being simulated.
        same = world == base.world_size and TOPOLOGIES[topology] == base.communicator
        if world % local_size:
            raise ValueError(f"{world} workers are no whole number of nodes of {local_size} ranks")
        inner = {"inner": "allreduce" if summable else "allgather", "gather": "allgather"}
        laid_out = node_profile(dataclasses.replace(base, hierarchy=base.hierarchy or inner), world // local_size,
                                local_size, bandwidth, latency, efficiency, intra_bandwidth)
        profile = dataclasses.replace(laid_out, world_size=world, communicator=TOPOLOGIES[topology],
                                      collectives=laid_out.collectives,
                                      finish={k: v for k, v in base.finish.items()
                                              if (same if k == "compress" else
                                                  world == base.world_size or not is_compressed(k))})
        costs = send_costs(profile, via)
        row = {"workers": world}
        modes = tuple(COMPRESS_VIA + name for name in via)
        for label, sends in (("fp32", ("fp32",)), ("fp16", ("fp16",)),
                             ("optimal", ("fp32", "fp16", "compress") + modes),
                             *((f"compress {TOPOLOGIES[topology]}", ("fp32", "compress")) for _ in via[:1]),
                             *((f"compress {name}", ("fp32", COMPRESS_VIA + name)) for name in via)):
            solution = OptimalScheduler(profile, costs=costs, sends=sends,
                                        chunk_mb=chunk_mb if label == "optimal" else None).solve()
            row[label] = {"iteration_time": solution.iteration_time,
                          "scaling": compute / solution.iteration_time,
                          "groups": len(solution.plan),
                          "sliced": sum(g.slices is not None for g in solution.plan.groups),
                          "sends": {s: sum(g.send == s for g in solution.plan.groups)
                                    for s in sends},
                          "exact": solution.exact}
        rows.append(row)
    return rows


def format_table(rows: List[dict]) -> str:
    extra = [label for label in rows[0] if label.startswith("compress ")] if rows else []
    lines = [f"{'N':>5} | {'fp32 ms':>9} {'scale':>6} | {'fp16 ms':>9} {'scale':>6} | "
             f"{'optimal ms':>10} {'scale':>6}  plan"]
    if extra:
        lines[0] += "  | " + " | ".join(f"{label} ms" for label in extra)
    for row in rows:
        cells = []
        for label in ("fp32", "fp16", "optimal"):
            cell = row[label]
            width = 10 if label == "optimal" else 9
            cells.append(f"{cell['iteration_time'] * 1e3:>{width}.2f} {cell['scaling']:>6.3f}")
        best = row["optimal"]
        shape = ", ".join(f"{k} {v}" for k, v in best["sends"].items() if v)
        mark = f", {best['sliced']} holding pieces of tensors" if best["sliced"] else ""
        mark += "" if best["exact"] else " (state sets cut: best found, not proven optimal)"
        lines.append(f"{row['workers']:>5} | " + " | ".join(cells) + f"  {best['groups']} groups: {shape}{mark}"
                     + "".join(f"  | {row[label]['iteration_time'] * 1e3:.2f}" for label in extra))
    return "\n".join(lines)


def _parse_args(argv: Optional[Sequence[str]]):
    parser = argparse.ArgumentParser(prog="python -m mergecomp.planning.simulate", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", help="a profile saved by the benchmark (--profile-out)")
    source.add_argument("--model", help="MODULE:FACTORY, a function that builds the model (with --compute-time)")
    parser.add_argument("--compute-time", type=float, help="seconds of forward + backward per iteration (with --model)")
    parser.add_argument("--forward-fraction", type=float, default=1 / 3)
    parser.add_argument("--compressor", default=None, help="compressor name (default: the profile's, or topk)")
    parser.add_argument("--compressor-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="constructor argument of the compressor, e.g. compress_ratio=0.01")
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="allgather",
                        help="how compressed payloads travel (raw groups always use ring allreduce)")
    parser.add_argument("--bandwidth", type=float, default=10.0, help="link bandwidth in Gbit/s")
    parser.add_argument("--latency", type=float, default=50.0, help="per-step latency in microseconds")
    parser.add_argument("--local-size", type=int, default=1,
                        help="ranks per node: --bandwidth is then each node's link to the others "
                             "(and --topology hierarchical sends dense inside a node)")
    parser.add_argument("--intra-bandwidth", type=float, default=None,
                        help="the link inside a node in Gbit/s (with --local-size > 1; default: the "
                             "profile's measured intra-node collectives)")
    parser.add_argument("--link-efficiency", default="1.0",
                        help="fraction of the bandwidth the collectives reach (default 1.0, line rate), "
                             "or 'profile': measured by the profile's allreduce (needs --profile)")
    parser.add_argument("--compute-scale", type=float, default=1.0,
                        help="multiply every processor-side time of the profile (compute, codecs, "
                             "copies, optimizer step) by this factor: 0.5 for a device twice as fast")
    parser.add_argument("--workers", default=",".join(map(str, DEFAULT_WORKERS)),
                        help="comma-separated worker counts")
    parser.add_argument("--chunk-mb", type=float, default=None,
                        help="let the optimal plan send tensors larger than this (MB) in pieces")
    parser.add_argument("--communicators", default="",
                        help="comma-separated communicators the optimal plan may also send compressed "
                             "groups by, group by group (e.g. sparse_allreduce beside --topology allgather)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser.parse_args(argv)


def _compressor_kwargs(pairs: Sequence[str]) -> dict:
    kwargs = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--compressor-arg must be KEY=VALUE, got {pair!r}")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    return kwargs


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse_args(argv)
    try:
        workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        print(f"error: --workers must be comma-separated integers, got {args.workers!r}", file=sys.stderr)
        return 2
    try:
        if args.profile:
            base = Profile.load(args.profile)
        else:
            if args.compute_time is None:
                raise ValueError("--model needs --compute-time (seconds of forward + backward per iteration)")
            base = model_profile(build_model(args.model), args.compute_time, args.forward_fraction)
        name = args.compressor or (base.compressor if args.profile and base.compressor != "none" else "topk")
        compressor = compressors.create(name, **_compressor_kwargs(args.compressor_arg))
        bandwidth = args.bandwidth * 1e9 / 8
        if args.link_efficiency == "profile":
            if not args.profile:
                raise ValueError("--link-efficiency profile needs --profile (a measured allreduce)")
            efficiency = measured_link_efficiency(base, bandwidth)
        else:
            try:
                efficiency = float(args.link_efficiency)
            except ValueError:
                raise ValueError(f"--link-efficiency must be a fraction in (0, 1] or 'profile', "
                                 f"got {args.link_efficiency!r}") from None
        base = with_codecs(base, name, compressor)
        if args.compute_scale != 1.0:
            base = scaled_compute(base, args.compute_scale)
        via = tuple(name.strip() for name in args.communicators.split(",") if name.strip())
        if args.local_size < 1 or (args.intra_bandwidth is not None and not args.intra_bandwidth > 0):
            raise ValueError(f"--local-size must be ≥ 1 and --intra-bandwidth > 0 Gbit/s, got "
                             f"{args.local_size} and {args.intra_bandwidth}")
        intra = None if args.intra_bandwidth is None else args.intra_bandwidth * 1e9 / 8
        rows = simulate(base, workers, bandwidth, args.latency * 1e-6, args.topology,
                        summable=bool(compressor.summable), efficiency=efficiency, chunk_mb=args.chunk_mb,
                        via=via, local_size=args.local_size, intra_bandwidth=intra)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"compressor": name, "topology": args.topology, "bandwidth_gbps": args.bandwidth,
                          "latency_us": args.latency, "link_efficiency": efficiency, "rows": rows}, indent=2))
    else:
        print(f"compressor {name}, topology {args.topology}, {args.bandwidth:g} Gbit/s at "
              f"{efficiency:.2f} efficiency, "
              f"{args.latency:g} us latency, compute {(base.forward_time + base.backward_time) * 1e3:.2f} ms")
        print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
