"""TernGrad: stochastic ternarisation, two bits per element.

Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in Distributed Deep
Learning", NeurIPS 2017.

    per bucket v:  S = max|v_i|;  decode: v̂_i = S·sign(v_i)·b_i,  b_i ~ Bernoulli(|v_i|/S)
    (each bucket first clipped to ±c·σ, c = ``clip``: 2.5 by default, as in the paper).

On the wire: one 2-bit code per element (−S, 0, +S), packed, then one fp32 S per bucket.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import register
from .base import Context
from .raisedlevels import RaisesLevels
from ..kernels import (Scratch, bucket_peaks, check_bucket_size, dequantize_packed, num_buckets,
                      padded_fp32_buckets, quantize_packed)
from .streams import StochasticCompressor


@register("terngrad")
class TernGradCompressor(RaisesLevels, StochasticCompressor):
    """Each element v of a bucket with scale S = max|v| becomes S·sign(v)·b, b ~ Bernoulli(|v|/S).

    Each bucket is first clipped to ±c·σ (``clip=c``, σ its standard deviation; 2.5 by
    default, the paper's setting for all its experiments), which lowers the variance, set by
    the bucket's largest element, at the price of a bias on the clipped outliers (the two
    variants' accuracy: docs/results.md#lm-more-rows).  ``clip=None`` is unbiased:
    E[S·sign(v)·b] = v (up to 2^-16 of S: the Bernoulli draw uses 16 random bits, see
    ``kernels.quantize.stochastic_codes``).  The ternary value travels as a 2-bit code (0 → −S, 1 → 0, 2 → +S); the scale is one fp32 per bucket (the paper uses
    one per layer; a fused group spans several layers, hence the buckets).  The Bernoulli
    draws come from a private stream per group, seeded from ``seed`` and this process's
    rank, saved in ``state_dict()`` and rewound by ``rollback()``.

    Its error, clipped or not, is noise around the gradient, which the drift meter reads
    (:attr:`reads_noise`); where it is high the quality controller sends the group at 4 or
    8 bits, 7 or 127 levels of S (:mod:`~mergecomp.compressors.raisedlevels`), and unclipped:
    the clip trades bias for the variance of one level, and at seven the bias would be
    most of what is left of the error.

    Wire for n elements: ⌈n/4⌉ bytes of codes + 4·⌈n/bucket_size⌉ bytes of fp32 scales
    (⌈n·b/8⌉ bytes of codes for a group raised to b bits).
    """

    summable = False
    fixed_size = True
    unbiased = False  # per instance: True with clip=None
    recommended_memory = "none"
    recommended_communicator = "allgather"
    #: One level each side of zero, in 2-bit codes: the configured setting the controller raises.
    levels, bits = 1, 2

    def __init__(self, bucket_size: int = 512, clip: Optional[float] = 2.5, seed: int = 0):
        super().__init__(seed)
        self.bucket_size = check_bucket_size(bucket_size)
        if clip is not None:
            clip = float(clip)
            if not clip > 0:
                raise ValueError(f"terngrad clip must be a positive multiple of σ or None, got {clip!r}; "
                                 f"the paper uses 2.5")
        self.clip = clip
        self.unbiased = clip is None
        self._scratch = Scratch()

    @property
    def reads_noise(self) -> bool:
        """Yes, clipped too: the clipping's bias on the outliers comes with the rounding's
        noise, and the drift meter reads the two together as the exchange's error."""
        return True

    def compress(self, tensor, name, layout=None):
        if not tensor.numel():
            empty = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            return (empty, torch.empty(0, dtype=torch.float32, device=tensor.device)), \
                Context(tensor.shape, tensor.dtype)
        source = tensor
        levels, bits = self.levels_of(name)
        if self.clip is not None and levels == self.levels:  # a raised group is not clipped
            work = padded_fp32_buckets(tensor, self.bucket_size, self._scratch)
            bound = self._bucket_std(work, tensor.numel()).mul_(self.clip)[:, None]
            torch.maximum(work, -bound, out=work)
            torch.minimum(work, bound, out=work)
            source = work.view(-1)[: tensor.numel()]
        scales = bucket_peaks(source, self.bucket_size, self._scratch)
        # L·v/S ∈ [−L, L] rounded stochastically and offset by L; at L = 1: code 0 → −S,
        # 1 → 0, 2 → +S, +S with probability v/S for v > 0 and −S with probability |v|/S for v < 0.
        factors = torch.where(scales > 0, levels / scales, torch.zeros_like(scales))
        packed = quantize_packed(source, self.bucket_size, factors, levels, bits, self._scratch,
                                 key=self.streams.key(name, source.numel()))
        return (packed, scales), self.levels_context(tensor, levels, bits)

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
        if not ctx.numel:
            return torch.zeros(ctx.shape, dtype=ctx.dtype, device=packed.device)
        # Code c stands for c − L times S / L (at L = 1, code 3 is never sent; it decodes as 2·S).
        levels, bits = self.context_levels(ctx)
        steps = scales if levels == 1 else scales / levels  # no copy at the configured level
        return dequantize_packed(packed, bits, ctx.numel, levels, steps,
                                 self.bucket_size, ctx.dtype, self._scratch).view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n/4⌉ bytes of 2-bit codes + 4 bytes per bucket (whatever the input dtype); a
        payload's own codes where the controller raised its group."""
        return self.codes_nbytes(numel, payload) + 4 * num_buckets(numel, self.bucket_size)

