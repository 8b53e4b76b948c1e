"""1-bit SGD: one bit per element, decoded with the mean of its side.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs", Interspeech 2014.

    b_i = [g_i < 0];   μ⁺ = mean{g_i : b_i = 0},   μ⁻ = mean{g_i : b_i = 1};
    decode: ĝ_i = μ⁻ if b_i else μ⁺.

On the wire: the packed bits (⌈n/8⌉ bytes) and the two fp32 means of each parameter view.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from . import register
from .base import Compressor, payload_nbytes
from ..kernels import Scratch, decode_values, packed_nbytes, signs_and_side_means
from ..kernels.segments import scale_views, signs_and_view_side_sums, span_lengths
from .raisedbits import MagnitudeContext, RaisesBits
from .recipes import Recipe
from .views import RemembersLayoutSpans, ViewsContext

#: 1-bit codes as 0 (clear: the non-negative side) and 1 (set: the negative side).
_ZERO_ONE = torch.tensor([0.0, 1.0])


#: A 1-bit payload's context when the group has several parameter views (the name it had
#: before the per-view compressors shared one).
OneBitContext = ViewsContext

@register("onebit")
class OneBitCompressor(RaisesBits, RemembersLayoutSpans, Compressor):
    """Quantise each element to one bit (its sign) and decode with the mean of its side.

    The receiver rebuilds a set bit as the mean of the negative elements and a clear bit
    as the mean of the non-negative ones (the bit is the IEEE sign bit, so −0.0 counts as
    negative and decodes to the negative mean), the reconstruction values of Seide et al.
    They keep the two means per column of each weight matrix; here they are kept per
    parameter view of the group (the ``layout``), so a layer of small gradients is not
    rebuilt with the means of a layer of large ones (the whole tensor is one view without a
    layout).  A view that is all zero decodes to 0 (both its means are 0).  Biased: pair it
    with the ``residual`` memory, the error feedback the paper introduced; its default takes
    the optimizer's momentum off (``momentum="fold"``: see the EF-SignSGD compressor; under
    SGD, once the loop clips, it runs the momentum before the exchange).

    Wire for n elements in v parameter views: ⌈n/8⌉ bytes + 8·v bytes for the two fp32
    means of each view.  A group the quality controller raised goes out at 2, 4 or 8 bits
    per element instead (:mod:`~mergecomp.compressors.raisedbits`).
    """

    summable = False
    fixed_size = True
    unbiased = False
    recommended_memory = "residual"
    #: SGD's momentum folded into the learning rate, an Adam's β1 off (the memory's "fold").
    recommended_memory_options = MappingProxyType({"momentum": "fold"})
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="the residual releases a coordinate's backlog in bursts of its side's mean, and "
               "momentum applied after the exchange multiplies each burst; the same step without "
               "it trains at parity",
        fold_momentum=True, memory="residual")

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name, layout=None):
        ctx = self._views_context(tensor, layout)
        if self.raised(name):
            return self._compress_raised(tensor, name, ctx)
        if isinstance(ctx, ViewsContext):
            return self._compress_views(tensor, ctx), ctx
        packed, means = signs_and_side_means(tensor, self._scratch)
        return (packed, means), ctx

    def _compress_views(self, tensor, ctx):
        """Per-view means, from each view's side sums and count of negative elements."""
        flat = tensor.reshape(-1)
        packed, total, absolute, num_negative = signs_and_view_side_sums(flat, ctx.spans, self._scratch)
        num_positive = span_lengths(ctx.spans, str(flat.device)) - num_negative
        means = torch.stack([(total + absolute) / 2 / num_positive.clamp(min=1),
                             (total - absolute) / 2 / num_negative.clamp(min=1)], dim=1).reshape(-1)
        return packed, means

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n/8⌉ bytes of signs + the two fp32 means of each view (a raised payload: its
        codes and table)."""
        if payload is not None and self._is_raised(payload):
            return payload_nbytes(payload)
        views = 1 if layout is None else max(1, len(layout))
        return packed_nbytes(numel, 1) + 8 * views

    def decompress(self, payload, ctx):
        if isinstance(ctx, MagnitudeContext):
            return self._decompress_raised(payload, ctx)
        packed, means = payload
        spans = getattr(ctx, "spans", None)
        if spans is None:
            # Clear bit → the non-negative mean, set bit → the negative one, copied bit for bit.
            return decode_values(packed, 1, ctx.numel, means.to(ctx.dtype)).view(ctx.shape)
        if means.numel() != 2 * len(spans):
            raise ValueError(f"1-bit SGD payload has {means.numel()} means but its context has "
                             f"{len(spans)} views (two means each): it was made with another layout")
        pairs = means.to(ctx.dtype).view(-1, 2)
        negative = decode_values(packed, 1, ctx.numel, _ZERO_ONE.to(dtype=ctx.dtype, device=packed.device))
        # μ⁺ + b·(μ⁻ − μ⁺) per view: b ∈ {0, 1}, so each element is one of its view's two means.
        return scale_views(negative, spans, pairs[:, 1] - pairs[:, 0], shifts=pairs[:, 0]).view(ctx.shape)
