"""Viewing gradients as matrices, for the low-rank compressors (PowerSGD, ATOMO).

A tensor of two or more dimensions is read as (first dimension) × (the rest), the
convention of both papers (a conv kernel out × in × h × w becomes out × (in·h·w)).

Per layer (``powersgd``, ``atomo``): a fused group buffer comes with its layout, the
per-parameter views (:class:`~mergecomp.compressors.base.ParamView`); :func:`split_layout`
makes each view of two or more dimensions a matrix of its own and leaves the rest (biases,
norms, pieces of sliced parameters, matrices too small to gain) to be sent raw.

Flat (``batched_powersgd``): the whole buffer is one matrix.  A flat buffer of n elements
is laid out row by row in a near-square matrix of r = ⌊√n⌋ rows and c = ⌈n/r⌉ columns,
zero-padded to r·c (fewer than r padding zeros).  Near-square gives a low-rank
factorisation its best ratio, (r + c)·rank numbers for r·c elements, but the layers laid
end to end in it share no low-rank structure.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from .base import GroupLayout, ParamView, check_layout, whole_layout


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the factorisations run and travel in: fp64 stays fp64, all else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def factor_element_size(element_size: int) -> int:
    """Bytes per factor element for gradients of ``element_size`` bytes (see :func:`compute_dtype`)."""
    return 8 if element_size == 8 else 4


# -- per layer -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerMatrix:
    """A view of the group buffer factored as a ``rows × cols`` matrix."""

    view: ParamView
    rows: int
    cols: int

    @property
    def start(self) -> int:
        return self.view.offset

    @property
    def stop(self) -> int:
        return self.view.offset + self.rows * self.cols


def group_layout(tensor: torch.Tensor, name: str, layout: Optional[GroupLayout]) -> GroupLayout:
    """The layout to factor ``tensor`` by: ``layout`` checked against it, or, without one,
    the tensor as one parameter of its own shape (a matrix if it has two or more dimensions)."""
    if layout is None:
        return whole_layout(tensor, name)
    layout = tuple(layout)
    if not all(isinstance(view, ParamView) for view in layout):
        raise TypeError(f"layout of group {name!r} must be a tuple of ParamView, got {layout!r}")
    check_layout(layout, tensor.numel())
    return layout


def split_layout(layout: GroupLayout, factor: Callable[[int, int], bool]
                 ) -> Tuple[Tuple[ParamView, ...], Tuple[LayerMatrix, ...]]:
    """(views sent raw, views factored): a view of two or more dimensions is a
    shape[0] × rest matrix, factored when ``factor(rows, cols)`` says it gains enough."""
    raw, matrices = [], []
    for view in layout:
        if len(view.shape) >= 2 and view.numel > 0:
            rows = int(view.shape[0])
            cols = view.numel // rows
            if factor(rows, cols):
                matrices.append(LayerMatrix(view, rows, cols))
                continue
        raw.append(view)
    return tuple(raw), tuple(matrices)


def raw_numel(raw: Sequence[ParamView]) -> int:
    return sum(view.numel for view in raw)


def gather_raw(flat: torch.Tensor, raw: Sequence[ParamView], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The raw views' elements back to back (into ``out`` when given)."""
    if out is None:
        out = torch.empty(raw_numel(raw), dtype=flat.dtype, device=flat.device)
    at = 0
    for view in raw:
        out[at:at + view.numel].copy_(flat[view.offset:view.offset + view.numel])
        at += view.numel
    return out


def scatter_raw(values: torch.Tensor, raw: Sequence[ParamView], flat: torch.Tensor) -> None:
    """Inverse of :func:`gather_raw`: write the raw views' elements into ``flat``."""
    at = 0
    for view in raw:
        flat[view.offset:view.offset + view.numel].copy_(values[at:at + view.numel])
        at += view.numel


def layer_matrix(flat: torch.Tensor, matrix: LayerMatrix, dtype: torch.dtype) -> torch.Tensor:
    """The view's elements as a ``rows × cols`` matrix of ``dtype`` (a view of ``flat`` when
    the dtype already matches: never write into it)."""
    return flat[matrix.start:matrix.stop].view(matrix.rows, matrix.cols).to(dtype)


# -- flat ----------------------------------------------------------------------------------
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
    matrix = torch.zeros(rows * cols, dtype=compute_dtype(tensor.dtype), device=tensor.device)
    matrix[: tensor.numel()].copy_(tensor.reshape(-1))
    return matrix.view(rows, cols)


def from_matrix(matrix: torch.Tensor, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_matrix`: drop the padding, restore shape and dtype."""
    n = math.prod(shape)
    return matrix.reshape(-1)[:n].to(dtype).view(shape)
