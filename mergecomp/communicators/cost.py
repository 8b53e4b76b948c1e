"""What a communicator's cost formula returns: the price of one way of sending a group.

Communicators own their cost formula (a ``send_cost(codec, profile)`` classmethod beside
their code), and the cost model (:mod:`mergecomp.planning.costmodel`) looks communicators up by
name to call it.  What both sides need — the :class:`SendCost` a formula builds and
:func:`collective_cost`, which reads a measured collective from the profile — lives here,
so that communicators import this module and the cost model, and neither imports the
other's half of the exchange through the back door.  The terms it is made of
(:class:`LinearCost`, :class:`WireSize`, which a profile stores too) are defined here, so
that this module imports nothing of the package: a leaf below the communicators.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

@dataclass(frozen=True)
class LinearCost:
    """``intercept + slope·x`` seconds; x is elements or bytes, as the field using it says."""

    intercept: float = 0.0
    slope: float = 0.0

    def __post_init__(self):
        for what in ("intercept", "slope"):
            value = getattr(self, what)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 \
                    or value == float("inf"):
                raise ValueError(f"a cost's {what} must be a finite number ≥ 0 seconds, got {value!r}")

    def __call__(self, x: float) -> float:
        return self.intercept + self.slope * x

    def __add__(self, other: "LinearCost") -> "LinearCost":
        return LinearCost(self.intercept + other.intercept, self.slope + other.slope)

    def scaled(self, intercept_factor: float, slope_factor: float) -> "LinearCost":
        """The cost of ``intercept_factor`` calls that together handle ``slope_factor``·x."""
        return LinearCost(self.intercept * intercept_factor, self.slope * slope_factor)

    def to_dict(self) -> dict:
        return {"intercept": self.intercept, "slope": self.slope}

    @classmethod
    def from_dict(cls, data, what: str = "cost") -> "LinearCost":
        try:
            return cls(float(data["intercept"]), float(data["slope"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{what}: expected {{'intercept': seconds, 'slope': seconds per unit}}, "
                             f"got {data!r} ({error})") from None


@dataclass(frozen=True)
class WireSize:
    """Bytes one rank puts on the wire for n elements: ``header + per_element·n``.

    ``per_element=None`` means the tensor travels at its own width (raw FP32 sends).
    """

    per_element: Optional[float] = None
    header: float = 0.0

    def __call__(self, numel: int, element_size: int) -> float:
        per = element_size if self.per_element is None else self.per_element
        return self.header + per * numel

    def to_dict(self) -> dict:
        return {"per_element": self.per_element, "header": self.header}

    @classmethod
    def from_dict(cls, data, what: str = "wire") -> "WireSize":
        try:
            per = data["per_element"]
            return cls(None if per is None else float(per), float(data.get("header", 0.0)))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{what}: expected {{'per_element': bytes, 'header': bytes}}, got "
                             f"{data!r} ({error})") from None




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
    ``blocking``: the part of ``collective`` (seconds for the wire bytes) that the launch
    waits for, a synchronous first phase such as an all-to-all, after which the relay work
    also runs in the launch; None when the launch only starts the collective.  A blocking
    launch waits for the channel, then for that phase: backward waits with it.
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
    blocking: Optional[LinearCost] = None


def collective_cost(profile, kind: str, why: str) -> LinearCost:
    """The :class:`~mergecomp.planning.profile.Profile`'s measured cost of collective ``kind``; a clear error if it has none
    (``why``: what needs it, for the message)."""
    if kind not in profile.collectives:
        raise ValueError(f"the profile has no {kind!r} cost ({why}); it measured "
                         f"{sorted(profile.collectives) or 'none'}. Re-profile with "
                         f"mergecomp.planning.measure.measure_collective_cost(backend, {kind!r}, sizes)")
    return profile.collectives[kind]
