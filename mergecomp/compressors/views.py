"""The parameter views of a group as (offset, numel) spans, for compressors that work per view.

A fused group holds several parameters back to back; the sign compressors (their zero-view
flags, EF-SignSGD's scales) and 1-bit SGD (its two means) work per parameter view of the
group's ``layout``.  Their contexts carry the views as spans, which every rank derives
alike from the layout.
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from .base import GroupLayout, check_layout

#: (offset, numel) of each parameter view of a group, in buffer order.
Spans = Tuple[Tuple[int, int], ...]


@functools.lru_cache(maxsize=256)
def layout_spans(layout: GroupLayout, numel: int) -> Spans:
    """The (offset, numel) spans of ``layout``'s views, checked to tile ``numel`` elements."""
    check_layout(layout, numel)
    return tuple((view.offset, view.numel) for view in layout)


@functools.lru_cache(maxsize=256)
def span_lengths(spans: Spans, device: str) -> torch.Tensor:
    """The views' element counts as an int64 tensor on ``device`` (for segment sums)."""
    return torch.tensor([size for _, size in spans], dtype=torch.int64, device=device)
