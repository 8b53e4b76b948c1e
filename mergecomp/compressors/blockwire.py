"""The compact sparse wire: 16-bit values, and indices as 16-bit offsets within 64K blocks.

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

DGC's ``fp16_values`` option halves the values alone; this halves the indices as well.
"""
from __future__ import annotations

from typing import Tuple

import torch

#: Coordinates per block: an offset within one fits 16 bits.
BLOCK = 1 << 16
#: Subtracted from an offset so that it fits int16 (torch has no uint16 arithmetic).
_OFFSET_SHIFT = 1 << 15

#: The wire formats a sparsifier can send.
WIRE_FORMATS = ("compact", "indexed")


def check_wire_format(wire_format: str) -> str:
    """``wire_format`` if it is one of :data:`WIRE_FORMATS`, else a ValueError naming them."""
    if wire_format not in WIRE_FORMATS:
        raise ValueError(f"wire_format must be one of {WIRE_FORMATS} ('compact': 16-bit values and "
                         f"16-bit block offsets, 4 bytes a coordinate; 'indexed': the gradient's dtype "
                         f"and int32 indices), got {wire_format!r}")
    return wire_format


def num_blocks(numel: int) -> int:
    """B = ⌈n / 65,536⌉: one count per block of the group."""
    return -(-numel // BLOCK)


def value_nbytes(element_size: int) -> int:
    """Bytes of one value on the compact wire: 2 (bf16, or the gradient's own 16-bit dtype)."""
    return min(element_size, 2)


def compact_nbytes(count: int, numel: int, element_size: int) -> int:
    """Bytes of a compact payload of ``count`` coordinates of an ``numel``-element group."""
    return count * (value_nbytes(element_size) + 2) + 4 * num_blocks(numel)


def wire_values(values: torch.Tensor) -> torch.Tensor:
    """The values as they travel: a 16-bit dtype kept, a wider one rounded to bf16."""
    return values if values.element_size() <= 2 else values.to(torch.bfloat16)


def pack(values: torch.Tensor, indices: torch.Tensor, numel: int) -> Tuple[torch.Tensor, ...]:
    """``(values, offsets, counts)`` for ``indices`` sorted ascending (the caller sorts: the
    selection that found them knows whether they already are) and their ``values``."""
    indices = indices.long()
    ends = torch.arange(1, num_blocks(numel) + 1, device=indices.device, dtype=torch.long) * BLOCK
    counts = torch.searchsorted(indices, ends).diff(prepend=ends.new_zeros(1)).to(torch.int32)
    offsets = ((indices & (BLOCK - 1)) - _OFFSET_SHIFT).to(torch.int16)
    return wire_values(values), offsets, counts


def unpack(payload, numel: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(values, flat int64 indices)`` of a compact payload for an ``numel``-element group.

    A payload that cannot be one (a peer's corrupt or mismatched bytes) is refused with what
    was wrong: counts for another group size, a count total other than the values', or an
    index past the group's end.  On a GPU the total is checked without a host sync
    (asynchronously: a mismatch fails the next synchronising call)."""
    if len(payload) != 3:
        raise ValueError(f"a compact sparse payload is (values, offsets, counts), got {len(payload)} tensors")
    values, offsets, counts = payload
    blocks, count = num_blocks(numel), values.numel()
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
    starts = torch.arange(blocks, device=counts.device, dtype=torch.long) * BLOCK
    indices = torch.repeat_interleave(starts, counts, output_size=count) + offsets.long() + _OFFSET_SHIFT
    if not indices.is_cuda and count and int(indices.max()) >= numel:
        raise ValueError(f"compact sparse payload names coordinate {int(indices.max())} of a group of "
                         f"{numel} elements (a corrupt payload)")
    return values, indices


def _brief(counts: torch.Tensor) -> str:
    shown = counts[:8].tolist()
    return str(shown) if counts.numel() <= 8 else str(shown)[:-1] + ", ...]"
