"""DeMo: the fast components of the momentum, found by a DCT of fixed-size chunks.

Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870 (2024),
Algorithm 1.  Each rank keeps its momentum to itself (m ← β·m + g, the ``demo`` memory),
and sends only the components of m that change fastest:

    chunks  = each parameter's momentum cut into rows of ``chunk`` elements (the last row
              zero-padded), never across parameters;
    C       = chunks · Dᵀ, D the orthonormal DCT-II basis of size ``chunk``;
    send    = per row, the ``k`` coefficients of largest magnitude and their positions;
    decode  = the sent coefficients scattered into zeros, · D (D is orthogonal: Dᵀ's inverse),
              the padding cut off.

What was sent is subtracted from the momentum by the memory (error feedback whose residual
*is* the momentum), so what is left decays with β and is sent later, when it has grown.
The paper's 2-D weights are chunked as s × s tiles with a 2-D DCT; here every parameter is
flattened and chunked in 1-D, which treats vectors and matrices alike.

On the wire for a group of n elements in views of nᵥ elements: Σᵥ ⌈nᵥ / chunk⌉ · k
coefficients in the gradient's dtype and as many positions, uint8 while ``chunk`` ≤ 256
(int16 beyond).  Ranks pick different positions, so payloads are not summable: the
allgather communicator carries them, and the sum is formed in the DCT domain (the scattered
coefficients of every rank added) with one inverse transform.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from . import register
from .base import Compressor, Context, GroupLayout
from .recipes import Recipe


def dct_basis(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The orthonormal DCT-II matrix D (``size`` × ``size``): row j is
    √(2/s)·cos(π·(2i + 1)·j / 2s), row 0 scaled by 1/√2, so D·Dᵀ = I and the inverse is Dᵀ."""
    i = torch.arange(size, dtype=torch.float64)
    j = i.view(-1, 1)
    basis = torch.cos(math.pi * (2 * i + 1) * j / (2 * size)) * math.sqrt(2.0 / size)
    basis[0] /= math.sqrt(2.0)
    return basis.to(dtype=dtype, device=device)


@register("demo")
class DeMoCompressor(Compressor):
    """The ``topk`` largest DCT-II coefficients of each ``chunk``-element row of each parameter.

    Deterministic and biased (what is not sent stays in the ``demo`` memory's momentum).
    The transform runs in float32 for 16-bit gradients (float64 for float64); the basis is
    built once per chunk size, dtype and device.

    Wire for a group whose views have nᵥ elements: Σᵥ ⌈nᵥ / chunk⌉ · topk · (value bytes + 1)
    bytes (+ 2 instead of + 1 when ``chunk`` > 256).
    """

    summable = False
    unbiased = False
    fixed_size = True
    recommended_memory = "demo"
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="the momentum lives in the demo memory, which sends part of it each step and "
               "keeps the rest; momentum in the optimizer as well would apply it twice",
        paper="SGD-like update of the decoded momentum components (the optimizer without "
              "momentum), demo memory β = 0.999, chunk 64, top-32 per chunk",
        memory="demo", fold_momentum=True)

    def __init__(self, chunk: int = 64, topk: int = 4):
        if isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= 32768:
            raise ValueError(f"demo chunk must be an integer in [1, 32768] (elements per DCT row; "
                             f"the paper uses 64), got {chunk!r}")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= chunk:
            raise ValueError(f"demo topk must be an integer in [1, chunk={chunk}] (coefficients "
                             f"sent per chunk), got {topk!r}")
        self.chunk, self.topk = chunk, topk
        self._bases: Dict[Tuple[torch.dtype, torch.device], torch.Tensor] = {}

    # -- the transform ---------------------------------------------------------------------------
    def _basis(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (dtype, device)
        if key not in self._bases:
            self._bases[key] = dct_basis(self.chunk, dtype, device)
        return self._bases[key]

    @staticmethod
    def _work_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _rows(self, numel: int, layout: Optional[GroupLayout]):
        """(offset, numel, rows) of each view: its rows of ``chunk`` elements."""
        views = [(v.offset, v.numel) for v in layout] if layout else [(0, numel)]
        return [(offset, n, -(-n // self.chunk)) for offset, n in views]

    def _chunked(self, flat: torch.Tensor, layout: Optional[GroupLayout]) -> torch.Tensor:
        """Every view's elements as zero-padded rows of ``chunk``, stacked."""
        parts = []
        for offset, n, rows in self._rows(flat.numel(), layout):
            piece = flat[offset:offset + n]
            pad = rows * self.chunk - n
            if pad:
                piece = torch.cat([piece, piece.new_zeros(pad)])
            parts.append(piece.view(rows, self.chunk))
        if not parts:
            return flat.new_zeros(0, self.chunk)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _unchunked(self, rows: torch.Tensor, ctx: "DeMoContext") -> torch.Tensor:
        """The rows' elements back in the views' places, padding dropped."""
        out = rows.new_empty(ctx.numel)
        row = 0
        for offset, n, count in ctx.views:
            out[offset:offset + n] = rows[row:row + count].reshape(-1)[:n]
            row += count
        return out

    # -- the contract ----------------------------------------------------------------------------
    def compress(self, tensor, name, layout=None):
        flat = tensor.reshape(-1)
        work = self._work_dtype(tensor.dtype)
        views = tuple(self._rows(flat.numel(), layout))
        ctx = DeMoContext(tensor.shape, tensor.dtype, views)
        coefficients = self._chunked(flat.to(work), layout) @ self._basis(work, tensor.device).t()
        k = min(self.topk, self.chunk)
        positions = coefficients.abs().topk(k, dim=1, sorted=False).indices
        values = coefficients.gather(1, positions)
        return (values.to(tensor.dtype), positions.to(self._index_dtype())), ctx

    def _index_dtype(self) -> torch.dtype:
        return torch.uint8 if self.chunk <= 256 else torch.int16

    def _coefficients(self, payload, ctx, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The payload's coefficients scattered into zero rows (added into ``out`` if given)."""
        values, positions = payload
        work = self._work_dtype(ctx.dtype)
        rows = sum(count for _, _, count in ctx.views)
        if out is None:
            out = torch.zeros(rows, self.chunk, dtype=work, device=values.device)
        return out.scatter_add_(1, positions.long(), values.to(work))

    def _inverse(self, coefficients: torch.Tensor, ctx) -> torch.Tensor:
        rows = coefficients @ self._basis(coefficients.dtype, coefficients.device)
        return self._unchunked(rows, ctx).to(ctx.dtype).view(ctx.shape)

    def decompress(self, payload, ctx):
        return self._inverse(self._coefficients(payload, ctx), ctx)

    def decompress_sum(self, payloads, ctx):
        """Every rank's coefficients added in the DCT domain, then one inverse transform
        (the DCT is linear: the same sum as decoding each, with one matrix product)."""
        total = None
        for payload in payloads:
            total = self._coefficients(payload, ctx, total)
        return self._inverse(total, ctx)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """k coefficients (the gradient's dtype) and k positions (1 or 2 bytes) per row."""
        rows = sum(count for _, _, count in self._rows(numel, layout))
        index_bytes = 1 if self.chunk <= 256 else 2
        return rows * min(self.topk, self.chunk) * (element_size + index_bytes)

    def __repr__(self):
        return f"DeMoCompressor(chunk={self.chunk}, topk={self.topk})"


@dataclass(frozen=True)
class DeMoContext(Context):
    """The views' (offset, numel, rows): they follow from the shape and layout alone."""

    views: Tuple[Tuple[int, int, int], ...] = ()
    layout_fields = ("views",)
