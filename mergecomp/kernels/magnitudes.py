"""Sign-and-magnitude codes: b bits per element, for the low-bit compressors the controller raised.

Each element becomes a code 2·k + s: s its IEEE sign bit (set for negatives and −0.0), k
one of L = 2^(b−1) magnitude bins of its parameter view.  The bins are uniform,
Δ_v = c_L · μ_v wide, where μ_v is the view's mean magnitude, except the last, which is
open; bin k < L − 1 decodes at its centre (k + ½)·Δ_v, the last at the mean magnitude of
the elements that fell in it.  c_L minimises the squared error of a Gaussian's magnitudes
under that decoding (:data:`STEPS`): a tenth of the energy left at two bits, against about a
third for one bit's mean magnitude.

On the wire for n elements in v views: ⌈n·b/8⌉ bytes of codes and two fp32 numbers per view
(Δ_v and the last bin's mean).  A view that is all zero has Δ_v = 0 and decodes to zero.
These are torch passes on any device: the codes only travel when the quality controller
raised a group (the compressors' own formats keep their own kernels).
"""
from __future__ import annotations

from typing import Tuple

import torch

from .packing import pack_bits, packed_nbytes, unpack_bits
from .segments import Spans, scale_views, span_lengths
from .scratch import Scratch
from .signs import sign_bits

#: Bits per element a code may have (the low-bit compressors' own formats are one and two).
BITS = (2, 4, 8)
#: L (magnitude bins) → c_L, each bin's width in units of the view's mean magnitude: the
#: width that minimises a Gaussian's squared error under this decoding (found numerically).
STEPS = {2: 1.22, 8: 0.40, 128: 0.038}


def _levels(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"sign-and-magnitude codes have {', '.join(map(str, BITS))} bits per element, "
                         f"got {bits!r}")
    return 1 << (bits - 1)


def magnitude_nbytes(numel: int, views: int, bits: int) -> int:
    """The bytes of ``numel`` elements' codes at ``bits`` each and their views' tables."""
    _levels(bits)
    return packed_nbytes(numel, bits) + 8 * views


def magnitude_codes(flat: torch.Tensor, spans: Spans, bits: int,
                    scratch: Scratch) -> Tuple[torch.Tensor, torch.Tensor]:
    """(the packed codes of ``flat``, fp32 (views × 2): each view's bin width and last bin's mean)."""
    levels = _levels(bits)
    lengths = span_lengths(spans, str(flat.device))
    magnitudes = flat.to(torch.float32).abs()
    means = torch.segment_reduce(magnitudes, "sum", lengths=lengths) / lengths.clamp(min=1)
    widths = means * STEPS[levels]
    inverse = torch.where(widths > 0, 1.0 / torch.where(widths > 0, widths, 1.0), 0.0)
    bins = scale_views(magnitudes.clone(), spans, inverse).floor_().clamp_(max=levels - 1)
    last = (bins == levels - 1).to(torch.float32)
    tail_sums = torch.segment_reduce(magnitudes * last, "sum", lengths=lengths)
    tail_means = tail_sums / torch.segment_reduce(last, "sum", lengths=lengths).clamp(min=1)
    codes = bins.to(torch.uint8).mul_(2).add_(sign_bits(flat, scratch))
    return pack_bits(codes, bits), torch.stack([widths, tail_means], dim=1)


def decode_magnitude_codes(packed: torch.Tensor, table: torch.Tensor, spans: Spans, bits: int,
                           numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The flat ``dtype`` tensor that :func:`magnitude_codes` encoded as ``packed`` and ``table``."""
    levels = _levels(bits)
    if table.shape != (len(spans), 2):
        raise ValueError(f"a sign-and-magnitude payload's table has shape {tuple(table.shape)}, but its "
                         f"context has {len(spans)} views (two numbers each): it was made with another layout")
    codes = unpack_bits(packed, bits, numel)
    bins = codes.bitwise_right_shift(1).to(torch.float32)
    centres = scale_views(bins + 0.5, spans, table[:, 0])
    tails = scale_views(torch.ones_like(bins), spans, table[:, 1])
    magnitudes = torch.where(bins == levels - 1, tails, centres)
    return torch.where(codes.bitwise_and(1).bool(), -magnitudes, magnitudes).to(dtype)
