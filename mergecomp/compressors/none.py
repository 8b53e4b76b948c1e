"""No compression: the FP32 baseline (the tensor travels as it is)."""
from __future__ import annotations

import torch

from . import register
from .base import REAL_FLOATS, Compressor, Context


@register("none", "fp32")
class NoneCompressor(Compressor):
    """Sends the gradient unchanged.

    Wire: n × element size bytes (4n for fp32).  Unbiased, lossless, summable.  The only
    compressor that carries complex gradients (as they are).
    """

    summable = True
    unbiased = True
    supported_dtypes = REAL_FLOATS + (torch.complex64, torch.complex128)
    recommended_memory = "none"
    recommended_communicator = "allreduce"
    fixed_size = True
    dense = True
    lossless = True

    def compress(self, tensor, name, layout=None):
        return (tensor.reshape(-1),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        return payload[0].view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """The tensor as it is: n × element size."""
        return numel * element_size
