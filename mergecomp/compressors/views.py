"""The parameter views of a group as (offset, numel) spans, for compressors that work per view.

A fused group holds several parameters back to back; the sign compressors (their zero-view
flags, EF-SignSGD's scales) and 1-bit SGD (its two means) work per parameter view of the
group's ``layout``, and so does TBQ (its measured thresholds).  Their contexts carry the
views as spans (:class:`ViewsContext`), which every rank derives alike from the layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from ..kernels.segments import Spans
from .base import Context, GroupLayout, check_layout


@dataclass(frozen=True)
class ViewsContext(Context):
    """A payload's context when the group has several parameter views: their spans, which
    say whose per-view numbers (flags, scales, means, thresholds) decode each element; the
    same on every rank, like the layout they come from."""

    spans: Spans
    layout_fields = ("spans",)


def context_spans(ctx: Context) -> Spans:
    """The views a payload's per-view numbers refer to: the context's spans, or the whole tensor."""
    return getattr(ctx, "spans", None) or ((0, ctx.numel),)


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

    def _views_context(self, tensor: torch.Tensor, layout: Optional[GroupLayout]) -> Context:
        """A :class:`ViewsContext` for a group of several views; a plain context (the whole
        tensor one view, :func:`context_spans`) for one view or none, its layout checked."""
        if layout is None or len(layout) <= 1:
            if layout is not None:
                check_layout(layout, tensor.numel())
            return Context(tensor.shape, tensor.dtype)
        return ViewsContext(tensor.shape, tensor.dtype, self._spans(layout, tensor.numel()))
