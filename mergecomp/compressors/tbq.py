"""Threshold binary quantisation.

Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
Interspeech 2015.

    ĝ_i = +τ if g_i ≥ τ,  −τ if g_i ≤ −τ,  else 0.

τ is measured (the default, ``threshold="auto"``): per parameter view,
τ_v = min(2·‖g_v‖₁ / n_v, ‖g_v‖_∞), twice its mean magnitude at most its largest, sent
beside the codes.  Or fixed, as in Strom's paper: a number shared by all ranks and not
sent (then ĝ_i = ±τ strictly above τ).

On the wire: one 2-bit code per element (0 → 0, 1 → +τ, 2 → −τ), ⌈n/4⌉ bytes, and with
a measured τ its fp32 value per parameter view, 4·v bytes.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Union

import torch

from . import register
from .base import Compressor, Context, payload_nbytes, positive_finite
from .raisedbits import MagnitudeContext, RaisesBits
from .recipes import Recipe
from .views import RemembersLayoutSpans, Spans, context_spans
from ..kernels import pack_bits, packed_nbytes, unpack_bits
from ..kernels.segments import scale_views, span_lengths

#: ``threshold=AUTO``: τ is measured per parameter view every step (see the class).
AUTO = "auto"
#: τ over the view's mean magnitude with ``threshold=AUTO`` (see the class).
DEFAULT_SCALE = 2.0


@register("tbq")
class TBQCompressor(RaisesBits, RemembersLayoutSpans, Compressor):
    """Send +τ where the accumulated gradient reaches τ, −τ where it reaches −τ, else 0.

    Strom's scheme relies on residual accumulation: what is not sent (everything under
    τ, and the excess over τ) stays in the ``residual`` memory and is sent once it has
    grown past the threshold.  Biased per step; with the residual nothing is lost.  Each
    element costs a 2-bit code (0 → 0, 1 → +τ, 2 → −τ) instead of Strom's sparse 32-bit
    index list, which keeps the payload fixed-size and cheaper whenever more than 1/16 of
    the elements pass.

    ``threshold="auto"`` (the default) measures τ per parameter view of the group (the
    ``layout``; the whole tensor without one): ``scale`` (2) times the mean magnitude of
    what the memory hands over, as EF-SignSGD's scale is its mean (Karimireddy et al., ICML
    2019), but never above the view's largest magnitude; one fp32 number per view on the
    wire.  Why measured: Strom's τ is an absolute size, right only for the gradients it was
    tuned on.  With gradients far above τ every element moves by τ a step and the residual
    grows a backlog of everything above it (under SGD a fixed τ = 0.01 left a character LSTM
    far behind dense, and τ = 0.001 too: docs/results.md#tbq-threshold); far below, nothing
    is sent for many steps.  Why twice the mean: at the mean itself (as EF-SignSGD) about
    two in five elements of a bell-shaped gradient go out each step, and under an Adam,
    which divides each coordinate by its own root mean square, a coordinate sent that often
    with one size moves by nearly the full learning rate every step, as a sign method does;
    at twice the mean about one in ten goes, Adam's steps stay those of a noisy gradient,
    and under SGD the backlog still drains within a few steps (measured: the same page).
    Never above the largest magnitude, so at least one element of a nonzero view goes out:
    the compressor is a contraction (‖x − ĝ‖ < ‖x‖ for any x ≠ 0, what error feedback
    needs), and a view of equal magnitudes (a one-element bias) is not held back forever.
    A view of small gradients beside one of large ones keeps its own scale.  A number
    keeps Strom's fixed τ.

    Its default memory takes the optimizer's momentum off (``momentum="fold"``: see the
    EF-SignSGD compressor), since after the exchange a momentum multiplies the residual's
    backlog; under SGD, once the loop clips, it runs SGD's momentum before the exchange.

    Wire for n elements in v parameter views: ⌈n/4⌉ bytes, plus 4·v bytes for the measured
    thresholds (none for a fixed τ).  A group the quality controller raised goes out at 4 or
    8 bits per element instead (:mod:`~mergecomp.compressors.raisedbits`).
    """

    summable = False
    fixed_size = True
    unbiased = False
    recommended_memory = "residual"
    #: SGD's momentum folded into the learning rate, an Adam's β1 off (the memory's "fold").
    recommended_memory_options = MappingProxyType({"momentum": "fold"})
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="an element moves by at most τ per step, so the residual of a large gradient holds a "
               "backlog that keeps pushing after the gradient turned; momentum applied after the "
               "exchange multiplies that overshoot, while the same step without it trains at parity",
        fold_momentum=True)
    base_bits = 2
    #: Not raised under an Adam: its own format keeps Adam's steps those of a noisy gradient
    #: (:mod:`~mergecomp.compressors.raisedbits`).
    raised_under_adam = False

    def __init__(self, threshold: Union[float, str] = AUTO, scale: float = DEFAULT_SCALE):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"tbq scale (τ over a view's mean magnitude, with threshold='auto') must be a "
                             f"positive finite number, got {scale!r}; {DEFAULT_SCALE:g} is the default")
        self.scale = float(scale)
        if isinstance(threshold, str) and threshold == AUTO:
            self.threshold = AUTO
            return
        value = positive_finite(threshold)
        if value is None:
            raise ValueError(f"tbq threshold τ must be 'auto' (measured per parameter view: scale × its mean "
                             f"magnitude) or a positive finite number near the typical magnitude of a gradient "
                             f"element, got {threshold!r}")
        self.threshold = value

    @property
    def measures_threshold(self) -> bool:
        """Whether τ is measured per view each step (``threshold="auto"``) and sent."""
        return self.threshold == AUTO

    def compress(self, tensor, name, layout=None):
        if self.raised(name):
            return self._compress_raised(tensor, name, self._views_context(tensor, layout))
        flat = tensor.reshape(-1)
        if not self.measures_threshold:
            codes = (flat > self.threshold).view(torch.uint8)
            codes.bitwise_or_((flat < -self.threshold).view(torch.uint8).bitwise_left_shift_(1))
            return (pack_bits(codes, 2),), Context(tensor.shape, tensor.dtype)
        ctx = self._views_context(tensor, layout)
        spans = context_spans(ctx)
        magnitudes = torch.abs(flat)
        thresholds = self._measured_thresholds(magnitudes, spans)
        # an all-zero view has τ = 0 and sends nothing: compared against +inf there
        per_element = torch.where(thresholds > 0, thresholds, float("inf")).to(flat.dtype)
        if len(spans) > 1:
            per_element = torch.repeat_interleave(per_element, span_lengths(spans, str(flat.device)),
                                                  output_size=flat.numel())
        passes = torch.ge(magnitudes, per_element)
        negative = torch.signbit(flat)
        codes = torch.logical_and(passes, negative.logical_not()).view(torch.uint8)  # 1: +τ
        codes.bitwise_or_(negative.logical_and_(passes).view(torch.uint8).bitwise_left_shift_(1))  # 2: −τ
        return (pack_bits(codes, 2), thresholds), ctx

    def _measured_thresholds(self, magnitudes: torch.Tensor, spans: Spans) -> torch.Tensor:
        """fp32 (views,): min(scale × mean |x|, max |x|) of each view, from |x|."""
        magnitudes = magnitudes.to(torch.float32)
        if len(spans) == 1:
            means = (magnitudes.sum() / max(1, magnitudes.numel())).reshape(1)
            peaks = magnitudes.max().reshape(1) if magnitudes.numel() else torch.zeros_like(means)
        else:
            lengths = span_lengths(spans, str(magnitudes.device))
            means = torch.segment_reduce(magnitudes, "sum", lengths=lengths) / lengths.clamp(min=1)
            peaks = torch.segment_reduce(magnitudes, "max", lengths=lengths, initial=0.0)
        return torch.minimum(means.mul_(self.scale), peaks)

    def decompress(self, payload, ctx):
        if isinstance(ctx, MagnitudeContext):
            return self._decompress_raised(payload, ctx)
        values = ternary_values(unpack_bits(payload[0], 2, ctx.numel))
        if not self.measures_threshold:
            return values.mul_(self.threshold).to(ctx.dtype).view(ctx.shape)
        thresholds, spans = payload[1], context_spans(ctx)
        if thresholds.numel() != len(spans):
            raise ValueError(f"TBQ payload has {thresholds.numel()} thresholds but its context has "
                             f"{len(spans)} views: the payload was made with another layout")
        values = values.to(ctx.dtype)
        if len(spans) == 1:
            return values.mul_(thresholds.to(ctx.dtype)).view(ctx.shape)
        return scale_views(values, spans, thresholds).view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """One 2-bit code per element, and a measured τ's fp32 value per parameter view (a
        raised payload: its codes and table)."""
        if payload is not None and self._is_raised(payload):
            return payload_nbytes(payload)
        if not self.measures_threshold:
            return packed_nbytes(numel, 2)
        views = 1 if layout is None else max(1, len(layout))
        return packed_nbytes(numel, 2) + 4 * views


def ternary_values(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0, 1, 2) → fp32 values (0, +1, −1): c − 3·(c >> 1), in int8, cast once."""
    signed = torch.bitwise_right_shift(codes, 1).mul_(3).view(torch.int8)
    return torch.sub(codes.view(torch.int8), signed, out=signed).to(torch.float32)
