"""QSGD: stochastic quantisation to s levels per bucket norm.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017.
"""
from __future__ import annotations

import torch

from . import register
from .base import Compressor, Context
from .buckets import check_bucket_size, padded_fp32_buckets, scale_buckets_
from .packing import Scratch, bits_for, pack_bits, unpack_bits


@register("qsgd")
class QSGDCompressor(Compressor):
    """Each element v of a bucket with norm ‖v‖₂ becomes sign(v)·‖v‖·ℓ/s, ℓ ∈ {0..s} drawn
    so that E[ℓ] = s·|v|/‖v‖ (stochastic rounding between the two nearest levels).

    Unbiased: E[decode(encode(v))] = v, with variance at most min(d/s², √d/s)·‖v‖² per
    bucket of d elements (Lemma 3.1).  The signed level ℓ·sign(v) ∈ [−s, s] travels as the
    code ℓ·sign(v) + s in the fewest bits that hold 2s + 1 values, b = ⌈log₂(2s+1)⌉
    (4 bits for the default s = 7, 8 bits for s = 127); the paper's Elias coding of the
    levels is not used, to keep payloads fixed-size.

    Wire for n elements: ⌈n·b/8⌉ bytes of codes + 4·⌈n/bucket_size⌉ bytes of fp32 norms.
    """

    summable = False
    fixed_size = True
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def __init__(self, levels: int = 7, bucket_size: int = 512):
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be an integer in [1, 127], got {levels!r}; "
                             f"s levels cost ⌈log2(2s+1)⌉ bits per element (7 → 4 bits)")
        self.levels = levels
        self.bucket_size = check_bucket_size(bucket_size)
        self.bits = bits_for(2 * levels + 1)
        self._scratch = Scratch()

    def compress(self, tensor, name):
        n = tensor.numel()
        s = self.levels
        work = padded_fp32_buckets(tensor, self.bucket_size, self._scratch)
        negative = work < 0
        # Norms of buckets scaled by their peak: no overflow of v² for |v| ~ 1e30 and no
        # underflow for |v| ~ 1e-30, at the cost of one amax.
        peaks = work.abs_().amax(dim=1)
        work.div_(torch.where(peaks > 0, peaks, torch.ones_like(peaks))[:, None])
        unit_norms = torch.linalg.vector_norm(work, dim=1)  # ≥ 1 where the bucket is not zero
        norms = peaks * unit_norms
        work.mul_(torch.where(unit_norms > 0, s / unit_norms, torch.zeros_like(unit_norms))[:, None])
        noise = self._scratch.get("noise", work.numel(), torch.float32, work.device)
        work.add_(noise.uniform_().view_as(work)).floor_().clamp_(max=s)
        codes = self._scratch.get("codes", work.numel(), torch.uint8, work.device)
        codes.copy_(work.view(-1))
        # code = s ± ℓ in uint8: negate where negative by two's complement (ℓ ^ 0xFF) + 1.
        flip = negative.view(-1).view(torch.uint8)
        codes.bitwise_xor_(flip.neg()).add_(flip).add_(s)
        return (pack_bits(codes[:n], self.bits), norms), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        packed, norms = payload
        codes = unpack_bits(packed, self.bits, ctx.numel)
        values = codes.to(torch.float32).sub_(self.levels)
        scale_buckets_(values, norms / self.levels, self.bucket_size)
        return values.to(ctx.dtype).view(ctx.shape)

    def __repr__(self):
        return f"QSGDCompressor(levels={self.levels}, bucket_size={self.bucket_size})"
