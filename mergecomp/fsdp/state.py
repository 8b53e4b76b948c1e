"""What :func:`mergecomp.fsdp.register` installed, its byte counts, and its checkpoints."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..checkpoint import CheckpointError, GroupSpec, SOURCE, check_finite, check_shapes, verify
from ..compressors.base import Compressor
from ..memories.base import Memory
from ..runtime import gate
from ..runtime.step import SharedSurface
from .replica import HSDP, REPLICATE, SHARD
from .units import BackwardStep

#: Format of FSDP compression state (2: the envelope every entry point shares,
#: :func:`mergecomp.runtime.gate.seal_state`; 1 is read too).
STATE_FORMAT = 2

_ADVICE = ("Nothing was loaded. Load an earlier checkpoint, or go on without this one: error feedback "
           "then restarts from zero")


def configuration(compressor: Compressor, memory: Memory, kind: str) -> str:
    """What ranks and checkpoints must agree on: the compressor, the memory and which
    collective is compressed (``kind``, as :func:`~mergecomp.fsdp.replica.exchange_kind`
    says; the text for FSDP and HSDP is the one their checkpoints were sealed with)."""
    mode = "replicate=True" if kind == REPLICATE else f"hsdp={kind == HSDP}"
    return f"{compressor!r} {memory!r} {mode}"


class FSDPCompression(SharedSurface):
    """The compressed exchange of every FSDP unit of a model.

    ``units``: each unit's name → what exchanges it (a
    :class:`~mergecomp.fsdp.units.CompressedReduceScatter`, or a
    :class:`~mergecomp.fsdp.replica.ReplicaAllReduce` under HSDP and ``replicate``);
    ``groups``: the state key of every buffer the compressor and memory keep state for → its
    size and dtype; ``kind``: the collective compressed, ``"shard"`` (FSDP's reduce-scatter),
    ``"hsdp"`` (the replicas' all-reduce of a shard) or ``"replicate"`` (``replicate``'s
    all-reduce of the whole gradient); ``hsdp`` and ``replicate`` say which of the last two.
    """

    def __init__(self, units: Dict[str, Any], compressor: Compressor, memory: Memory, rank: int,
                 world_size: int, backward: BackwardStep, groups: Dict[str, GroupSpec], kind: str):
        self.units = units
        self.compressor = compressor
        self.memory = memory
        self.rank, self.world_size = rank, world_size
        self.backward = backward
        self.kind = kind
        self.hsdp = kind == HSDP
        self.replicate = kind == REPLICATE
        self._groups = groups

    @property
    def lifecycle(self):
        """The shared :class:`~mergecomp.runtime.step.StepLifecycle` (its listeners, its counts)."""
        return self.backward.lifecycle

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank has sent for every unit so far."""
        return sum(unit.wire_bytes for unit in self.units.values())

    @property
    def uncompressed_bytes(self) -> int:
        """Bytes FSDP's own collective would have sent for the same gradients (the
        reduce-scatter, or under HSDP the replicas' all-reduce), in the reduce dtype."""
        return sum(unit.uncompressed_bytes for unit in self.units.values())

    @property
    def dropped(self) -> int:
        """Backwards dropped because a gradient was non-finite on some rank."""
        return self.lifecycle.skipped_steps

    # -- checkpoints -------------------------------------------------------------------------
    def _configuration(self) -> str:
        return configuration(self.compressor, self.memory, self.kind)

    def groups(self) -> Dict[str, GroupSpec]:
        """Each state key → its size and dtype: what saved state must fit."""
        return dict(self._groups)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals, compressor state and step count, sealed with a checksum.
        Save one file per rank (``mergecomp.save(state.state_dict(), f"fsdp.rank{rank}.pt")``)
        beside FSDP's own checkpoint of the model and optimizer."""
        return gate.seal_state("fsdp", STATE_FORMAT, self.lifecycle.backend,
                               gate.config_digest(self._configuration()), self.lifecycle.state_dict(),
                               {"compressor": self.compressor.state_dict(), "memory": self.memory.state_dict()})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after every check passed (checksum, configuration, rank,
        world size, finite values, each residual's shape and dtype); otherwise
        :class:`~mergecomp.checkpoint.CheckpointError` and nothing changes."""
        try:
            self._check(state)
        except CheckpointError as error:  # the same refusal, with this entry point's advice
            raise error.advise(_ADVICE) from None
        self.memory.load_state_dict(state.get("memory", {}))
        self.compressor.load_state_dict(state.get("compressor", {}))
        self.lifecycle.load_state_dict(gate.lifecycle_state(state))

    def _check(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(f"FSDP compression state must be the dict state_dict() returned, got "
                                  f"{type(state).__name__}")
        source: Optional[str] = state.get(SOURCE)
        verify(state, "FSDP compression state", source, self.groups())
        gate.check_envelope(state, "fsdp", STATE_FORMAT, self.lifecycle.backend,
                            gate.config_digest(self._configuration()), _ADVICE, described=self._configuration())
        groups = self.groups()
        check_finite(state, "FSDP compression state", source, groups)
        check_shapes(self.memory, state.get("memory", {}), groups, f"the {self.memory!r} state", source)
        check_shapes(self.compressor, state.get("compressor", {}), groups, f"the {self.compressor!r} state", source)

    def __repr__(self) -> str:
        return (f"FSDPCompression({self.compressor!r}, {self.memory!r}, units={list(self.units)}"
                f"{'' if self.kind == SHARD else ', ' + self.kind})")
