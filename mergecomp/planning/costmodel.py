"""Predict the iteration time of a Plan from a Profile.

The model follows what :class:`~mergecomp.optimizer.DistributedOptimizer` does, step by
step, with the linear costs of :mod:`mergecomp.planning.profile`:

1. **Launch.**  A group launches from the hook of the gradient that completes it, in plan
   order (a complete group waits for the groups before it).  Launching copies the group's
   gradients into its fused buffer, runs the error-feedback memory (compensate, update) and
   compresses it: ``encode = copy(bytes) + memory(n) + codec(n)``; raw groups share the
   memory, so they pay ``memory(n)`` too.
2. **Where encoding runs** is an explicit choice, ``compression_on_compute``:

   * ``True`` (the default, and what the optimizer does): encoding runs inside the hook,
     on the thread (CPU) or stream (GPU) that runs backward, as in MergeComp (Wang et al.,
     2021) and HiPress (Bai et al., SOSP 2021).  It delays every later gradient and the end
     of backward by its duration.
   * ``False``: encoding runs on a separate worker (one FIFO compression stream/thread),
     overlapping backward but serialized with other groups' encoding.

3. **Communicate.**  One channel, FIFO in plan order: a group's collective starts when its
   encoding is done and the previous collective has finished, and takes
   ``collective(wire bytes) + relay(n)`` (relay: server-side work of a parameter server).
   Raw groups (``fp32``/``fp16``/``bf16``) send ``n × width`` bytes through allreduce.
   A communicator whose launch waits for a first phase (the sparse allreduce's and the
   PS's all-to-all, then the owners' or servers' sums: ``SendCost.blocking``) holds the
   launch until the channel is free and that phase is done, so backward waits with it
   (encoding off compute: the compression worker waits); the rest of the collective runs
   on the channel as any other.
4. **Finish** (in ``step()``, after backward): groups are finished in plan order; each waits
   for its collective, decodes, aggregates, averages and writes the result back into
   ``p.grad``.  ``finish(n)`` is the profile's measured cost of that whole phase for the
   group's send mode (``profile.finish``, probed through the job's communicator at sizes
   up to the largest group: on a CPU the phase allocates and touches a group-sized buffer
   per decoded payload, which dominates and does not extrapolate from small probes);
   profiles without it price it as ``decode(n) + (aggregate_passes + 2) × copy(bytes)``.
5. **Optimizer step**: the wrapped optimizer's ``step()``, ``profile.optimizer_step``
   seconds measured on the live run, after the last group is finished.

Iteration time = forward + the time the last group is finished + the optimizer step, where
the finish time is
``max(backward end + Σ finish, max over groups g of (comm end of g + Σ finish of g and later))``
— the max-plus form of the sequential finish loop.  A profile of a job whose collectives
all hide under backward therefore still pays for decoding and write-back after backward,
which a "last group only" formula would miss.

**Interference** (``profile.interference`` = k ≥ 1, measured on the live run by the ``auto``
scheduler, 1.0 in older profiles).  A collective is not free for the processor: the
communication library's threads and the kernel's network stack take CPU time and memory
bandwidth from the thread that runs backward (on a CPU host, markedly so while a large
allreduce runs).  So compute on the backward thread — backward itself and the encoding in
the hooks — runs k times slower while the channel is busy.  Between two launches the channel is busy from the
moment backward resumes (W) until its last collective ends (F), one contiguous interval,
since every collective starts at its group's encode end or at the previous one's end; c
seconds of compute therefore take ``c + stretch(c, F − W)`` with
``stretch(c, b) = min((k − 1)·c, (1 − 1/k)·max(b, 0))``: all of it at 1/k speed while the
channel is busy, the rest at full speed.  The same holds for the end of backward after
the last launch.  Decoding and write-back after backward are not stretched; how compute slows the
collectives is the collective slowdown below.
The term is modelled with compression on compute only (off compute the backward delay
would need a fifth state component); :func:`predict` refuses k ≠ 1 off compute.

**Collective slowdown** (``profile.collective_slowdown`` = c ≥ 1, measured by ``auto``
from a short allreduce timed under backward and alone; 1.0 in older profiles).  The other
direction of the same contention: a collective runs c times slower while compute runs on
the backward thread.  On compute, that thread is busy from the start of backward to its
end, so a collective starting at s overlaps compute until backward ends; at the time a
group launches, backward ends no earlier than ``T_b + A`` (its uncompressed end plus the
delay so far, this group's encoding included; later hooks and the tail's stretch only
add).  So a collective of d seconds starting at s ends at
``s + d + stretch(d, T_b + A − s, c)``: at 1/c speed until ``T_b + A``, at full speed
after.  Counting the overlap only to that lower bound of backward's end under-states the
slowdown of collectives that run past it, but keeps the end non-decreasing in s and in A
(raising s by x lowers the stretch by at most (1 − 1/c)·x), so the DP stays exact.  Like
k, c is modelled with compression on compute only.

**Live launch and finish costs.**  ``profile.launch`` (when present for the send mode)
replaces ``copy + memory + codec`` as a group's encode cost, and ``profile.finish`` its
finish cost; ``auto`` fits both from groups timed inside the optimizer during its check
of candidate plans.  Launches are timed only for the first group of a step, when no
collective of the step is in flight, so the fit carries no interference the model would
count twice.

The same state update (:func:`advance`) drives :func:`predict` and the optimal scheduler's
dynamic program, so the scheduler optimizes exactly what this module predicts.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .. import communicators
from ..plan import COMPRESS_VIA, Plan, send_communicator
from .profile import LinearCost, Profile, WireSize
from ..communicators.cost import SendCost, collective_cost

#: Elementwise passes over a group after decoding: the division by the world size, and the
#: copy of each slice into ``p.grad``.
WRITE_BACK_PASSES = 2

RAW_SENDS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class GroupCost:
    """Seconds of one group's three phases (see the module docstring)."""

    encode: float
    communicate: float
    finish: float
    wire_bytes: float
    blocking: Optional[float] = None  # the part of communicate the launch waits for


def group_cost(send: SendCost, copy: LinearCost, numel: int, nbytes: int,
               memory: LinearCost = LinearCost()) -> GroupCost:
    """The phases of a group of ``numel`` elements (``nbytes`` bytes in its own dtype);
    ``memory``: the error-feedback memory's cost per group (the profile's)."""
    element_size = nbytes // numel
    wire = send.wire(numel, element_size)
    if send.finish is not None:
        finish = send.finish(numel)
    else:
        finish = send.decode(numel) + (send.aggregate_passes + WRITE_BACK_PASSES) * copy(nbytes)
    if send.launch is not None:
        encode = send.launch(numel)
    else:
        encode = copy(nbytes) + memory(numel * send.memory_share) + send.encode(numel)
    blocking = None if send.blocking is None else send.blocking(wire) + send.relay(numel)
    return GroupCost(encode=encode,
                     communicate=send.collective(wire) + send.relay(numel),
                     finish=finish, wire_bytes=wire, blocking=blocking)


def send_costs(profile: Profile, via: Sequence[str] = ()) -> Dict[str, SendCost]:
    """The send modes this profile can price: ``fp32`` always, ``fp16``/``bf16`` when their
    codecs were measured, ``compress`` when the configured compressor's codec was, and
    ``compress:<name>`` for each communicator name in ``via``.

    A send mode with a measured finish cost in ``profile.finish`` uses it for the whole
    finish phase; otherwise the phase is priced from the decode cost and copy passes.
    Compressed payloads travel by the profile's communicator (``compress``) or by the one
    a ``compress:<name>`` mode names, priced by that communicator's own formula
    (:func:`communicator_formula`): allreduce (one decode), allgather (N payloads decoded,
    then aggregated), ``ps`` (two collectives, the servers' work as relay on the channel),
    ``sparse_allreduce`` (an all-to-all, the owners' sums, an allgather of 1/N), or a
    plugin's ``send_cost``.  A plugin communicator that declares no formula is refused
    (:class:`NoCostFormula`), never priced as another one; so is a formula whose
    collectives the profile did not measure.

    A send mode with a measured launch cost in ``profile.launch`` uses it as its encode
    cost (gather copy, memory and codec together).
    """
    costs = _formula_costs(profile, via)
    return {send: replace(cost, finish=profile.finish.get(send, cost.finish),
                          launch=profile.launch.get(send, cost.launch))
            for send, cost in costs.items()}


def _formula_costs(profile: Profile, via: Sequence[str] = ()) -> Dict[str, SendCost]:
    allreduce = collective_cost(profile, "allreduce", "raw groups travel by allreduce")
    costs = {"fp32": SendCost(LinearCost(), WireSize(None), allreduce)}
    for half in ("fp16", "bf16"):
        if half in profile.codecs:
            codec = profile.codecs[half]
            costs[half] = SendCost(codec.encode, codec.wire, allreduce, codec.decode)
    name = profile.compressor
    if name in ("none", "fp32"):
        costs["compress"] = costs["fp32"]
        return costs
    if name not in profile.codecs:
        return costs
    costs["compress"] = communicator_formula(profile.communicator).send_cost(profile.codecs[name], profile)
    for communicator in via:
        costs[COMPRESS_VIA + communicator] = communicator_formula(communicator).send_cost(profile.codecs[name],
                                                                                          profile)
    return costs


# --------------------------------------------------------------------- communicators' formulas
class NoCostFormula(ValueError):
    """A communicator declares no cost formula: the cost model cannot price its groups."""


def communicator_formula(name: str) -> type:
    """The registered communicator class ``name``, which prices its compressed groups.

    A communicator owns its cost formula, beside its code: a classmethod
    ``send_cost(codec, profile) -> SendCost`` (``codec``: the compressor's
    :class:`~mergecomp.planning.profile.CodecCost`; the profile gives the world size and the
    collectives' measured costs, read with :func:`collective_cost`), the tuple
    ``cost_collectives`` of the collective kinds the formula needs measured (the probes
    measure them), and ``phases_are_local`` (see :func:`phases_are_local`).  ``ValueError``
    for a name that is not registered; :class:`NoCostFormula` for a class without
    ``send_cost``.
    """
    cls = communicators.get(name)
    if not callable(getattr(cls, "send_cost", None)):
        raise NoCostFormula(
            f"communicator {name!r} ({cls.__module__}.{cls.__qualname__}) declares no cost formula, so "
            "the cost model cannot price its compressed groups. Give the class a classmethod "
            "send_cost(cls, codec, profile) returning a mergecomp.communicators.cost.SendCost, and "
            "cost_collectives naming the collectives it uses (see AllgatherCommunicator in "
            "mergecomp/communicators/allgather.py); or use a schedule that needs no cost model "
            "(a fusion-num, 'bucket' or 'binary').")
    return cls


def priced_collectives(name: str) -> Tuple[str, ...]:
    """The collective kinds communicator ``name``'s formula needs measured (allreduce,
    which raw groups use, always is); none for an unknown name or one without a formula."""
    try:
        cls = communicators.get(name)
    except ValueError:
        return ()
    return tuple(getattr(cls, "cost_collectives", ())) if callable(getattr(cls, "send_cost", None)) else ()


def phases_are_local(name: str) -> bool:
    """Whether communicator ``name`` declares (``phases_are_local = True``) that a group's
    launch (``start``) and finish, as the optimizer times them, are local work that waits
    on no collective: then lines fitted to those times in the live run may price its
    compressed groups.  False for PS (``start`` waits for an alltoall), for an unknown name
    and for a communicator that does not say."""
    try:
        return bool(getattr(communicators.get(name), "phases_are_local", False))
    except ValueError:
        return False


# ------------------------------------------------------------------------- the timeline step
#: The state after some groups have launched: (A, F, Q, H).
#: A: on compute, the total delay added to backward so far (encoding, and the stretch of
#:    compute by interference); off compute, the time the compression worker becomes free.
#: F: the time the channel becomes free (the last collective's end).
#: Q: the time the finish loop would be done with these groups if backward ended at 0.
#: H: Σ finish of these groups.  Seconds added after the uncompressed backward end are
#:    A + H (+ the stretch of backward's tail) on compute, H off compute.
State = Tuple[float, float, float, float]
START: State = (0.0, 0.0, 0.0, 0.0)


def stretch(work: float, busy: float, interference: float) -> float:
    """Seconds added to ``work`` seconds of compute when the channel stays busy for the next
    ``busy`` seconds and compute runs ``interference`` (k ≥ 1) times slower meanwhile:
    ``min((k − 1)·work, (1 − 1/k)·max(busy, 0))``.  Non-decreasing in ``work`` and ``busy``;
    raising the start of the work by x lowers it by at most (1 − 1/k)·x < x."""
    if interference == 1.0:
        return 0.0
    return min((interference - 1.0) * work, (1.0 - 1.0 / interference) * max(busy, 0.0))


def advance(state: State, ready: float, cost: GroupCost, on_compute: bool,
            interference: float = 1.0, since: float = 0.0, slowdown: float = 1.0,
            backward_time: float = 0.0):
    """Launch one group whose completing gradient was ready at ``ready`` (uncompressed time).

    ``since``: the uncompressed ready time of the previous launch (0 for the first group):
    the compute between the two launches, ``ready − since`` of backward plus this group's
    encoding, is what interference stretches (see the module docstring).  ``slowdown``:
    the collective slowdown c, applied to the part of the collective before
    ``backward_time + A`` (the uncompressed backward end ``backward_time`` plus the delay
    A after this group's encoding: a lower bound of when backward ends).

    Returns (new state, launch, encode end, collective start, collective end).  Every
    component of the new state is a non-decreasing function of every component of the old
    one — the property that makes the optimal scheduler's dynamic program exact (A enters
    as ``A + stretch(…, F − since − A)``, which grows with A at rate ≥ 1/k > 0; the
    collective's end ``s + d + stretch(d, T_b + A − s, c)`` grows with its start s at rate
    ≥ 1/c and with A).
    """
    delay_or_worker, channel, finish_loop, finished = state
    if on_compute:
        busy = channel - (since + delay_or_worker)
        compute = ready - since
        launch = (ready + delay_or_worker) + stretch(compute, busy, interference)
        new_first = (delay_or_worker + stretch(compute + cost.encode, busy, interference)) + cost.encode
        encoded = ready + new_first
    else:
        if interference != 1.0 or slowdown != 1.0:
            raise ValueError(_OFF_COMPUTE_INTERFERENCE.format(interference, slowdown))
        launch = ready
        encoded = max(delay_or_worker, ready) + cost.encode
        new_first = encoded
    start = max(encoded, channel)
    begin, rest = start, cost.communicate
    if cost.blocking is not None:  # the launch waits for the channel, then the first phase
        begin, rest = start + cost.blocking, cost.communicate - cost.blocking
        new_first = new_first + (begin - encoded) if on_compute else begin
    end = begin + rest
    if on_compute:
        end = end + stretch(rest, (backward_time + new_first) - begin, slowdown)
    finish_loop = max(finish_loop, end) + cost.finish
    return (new_first, end, finish_loop, finished + cost.finish), launch, encoded, start, end


_OFF_COMPUTE_INTERFERENCE = (
    "the profile's interference factor {!r} and collective slowdown {!r} are modelled with "
    "compression on compute only; predict with compression_on_compute=True, or use "
    "dataclasses.replace(profile, interference=1.0, collective_slowdown=1.0) to ignore them")


def backward_end(state: State, backward_time: float, on_compute: bool = True,
                 interference: float = 1.0, last_ready: float = 0.0) -> float:
    """When backward ends: its uncompressed end plus the delay A and the stretch of the
    compute after the last launch (at uncompressed ``last_ready``) while the channel is busy."""
    if not on_compute:
        return backward_time
    delay, channel = state[0], state[1]
    tail = stretch(backward_time - last_ready, channel - (last_ready + delay), interference)
    return (backward_time + delay) + tail


def finish_time(state: State, backward_time: float, on_compute: bool = True,
                interference: float = 1.0, last_ready: float = 0.0) -> float:
    """When ``step()`` is done with every group: ``max(backward end + Σ finish, Q)``."""
    return max(backward_end(state, backward_time, on_compute, interference, last_ready) + state[3],
               state[2])


# ------------------------------------------------------------------------------- prediction
@dataclass(frozen=True)
class GroupTiming:
    """One group on the predicted timeline (seconds from the start of backward)."""

    index: int
    send: str
    numel: int
    nbytes: int
    wire_bytes: float
    launch: float
    encode_end: float
    comm_start: float
    comm_end: float
    finish_start: float
    finish_end: float


@dataclass(frozen=True)
class Prediction:
    """Predicted iteration: forward + backward (with overlap) + the finish loop + the
    optimizer's step."""

    iteration_time: float
    forward_time: float
    backward_end: float
    groups: Tuple[GroupTiming, ...]
    optimizer_step: float = 0.0

    def describe(self) -> str:
        middle = self.iteration_time - self.forward_time - self.optimizer_step
        lines = [f"iteration {self.iteration_time * 1e3:.3f} ms = forward {self.forward_time * 1e3:.3f} ms"
                 f" + backward/finish {middle * 1e3:.3f} ms + optimizer step "
                 f"{self.optimizer_step * 1e3:.3f} ms (backward ends at {self.backward_end * 1e3:.3f} ms)",
                 f"{'group':>5} {'send':>8} {'MB':>9} {'wire MB':>9} {'launch':>9} {'comm':>19} {'done':>9}"]
        for g in self.groups:
            lines.append(f"{g.index:>5} {g.send:>8} {g.nbytes / 1e6:>9.3f} {g.wire_bytes / 1e6:>9.3f} "
                         f"{g.launch * 1e3:>9.3f} {g.comm_start * 1e3:>9.3f}-{g.comm_end * 1e3:<9.3f} "
                         f"{g.finish_end * 1e3:>9.3f}")
        return "\n".join(lines)


def predict(plan: Plan, profile: Profile, costs: Optional[Mapping[str, SendCost]] = None,
            compression_on_compute: bool = True) -> Prediction:
    """Predicted iteration time and per-group timeline of ``plan`` (see the module docstring).

    ``costs`` maps send modes to :class:`SendCost`; by default :func:`send_costs` of the
    profile, with the ``compress:<name>`` modes the plan uses.  Groups may be any partition of the profiled tensors; they launch from the
    hooks in plan order, as in the optimizer.
    """
    if costs is None:  # the job's modes, and each communicator a "compress:<name>" group names
        costs = send_costs(profile, sorted({send_communicator(g.send) for g in plan.groups} - {None}))
    timeline = profile.timeline
    interference, slowdown = profile.interference, profile.collective_slowdown
    if not compression_on_compute and (interference != 1.0 or slowdown != 1.0):
        raise ValueError(_OFF_COMPUTE_INTERFERENCE.format(interference, slowdown))
    numels = {t.name: t.numel for t in timeline}
    plan.validate((t.name for t in timeline), numels)
    index = {t.name: i for i, t in enumerate(timeline)}
    pieces = plan.pieces(numels)
    groups_of: Dict[str, List[int]] = {}  # a sliced tensor completes a piece of several groups
    for g, members in enumerate(pieces):
        for name, _, _ in members:
            groups_of.setdefault(name, []).append(g)
    remaining = [len(members) for members in pieces]
    phases = [_phases(group, members, timeline, index, costs, profile.copy, profile.memory)
              for group, members in zip(plan.groups, pieces)]
    state, launched, records, since = START, 0, [], 0.0
    for tensor in timeline:
        for g in groups_of[tensor.name]:
            remaining[g] -= 1
        while launched < len(plan.groups) and remaining[launched] == 0:
            state, launch, encoded, start, end = advance(state, tensor.ready, phases[launched][0],
                                                         compression_on_compute, interference, since,
                                                         slowdown, profile.backward_time)
            records.append((launch, encoded, start, end))
            since = tensor.ready
            launched += 1
    ended = backward_end(state, profile.backward_time, compression_on_compute, interference, since)
    clock, groups = ended, []
    for g, (group, (cost, numel, nbytes)) in enumerate(zip(plan.groups, phases)):
        launch, encoded, start, end = records[g]
        finish_start = max(clock, end)
        clock = finish_start + cost.finish
        groups.append(GroupTiming(g, group.send, numel, nbytes, cost.wire_bytes, launch, encoded,
                                  start, end, finish_start, clock))
    return Prediction(profile.forward_time + clock + profile.optimizer_step, profile.forward_time,
                      ended, tuple(groups), profile.optimizer_step)


def _phases(group, members, timeline, index, costs, copy, memory) -> Tuple[GroupCost, int, int]:
    if group.send not in costs:
        raise ValueError(f"plan group [{group.names[0]} ..] is sent {group.send!r}, which this "
                         f"profile cannot price (it prices {sorted(costs)}); measure that codec "
                         "into the profile or plan without it")
    numel = sum(stop - start for _, start, stop in members)
    nbytes = sum(timeline[index[n]].element_size * (stop - start) for n, start, stop in members)
    return group_cost(costs[group.send], copy, numel, nbytes, memory), numel, nbytes
