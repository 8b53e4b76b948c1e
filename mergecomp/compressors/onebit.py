"""1-bit SGD.

Seide et al., "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs", Interspeech 2014.
"""
from __future__ import annotations

import torch

from . import native, numpy_kernels, register
from .base import Compressor, Context
from .packing import Scratch, decode_values, pack_bits, packed_nbytes
from .quantize import sign_bits


@register("onebit")
class OneBitCompressor(Compressor):
    """Quantise each element to one bit (its sign) and decode with the mean of its side.

    The receiver rebuilds a set bit as the mean of the negative elements and a clear bit
    as the mean of the non-negative ones (the bit is the IEEE sign bit, so −0.0 counts as
    negative and decodes to the negative mean), the reconstruction values of Seide et al.
    (who keep them per column; here per fused group).  Biased: pair it with the
    ``residual`` memory, the error feedback the paper introduced.

    Wire for n elements: ⌈n/8⌉ bytes + 8 bytes for the two fp32 means.
    """

    summable = False
    fixed_size = True
    unbiased = False
    recommended_memory = "residual"
    recommended_communicator = "allgather"

    def __init__(self):
        self._scratch = Scratch()

    def compress(self, tensor, name, layout=None):
        if tensor.dtype == torch.float32 and native.usable(tensor):
            return self._compress_native(tensor)
        flat = tensor.reshape(-1)
        negative = sign_bits(flat, self._scratch)  # 1 where the sign bit is set
        # Both side sums from two reductions: sum(g⁺) = (Σg + Σ|g|)/2, sum(g⁻) = (Σg − Σ|g|)/2.
        total = flat.sum(dtype=torch.float32)
        magnitudes = torch.abs(flat, out=self._scratch.get("abs", flat.numel(), flat.dtype, flat.device))
        absolute = magnitudes.sum(dtype=torch.float32)
        if numpy_kernels.on_cpu(negative):  # numpy counts bytes several times faster
            num_negative = torch.tensor(numpy_kernels.count_nonzero(negative))
        elif flat.numel() < 2 ** 31:  # faster than count_nonzero
            num_negative = negative.sum(dtype=torch.int32)
        else:
            num_negative = torch.count_nonzero(negative)
        num_positive = flat.numel() - num_negative
        means = torch.stack([(total + absolute) / 2 / num_positive.clamp(min=1),
                             (total - absolute) / 2 / num_negative.clamp(min=1)])
        return (pack_bits(negative, 1), means), Context(tensor.shape, tensor.dtype)

    def _compress_native(self, tensor):
        """One pass on the CPU: the sign bits and both sums (in double, so the means can
        differ from the torch path's fp32 sums in their last bits)."""
        packed, total, absolute, num_negative = native.onebit_encode(tensor)
        num_positive = tensor.numel() - num_negative
        means = torch.tensor([(total + absolute) / 2 / max(num_positive, 1),
                              (total - absolute) / 2 / max(num_negative, 1)], dtype=torch.float32)
        return (packed, means), Context(tensor.shape, tensor.dtype)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n/8⌉ bytes of signs + the two fp32 means."""
        return packed_nbytes(numel, 1) + 8

    def decompress(self, payload, ctx):
        packed, means = payload
        # Clear bit → the non-negative mean, set bit → the negative one, copied bit for bit.
        return decode_values(packed, 1, ctx.numel, means.to(ctx.dtype)).view(ctx.shape)
