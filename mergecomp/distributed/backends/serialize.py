"""Tuples of tensors ↔ one flat byte tensor, so a whole payload travels in one collective.

Each part starts at an 8-byte aligned offset, so any dtype can be viewed back in place.

Sizes and shapes read from a peer are checked before anything is allocated or viewed
with them: a rank whose collectives got out of step with the others (a different
communicator, compressor or plan) reads whatever the peer sent in that collective as a
header, and would otherwise try to allocate absurd sizes.  A bad header raises
:class:`HeaderError` naming the rank that sent it.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

ALIGN = 8
MAX_DIMS = 4

#: A variable-size payload from a peer may claim at most ``LIMIT_FACTOR`` times the bytes
#: of the uncompressed tensor plus ``LIMIT_SLACK`` bytes (:func:`payload_limit`).  No
#: compressor sends more than a few times the raw gradient (top-k at ratio 1 sends every
#: value and an int64 index: 3x), while a size misread from another collective is
#: typically absurd (gigabytes to terabytes).
LIMIT_FACTOR = 16
LIMIT_SLACK = 1 << 16


class HeaderError(ValueError):
    """A peer's sizes or shapes do not describe a payload of this group."""


def header_error(source: Optional[int], detail: str) -> HeaderError:
    """The error for a bad header from rank ``source`` (None: not known here)."""
    who = "a peer" if source is None else f"rank {source}"
    return HeaderError(
        f"{who} sent a header that does not describe a payload of this group: {detail}. Are all "
        f"ranks using the same communicator, compressor and plan? Every rank must build the "
        f"same configuration and run the same collectives in the same order; a rank whose "
        f"collectives got out of step reads another collective's data as sizes.")


def payload_limit(numel: int, dtype: torch.dtype) -> int:
    """The most bytes a peer's variable-size payload for ``numel`` elements of ``dtype`` may
    claim (see ``LIMIT_FACTOR``)."""
    return LIMIT_FACTOR * numel * _itemsize(dtype) + LIMIT_SLACK


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


def shapes_from_header(header: torch.Tensor, source: Optional[int] = None) -> List[torch.Size]:
    """The shapes a :func:`shape_header` describes; HeaderError unless each row is
    non-negative dims followed by -1 padding."""
    rows = header.view(-1, MAX_DIMS).tolist()
    shapes = []
    for index, row in enumerate(rows):
        ndim = next((i for i, d in enumerate(row) if d < 0), MAX_DIMS)
        if any(d != -1 for d in row[ndim:]):
            raise header_error(source, f"part {index} has the shape row {row}, which is neither "
                                       f"sizes (>= 0) nor -1 padding after them")
        shapes.append(torch.Size(row[:ndim]))
    return shapes


def check_blob_size(shapes: Sequence[torch.Size], dtypes: Sequence[torch.dtype],
                    limit: Optional[int], source: Optional[int]) -> int:
    """The bytes ``shapes`` take; HeaderError when they exceed ``limit`` (None: no limit)."""
    size = blob_size(shapes, dtypes)
    if limit is not None and size > limit:
        described = ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d in zip(shapes, dtypes))
        raise header_error(source, f"parts of shapes {described} take {size} bytes, more than "
                                   f"the {limit} any payload of this group may take")
    return size


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


def unpack_bounded(blob: torch.Tensor, dtypes: Sequence[torch.dtype],
                   bound: Optional[Sequence[torch.Size]] = None,
                   source: Optional[int] = None) -> Tuple[torch.Tensor, ...]:
    """Inverse of :func:`pack_bounded` for a payload of ``len(dtypes)`` parts.

    The shapes in the blob's header come from rank ``source``: each part must fit its
    ``bound`` and all of them the blob, else HeaderError.
    """
    header_bytes = len(dtypes) * MAX_DIMS * 8
    if blob.numel() < header_bytes:
        raise header_error(source, f"a bounded payload of {len(dtypes)} parts needs a "
                                   f"{header_bytes}-byte header, got a {blob.numel()}-byte blob")
    shapes = shapes_from_header(blob[:header_bytes].view(torch.int64), source)
    if bound is not None:
        for index, (shape, largest) in enumerate(zip(shapes, bound)):
            if _numel(shape) > _numel(largest):
                raise header_error(source, f"part {index} has shape {tuple(shape)}, larger than "
                                           f"its bound {tuple(largest)}")
    check_blob_size(shapes, dtypes, blob.numel() - header_bytes, source)
    return unpack(blob[header_bytes:], shapes, dtypes)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
