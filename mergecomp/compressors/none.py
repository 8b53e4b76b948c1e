"""No compression: the FP32 baseline (the tensor travels as it is)."""
from __future__ import annotations

from . import register
from .base import Compressor, Context


@register("none", "fp32")
class NoneCompressor(Compressor):
    """Sends the gradient unchanged.

    Wire: n × element size bytes (4n for fp32).  Unbiased, lossless, summable.
    """

    summable = True
    recommended_memory = "none"
    recommended_communicator = "allreduce"
    fixed_size = True
    dense = True
    lossless = True

    def compress(self, tensor, name):
        return (tensor.reshape(-1),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return payload[0].view(ctx.shape)
