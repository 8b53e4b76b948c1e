"""Measure a :class:`~mergecomp.planning.profile.Profile` on the machine the job runs on.

:mod:`mergecomp.planning.profile` holds the data (what the cost model knows about one job, plain
JSON); this module takes the measurements — timers and probes — that fill it in:

* :class:`BackwardTimer` — when each gradient becomes ready during backward, with its own
  hooks, plus forward and backward totals (the ``auto`` scheduler records the same
  timeline through the optimizer's hooks instead);
* :func:`measure_compression_cost` — compress and decompress seconds of a compressor as
  ``a + b·n`` for n elements, and the bytes it really puts on the wire;
* :func:`measure_copy_cost`, :func:`measure_memory_cost` — the fused buffer's gather and
  write-back copies, and the error-feedback memory's passes over a group;
* :func:`measure_finish_cost` / :func:`measure_finish_costs` — a group's finish phase
  (decode, aggregate, average, write-back) through the job's own communicator;
* :func:`measure_collective_cost` — ``α + β·bytes`` of each collective at this world size,
  timed on every rank (a collective call: every rank must make it, in the same order);
* :func:`profile_from_timeline` / :func:`assemble_profile` — all of the above around a
  measured timeline, as one :class:`~mergecomp.planning.profile.Profile`.

Local probes take the fastest of a few repeats (noise on a shared machine only adds
time); collective probes take the slowest rank's median (a collective ends when its last
rank does).  Sizes should reach the largest group a plan may form: costs of cache-sized
buffers extrapolate badly to groups of tens of megabytes.
"""
from __future__ import annotations

import copy as copying
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .. import communicators, compressors, memories
from ..communicators.base import Handle
from ..compressors.base import ParamView, accepts_layout, payload_nbytes
from ..distributed.backends.base import Completed
from ..distributed.backends.expect import NUMBER, list_of
from ..plan import COMPRESS_VIA
from .costmodel import priced_collectives
from .timeline import BackwardTimer, _synchronize
from .profile import (COLLECTIVE_KINDS, CodecCost, LinearCost, Profile, TensorTiming, WireSize, fit_from_smallest,
                      fit_linear)


def _best_time(fn, device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` runs: noise (other processes, interrupts) only adds time."""
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def _check_sizes(sizes: Sequence[int], what: str) -> List[int]:
    sizes = list(sizes)
    if len(set(sizes)) < 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"{what} must be at least two distinct positive integers, got {sizes}")
    return sizes


def probe_layout(numel: int, views: Optional[Sequence[int]]):
    """The layout of a probe buffer of ``numel`` elements fused from parameters of
    ``views`` elements each, in that order (a plan fuses consecutive gradients of the
    backward order), cycled as needed, the last view cut at ``numel``; None for
    ``views=None`` (the buffer is one parameter).

    Probes compress with it because a fused group runs other code than a lone tensor:
    EF-SignSGD has one scale per view, and decodes a group of several views with a
    further pass that spreads the scales over the elements; a probe of one view would
    time only the fast path of a group of one parameter."""
    if views is None:
        return None
    sizes = [int(v) for v in views if int(v) > 0]
    if not sizes:
        raise ValueError(f"probe views must hold at least one positive parameter size, got {list(views)!r}")
    layout, offset, i = [], 0, 0
    while offset < numel:
        size = min(sizes[i % len(sizes)], numel - offset)
        layout.append(ParamView(f"profile-view-{i}", torch.Size([size]), offset))
        offset += size
        i += 1
    return tuple(layout)


def _compress(compressor, tensor: torch.Tensor, name: str, layout):
    """``compressor.compress`` with ``layout`` when there is one and the compressor takes one."""
    if layout is not None and accepts_layout(compressor.compress):
        return compressor.compress(tensor, name, layout=layout)
    return compressor.compress(tensor, name)


def _encode_once(compressor, tensor: torch.Tensor, layout=None):
    """(payload tuple, ctx or None, wire bytes): one compression of ``tensor`` (fused as
    ``layout`` says, if given).

    A multi-round compressor (PowerSGD) is driven through its rounds on this rank alone,
    each request summed over one rank (itself); its wire bytes are those of every round.
    """
    if compressor.multi_round:
        if layout is not None and accepts_layout(compressor.rounds):
            rounds = compressor.rounds(tensor, "profile", layout=layout)
        else:
            rounds = compressor.rounds(tensor, "profile")
        wire = 0
        try:
            request = next(rounds)
            while True:
                wire += payload_nbytes(request.tensors)
                request = rounds.send(request.tensors)
        except StopIteration:
            return None, None, wire
    payload, ctx = _compress(compressor, tensor, "profile", layout)
    return payload, ctx, payload_nbytes(payload)


def measure_compression_cost(compressor, sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                             device="cpu", repeats: int = 5, dtype=torch.float32,
                             views: Optional[Sequence[int]] = None) -> CodecCost:
    """Time compress and decompress of ``compressor`` on ``device`` at each size; fit a + b·n.

    ``views``: the sizes of the parameters a group is fused from (the profile passes the
    model's, in backward order); each probe buffer then carries the layout of a group of
    them (:func:`probe_layout`), as the communicator passes it.  None: one view.
    The lines are fitted by :func:`~mergecomp.planning.profile.fit_from_smallest`: the
    smallest size gives the per-call cost, the large sizes the cost per element.

    Inputs are standard-normal tensors (a gradient's distribution matters little to the
    cost of these kernels, but it does to value-dependent payload sizes such as DGC's, for
    which the fitted wire size is an estimate).  The wire size is fitted to the payload
    bytes actually produced.  Multi-round compressors have all their work in ``encode``.
    Compressors that sum payloads in place also get ``add``: what a second payload adds
    to ``decompress_sum``.
    """
    sizes = _check_sizes(sizes, "measure_compression_cost sizes")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    in_place = getattr(compressor, "sums_in_place", False)
    encode, decode, wire, add = [], [], [], []
    for n in sizes:
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        layout = probe_layout(n, views)
        payload, ctx, nbytes = _encode_once(compressor, tensor, layout)  # warm-up, and the wire size
        wire.append(nbytes)
        encode.append(_best_time(lambda: _encode_once(compressor, tensor, layout), device, repeats))
        if payload is None:
            decode.append(0.0)
            continue
        compressor.decompress(payload, ctx)
        decode.append(_best_time(lambda: compressor.decompress(payload, ctx), device, repeats))
        if in_place:  # what a second payload adds to the in-place sum
            one = _best_time(lambda: compressor.decompress_sum([payload], ctx), device, repeats)
            two = _best_time(lambda: compressor.decompress_sum([payload, payload], ctx), device, repeats)
            add.append(max(0.0, two - one))
    wire_fit = _fit_wire(sizes, wire)
    return CodecCost(fit_from_smallest(sizes, encode), fit_from_smallest(sizes, decode), wire_fit,
                     fit_from_smallest(sizes, add) if add else None)


def _fit_wire(sizes: Sequence[int], nbytes: Sequence[int]) -> WireSize:
    line = fit_linear(sizes, nbytes)
    return WireSize(line.slope, line.intercept)


def measure_copy_cost(sizes: Sequence[int] = (2 ** 14, 2 ** 18, 2 ** 22), device="cpu",
                      repeats: int = 5) -> LinearCost:
    """Seconds to copy ``x`` bytes on ``device`` (gather into a fused buffer, write-back)."""
    sizes = _check_sizes(sizes, "measure_copy_cost sizes")
    device = torch.device(device)
    times = []
    for nbytes in sizes:
        source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
        target = torch.empty_like(source)
        target.copy_(source)
        times.append(_best_time(lambda: target.copy_(source), device, repeats))
    return fit_linear(sizes, times)


def measure_memory_cost(memory, compressor, sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                        device="cpu", repeats: int = 3, dtype=torch.float32,
                        views: Optional[Sequence[int]] = None) -> LinearCost:
    """Seconds of ``memory.compensate`` + ``memory.update`` for n elements; fit a + b·n
    (:func:`~mergecomp.planning.profile.fit_from_smallest`).  ``views``: as in
    :func:`measure_compression_cost` (the residual memory decodes the payload, whose cost
    follows the layout).

    Runs on a deep copy of ``memory`` under a probe name, so the job's residuals are
    neither read nor changed.  ``update`` gets a payload of ``compressor`` (as in the
    communicator); for a multi-round compressor only ``compensate`` runs, as there.
    """
    sizes = _check_sizes(sizes, "measure_memory_cost sizes")
    device = torch.device(device)
    probe = copying.deepcopy(memory)
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for n in sizes:
        name = f"profile-memory-{n}"
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        compensated = probe.compensate(tensor, name)
        if compressor.multi_round:
            times.append(_best_time(lambda: probe.compensate(tensor, name), device, repeats))
            continue
        payload, ctx = _compress(compressor, compensated, name, probe_layout(n, views))
        probe.update(compensated, name, compressor, payload, ctx)

        def once():
            probe.update(probe.compensate(tensor, name), name, compressor, payload, ctx)
        times.append(_best_time(once, device, repeats))
    return fit_from_smallest(sizes, times)


def measure_finish_cost(communicator, sizes: Sequence[int], device="cpu", repeats: int = 3,
                        dtype=torch.float32, views: Optional[Sequence[int]] = None) -> LinearCost:
    """Seconds of one group's finish phase for n elements, through ``communicator``; fit a + b·n.

    What ``DistributedOptimizer.synchronize`` does for a group once its collective is
    done: ``communicator.finish`` (decode, aggregate, average) on a completed handle, then
    the write-back of the average into the parameters' gradients (one copy into existing
    tensors).  The handle's result is what the collective would return at this world size:
    for ``allgather`` one payload per rank (copies of a real payload of this compressor,
    each in its own memory, as received), for ``allreduce`` the summed payload.  So the
    probe runs the code the optimizer runs, allocations and page faults of group-sized
    buffers included; sizes should reach the largest group a plan may form.  Each size
    is timed ``repeats`` times after one warm-up; its time is the median (not the
    fastest: the allocations' cost recurs every step).  ``views``: the payloads are made
    with the layout of a group fused from parameters of those sizes (:func:`probe_layout`).  The fit minimizes the absolute
    error (see :func:`fit_linear`): the cost per element grows past the caches, and the
    large groups are the ones whose finish decides a plan's time.

    Local work only (no collective).  Communicators whose finish phase runs collectives
    (``ps``'s second phase, multi-round compressors) cannot be probed this way.
    """
    sizes = _check_sizes(sizes, "measure_finish_cost sizes")
    kind = getattr(communicator, "name", None)
    if kind not in ("allreduce", "allgather"):
        raise ValueError(f"measure_finish_cost probes the allreduce and allgather communicators; "
                         f"{kind!r} runs collectives in its finish phase")
    if communicator.compressor.multi_round:
        raise ValueError(f"compressor {communicator.compressor.name!r} is multi-round: its finish "
                         "phase runs collectives and cannot be probed locally")
    device = torch.device(device)
    world = communicator.backend.size
    generator = torch.Generator(device=device).manual_seed(0)
    times = []
    for n in sizes:
        tensor = torch.randn(n, generator=generator, device=device, dtype=dtype)
        payload, ctx = _compress(communicator.compressor, tensor, f"profile-finish-{n}", probe_layout(n, views))
        target = torch.zeros(n, device=device, dtype=dtype)

        def once():
            if kind == "allgather":
                result = [tuple(part.clone() for part in payload) for _ in range(world)]
            else:
                result = tuple(part.clone() for part in payload)
            _synchronize(device)
            start = time.perf_counter()
            averaged = communicator.finish(Handle("profile-finish", tensor.shape,
                                                  Completed(result), ctx=ctx))
            target.copy_(averaged.reshape(-1))
            _synchronize(device)
            return time.perf_counter() - start
        once()
        times.append(statistics.median(once() for _ in range(repeats)))
        tensor = payload = target = None  # free the group-sized buffers before the next size
    return fit_linear(sizes, times, relative=False)


def measure_collective_cost(backend, kind: str, sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22),
                            repeats: int = 3, device=None) -> LinearCost:
    """Time one collective through ``backend`` at each payload size (bytes per rank); fit α + β·B.

    A collective: every rank must call this with the same ``kind``, ``sizes`` and
    ``repeats`` in the same order.  Each size is timed ``repeats`` times after one warm-up,
    each time starting from a barrier; a rank's time is its median, and the size's time
    is the maximum over ranks (the slowest rank decides when a collective is over).
    The probe runs inside ``backend.uncounted()``, so it does not show up in the
    benchmark's bytes per iteration.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; measure one of {COLLECTIVE_KINDS}")
    sizes = _check_sizes(sizes, "measure_collective_cost sizes")
    device = torch.device(device if device is not None else getattr(backend, "device", "cpu"))
    world = backend.size
    with backend.uncounted():
        local, actual = _time_collective(backend, kind, sizes, repeats, device, world)
        everyone = backend.allgather_object(local, expect=list_of(NUMBER, length=len(local)))
    slowest = [max(per_size) for per_size in zip(*everyone)]
    return fit_linear(actual, slowest)


def measure_link_costs(communicator, sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22)) -> Dict[str, LinearCost]:
    """The intra- and inter-node collective costs of a node layout, timed through the groups
    of ``communicator`` (the hierarchical exchange's ``link_backends()``), keyed as in
    ``Profile.collectives`` (``intra_allreduce``, ``inter_allgather`` …).  A collective:
    every rank, the same sizes."""
    costs = {}
    for link, backend in communicator.link_backends().items():
        for kind in ("allreduce", "allgather"):
            costs[f"{link}_{kind}"] = measure_collective_cost(backend, kind, sizes)
    return costs


def _time_collective(backend, kind: str, sizes: Sequence[int], repeats: int, device: torch.device,
                     world: int) -> Tuple[List[float], List[int]]:
    """This rank's median seconds of ``kind`` at each size, and the bytes each size handed."""
    local, actual = [], []
    for nbytes in sizes:
        if kind == "alltoall":
            per_rank = max(1, nbytes // world)
            chunks = [torch.ones(per_rank, dtype=torch.uint8, device=device) for _ in range(world)]
            actual.append(per_rank * world)

            def op():
                backend.alltoall(chunks)
        else:
            numel = max(1, nbytes // 4)
            tensor = torch.ones(numel, dtype=torch.float32, device=device)
            actual.append(numel * 4)
            if kind == "allreduce":
                def op():
                    backend.allreduce_async([tensor]).wait()
            else:
                def op():
                    backend.allgather_async([tensor], same_shapes=True).wait()
        times = []
        for attempt in range(repeats + 1):
            backend.barrier()
            _synchronize(device)
            start = time.perf_counter()
            op()
            _synchronize(device)
            if attempt:
                times.append(time.perf_counter() - start)
        local.append(statistics.median(times))
    return local, actual


def assemble_profile(timer: BackwardTimer, compressor_name: str, compressor, backend,
                     communicator: str = "allreduce",
                     compression_sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                     collective_sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22)) -> Profile:
    """A full profile from a finished :class:`BackwardTimer` plus codec, copy and collective probes.

    Collective: call on every rank.  Measures the configured compressor and the FP16/BF16
    casts (for raw half-precision sends), allreduce always (raw sends use it), and the
    collectives of ``communicator`` (allgather; PS = alltoall + allgather).
    """
    timeline, forward, backward = timer.result()
    return profile_from_timeline(timeline, forward, backward, timer.device, compressor_name,
                                 compressor, backend, communicator, compression_sizes,
                                 collective_sizes)


def profile_from_timeline(timeline: List[TensorTiming], forward: float, backward: float, device,
                          compressor_name: str, compressor, backend, communicator: str = "allreduce",
                          compression_sizes: Sequence[int] = (2 ** 12, 2 ** 16, 2 ** 20),
                          collective_sizes: Sequence[int] = (2 ** 12, 2 ** 18, 2 ** 22),
                          memory=None, copy_sizes: Sequence[int] = (2 ** 14, 2 ** 18, 2 ** 22),
                          communicator_object=None, finish_sizes: Optional[Sequence[int]] = None,
                          optimizer_step: float = 0.0, extra_collectives: Sequence[str] = (),
                          finish_via: Optional[Sequence[str]] = None) -> Profile:
    """A full profile from a measured backward timeline (however recorded) plus the probes.

    Collective: call on every rank (see :func:`assemble_profile`).  ``memory``: the
    job's error-feedback memory, whose cost is measured on a copy (None: not measured,
    zero).  Sizes should reach the largest group a plan may form: costs measured on
    cache-sized buffers extrapolate badly to tens of megabytes.

    ``communicator_object``: the job's communicator; when given, the finish phase of
    compressed groups is measured through it and that of raw FP32/FP16/BF16 groups through
    allreduce communicators with the casts (:func:`measure_finish_cost`, at
    ``finish_sizes``, by default ``compression_sizes``).  ``optimizer_step``: the wrapped
    optimizer's measured step seconds, stored as they are.  ``extra_collectives``: kinds
    measured besides those the communicator's formula needs (for ``"compress:<name>"``
    send modes priced by other communicators).  ``finish_via``: the communicators of
    ``"compress:<name>"`` modes whose finish phase is probed too (those that can be probed
    locally: allreduce, allgather); None: those of the two whose collectives this profile
    measures, so a hierarchical job's flat allgather mode is priced from its own finish
    (N dense decodes of a fused group) and not from the codec's decode line.

    Every codec, memory and finish probe compresses buffers laid out as groups fused from
    the timeline's parameters (``views``, :func:`probe_layout`): what the optimizer's
    groups run.
    """
    device = torch.device(device)
    views = [t.numel for t in timeline]
    codecs = {compressor_name: measure_compression_cost(compressor, compression_sizes, device, views=views)}
    for half in ("fp16", "bf16"):
        if half not in codecs:
            codecs[half] = measure_compression_cost(compressors.create(half), compression_sizes, device)
    kinds = list(dict.fromkeys(["allreduce", *priced_collectives(communicator),
                                *(kind for kind in extra_collectives if kind in COLLECTIVE_KINDS)]))
    collectives = {kind: measure_collective_cost(backend, kind, collective_sizes)
                   for kind in kinds if kind in COLLECTIVE_KINDS}
    hierarchy = {}
    if any(kind not in COLLECTIVE_KINDS for kind in kinds):  # a node layout's links (hierarchical)
        if not callable(getattr(communicator_object, "link_backends", None)):
            raise ValueError(f"communicator {communicator!r} prices the links of a node layout: pass the "
                             "job's communicator as communicator_object, whose groups they are measured through")
        collectives.update(measure_link_costs(communicator_object, collective_sizes))
        hierarchy = dict(communicator_object.hierarchy)
    finish = {}
    if communicator_object is not None:
        if finish_via is None:
            finish_via = [name for name in LOCAL_FINISH if name != communicator
                          and all(kind in collectives for kind in priced_collectives(name))]
        finish = measure_finish_costs(communicator_object, compressor_name,
                                      compression_sizes if finish_sizes is None else finish_sizes, device,
                                      views=views, via=finish_via)
    return Profile(world_size=backend.size, timeline=timeline, forward_time=forward,
                   backward_time=backward, compressor=compressor_name, communicator=communicator,
                   codecs=codecs, collectives=collectives,
                   copy=measure_copy_cost(copy_sizes, device=device), device=str(device),
                   memory=LinearCost() if memory is None else
                   measure_memory_cost(memory, compressor, compression_sizes, device, views=views),
                   finish=finish, optimizer_step=optimizer_step, hierarchy=hierarchy)


#: The communicators whose finish phase is local work, which :func:`measure_finish_cost` probes.
LOCAL_FINISH = ("allreduce", "allgather")


def measure_finish_costs(communicator, compressor_name: str, sizes: Sequence[int],
                         device="cpu", views: Optional[Sequence[int]] = None,
                         via: Sequence[str] = ()) -> Dict[str, LinearCost]:
    """:func:`measure_finish_cost` of every send mode the cost model prices: raw FP32,
    FP16 and BF16 groups (an allreduce communicator with the cast, as the optimizer builds
    for raw groups), when ``communicator`` can be probed locally compressed groups, and
    ``"compress:<name>"`` for each name in ``via`` that can be (allreduce, allgather): a
    communicator of that name around the job's compressor, as the optimizer builds for
    such groups.  A name that cannot carry the compressor (it refuses it, as it would
    refuse the plan) or whose finish runs collectives is left out: the formula prices it.
    ``views``: compressed payloads carry the layout of groups fused from parameters of
    those sizes (:func:`probe_layout`)."""
    costs = {}
    for send in ("fp32", "fp16", "bf16"):
        raw = communicators.create("allreduce", compressor=compressors.create("none" if send == "fp32" else send),
                                   memory=memories.create("none"), backend=communicator.backend)
        costs[send] = measure_finish_cost(raw, sizes, device)
    if compressor_name in ("none", "fp32"):
        costs["compress"] = costs["fp32"]
    elif getattr(communicator, "name", None) in LOCAL_FINISH and not communicator.compressor.multi_round:
        costs["compress"] = measure_finish_cost(communicator, sizes, device, views=views)
    if compressor_name in ("none", "fp32") or communicator.compressor.multi_round:
        return costs
    for name in dict.fromkeys(via):
        if name not in LOCAL_FINISH:
            continue
        if name == getattr(communicator, "name", None) and "compress" in costs:
            costs[COMPRESS_VIA + name] = costs["compress"]
            continue
        try:
            other = communicators.create(name, compressor=communicator.compressor,
                                         memory=memories.create("none"), backend=communicator.backend)
        except (TypeError, ValueError):
            continue
        costs[COMPRESS_VIA + name] = measure_finish_cost(other, sizes, device, views=views)
    return costs
