"""The parameter views of a group as (offset, numel) spans, for compressors that work per view.

A fused group holds several parameters back to back; the sign compressors (their zero-view
flags, EF-SignSGD's scales) and 1-bit SGD (its two means) work per parameter view of the
group's ``layout``, and so does TBQ (its measured thresholds).  Their contexts carry the
views as spans, which every rank derives alike from the layout.
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


class RemembersLayoutSpans:
    """Mixin of compressors that derive spans from a layout every step (:meth:`_spans`)."""

    def _spans(self, layout: GroupLayout, numel: int) -> Spans:
        """:func:`layout_spans`, remembered by the layout object: a plan hands the same tuple
        every step, and hashing a long one costs more than the zero-view test itself."""
        cache = self.__dict__.setdefault("_layout_spans", {})
        hit = cache.get(id(layout))
        if hit is not None and hit[0] is layout and hit[1] == numel:
            return hit[2]
        if len(cache) >= 64:  # layouts made afresh each step (a shard's): keep the cache small
            cache.clear()
        spans = layout_spans(tuple(layout), numel)
        cache[id(layout)] = (layout, numel, spans)
        return spans
