"""Plan and Group: which gradients travel together, in backward order, and how.

A Plan is plain data.  It can be printed, saved as JSON, broadcast from rank 0 and
compared by digest, so every rank provably executes the same collectives in the same
order.  Schedulers produce plans; the optimizer executes them.

A group names whole parameters, or *slices* of them: a range of elements of the flattened
gradient.  A large tensor cut into slices in consecutive groups is sent as chunks, so the
first chunk is on the wire while the next one is compressed, and the first is decoded while
the next one is in flight (HiPress's and Espresso's partitioning of large tensors).  The
slices of a parameter tile it exactly: together they cover ``[0, numel)`` once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from .registry import registry_of

#: How a group travels: through the configured compressor, or raw at a float width.
SEND_MODES = ("compress", "fp32", "fp16", "bf16")

#: ``"compress:<communicator>"``: the configured compressor (and its error-feedback memory)
#: carried by another registered communicator, e.g. ``"compress:sparse_allreduce"`` for a
#: large group on many ranks beside ``"compress"`` (the job's communicator) for the rest.
COMPRESS_VIA = "compress:"

#: What a plan file holds, for the errors of one that does not.
PLAN_FORMAT = ('a plan file is the JSON Plan.save (--plan-out) writes: {"groups": [{"names": ["fc.weight", '
               '"fc.bias"], "send": "compress"}, ...]}, the groups in launch order, each naming its '
               f'parameters in backward order, "send" one of {", ".join(SEND_MODES)} or '
               f'"{COMPRESS_VIA}<communicator>", and optionally "slices": one [start, stop] or null per name')


class CannotRegroup(Exception):
    """A plan switch cannot move the state: it holds something that cannot follow its
    parameters into new groups (:mod:`mergecomp.runtime.regroup`).  Defined with the plan so
    that a scheduler, which proposes plans, can catch it without importing the runtime."""


def is_compressed(send: str) -> bool:
    """Whether a group sent ``send`` goes through the configured compressor."""
    return send == "compress" or send.startswith(COMPRESS_VIA)


def send_communicator(send: str) -> Optional[str]:
    """The communicator a ``"compress:<name>"`` mode names; None for every other mode."""
    return send[len(COMPRESS_VIA):] if send.startswith(COMPRESS_VIA) else None


def valid_sends() -> Tuple[str, ...]:
    """Every send mode a plan may name here: :data:`SEND_MODES` and ``"compress:<name>"``
    for each registered communicator."""
    return SEND_MODES + tuple(COMPRESS_VIA + name for name in registry_of("communicator").available())


def check_send(send, what: str = "group send mode") -> str:
    """``send`` if a plan may name it; else ValueError listing the valid modes."""
    if isinstance(send, str) and (send in SEND_MODES or (send.startswith(COMPRESS_VIA)
                                                         and send in valid_sends())):
        return send
    raise ValueError(f"{what} must be one of {', '.join(valid_sends())}, got {send!r}")


@dataclass(frozen=True)
class ParamInfo:
    """What a scheduler knows about one gradient: its name, size and type."""

    name: str
    numel: int
    dtype: str = "torch.float32"
    device: str = "cpu"
    element_size: int = 4

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


#: A piece of a group: (parameter name, first element, end element) of its flat gradient.
Piece = Tuple[str, int, int]


@dataclass(frozen=True)
class Group:
    """Parameters fused into one flat buffer (in backward order) and how it is sent.

    ``slices``, when given, has one entry per name: None for the whole parameter, or
    ``(start, stop)``, the elements ``start ≤ i < stop`` of its flattened gradient.
    """

    names: tuple
    send: str = "compress"
    slices: Optional[tuple] = None

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        if not self.names:
            raise ValueError("a group must name at least one parameter")
        check_send(self.send)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"a group names each parameter at most once, got {list(self.names)}")
        if self.slices is not None:
            slices = tuple(None if s is None else tuple(s) for s in self.slices)
            if len(slices) != len(self.names):
                raise ValueError(f"group slices must have one entry per name ({len(self.names)}), "
                                 f"got {len(slices)}")
            for name, piece in zip(self.names, slices):
                if piece is not None and (len(piece) != 2 or any(isinstance(x, bool) or not isinstance(x, int)
                                                                 for x in piece) or not 0 <= piece[0] < piece[1]):
                    raise ValueError(f"slice of {name!r} must be (start, stop) integers with "
                                     f"0 ≤ start < stop, got {piece!r}")
            # All-whole slices are the same group as no slices: one canonical form.
            object.__setattr__(self, "slices", slices if any(x is not None for x in slices) else None)

    def pieces(self, numels: Mapping[str, int]) -> List[Piece]:
        """(name, start, stop) of every member, whole parameters as (name, 0, numel)."""
        slices = self.slices or (None,) * len(self.names)
        return [(n, 0, numels[n]) if piece is None else (n, piece[0], piece[1])
                for n, piece in zip(self.names, slices)]


@dataclass
class Plan:
    """An ordered list of groups; the order is the launch order on every rank."""

    groups: List[Group] = field(default_factory=list)

    # -- checks ------------------------------------------------------------------------
    def validate(self, names: Iterable[str], numels: Optional[Mapping[str, int]] = None) -> None:
        """Every trainable parameter appears in exactly one group, and nothing else does;
        a sliced parameter's slices tile it exactly (``numels``: elements per name, needed
        when a group has slices)."""
        expected = list(names)
        seen: Dict[str, int] = {}
        cut: Dict[str, List[Tuple[int, int, int]]] = {}
        for index, group in enumerate(self.groups):
            for position, name in enumerate(group.names):
                piece = group.slices[position] if group.slices else None
                if piece is not None:
                    cut.setdefault(name, []).append((piece[0], piece[1], index))
                    if name in seen:
                        raise ValueError(f"plan puts parameter {name!r} whole in group {seen[name]} "
                                         f"and a slice of it in group {index}")
                    continue
                if name in seen or name in cut:
                    raise ValueError(f"plan puts parameter {name!r} in groups "
                                     f"{seen[name] if name in seen else cut[name][0][2]} and {index}")
                seen[name] = index
        missing = [n for n in expected if n not in seen and n not in cut]
        unknown = [n for n in list(seen) + list(cut) if n not in set(expected)]
        if missing or unknown:
            raise ValueError(
                f"plan does not match the model: missing parameters {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unknown parameters {unknown[:5]}"
                f"{'...' if len(unknown) > 5 else ''}")
        if cut and numels is None:
            raise ValueError("plan slices parameters; validating it needs their sizes (numels)")
        for name, pieces in cut.items():
            end = 0
            for start, stop, index in sorted(pieces):
                if start != end:
                    raise ValueError(f"slices of {name!r} must tile its {numels[name]} elements: "
                                     f"{'a gap' if start > end else 'an overlap'} at element {min(start, end)} "
                                     f"(group {index} starts at {start})")
                end = stop
            if end != numels[name]:
                raise ValueError(f"slices of {name!r} must tile its {numels[name]} elements, "
                                 f"they end at {end}")

    def order(self) -> List[str]:
        """The parameter names in plan order (backward order), each once."""
        return list(dict.fromkeys(n for g in self.groups for n in g.names))

    def pieces(self, numels: Mapping[str, int]) -> List[List[Piece]]:
        """Per group, :meth:`Group.pieces`."""
        return [g.pieces(numels) for g in self.groups]

    # -- plain data --------------------------------------------------------------------
    def to_dict(self) -> dict:
        groups = []
        for g in self.groups:
            entry = {"names": list(g.names), "send": g.send}
            if g.slices is not None:  # absent for whole parameters: older digests stay valid
                entry["slices"] = [None if s is None else list(s) for s in g.slices]
            groups.append(entry)
        return {"groups": groups}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
            raise ValueError(f"not a mergecomp plan: it has no list of \"groups\"; {PLAN_FORMAT}")
        groups = []
        for index, g in enumerate(data["groups"]):
            if not isinstance(g, dict) or not isinstance(g.get("names"), (list, tuple)):
                raise ValueError(f"not a mergecomp plan: group {index} is {g!r:.80}, not a mapping with a list "
                                 f"of \"names\"; {PLAN_FORMAT}")
            try:
                groups.append(Group(tuple(g["names"]), g.get("send", "compress"), g.get("slices")))
            except (TypeError, ValueError) as error:
                raise ValueError(f"group {index} of the plan: {error}") from None
        return cls(groups)

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"not a mergecomp plan: not JSON ({error.msg} at line {error.lineno}, "
                             f"column {error.colno}); {PLAN_FORMAT}") from None
        return cls.from_dict(data)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "Plan":
        """The plan saved at ``path``; ValueError naming the file when it cannot be read or
        holds no plan."""
        try:
            with open(path) as f:
                text = f.read()
        except OSError as error:
            raise ValueError(f"cannot read plan file {path}: {error.strerror}; save a plan with "
                             f"--plan-out or Plan.save()") from None
        except UnicodeDecodeError as error:
            raise ValueError(f"plan file {path} is not text ({error.reason} at byte {error.start}); "
                             f"{PLAN_FORMAT}") from None
        try:
            return cls.from_json(text)
        except ValueError as error:
            raise ValueError(f"plan file {path}: {error}") from None

    def digest(self) -> str:
        """A short hash of the canonical JSON: equal on two ranks iff the plans are equal."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]

    # -- for people --------------------------------------------------------------------
    def describe(self, params: Sequence[ParamInfo] = ()) -> str:
        sizes = {p.name: p.element_size for p in params}
        numels = {p.name: p.numel for p in params}

        def label(name, piece):
            return name if piece is None else f"{name}[{piece[0]}:{piece[1]}]"

        lines = [f"Plan {self.digest()}: {_count(len(self.groups), 'group')}"]
        for index, group in enumerate(self.groups):
            slices = group.slices or (None,) * len(group.names)
            size = ""
            if sizes and all(n in sizes for n in group.names):
                nbytes = sum((stop - start) * sizes[n] for n, start, stop in group.pieces(numels))
                size = f", {nbytes / 1e6:.2f} MB"
            what = _count(len(group.names), "tensor") + (f" ({sum(s is not None for s in slices)} sliced)"
                                                     if group.slices else "")
            span = label(group.names[0], slices[0]) + (
                f" .. {label(group.names[-1], slices[-1])}" if len(group.names) > 1 else "")
            lines.append(f"  group {index}: {what}{size}, send={group.send} [{span}]")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.groups)


def _count(number: int, noun: str) -> str:
    """"1 group", "3 groups"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
