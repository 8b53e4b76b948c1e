"""The parameter views of a group as (offset, numel) spans, for compressors that work per view.

A fused group holds several parameters back to back; the sign compressors (their zero-view
flags, EF-SignSGD's scales) and 1-bit SGD (its two means) work per parameter view of the
group's ``layout``.  Their contexts carry the views as spans, which every rank derives
alike from the layout.
"""
from __future__ import annotations

import functools

from ..kernels.segments import Spans
from .base import GroupLayout, check_layout


@functools.lru_cache(maxsize=256)
def layout_spans(layout: GroupLayout, numel: int) -> Spans:
    """The (offset, numel) spans of ``layout``'s views, checked to tile ``numel`` elements."""
    check_layout(layout, numel)
    return tuple((view.offset, view.numel) for view in layout)
