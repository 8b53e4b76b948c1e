"""TernGrad: stochastic ternarisation, two bits per element.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", NeurIPS 2017.
"""
from __future__ import annotations

import torch

from . import register
from .base import Compressor, Context
from .buckets import check_bucket_size, padded_fp32_buckets, scale_buckets_
from .packing import Scratch, pack_bits, unpack_bits


@register("terngrad")
class TernGradCompressor(Compressor):
    """Each element v of a bucket with scale S = max|v| becomes S·sign(v)·b, b ~ Bernoulli(|v|/S).

    Unbiased without clipping: E[S·sign(v)·b] = v.  With ``clip=c`` (the paper uses 2.5)
    each bucket is first clipped to ±c·σ, σ its standard deviation, which lowers the
    variance at the price of a bias on the clipped outliers.  The ternary value travels as
    a 2-bit code (0 → 0, 1 → +S, 2 → −S); the scale is one fp32 per bucket (the paper uses
    one per layer; a fused group spans several layers, hence the buckets).

    Wire for n elements: ⌈n/4⌉ bytes of codes + 4·⌈n/bucket_size⌉ bytes of fp32 scales.
    """

    summable = False
    fixed_size = True
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def __init__(self, bucket_size: int = 512, clip: float = None):
        self.bucket_size = check_bucket_size(bucket_size)
        if clip is not None:
            clip = float(clip)
            if not clip > 0:
                raise ValueError(f"terngrad clip must be a positive multiple of σ or None, got {clip!r}; "
                                 f"the paper uses 2.5")
        self.clip = clip
        self._scratch = Scratch()

    def compress(self, tensor, name):
        n = tensor.numel()
        work = padded_fp32_buckets(tensor, self.bucket_size, self._scratch)
        if self.clip is not None:
            bound = self._bucket_std(work, n).mul_(self.clip)[:, None]
            torch.maximum(work, -bound, out=work)
            torch.minimum(work, bound, out=work)
        negative = work < 0
        scales = work.abs_().amax(dim=1)
        noise = self._scratch.get("noise", work.numel(), torch.float32, work.device)
        threshold = noise.uniform_().view_as(work).mul_(scales[:, None])
        keep = work > threshold  # P(keep) = |v|/S
        # code = keep << negative: 0 dropped, 1 kept positive, 2 kept negative.
        codes = keep.view(-1).view(torch.uint8).bitwise_left_shift_(negative.view(-1).view(torch.uint8))
        return (pack_bits(codes[:n], 2), scales), Context(tensor.shape, tensor.dtype)

    def _bucket_std(self, work, n):
        """Standard deviation of each bucket, the zero padding of the last one excluded.

        Computed on the bucket divided by its peak, so v² neither overflows nor underflows.
        """
        peaks = torch.maximum(work.amax(dim=1), work.amin(dim=1).neg())
        peaks = torch.where(peaks > 0, peaks, torch.ones_like(peaks))
        unit = work / peaks[:, None]
        counts = torch.full_like(peaks, float(self.bucket_size))
        counts[-1] = n - (work.shape[0] - 1) * self.bucket_size
        mean = unit.sum(dim=1) / counts
        square = torch.linalg.vector_norm(unit, dim=1).square_() / counts
        return (square - mean.square()).clamp_(min=0).sqrt_().mul_(peaks)

    def decompress(self, payload, ctx):
        packed, scales = payload
        values = ternary_values(unpack_bits(packed, 2, ctx.numel))
        return scale_buckets_(values, scales, self.bucket_size).to(ctx.dtype).view(ctx.shape)

    def __repr__(self):
        return f"TernGradCompressor(bucket_size={self.bucket_size}, clip={self.clip})"


def ternary_values(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0, 1, 2) → fp32 values (0, +1, −1): c − 3·(c >> 1)."""
    return codes.view(torch.int8).to(torch.float32).sub_(torch.bitwise_right_shift(codes, 1).to(torch.float32).mul_(3))
