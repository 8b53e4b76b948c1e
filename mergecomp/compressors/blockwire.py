"""The block wires: indices as 16-bit offsets within 64K blocks, values in 16 or 8 bits.

A sparsifier's payload names k of a group's n coordinates.  Sent as they are (the
``"indexed"`` wire), each costs its value in the gradient's dtype plus an int32 index:
8 bytes for an fp32 gradient.  Half of that carries little: the high 16 bits of sorted
indices change at most once per block of 2^16 coordinates, and a value rounded to 16 bits
loses what error feedback keeps anyway.  So the ``"compact"`` wire sends, for indices sorted
ascending and cut into blocks of 65,536 coordinates:

    values   k × 16 bits   bf16 for an fp32 (or fp64) gradient, a 16-bit gradient's own dtype
    offsets  k × 16 bits   each index's low 16 bits, as int16 (offset − 32,768)
    counts   B × 32 bits   how many indices fall in each block, B = ⌈n / 65,536⌉

4·k + 4·B bytes, where the indexed wire takes 8·k: twice the coordinates in the same bytes.
Decoding rebuilds index = 65,536 · block + offset, the block repeated ``counts`` times.

Why bf16 and not fp16: bf16 has fp32's exponent range, so a finite gradient stays finite on
the wire (fp16 turns a value above 65,504 into Inf, and the step would be dropped as
non-finite) and a non-finite one stays non-finite.  Its 8-bit mantissa is coarse, but what
the rounding loses is not lost: error feedback subtracts the rounded value it sent
(``SparseCompressor.subtract_sent``) and keeps the rest for the next step.

The ``"compact8"`` wire sends the values in 8 bits, fp8 e4m3 after one fp32 scale per payload
(a power of two that puts the largest magnitude within a factor two of e4m3's largest, 448),
and the offsets and counts as above:

    values   k × 8 bits    e4m3 codes of value / scale (3 mantissa bits: within 6.25% of each)
    offsets  k × 16 bits
    counts   B × 32 bits
    scale    32 bits       2^(⌊log2(max |value| / 448)⌋ + 1)

3·k + 4·B + 4 bytes (no scale for no values): four coordinates in the bytes three took on
the compact wire.  A non-finite value makes the scale non-finite, and the whole payload
decodes non-finite (so the step is dropped, as any non-finite payload's is); a value below
e4m3's smallest step after scaling is sent as 0, and error feedback keeps it.

The ``"tight8"`` wire sends the 8-bit values and scale as ``"compact8"`` does, and the
indices in blocks of 255 coordinates, so that both an offset and a block's count fit 8 bits:

    values   k × 8 bits    e4m3 codes of value / scale, as on compact8
    offsets  k × 8 bits    each index − 255 · its block (0 to 254)
    counts   B × 8 bits    how many indices fall in each block (0 to 255), B = ⌈n / 255⌉
    scale    32 bits

2·k + ⌈n / 255⌉ + 4 bytes: at a density d, 2 + 1 / (255·d) bytes a coordinate (2.16 at
2.5%, 2.08 at 5%), where compact8 takes 3.  The counts are the price of short blocks: at
a density under 0.4% they cost more than the offsets save, and compact8 sends less.

``"auto"`` sends each payload on whichever of ``"tight8"`` and ``"compact8"`` is smaller for
the number of coordinates the group plans to send (:func:`chosen`): tight8 from a density
of about 0.4%, compact8 below it.  The plan is the same on every rank (the configured
density times the controller's scale, or DGC's bound), so every rank sends one format for
a group; a receiver tells the two apart by the offsets' dtype.

DGC's ``fp16_values`` option halves the values alone; these halve the indices as well.
"""
from __future__ import annotations

from typing import Tuple

import torch

#: Coordinates per block: an offset within one fits 16 bits.
BLOCK = 1 << 16
#: Coordinates per block on the ``"tight8"`` wire: an offset (0 to 254) and a block's count
#: (0 to 255) each fit 8 bits.
SHORT_BLOCK = 255
#: Subtracted from an offset so that it fits int16 (torch has no uint16 arithmetic).
_OFFSET_SHIFT = 1 << 15

#: The wire formats a sparsifier can send.
WIRE_FORMATS = ("auto", "compact", "compact8", "tight8", "indexed")
#: The block wires (the others send indices as they are); ``"auto"`` picks one per payload.
BLOCK_FORMATS = ("auto", "compact", "compact8", "tight8")
#: The block wires whose values travel in 8 bits after one scale.
EIGHT_BIT_FORMATS = ("compact8", "tight8")
#: The 8-bit values' type and its largest finite value, where a payload's largest magnitude lands.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def check_wire_format(wire_format: str) -> str:
    """``wire_format`` if it is one of :data:`WIRE_FORMATS`, else a ValueError naming them."""
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire_format must be one of {WIRE_FORMATS} ('compact': 16-bit values and "
                         f"16-bit block offsets, 4 bytes a coordinate; 'compact8': 8-bit values with "
                         f"one scale and 16-bit block offsets, 3 bytes; 'tight8': 8-bit values and "
                         f"8-bit offsets within blocks of 255, about 2 bytes; 'auto': the smaller of "
                         f"'tight8' and 'compact8' for the density; 'indexed': the gradient's "
                         f"dtype and int32 indices), got {wire_format!r}")
    return wire_format


def chosen(wire_format: str, planned: int, numel: int) -> str:
    """The wire a payload travels on: ``wire_format`` itself, or for ``"auto"`` whichever of
    ``"tight8"`` and ``"compact8"`` takes fewer bytes for ``planned`` coordinates of an
    ``numel``-element group (tight8 on a tie)."""
    if wire_format != "auto":
        return wire_format
    tight, eight = (compact_nbytes(planned, numel, 1, wire) for wire in ("tight8", "compact8"))
    return "tight8" if tight <= eight else "compact8"


def format_of(payload) -> str:
    """Which block wire ``payload`` travels on, read from its parts: a scale (four parts)
    with 8-bit offsets is ``"tight8"``, with 16-bit ones ``"compact8"``; three parts
    ``"compact"``."""
    if len(payload) == 4:
        return "tight8" if payload[1].dtype == torch.uint8 else "compact8"
    return "compact"


def block_size(wire_format: str = "compact") -> int:
    """Coordinates per block: :data:`SHORT_BLOCK` on ``"tight8"``, :data:`BLOCK` otherwise."""
    return SHORT_BLOCK if wire_format == "tight8" else BLOCK


def num_blocks(numel: int, wire_format: str = "compact") -> int:
    """B = ⌈n / block⌉: one count per block of the group."""
    return -(-numel // block_size(wire_format))


def value_nbytes(element_size: int, wire_format: str = "compact") -> int:
    """Bytes of one value on a block wire: 1 on the 8-bit wires; 2 on ``"compact"`` (bf16, or
    the gradient's own 16-bit dtype)."""
    return 1 if wire_format in EIGHT_BIT_FORMATS else min(element_size, 2)


def compact_nbytes(count: int, numel: int, element_size: int, wire_format: str = "compact") -> int:
    """Bytes of a block-wire payload of ``count`` coordinates of an ``numel``-element group."""
    wire_format = chosen(wire_format, count, numel)
    scale = 4 if wire_format in EIGHT_BIT_FORMATS and count else 0  # an empty payload sends no scale
    short = wire_format == "tight8"  # 8-bit offsets and counts, else 16-bit offsets and int32 counts
    offset_bytes, count_bytes = (1, 1) if short else (2, 4)
    return (count * (value_nbytes(element_size, wire_format) + offset_bytes)
            + count_bytes * num_blocks(numel, wire_format) + scale)


def largest_shapes(count: int, numel: int, wire_format: str = "compact") -> Tuple[torch.Size, ...]:
    """The shape of each part of a block-wire payload of at most ``count`` coordinates of an
    ``numel``-element group: values and offsets ``count``, one count per block, and on the
    8-bit wires one scale (a variable-size payload's bound, which the allgather pads to)."""
    wire_format = chosen(wire_format, count, numel)
    scale = (torch.Size([1]),) if wire_format in EIGHT_BIT_FORMATS else ()
    return (torch.Size([count]), torch.Size([count]), torch.Size([num_blocks(numel, wire_format)])) + scale


def wire_values(values: torch.Tensor) -> torch.Tensor:
    """The values as they travel: a 16-bit dtype kept, a wider one rounded to bf16."""
    return values if values.element_size() <= 2 else values.to(torch.bfloat16)


def fp8_values(values: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(e4m3 codes, fp32 scale of one element)``: the scale is the power of two that puts the
    largest magnitude in [224, 448), so a decoded value (a code times the scale) is exact in
    bf16 and the sparse allreduce can carry it on; a zero payload gets scale 1, a non-finite
    one its non-finite peak, an empty one no scale (nothing is sent for nothing).  No host
    sync."""
    if not values.numel():
        return values.to(FP8), values.new_zeros(0, dtype=torch.float32)
    peak = values.abs().amax().float()
    _, exponent = torch.frexp(peak / FP8_MAX)
    scale = torch.where(peak > 0, torch.ldexp(torch.ones_like(peak), exponent), torch.ones_like(peak))
    scale = torch.where(torch.isfinite(peak), scale, peak).reshape(1)
    return (values.float() / scale).to(FP8), scale


def pack(values: torch.Tensor, indices: torch.Tensor, numel: int,
         wire_format: str = "compact") -> Tuple[torch.Tensor, ...]:
    """``(values, offsets, counts)`` (``"compact8"``: ``(codes, offsets, counts, scale)``;
    ``"tight8"``: ``(codes, uint8 offsets, uint8 counts, scale)`` over blocks of
    :data:`SHORT_BLOCK`) for ``indices`` sorted ascending (the caller sorts: the selection
    that found them knows whether they already are) and their ``values``."""
    wire_format = chosen(wire_format, values.numel(), numel)
    indices = indices.long()
    size = block_size(wire_format)
    ends = torch.arange(1, num_blocks(numel, wire_format) + 1, device=indices.device, dtype=torch.long) * size
    counts = torch.searchsorted(indices, ends).diff(prepend=ends.new_zeros(1))
    if wire_format == "tight8":
        codes, scale = fp8_values(values)
        return codes, torch.remainder(indices, size).to(torch.uint8), counts.to(torch.uint8), scale
    counts = counts.to(torch.int32)
    offsets = ((indices & (BLOCK - 1)) - _OFFSET_SHIFT).to(torch.int16)
    if wire_format == "compact8":
        codes, scale = fp8_values(values)
        return codes, offsets, counts, scale
    return wire_values(values), offsets, counts


def unpack(payload, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(values, flat int64 indices)`` of a block-wire payload for an ``numel``-element group
    (an 8-bit payload's values decoded to fp32).

    A payload that cannot be one (a peer's corrupt or mismatched bytes) is refused with what
    was wrong: counts for another group size, a count total other than the values', or an
    index past the group's end.  On a GPU the total is checked without a host sync
    (asynchronously: a mismatch fails the next synchronising call)."""
    if len(payload) == 4:
        codes, offsets, counts, scale = payload
        if scale.numel() != min(codes.numel(), 1):
            raise ValueError(f"an 8-bit compact payload of {codes.numel()} values carries "
                             f"{min(codes.numel(), 1)} scale, got {scale.numel()} (a corrupt payload)")
        values, indices = unpack((codes, offsets, counts), numel)
        return values.float() * scale.float(), indices
    if len(payload) != 3:
        raise ValueError(f"a compact sparse payload is (values, offsets, counts), or (codes, offsets, "
                         f"counts, scale) on the 8-bit wire, got {len(payload)} tensors")
    values, offsets, counts = payload
    short = offsets.dtype == torch.uint8  # the tight8 wire's 8-bit offsets within blocks of 255
    wire_format = "tight8" if short else "compact"
    size, shift = block_size(wire_format), 0 if short else _OFFSET_SHIFT
    blocks, count = num_blocks(numel, wire_format), values.numel()
    if counts.numel() != blocks or offsets.numel() != count:
        raise ValueError(f"compact sparse payload has {count} values, {offsets.numel()} offsets and "
                         f"{counts.numel()} block counts; a group of {numel} elements needs {blocks} "
                         f"counts and as many offsets as values (a peer with another plan or a corrupt payload)")
    counts = counts.long()
    if counts.is_cuda:
        torch._assert_async((counts.sum() == count) & (counts.min() >= 0) if blocks else
                            torch.tensor(count == 0, device=counts.device))
    elif (int(counts.sum()) if blocks else 0) != count or (blocks and int(counts.min()) < 0):
        raise ValueError(f"compact sparse payload's block counts {_brief(counts)} add up to "
                         f"{int(counts.sum()) if blocks else 0}, not its {count} values (a corrupt payload)")
    offsets = offsets.long()
    if short and count:  # an offset of 255 would name the next block's first coordinate
        if offsets.is_cuda:
            torch._assert_async(offsets.max() < SHORT_BLOCK)
        elif int(offsets.max()) >= SHORT_BLOCK:
            raise ValueError(f"tight8 sparse payload has offset {int(offsets.max())} in a block of "
                             f"{SHORT_BLOCK} coordinates (a corrupt payload)")
    starts = torch.arange(blocks, device=counts.device, dtype=torch.long) * size
    indices = torch.repeat_interleave(starts, counts, output_size=count) + offsets + shift
    if not indices.is_cuda and count and int(indices.max()) >= numel:
        raise ValueError(f"compact sparse payload names coordinate {int(indices.max())} of a group of "
                         f"{numel} elements (a corrupt payload)")
    return values, indices


def _brief(counts: torch.Tensor) -> str:
    shown = counts[:8].tolist()
    return str(shown) if counts.numel() <= 8 else str(shown)[:-1] + ", ...]"
