"""Plan and Group: which gradients travel together, in backward order, and how.

A Plan is plain data.  It can be printed, saved as JSON, broadcast from rank 0 and
compared by digest, so every rank provably executes the same collectives in the same
order.  Schedulers produce plans; the optimizer executes them.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

#: How a group travels: through the configured compressor, or raw at a float width.
SEND_MODES = ("compress", "fp32", "fp16", "bf16")


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


@dataclass(frozen=True)
class Group:
    """Parameters fused into one flat buffer (in backward order) and how it is sent."""

    names: tuple
    send: str = "compress"

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(self.names))
        if not self.names:
            raise ValueError("a group must name at least one parameter")
        if self.send not in SEND_MODES:
            raise ValueError(f"group send mode must be one of {SEND_MODES}, got {self.send!r}")


@dataclass
class Plan:
    """An ordered list of groups; the order is the launch order on every rank."""

    groups: List[Group] = field(default_factory=list)

    # -- checks ------------------------------------------------------------------------
    def validate(self, names: Iterable[str]) -> None:
        """Every trainable parameter appears in exactly one group, and nothing else does."""
        expected = list(names)
        seen: Dict[str, int] = {}
        for index, group in enumerate(self.groups):
            for name in group.names:
                if name in seen:
                    raise ValueError(f"plan puts parameter {name!r} in groups {seen[name]} and {index}")
                seen[name] = index
        missing = [n for n in expected if n not in seen]
        unknown = [n for n in seen if n not in set(expected)]
        if missing or unknown:
            raise ValueError(
                f"plan does not match the model: missing parameters {missing[:5]}"
                f"{'...' if len(missing) > 5 else ''}, unknown parameters {unknown[:5]}"
                f"{'...' if len(unknown) > 5 else ''}")

    # -- plain data --------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"groups": [{"names": list(g.names), "send": g.send} for g in self.groups]}

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        try:
            return cls([Group(tuple(g["names"]), g.get("send", "compress")) for g in data["groups"]])
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a mergecomp plan (expected {{'groups': [{{'names': [...], "
                             f"'send': ...}}]}}): {error!r}") from None

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str) -> "Plan":
        with open(path) as f:
            return cls.from_json(f.read())

    def digest(self) -> str:
        """A short hash of the canonical JSON: equal on two ranks iff the plans are equal."""
        return hashlib.sha256(self.to_json(indent=None).encode()).hexdigest()[:16]

    # -- for people --------------------------------------------------------------------
    def describe(self, params: Sequence[ParamInfo] = ()) -> str:
        sizes = {p.name: p.nbytes for p in params}
        lines = [f"Plan {self.digest()}: {len(self.groups)} groups"]
        for index, group in enumerate(self.groups):
            nbytes = sum(sizes.get(n, 0) for n in group.names)
            size = f", {nbytes / 1e6:.2f} MB" if sizes else ""
            lines.append(f"  group {index}: {len(group.names)} tensors{size}, send={group.send} "
                         f"[{group.names[0]} .. {group.names[-1]}]")
        return "\n".join(lines)

    def __len__(self) -> int:
        return len(self.groups)
