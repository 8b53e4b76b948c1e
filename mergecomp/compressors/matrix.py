"""Viewing a gradient as a matrix, for the low-rank compressors (ATOMO, PowerSGD).

A tensor of two or more dimensions is read as (first dimension) × (the rest), the
convention of both papers (a conv kernel out × in × h × w becomes out × (in·h·w)).
The communicators hand compressors flat fused buffers, whose layer structure is gone; a
flat buffer of n elements is laid out row by row in a near-square matrix of
r = ⌊√n⌋ rows and c = ⌈n/r⌉ columns, zero-padded to r·c (fewer than r padding zeros).
Near-square is what gives a low-rank factorisation its best ratio: (r + c)·rank numbers
for r·c elements.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch


def matrix_shape(shape: torch.Size) -> Tuple[int, int]:
    """(rows, cols) of the matrix a tensor of ``shape`` is viewed as; see the module docstring."""
    if len(shape) >= 2:
        return int(shape[0]), math.prod(shape[1:])
    n = math.prod(shape)
    rows = max(1, math.isqrt(n))
    return rows, max(1, -(-n // rows))


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """A new fp32 (or fp64) matrix holding ``tensor`` in :func:`matrix_shape` layout."""
    rows, cols = matrix_shape(tensor.shape)
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    matrix = torch.zeros(rows * cols, dtype=dtype, device=tensor.device)
    matrix[: tensor.numel()].copy_(tensor.reshape(-1))
    return matrix.view(rows, cols)


def from_matrix(matrix: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_matrix`: drop the padding, restore shape and dtype."""
    n = math.prod(shape)
    return matrix.reshape(-1)[:n].to(dtype).view(shape)
