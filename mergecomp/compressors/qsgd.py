"""QSGD: stochastic quantisation to s levels per bucket norm.

Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient Quantization and
Encoding", NeurIPS 2017.

    per bucket v of ``bucket_size`` elements:  ℓ_i = stochastic rounding of s·|v_i|/‖v‖₂
    (⌊·⌋ + Bernoulli of the fraction);  decode: v̂_i = ‖v‖₂·sign(v_i)·ℓ_i/s.

On the wire: the codes ℓ_i·sign(v_i) + s in ⌈log₂(2s+1)⌉ bits each, packed, then one fp32
norm per bucket.  The rounding and packing are kernels (``kernels.quantize_packed``).
"""
from __future__ import annotations

import torch

from . import register
from .base import Context
from .raisedlevels import RaisesLevels
from ..kernels import (Scratch, bits_for, bucket_norms, check_bucket_size, dequantize_packed, num_buckets,
                      quantize_packed)
from .streams import StochasticCompressor


@register("qsgd")
class QSGDCompressor(RaisesLevels, StochasticCompressor):
    """Each element v of a bucket with norm ‖v‖₂ becomes sign(v)·‖v‖·ℓ/s, ℓ ∈ {0..s} drawn
    so that E[ℓ] = s·|v|/‖v‖ (stochastic rounding between the two nearest levels).

    Unbiased: E[decode(encode(v))] = v, with variance at most min(d/s², √d/s)·‖v‖² per
    bucket of d elements (Lemma 3.1); the rounding draws 16 random bits per element, so
    the mean is exact up to 2^-16 of a level (see ``kernels.quantize.stochastic_codes``).  The signed level ℓ·sign(v) ∈ [−s, s] travels as the
    code ℓ·sign(v) + s in the fewest bits that hold 2s + 1 values, b = ⌈log₂(2s+1)⌉
    (4 bits for the default s = 7, 8 bits for s = 127); the paper's Elias coding of the
    levels is not used, to keep payloads fixed-size.

    The rounding draws from a private stream per group, seeded from ``seed`` and this
    process's rank (ranks round independently), saved in ``state_dict()`` and rewound by
    ``rollback()`` (:mod:`~mergecomp.compressors.streams`).

    The quality controller may send a group at more bits and levels where its noise is
    high (8 bits, 127 levels, from the default's 4; :mod:`~mergecomp.compressors.raisedlevels`).

    ``bucket_size`` is 128 by default, a quarter of the paper's 512: the variance bound
    √d/s·‖v‖² halves, for a quarter of a bit more per element (one fp32 norm per 128); what
    that does to accuracy: docs/results.md#lm-momentum-placement.

    Wire for n elements: ⌈n·b/8⌉ bytes of codes + 4·⌈n/bucket_size⌉ bytes of fp32 norms.
    """

    summable = False
    fixed_size = True
    unbiased = True
    recommended_memory = "none"
    recommended_communicator = "allgather"

    def __init__(self, levels: int = 7, bucket_size: int = 128, seed: int = 0):
        super().__init__(seed)
        if isinstance(levels, bool) or not isinstance(levels, int) or not 1 <= levels <= 127:
            raise ValueError(f"qsgd levels must be an integer in [1, 127], got {levels!r}; "
                             f"s levels cost ⌈log2(2s+1)⌉ bits per element (7 → 4 bits)")
        self.levels = levels
        self.bucket_size = check_bucket_size(bucket_size)
        self.bits = bits_for(2 * levels + 1)
        self._scratch = Scratch()

    def compress(self, tensor, name, layout=None):
        if not tensor.numel():
            empty = torch.empty(0, dtype=torch.uint8, device=tensor.device)
            return (empty, torch.empty(0, dtype=torch.float32, device=tensor.device)), \
                Context(tensor.shape, tensor.dtype)
        norms = bucket_norms(tensor, self.bucket_size, self._scratch)
        s, bits = self.levels_of(name)
        # Signed level s·v/‖v‖ ∈ [−s, s], rounded stochastically and offset by s: the code.
        factors = torch.where(norms > 0, s / norms, torch.zeros_like(norms))
        packed = quantize_packed(tensor, self.bucket_size, factors, s, bits, self._scratch,
                                 key=self.streams.key(name, tensor.numel()))
        return (packed, norms), self.levels_context(tensor, s, bits)

    def decompress(self, payload, ctx):
        packed, norms = payload
        if not ctx.numel:
            return torch.zeros(ctx.shape, dtype=ctx.dtype, device=packed.device)
        s, bits = self.context_levels(ctx)
        return dequantize_packed(packed, bits, ctx.numel, s, norms / s,
                                 self.bucket_size, ctx.dtype, self._scratch).view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """⌈n·b/8⌉ bytes of codes + 4 bytes per bucket (whatever the input dtype); a
        payload's own codes where the controller raised its group."""
        return self.codes_nbytes(numel, payload) + 4 * num_buckets(numel, self.bucket_size)
