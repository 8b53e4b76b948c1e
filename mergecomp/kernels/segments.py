"""Per-view sums and scales: the operations of compressors that keep one number per parameter.

A fused group is its parameters' gradients back to back, each a view given as an
(offset, numel) span.  EF-SignSGD sends each view's mean magnitude, 1-bit SGD each view's
two side means; both sum every view on the way out and scale every view on the way in.

The sign compressors also flag the views that are all zero (a rank with no gradient there
abstains from the vote), one bit per view: :func:`zero_view_flags` finds them and
:func:`clear_flagged_views` zeroes them in a decoded tensor.

On the CPU, and on CUDA without Triton, the torch path: ``torch.segment_reduce`` for the
sums and ``torch.repeat_interleave`` to expand the per-view values before a multiply (the
bits these compressors have always sent).  On a GPU with Triton one kernel per operation
(:mod:`.triton.segments`), cut along the views: no n-element expansion, no slow segment
kernels; the scaling gives the same bits, the sums the same values to rounding.  The zero
flags are found and applied there without reading anything back to the host (the torch
path reads each view's first element, and a whole view only where that is zero).
"""
from __future__ import annotations

import functools
from typing import List, Optional, Tuple

import torch

from . import triton as gpu
from .packing import pack_bits, packed_nbytes, unpack_bits
from .scratch import Scratch
from .signs import pack_signs, sign_bits

#: (offset, numel) of each view of a flat tensor, in order, tiling it.
Spans = Tuple[Tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def span_lengths(spans: Spans, device: str) -> torch.Tensor:
    """The views' element counts as an int64 tensor on ``device`` (for segment sums)."""
    return torch.tensor([size for _, size in spans], dtype=torch.int64, device=device)


def view_abs_sums(flat: torch.Tensor, spans: Spans, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """fp32 (views,): Σ|v| of each view of ``flat`` (the torch path takes |v| into
    ``scratch``'s "abs" buffer when given)."""
    if gpu.usable(flat):
        from .triton import segments
        return segments.view_sums(flat, spans, absolute=True)
    out = None if scratch is None else scratch.get("abs", flat.numel(), flat.dtype, flat.device)
    magnitudes = torch.abs(flat, out=out)
    return torch.segment_reduce(magnitudes.to(torch.float32), "sum", lengths=span_lengths(spans, str(flat.device)))


def signs_and_view_side_sums(flat: torch.Tensor, spans: Spans, scratch: Scratch
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed sign bits, and per view, fp32: Σv, Σ|v|, the number of set sign bits).

    1-bit SGD's encoder view by view; a set sign bit (−0.0 included) is "negative".  On a
    GPU the signs are packed by one kernel and the three sums come from one read.
    """
    if gpu.usable(flat):
        from .triton import segments
        total, absolute, num_negative = segments.view_side_sums(flat, spans)
        return pack_signs(flat, scratch), total, absolute, num_negative
    lengths = span_lengths(spans, str(flat.device))
    negative = sign_bits(flat, scratch)
    values = flat.to(torch.float32)
    total = torch.segment_reduce(values, "sum", lengths=lengths)
    absolute = torch.segment_reduce(values.abs(), "sum", lengths=lengths)  # not abs_: values may be the input
    num_negative = torch.segment_reduce(negative.to(torch.float32), "sum", lengths=lengths)
    return pack_bits(negative, 1), total, absolute, num_negative


def scale_views(flat: torch.Tensor, spans: Spans, scales: torch.Tensor,
                shifts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each view v of ``flat`` (1-D, contiguous) as v·scale (+ shift) of that view, in the
    tensor's dtype (``scales``/``shifts``: one value per view, converted to it first).

    The result may be ``flat`` itself, overwritten: callers pass a tensor they own.
    """
    if gpu.usable(flat):
        from .triton import segments
        return segments.scale_views_(flat, spans, scales, shifts)
    lengths = span_lengths(spans, str(flat.device))
    expanded = torch.repeat_interleave(scales.to(flat.dtype), lengths, output_size=flat.numel())
    if shifts is None:
        return flat.mul_(expanded)
    base = torch.repeat_interleave(shifts.to(flat.dtype), lengths, output_size=flat.numel())
    return base.addcmul_(flat, expanded)


@functools.lru_cache(maxsize=256)
def _first_elements(spans: Spans, device: str) -> Tuple[torch.Tensor, Tuple[int, ...]]:
    """(index of each non-empty view's first element, on ``device``; those views' positions)."""
    positions = tuple(i for i, (_, size) in enumerate(spans) if size)
    return torch.tensor([spans[i][0] for i in positions], dtype=torch.int64, device=device), positions


def zero_views(flat: torch.Tensor, spans: Spans) -> List[int]:
    """Positions of the views that are all zero (±0.0; a NaN is not zero) in ``flat``.

    One gather of the views' first elements; only the views whose first element is zero
    are read in full.  Empty views count as zero.
    """
    if len(spans) == 1:
        if not flat.numel():
            return [0]
        return [0] if flat[0].item() == 0 and not bool(flat.any()) else []
    starts, positions = _first_elements(spans, str(flat.device))
    zero = [i for i, (_, size) in enumerate(spans) if not size]
    firsts = flat.index_select(0, starts).tolist() if starts.numel() else []
    for j, first in enumerate(firsts):
        if first == 0:
            offset, size = spans[positions[j]]
            if not bool(flat[offset: offset + size].any()):
                zero.append(positions[j])
    return sorted(zero)


def pack_zero_flags(zero: List[int], views: int, device) -> torch.Tensor:
    """⌈views/8⌉ bytes, bit i (first view in the top bit of byte 0) set for each view in ``zero``."""
    flags = bytearray(packed_nbytes(views, 1))
    for i in zero:
        flags[i // 8] |= 0x80 >> (i % 8)
    if not any(flags):
        return torch.zeros(len(flags), dtype=torch.uint8, device=device)
    return torch.tensor(list(flags), dtype=torch.uint8, device=device)


def zero_view_flags(flat: torch.Tensor, spans: Spans) -> torch.Tensor:
    """⌈views/8⌉ bytes on ``flat``'s device: bit i (first view in the top bit of byte 0) set
    where view i of ``flat`` is all ±0.0 (or empty; a NaN is not zero)."""
    if gpu.usable(flat):
        from .triton import segments
        zero = segments.view_nonzero_counts(flat, spans) == 0
        return pack_bits(zero.to(torch.uint8), 1)
    return pack_zero_flags(zero_views(flat, spans), len(spans), flat.device)


def clear_flagged_views(flat: torch.Tensor, flags: torch.Tensor, spans: Spans) -> torch.Tensor:
    """``flat`` (1-D, contiguous) with the views flagged in ``flags`` set to +0.0, in place.

    On a GPU one kernel reads the flags there and writes only the flagged views, where the
    torch path reads the flags on the host first.
    """
    if gpu.usable(flat):
        from .triton import segments
        return segments.clear_views_(flat, spans, 1 - unpack_bits(flags, 1, len(spans)))
    for byte_index, byte in enumerate(flags.tolist()):
        while byte:
            bit = byte.bit_length() - 1  # the lowest view of this byte still set
            offset, size = spans[byte_index * 8 + 7 - bit]
            flat[offset: offset + size] = 0
            byte &= ~(1 << bit)
    return flat
