"""SparseLoCo's pseudo-gradient format: top-k of each chunk, each kept value in 2 bits.

SparseLoCo ("Communication Efficient LLM Pre-training with SparseLoCo", 2025) sends
DiLoCo's pseudo-gradient through a chunked top-k with error feedback and quantises the
kept values to 2 bits; what the quantiser and the selection leave out stays in the
residual memory and is sent in a later outer step.  Here:

    rows    = the group's flat elements cut into rows of ``chunk`` (the last zero-padded);
    keep    = per row, the ``topk`` entries of largest magnitude and their positions;
    split   = per row, the mean magnitude μ of the kept values;
    levels  = per row, lo = mean of the kept magnitudes below μ, hi = mean of those ≥ μ
              (the two-level quantiser of least squared error for that split);
    code    = 2 bits per kept value: its sign and whether its magnitude is ≥ μ;
    decode  = ± lo or ± hi scattered into zero rows, the padding cut off.

Deterministic and biased: pair it with the ``residual`` memory (its recommendation), which
keeps the pseudo-gradient minus the decode, quantisation error included.  Rows are cut
from the flat group, across parameter boundaries, so no padding is spent per parameter.

On the wire for n elements in r = ⌈n / chunk⌉ rows and k = min(topk, chunk) kept per row:
⌈r·k·2 / 8⌉ bytes of packed codes, r·k positions (uint8 while ``chunk`` ≤ 256, int16
beyond), and r·2 levels in the gradient's dtype.  Ranks keep different positions, so
payloads are not summable: the allgather communicator carries them and the decode adds
every rank's values into one set of rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import register
from .base import Compressor, Context
from ..kernels.packing import pack_bits, packed_nbytes, unpack_bits

BITS = 2


@register("sparseloco")
class SparseLoCoCompressor(Compressor):
    """The ``topk`` largest-magnitude entries of each ``chunk``-element row, values in 2 bits
    (sign, and one of the row's two magnitude levels).

    Wire for n elements: ⌈r·k/4⌉ + r·k·(1 or 2) + 2·r·(value bytes), r = ⌈n / chunk⌉ rows,
    k = min(topk, chunk).
    """

    summable = False
    unbiased = False
    fixed_size = True
    recommended_memory = "residual"
    recommended_communicator = "allgather"

    def __init__(self, chunk: int = 4096, topk: int = 64):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 32768:
            raise ValueError(f"sparseloco chunk must be an integer in [1, 32768] (elements per row; "
                             f"4096 by default), got {chunk!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk:
            raise ValueError(f"sparseloco topk must be an integer in [1, chunk={chunk}] (values kept per "
                             f"row; SparseLoCo keeps 1-3% of a row), got {topk!r}")
        self.chunk, self.topk = chunk, topk
        self.compress_ratio = topk / chunk

    def _index_dtype(self) -> torch.dtype:
        return torch.uint8 if self.chunk <= 256 else torch.int16

    def _index_nbytes(self) -> int:
        return 1 if self.chunk <= 256 else 2

    def compress(self, tensor, name, layout=None):
        flat = tensor.reshape(-1)
        rows = -(-flat.numel() // self.chunk)
        ctx = SparseLoCoContext(tensor.shape, tensor.dtype, rows)
        work = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        padded = flat.new_zeros(rows * self.chunk, dtype=work)
        padded[:flat.numel()] = flat
        grid = padded.view(rows, self.chunk)
        positions = grid.abs().topk(self.topk, dim=1, sorted=False).indices
        values = grid.gather(1, positions)
        magnitude = values.abs()
        high = magnitude >= magnitude.mean(dim=1, keepdim=True)
        levels = torch.stack([_masked_mean(magnitude, ~high), _masked_mean(magnitude, high)], dim=1)
        codes = (high.to(torch.uint8) << 1) | torch.signbit(values).to(torch.uint8)
        payload = (pack_bits(codes, BITS), positions.to(self._index_dtype()), levels.to(tensor.dtype))
        return payload, ctx

    def _values(self, payload, ctx) -> torch.Tensor:
        """(rows × k) decoded values, in the work dtype."""
        packed, positions, levels = payload
        work = torch.float64 if ctx.dtype == torch.float64 else torch.float32
        codes = unpack_bits(packed, BITS, positions.numel()).view(positions.shape).long()
        magnitude = levels.to(work).gather(1, codes >> 1)
        return torch.where((codes & 1).bool(), -magnitude, magnitude)

    def _scatter(self, payload, ctx, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        values = self._values(payload, ctx)
        if out is None:
            out = values.new_zeros(ctx.rows, self.chunk)
        return out.scatter_add_(1, payload[1].long(), values)

    def _cut(self, grid: torch.Tensor, ctx) -> torch.Tensor:
        numel = 1
        for size in ctx.shape:
            numel *= size
        return grid.reshape(-1)[:numel].to(ctx.dtype).view(ctx.shape)

    def decompress(self, payload, ctx):
        return self._cut(self._scatter(payload, ctx), ctx)

    def decompress_sum(self, payloads, ctx):
        """Every rank's values added into one set of rows, the padding cut off once (flat)."""
        total = None
        for payload in payloads:
            total = self._scatter(payload, ctx, total)
        return self._cut(total, ctx).reshape(-1)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """Packed 2-bit codes, one position per kept value, two levels per row."""
        rows = -(-numel // self.chunk)
        kept = rows * self.topk
        return packed_nbytes(kept, BITS) + kept * self._index_nbytes() + 2 * rows * element_size

    def __repr__(self):
        return f"SparseLoCoCompressor(chunk={self.chunk}, topk={self.topk})"


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, the mean of ``values`` where ``mask`` holds (0 where it holds nowhere)."""
    count = mask.sum(dim=1).clamp(min=1).to(values.dtype)
    return (values * mask).sum(dim=1) / count


@dataclass(frozen=True)
class SparseLoCoContext(Context):
    """The number of rows: it follows from the shape alone."""

    rows: int = 0
    layout_fields = ("rows",)
