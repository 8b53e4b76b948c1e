"""What the sparsifiers share: a payload of (values, indices) and its decoding.

Top-k, DGC and GradDrop differ only in which coordinates they pick; each sends the picked
values in the gradient's dtype (DGC optionally fp16) and their flat indices, int32 while
the group has fewer than 2^31 elements (the ``"indexed"`` wire), or, where the compressor
offers them, 16-bit offsets within blocks with 16-bit values (the ``"compact"`` wire) or
8-bit ones (``"compact8"``, :mod:`.blockwire`).  Decoding scatters the values into zeros,
and a sum of several ranks' payloads is scatter-added into one buffer.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..kernels import scatter
from . import blockwire
from .base import Compressor, Context


#: Why a sparsifier with error feedback clips locally (its recipe's first clause).
RESIDUAL_CLIPPING_REASON = (
    "what it sends is the residual of many steps, so clipping the averaged update after the "
    "exchange shrinks its steps far more than dense SGD's, and what it cuts is never sent again: "
    "clip each rank's gradient before the residual is added")


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices whenever they fit: half the index bytes of int64."""
    return torch.int32 if numel <= torch.iinfo(torch.int32).max else torch.int64


def index_nbytes(numel: int) -> int:
    """Bytes of one index of :func:`index_dtype`."""
    return 4 if index_dtype(numel) == torch.int32 else 8


def num_selected(numel: int, ratio: float) -> int:
    """k for a ratio: at least one element of a non-empty tensor, as in the reference implementations."""
    return min(numel, max(1, int(numel * ratio)))


def scatter_values(values: torch.Tensor, indices: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Dense tensor of ``ctx``'s shape with ``values`` at ``indices``, zero elsewhere."""
    dense = torch.zeros(ctx.numel, dtype=ctx.dtype, device=values.device)
    return scatter(dense, indices, values, "set").view(ctx.shape)


class SparseCompressor(Compressor):
    """Base of sparsifiers whose payload is ``(values, indices)``: top-k, DGC, GradDrop.

    Decoding scatters the values into zeros; :meth:`transmitted_indices` tells the DGC
    memory exactly which coordinates went out (for momentum factor masking).

    The sum of N ranks' payloads (:meth:`decompress_sum`) is one zero buffer and N
    scatter-adds of k values, in rank order: n + N·k elements touched instead of the N
    dense n-element decodes and N passes of decode-then-add, with the same floating-point
    result (each coordinate gets the same additions in the same order, starting from 0).
    """

    summable = False
    #: How a payload travels (:mod:`.blockwire`): ``"indexed"`` ``(values, indices)``, or
    #: where a subclass offers them ``"compact"`` ``(values, offsets, counts)`` and
    #: ``"compact8"`` ``(codes, offsets, counts, scale)``.
    wire_format = "indexed"

    def entries(self, payload, ctx):
        """``(values, flat indices)`` of a payload, whichever wire carried it."""
        if self.wire_format in blockwire.BLOCK_FORMATS:
            return blockwire.unpack(payload, ctx.numel)
        return payload[0], payload[1]

    def entries_nbytes(self, count: int, numel: int, element_size: int, payload=None,
                       planned: Optional[int] = None) -> int:
        """Bytes of ``count`` coordinates of an ``numel``-element group on this wire: on
        ``"auto"``, the wire ``payload`` travels on, or without one the wire chosen for
        ``planned`` coordinates (default ``count``)."""
        if self.wire_format in blockwire.BLOCK_FORMATS:
            if payload is not None and self.wire_format == "auto":
                wire = blockwire.format_of(payload)
            else:
                wire = blockwire.chosen(self.wire_format, count if planned is None else planned, numel)
            return blockwire.compact_nbytes(count, numel, element_size, wire)
        return count * (element_size + index_nbytes(numel))

    def wire_payload(self, values, indices, numel, planned: Optional[int] = None):
        """The payload for ``values`` at ``indices`` (ascending, for a block wire); on
        ``"auto"``, on the wire chosen for ``planned`` coordinates (default: as many as
        there are values), a number every rank agrees on."""
        if self.wire_format in blockwire.BLOCK_FORMATS:
            planned = values.numel() if planned is None else planned
            return blockwire.pack(values, indices, numel, blockwire.chosen(self.wire_format, planned, numel))
        return values, indices.to(index_dtype(numel))

    @property
    def sums_in_place(self) -> bool:  # unless a subclass decodes or combines its own way
        cls = type(self)
        return cls.decompress is SparseCompressor.decompress and cls.aggregate is Compressor.aggregate

    def decompress(self, payload, ctx):
        values, indices = self.entries(payload, ctx)
        return scatter_values(values, indices, ctx)

    def decompress_sum(self, payloads, ctx, out=None, received=None):
        """The sum, scatter-added into one zeroed buffer: ``out`` (a flat tensor of the
        group's size and dtype that the caller gives up, e.g. its group buffer, so no
        buffer of the group's size is allocated per step) or a new one.  ``received``: a
        list that gets each payload's flat int64 indices (what the allgather's non-finite
        check reads), so a compact payload is unpacked once, not again by
        :meth:`transmitted_indices`."""
        if not self.sums_in_place:
            if received is not None:
                received.extend(self.transmitted_indices(payload, ctx) for payload in payloads)
            total = super().decompress_sum(payloads, ctx)
            return total if out is None else out.copy_(total)
        if out is not None and out.numel() == ctx.numel and out.dtype == ctx.dtype:
            total = out.zero_()
        else:
            total = torch.zeros(ctx.numel, dtype=ctx.dtype, device=payloads[0][0].device)
        for payload in payloads:
            values, indices = self.entries(payload, ctx)
            scatter(total, indices, values, "add")
            if received is not None:
                received.append(indices.long())
        return total

    def subtract_sent(self, flat: torch.Tensor, payload, ctx) -> None:
        """``flat`` minus what the payload decodes to, in place (error feedback's residual):
        the values at their indices only, instead of a decoded tensor of the group's size."""
        if not self.sums_in_place:  # a subclass decodes its own way
            flat.sub_(self.decompress(payload, ctx).reshape(-1).to(flat.dtype))
            return
        values, indices = self.entries(payload, ctx)
        scatter(flat, indices, values, "subtract")

    def transmitted_indices(self, payload, ctx) -> torch.Tensor:
        """Flat indices of the coordinates this payload sent."""
        return self.entries(payload, ctx)[1].long()
