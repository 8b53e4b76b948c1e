"""One FSDP2 unit's gradient reduce-scatter, compressed: a Communicator whose result is a shard.

FSDP hands the reduce-scatter a unit's whole, unsharded gradient laid out as ``world``
equal chunks (chunk *j* holds rank *j*'s padded shard of every parameter of the unit), and
each rank must end with the reduced chunk of its own rank.  :class:`ScatterCommunicator`
does that in one of three ways, picked from the compressor's capabilities:

``reduce_scatter``
    a summable compressor without error feedback (``none``, ``fp16``, ``bf16``): each chunk
    is cast and one plain reduce-scatter sums them.  On the wire: (W−1)/W of the cast input.
``all_to_all``
    any other one-shot, fixed-size compressor (top-k, rand-k, QSGD, TernGrad, 1-bit,
    signSGD, ...): every chunk is encoded separately (error feedback per destination
    chunk), and one ``all_to_all`` gives each rank the payloads of its own chunk from every
    rank, decoded and summed (or voted, for majority vote).  On the wire: (W−1) of the W
    chunk payloads.
``whole``
    a multi-round or variable-size compressor (PowerSGD, DGC, GradDrop, ATOMO): the chunks
    are put back into the unit's padded parameter matrices, the whole gradient travels
    through the compressor's own communicator (PowerSGD's two small allreduces of P and Q
    per matrix, Vogels et al. 2019; an allgather of variable-size payloads), and each rank
    keeps the rows of its shard.  On the wire: what that communicator sends for the whole
    unit; for PowerSGD of rank r, 2·(W−1)/W·r·(m+n) elements per m×n matrix instead of
    (W−1)/W·m·n.

Error feedback lives on the sender, on the unsharded gradient: one residual per unit
chunk (``all_to_all``) or per unit (``whole``), i.e. one unsharded gradient per unit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .. import communicators
from ..distributed.backends.base import Work
from ..distributed.backends.serialize import pack, unpack
from ..communicators.base import Communicator, Handle
from ..compressors.base import Compressor, GroupLayout, ParamView
from ..memories.base import Memory
from ..memories.none import NoneMemory

#: What FSDP's reduce-scatter may be asked to do; anything else is refused by name.
_OPS = {"AVG", "SUM", "PREMUL_SUM"}


def scale_of(op, world_size: int) -> Tuple[float, int]:
    """(multiplier, divisor) that turn the sum over ranks into what ``op`` asks for (an
    average divides, as the backends' ``AVG`` does, so FP32 results match it bit for bit)."""
    kind = getattr(op, "op", op)  # a PREMUL_SUM arrives as a ReduceOp object carrying a factor
    name = getattr(kind, "name", str(kind)).split(".")[-1]
    if name not in _OPS:
        raise ValueError(f"the compressed reduce-scatter sums or averages gradients, but FSDP asked "
                         f"for {op!r}: use FSDP's own reduce-scatter for this module")
    if name == "AVG":
        return 1.0, world_size
    if name == "PREMUL_SUM":
        return float(op.factor), 1
    return 1.0, 1


def chunk_name(unit: str, index: int) -> str:
    """The key of unit ``unit``'s chunk ``index`` in the memory and the compressor."""
    return f"{unit}#shard{index}"


@dataclass(frozen=True)
class UnitShape:
    """What one unit's reduce-scatter input holds: its parameters' padded shards, in order.

    ``params``: (name, padded shard shape) of each parameter; ``world``: the shard group's
    size.  The unsharded padded matrix of a parameter is its shard shape with ``world``
    times the rows (FSDP moves any other shard dimension to dim 0 before it scatters).
    """

    params: Tuple[Tuple[str, torch.Size], ...]
    world: int
    dtype: torch.dtype

    @property
    def chunk_numel(self) -> int:
        return sum(shape.numel() for _, shape in self.params)

    def shard_layout(self) -> GroupLayout:
        """The per-parameter views of one chunk (a rank's shard)."""
        views, offset = [], 0
        for name, shape in self.params:
            views.append(ParamView(name, shape, offset))
            offset += shape.numel()
        return tuple(views)

    def whole_layout(self) -> GroupLayout:
        """The per-parameter views of the unit's padded gradient, parameter by parameter."""
        views, offset = [], 0
        for name, shape in self.params:
            full = torch.Size((shape[0] * self.world,) + tuple(shape[1:])) if len(shape) else shape
            views.append(ParamView(name, full, offset))
            offset += full.numel()
        return tuple(views)

    def to_whole(self, chunks: torch.Tensor) -> torch.Tensor:
        """(world, chunk_numel) chunk-major → the flat parameter-major padded gradient."""
        parts, offset = [], 0
        for _, shape in self.params:
            numel = shape.numel()
            parts.append(chunks[:, offset:offset + numel].reshape(-1))
            offset += numel
        return torch.cat(parts)

    def shard_of(self, whole: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's chunk of a flat parameter-major gradient (the inverse of :meth:`to_whole`)."""
        parts, offset = [], 0
        for _, shape in self.params:
            numel = shape.numel()
            parts.append(whole[offset + rank * numel:offset + (rank + 1) * numel])
            offset += numel * self.world
        return torch.cat(parts)


def exchange_mode(compressor: Compressor, memory: Memory) -> str:
    """``reduce_scatter``, ``all_to_all`` or ``whole`` (see the module)."""
    if compressor.summable and not compressor.multi_round and isinstance(memory, NoneMemory):
        return "reduce_scatter"
    if compressor.fixed_size and not compressor.multi_round:
        return "all_to_all"
    return "whole"


class ScatterCommunicator(Communicator):
    """The compressed reduce-scatter of FSDP units, over the shard group's ``backend``.

    ``start(unsharded, unit)`` exchanges and ``finish`` returns this rank's reduced chunk,
    scaled by :attr:`scaling` (set per call from FSDP's ``op``).  ``units`` maps a unit's
    name to its :class:`UnitShape`.  ``wire_bytes``/``uncompressed_bytes``: per unit, what
    this rank has put on the wire (the backend's count: every chunk but its own for the
    reduce-scatter and the all_to_all; the inner communicator's collectives for ``whole``)
    and what FSDP's own reduce-scatter would have.
    """

    name = "fsdp_scatter"

    def __init__(self, compressor: Compressor, memory: Memory, backend, units: Dict[str, UnitShape]):
        super().__init__(compressor, memory, backend)
        self.units = units
        self.mode = exchange_mode(compressor, memory)
        self.inner: Optional[Communicator] = None
        if self.mode == "whole":
            carrier = "allreduce" if compressor.summable or compressor.multi_round else "allgather"
            self.inner = communicators.create(carrier, compressor=compressor, memory=memory, backend=backend)
        #: (multiplier, divisor) for the next call, from FSDP's ``op``.
        self.scaling: Tuple[float, int] = (1.0, backend.size)
        self.wire_bytes: Dict[str, int] = {}
        self.uncompressed_bytes: Dict[str, int] = {}

    def _count(self, unit: str, sent: int, reference: int) -> None:
        self.wire_bytes[unit] = self.wire_bytes.get(unit, 0) + int(sent)
        self.uncompressed_bytes[unit] = self.uncompressed_bytes.get(unit, 0) + int(reference)

    # -- start: the exchange ---------------------------------------------------------------------
    def start(self, tensor: torch.Tensor, name: str, layout: Optional[GroupLayout] = None,
              in_place: bool = False) -> Handle:
        world, rank = self.backend.size, self.backend.rank
        chunks = tensor.view(world, -1)
        reference = chunks[0].numel() * chunks.element_size() * (world - 1)
        if self.scaling != (1.0, 1) and self.mode == "reduce_scatter" and not self.compressor.lossless:
            # average before the cast, as DDP's 16-bit hook does: a sum of N fp16 gradients
            # overflows N times sooner
            multiplier, divisor = self.scaling
            chunks, self.scaling = chunks * multiplier / divisor, (1.0, 1)
        before = self.backend.wire_bytes
        if self.mode == "reduce_scatter":
            total = self._reduce_scatter(chunks, name, rank)
        elif self.mode == "all_to_all":
            total = self._all_to_all(chunks, name, rank)
        else:
            total = self._whole(chunks, name, rank)
        self._count(name, self.backend.wire_bytes - before, reference)
        return Handle(name, torch.Size([chunks.shape[1]]), Work(finalize=lambda: total),
                      extra={"scaling": self.scaling})

    def finish(self, handle: Handle) -> torch.Tensor:
        """This rank's reduced chunk, scaled as FSDP's ``op`` asks (a majority vote as is)."""
        total = handle.work.wait().reshape(-1)
        if not self.compressor.average:
            return total
        multiplier, divisor = handle.extra["scaling"]
        if multiplier != 1.0:
            total = total * multiplier
        if divisor != 1:
            total = total / divisor
        return total

    # -- the three exchanges, each through the backend (its timeouts, counters, failure reports) --
    def _reduce_scatter(self, chunks: torch.Tensor, unit: str, rank: int):
        payloads, ctx = [], None
        for j in range(chunks.shape[0]):
            payload, chunk_ctx = self.encode(chunks[j], chunk_name(unit, j))
            payloads.append(payload[0].reshape(-1))
            ctx = chunk_ctx if j == rank else ctx
        return self.compressor.decompress((self.backend.reduce_scatter(torch.stack(payloads)),), ctx)

    def _all_to_all(self, chunks: torch.Tensor, unit: str, rank: int):
        world = chunks.shape[0]
        blobs, shapes, dtypes, ctx = [], None, None, None
        for j in range(world):
            payload, chunk_ctx = self.encode(chunks[j], chunk_name(unit, j))
            if shapes is None:
                shapes, dtypes = [p.shape for p in payload], [p.dtype for p in payload]
            elif [p.shape for p in payload] != shapes:
                raise ValueError(f"{self.compressor!r} gave payloads of different shapes for the equal "
                                 f"chunks of FSDP unit {unit!r}: it is not fixed-size")
            if j == rank:
                ctx = chunk_ctx
            blobs.append(pack(tuple(payload), chunks.device))
        received = self.backend.alltoall_fixed(torch.stack(blobs))
        payloads = [unpack(received[source], shapes, dtypes) for source in range(world)]
        return self.compressor.decompress_sum(payloads, ctx)

    def _whole(self, chunks: torch.Tensor, unit: str, rank: int):
        shape = self.units.get(unit)
        world = chunks.shape[0]
        fits = shape is not None and shape.chunk_numel == chunks.shape[1]
        # a unit whose parameters did not all get a gradient travels as one flat tensor
        whole = shape.to_whole(chunks) if fits else chunks.reshape(-1)
        layout = shape.whole_layout() if fits else None
        handle = self.inner.start(whole, unit, layout)  # its collectives go through the backend, counted
        total = self.inner.finish(handle).reshape(-1)
        if self.compressor.average:
            total = total * world  # the inner communicator averaged; scaling is applied in finish()
        return shape.shard_of(total, rank) if fits else total.view(world, -1)[rank]



__all__: List[str] = ["ScatterCommunicator", "UnitShape", "chunk_name", "exchange_mode", "scale_of"]
