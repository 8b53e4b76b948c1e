"""What a communicator's cost formula returns: the price of one way of sending a group.

Communicators own their cost formula (a ``send_cost(codec, profile)`` classmethod beside
their code), and the cost model (:mod:`mergecomp.planning.costmodel`) looks communicators up by
name to call it.  What both sides need — the :class:`SendCost` a formula builds and
:func:`collective_cost`, which reads a measured collective from the profile — lives here,
so that communicators import this module and the cost model, and neither imports the
other's half of the exchange through the back door.  This module imports only the
profile's plain data.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .profile import LinearCost, Profile, WireSize


@dataclass(frozen=True)
class SendCost:
    """How one way of sending a group costs, as functions of its elements n.

    ``encode``: compression (or cast) seconds, not counting the gather copy.
    ``wire``: bytes one rank hands to the collective.  ``collective``: seconds for those
    bytes.  ``relay``: seconds of work between the collective's phases (PS servers),
    occupying the channel.  ``decode``: all the decoding one rank does for the group.
    ``aggregate_passes``: elementwise passes of the aggregation after decoding (allgather:
    the copy of the first decoded payload and N − 1 additions, N in all).
    ``finish``: the measured seconds of the whole finish phase (decode, aggregate, average,
    write-back) for n elements; when set it replaces ``decode`` and the copy passes.
    ``launch``: the measured seconds of the whole hook-side launch (gather copy, memory,
    codec, collective start) for n elements; when set it replaces copy + memory + encode.
    ``memory_share``: the fraction of the group the error-feedback memory runs on (the
    hierarchical exchange compensates only this rank's 1/L shard of the node's sum).
    """

    encode: LinearCost
    wire: WireSize
    collective: LinearCost
    decode: LinearCost = field(default_factory=LinearCost)
    relay: LinearCost = field(default_factory=LinearCost)
    aggregate_passes: int = 0
    finish: Optional[LinearCost] = None
    launch: Optional[LinearCost] = None
    memory_share: float = 1.0


def collective_cost(profile: Profile, kind: str, why: str) -> LinearCost:
    """The profile's measured cost of collective ``kind``; a clear error if it has none
    (``why``: what needs it, for the message)."""
    if kind not in profile.collectives:
        raise ValueError(f"the profile has no {kind!r} cost ({why}); it measured "
                         f"{sorted(profile.collectives) or 'none'}. Re-profile with "
                         f"mergecomp.planning.measure.measure_collective_cost(backend, {kind!r}, sizes)")
    return profile.collectives[kind]
