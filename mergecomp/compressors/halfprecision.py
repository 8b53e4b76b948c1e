"""16-bit floating point: the honest baseline every lossy compressor must beat.

Micikevicius et al., "Mixed Precision Training", ICLR 2018 (FP16);
Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", 2019 (BF16).

    ĝ = cast(cast(g, 16-bit), dtype of g), rounding to nearest.   On the wire: 2n bytes.
"""
from __future__ import annotations

import torch

from . import register
from .base import Compressor, Context


class _CastCompressor(Compressor):
    """Casts to a 16-bit type for the wire and back to the input's dtype on arrival.

    Wire: 2n bytes.  Deterministic rounding to nearest (biased by at most half an ulp, so
    ``unbiased = False``); summable, because the sum of 16-bit payloads decodes like the sum
    of decoded ones (up to the rounding of the 16-bit sum).
    """

    summable = True
    unbiased = False
    recommended_memory = "none"
    recommended_communicator = "allreduce"
    fixed_size = True
    dense = True
    wire_dtype: torch.dtype

    def compress(self, tensor, name, layout=None):
        return (tensor.reshape(-1).to(self.wire_dtype),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return payload[0].to(ctx.dtype).view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """Two bytes per element, whatever the input dtype."""
        return 2 * numel


@register("fp16")
class FP16Compressor(_CastCompressor):
    """IEEE half precision: 5-bit exponent, so magnitudes above 65504 become inf.  Wire: 2n bytes."""

    wire_dtype = torch.float16


@register("bf16")
class BF16Compressor(_CastCompressor):
    """bfloat16: fp32's exponent range with 8 bits of mantissa; never overflows where fp32 does not.

    Wire: 2n bytes.
    """

    wire_dtype = torch.bfloat16
