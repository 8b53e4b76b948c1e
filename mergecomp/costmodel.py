"""Predict the iteration time of a Plan from a Profile.

The model follows what :class:`~mergecomp.optimizer.DistributedOptimizer` does, step by
step, with the linear costs of :mod:`mergecomp.profile`:

1. **Launch.**  A group launches from the hook of the gradient that completes it, in plan
   order (a complete group waits for the groups before it).  Launching copies the group's
   gradients into its fused buffer and compresses it: ``encode = copy(bytes) + codec(n)``.
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
4. **Finish** (in ``step()``, after backward): groups are finished in plan order; each waits
   for its collective, decodes, aggregates, averages and writes the result back into
   ``p.grad``: ``finish = decode(n) + (aggregate_passes + 2) × copy(bytes)``.

Iteration time = forward + the time the last group is finished, which is
``max(backward end + Σ finish, max over groups g of (comm end of g + Σ finish of g and later))``
— the max-plus form of the sequential finish loop.  A profile of a job whose collectives
all hide under backward therefore still pays for decoding and write-back after backward,
which a "last group only" formula would miss.

The same state update (:func:`advance`) drives :func:`predict` and the optimal scheduler's
dynamic program, so the scheduler optimizes exactly what this module predicts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

from .plan import Plan
from .profile import LinearCost, Profile, WireSize

#: Elementwise passes over a group after decoding: the division by the world size, and the
#: copy of each slice into ``p.grad``.
WRITE_BACK_PASSES = 2

RAW_SENDS = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class SendCost:
    """How one way of sending a group costs, as functions of its elements n.

    ``encode``: compression (or cast) seconds, not counting the gather copy.
    ``wire``: bytes one rank hands to the collective.  ``collective``: seconds for those
    bytes.  ``relay``: seconds of work between the collective's phases (PS servers),
    occupying the channel.  ``decode``: all the decoding one rank does for the group.
    ``aggregate_passes``: elementwise additions after decoding (allgather: N − 1).
    """

    encode: LinearCost
    wire: WireSize
    collective: LinearCost
    decode: LinearCost = field(default_factory=LinearCost)
    relay: LinearCost = field(default_factory=LinearCost)
    aggregate_passes: int = 0


@dataclass(frozen=True)
class GroupCost:
    """Seconds of one group's three phases (see the module docstring)."""

    encode: float
    communicate: float
    finish: float
    wire_bytes: float


def group_cost(send: SendCost, copy: LinearCost, numel: int, nbytes: int) -> GroupCost:
    """The phases of a group of ``numel`` elements (``nbytes`` bytes in its own dtype)."""
    element_size = nbytes // numel
    wire = send.wire(numel, element_size)
    return GroupCost(encode=copy(nbytes) + send.encode(numel),
                     communicate=send.collective(wire) + send.relay(numel),
                     finish=send.decode(numel) + (send.aggregate_passes + WRITE_BACK_PASSES) * copy(nbytes),
                     wire_bytes=wire)


def send_costs(profile: Profile) -> Dict[str, SendCost]:
    """The send modes this profile can price: ``fp32`` always, ``fp16``/``bf16`` when their
    codecs were measured, ``compress`` when the configured compressor's codec was.

    Compressed payloads travel by the profile's communicator: allreduce (one decode),
    allgather (N payloads decoded, N − 1 additions), or ``ps`` (alltoall of the payload
    in N shards, then allgather of the recompressed 1/N shard; the servers' decode of N
    shards and re-encode of one are relay work on the channel, their summation is not
    modelled).
    """
    allreduce = _collective(profile, "allreduce", "raw groups travel by allreduce")
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
    codec, world = profile.codecs[name], profile.world_size
    if profile.communicator == "allreduce":
        costs["compress"] = SendCost(codec.encode, codec.wire, allreduce, codec.decode)
    elif profile.communicator == "allgather":
        costs["compress"] = SendCost(codec.encode, codec.wire,
                                     _collective(profile, "allgather", "the allgather communicator"),
                                     codec.decode.scaled(world, world), aggregate_passes=world - 1)
    elif profile.communicator == "ps":
        alltoall = _collective(profile, "alltoall", "the PS communicator's first phase")
        allgather = _collective(profile, "allgather", "the PS communicator's second phase")
        costs["compress"] = SendCost(
            codec.encode, codec.wire, alltoall + allgather.scaled(1, 1 / world),
            decode=codec.decode.scaled(world, 1),
            relay=codec.decode.scaled(world, 1) + codec.encode.scaled(1, 1 / world))
    else:
        raise ValueError(f"no cost formula for communicator {profile.communicator!r}; the cost "
                         "model knows 'allreduce', 'allgather' and 'ps'")
    return costs


def _collective(profile: Profile, kind: str, why: str) -> LinearCost:
    if kind not in profile.collectives:
        raise ValueError(f"the profile has no {kind!r} cost ({why}); it measured "
                         f"{sorted(profile.collectives) or 'none'}. Re-profile with "
                         f"measure_collective_cost(backend, {kind!r}, sizes)")
    return profile.collectives[kind]


# ------------------------------------------------------------------------- the timeline step
#: The state after some groups have launched: (A, F, Q, G).
#: A: on compute, the total encode delay added to backward so far; off compute, the time
#:    the compression worker becomes free.
#: F: the time the channel becomes free (the last collective's end).
#: Q: the time the finish loop would be done with these groups if backward ended at 0.
#: G: seconds added after the uncompressed backward end: encode delay (on compute) + Σ finish.
State = Tuple[float, float, float, float]
START: State = (0.0, 0.0, 0.0, 0.0)


def advance(state: State, ready: float, cost: GroupCost, on_compute: bool):
    """Launch one group whose completing gradient was ready at ``ready`` (uncompressed time).

    Returns (new state, launch, encode end, collective start, collective end).  Every
    component of the new state is a non-decreasing function of every component of the old
    one — the property that makes the optimal scheduler's dynamic program exact.
    """
    delay_or_worker, channel, finish_loop, added = state
    if on_compute:
        launch = ready + delay_or_worker
        encoded = launch + cost.encode
        new_first = delay_or_worker + cost.encode
        added = added + cost.encode + cost.finish
    else:
        launch = ready
        encoded = max(delay_or_worker, ready) + cost.encode
        new_first = encoded
        added = added + cost.finish
    start = max(encoded, channel)
    end = start + cost.communicate
    finish_loop = max(finish_loop, end) + cost.finish
    return (new_first, end, finish_loop, added), launch, encoded, start, end


def finish_time(state: State, backward_time: float) -> float:
    """When ``step()`` is done with every group: ``max(backward end + Σ finish, Q)``."""
    return max(backward_time + state[3], state[2])


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
    """Predicted iteration: forward + backward (with overlap) + the finish loop."""

    iteration_time: float
    forward_time: float
    backward_end: float
    groups: Tuple[GroupTiming, ...]

    def describe(self) -> str:
        lines = [f"iteration {self.iteration_time * 1e3:.3f} ms = forward {self.forward_time * 1e3:.3f} ms"
                 f" + backward/finish {(self.iteration_time - self.forward_time) * 1e3:.3f} ms "
                 f"(backward ends at {self.backward_end * 1e3:.3f} ms)",
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
    profile.  Groups may be any partition of the profiled tensors; they launch from the
    hooks in plan order, as in the optimizer.
    """
    costs = send_costs(profile) if costs is None else costs
    timeline = profile.timeline
    plan.validate(t.name for t in timeline)
    index = {t.name: i for i, t in enumerate(timeline)}
    group_of = {name: g for g, group in enumerate(plan.groups) for name in group.names}
    remaining = [len(group.names) for group in plan.groups]
    phases = [_phases(group, timeline, index, costs, profile.copy) for group in plan.groups]
    state, launched, records = START, 0, []
    for tensor in timeline:
        remaining[group_of[tensor.name]] -= 1
        while launched < len(plan.groups) and remaining[launched] == 0:
            state, launch, encoded, start, end = advance(state, tensor.ready, phases[launched][0],
                                                         compression_on_compute)
            records.append((launch, encoded, start, end))
            launched += 1
    backward_end = profile.backward_time + (state[0] if compression_on_compute else 0.0)
    clock, groups = backward_end, []
    for g, (group, (cost, numel, nbytes)) in enumerate(zip(plan.groups, phases)):
        launch, encoded, start, end = records[g]
        finish_start = max(clock, end)
        clock = finish_start + cost.finish
        groups.append(GroupTiming(g, group.send, numel, nbytes, cost.wire_bytes, launch, encoded,
                                  start, end, finish_start, clock))
    return Prediction(profile.forward_time + clock, profile.forward_time, backward_end, tuple(groups))


def _phases(group, timeline, index, costs, copy) -> Tuple[GroupCost, int, int]:
    if group.send not in costs:
        raise ValueError(f"plan group [{group.names[0]} ..] is sent {group.send!r}, which this "
                         f"profile cannot price (it prices {sorted(costs)}); measure that codec "
                         "into the profile or plan without it")
    members = [timeline[index[n]] for n in group.names]
    numel = sum(t.numel for t in members)
    nbytes = sum(t.nbytes for t in members)
    return group_cost(costs[group.send], copy, numel, nbytes), numel, nbytes
