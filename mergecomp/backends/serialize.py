"""Tuples of tensors ↔ one flat byte tensor, so a whole payload travels in one collective.

Each part starts at an 8-byte aligned offset, so any dtype can be viewed back in place.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

ALIGN = 8
MAX_DIMS = 4


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def blob_size(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> int:
    return sum(_aligned(_numel(shape) * _itemsize(dtype)) for shape, dtype in zip(shapes, dtypes))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def pack(tensors: Sequence[torch.Tensor], device, size: int = 0) -> torch.Tensor:
    """Concatenate the parts' bytes (aligned) into a uint8 tensor of at least ``size`` bytes."""
    shapes = [t.shape for t in tensors]
    used = blob_size(shapes, [t.dtype for t in tensors])
    blob = torch.empty(max(used, size), dtype=torch.uint8, device=device)
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            blob[offset:offset + nbytes].copy_(t.detach().reshape(-1).view(torch.uint8))
        offset += _aligned(nbytes)
    if blob.numel() > offset:
        blob[offset:].zero_()
    return blob


def unpack(blob: torch.Tensor, shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype]) -> Tuple[torch.Tensor, ...]:
    """Inverse of :func:`pack`: views into ``blob`` with the given shapes and dtypes."""
    parts: List[torch.Tensor] = []
    offset = 0
    for shape, dtype in zip(shapes, dtypes):
        nbytes = _numel(shape) * _itemsize(dtype)
        part = blob[offset:offset + nbytes]
        parts.append(part.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype, device=blob.device))
        offset += _aligned(nbytes)
    return tuple(parts)


def shape_header(tensors: Sequence[torch.Tensor], device) -> torch.Tensor:
    """int64 tensor of every part's shape padded to MAX_DIMS with −1 (for variable payloads)."""
    rows = []
    for t in tensors:
        if t.dim() > MAX_DIMS:
            raise ValueError(f"variable-size payload parts may have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
        rows.append(list(t.shape) + [-1] * (MAX_DIMS - t.dim()))
    return torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)


def shapes_from_header(header: torch.Tensor) -> List[torch.Size]:
    rows = header.view(-1, MAX_DIMS).tolist()
    return [torch.Size([d for d in row if d >= 0]) for row in rows]


def pack_bounded(tensors: Sequence[torch.Tensor], bound: Sequence[torch.Size], device) -> torch.Tensor:
    """A payload whose shapes vary up to ``bound`` (the largest shape of each part), as a
    blob of fixed size: its shape header, then :func:`pack` padded to the bound's size.
    Every rank's blob has the same size, so one allgather carries them without an
    exchange of sizes first."""
    if len(bound) != len(tensors):
        raise ValueError(f"a payload bound needs one shape per part: {len(tensors)} parts, bound {list(bound)}")
    for t, largest in zip(tensors, bound):
        if t.numel() > _numel(largest):
            raise ValueError(f"a payload part of shape {tuple(t.shape)} exceeds its bound {tuple(largest)}: the "
                             "compressor's payload_bound() must cover every payload it produces")
    header = shape_header(tensors, device)
    capacity = blob_size(bound, [t.dtype for t in tensors])
    return pack((header, *tensors), device, size=header.numel() * 8 + capacity)


def unpack_bounded(blob: torch.Tensor, dtypes: Sequence[torch.dtype]) -> Tuple[torch.Tensor, ...]:
    """Inverse of :func:`pack_bounded` for a payload of ``len(dtypes)`` parts."""
    header_bytes = len(dtypes) * MAX_DIMS * 8
    shapes = shapes_from_header(blob[:header_bytes].view(torch.int64))
    return unpack(blob[header_bytes:], shapes, dtypes)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
