"""1-bit SGD.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs", Interspeech 2014.
"""
from __future__ import annotations

import torch

from . import register
from .base import Compressor, Context
from .packing import pack_bits, unpack_bits


@register("onebit")
class OneBitCompressor(Compressor):
    """Quantise each element to one bit (its sign) and decode with the mean of its side.

    The receiver rebuilds a negative bit as the mean of the negative elements and a clear
    bit as the mean of the non-negative ones, the reconstruction values of Seide et al.
    (who keep them per column; here per fused group).  Biased: pair it with the
    ``residual`` memory, the error feedback the paper introduced.

    Wire for n elements: ⌈n/8⌉ bytes + 8 bytes for the two fp32 means.
    """

    summable = False
    fixed_size = True
    recommended_memory = "residual"
    recommended_communicator = "allgather"

    def compress(self, tensor, name):
        flat = tensor.reshape(-1)
        negative = flat < 0
        # Both side sums from two reductions and no n-element temporary:
        # sum(g⁺) = (Σg + Σ|g|)/2 and sum(g⁻) = (Σg − Σ|g|)/2.
        total = flat.sum(dtype=torch.float32)
        absolute = torch.linalg.vector_norm(flat, ord=1, dtype=torch.float32)
        num_negative = torch.count_nonzero(negative)
        num_positive = flat.numel() - num_negative
        means = torch.stack([(total + absolute) / 2 / num_positive.clamp(min=1),
                             (total - absolute) / 2 / num_negative.clamp(min=1)])
        return (pack_bits(negative, 1), means), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        packed, means = payload
        negative = unpack_bits(packed, 1, ctx.numel).view(torch.bool)
        means = means.to(ctx.dtype)
        return torch.where(negative, means[1], means[0]).view(ctx.shape)
