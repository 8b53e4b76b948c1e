"""Threshold binary quantisation.

Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
Interspeech 2015.

    ĝ_i = +τ if g_i > τ,  −τ if g_i < −τ,  else 0   (τ shared by all ranks, not sent).

On the wire: one 2-bit code per element (0 → 0, 1 → +τ, 2 → −τ), ⌈n/4⌉ bytes.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from . import register
from .base import Compressor, Context
from .recipes import Recipe
from ..kernels import pack_bits, packed_nbytes, unpack_bits


@register("tbq")
class TBQCompressor(Compressor):
    """Send +τ where the accumulated gradient exceeds τ, −τ where it is below −τ, else 0.

    Strom's scheme relies on residual accumulation: what is not sent (everything under
    τ, and the excess over τ) stays in the ``residual`` memory and is sent once it has
    grown past the threshold.  Biased per step; with the residual nothing is lost.  τ is a
    hyperparameter shared by all ranks, so it is not sent; each element costs a 2-bit code
    (0 → 0, 1 → +τ, 2 → −τ) instead of Strom's sparse 32-bit index list, which keeps the
    payload fixed-size and cheaper whenever more than 1/16 of the elements pass.  Its default
    memory takes the optimizer's momentum off (``momentum="fold"``: see the EF-SignSGD
    compressor), since after the exchange a momentum multiplies the residual's backlog.

    Wire for n elements: ⌈n/4⌉ bytes.
    """

    summable = False
    fixed_size = True
    unbiased = False
    recommended_memory = "residual"
    #: SGD's momentum folded into the learning rate, an Adam's β1 off (the memory's "fold").
    recommended_memory_options = MappingProxyType({"momentum": "fold"})
    recommended_communicator = "allgather"
    recipe = Recipe(
        reason="an element moves by at most τ per step, so the residual of a large gradient holds a "
               "backlog that keeps pushing after the gradient turned; momentum applied after the "
               "exchange multiplies that overshoot, while the same step without it trains at parity",
        fold_momentum=True)

    def __init__(self, threshold: float = 0.01):
        threshold = float(threshold)
        if not threshold > 0 or threshold == float("inf"):
            raise ValueError(f"tbq threshold τ must be a positive finite number, got {threshold!r}; "
                             f"pick it near the typical magnitude of a gradient element")
        self.threshold = threshold

    def compress(self, tensor, name, layout=None):
        flat = tensor.reshape(-1)
        codes = (flat > self.threshold).view(torch.uint8)
        codes.bitwise_or_((flat < -self.threshold).view(torch.uint8).bitwise_left_shift_(1))
        return (pack_bits(codes, 2),), Context(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        values = ternary_values(unpack_bits(payload[0], 2, ctx.numel)).mul_(self.threshold)
        return values.to(ctx.dtype).view(ctx.shape)

    def wire_nbytes(self, numel, element_size, payload=None, layout=None):
        """One 2-bit code per element."""
        return packed_nbytes(numel, 2)


def ternary_values(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (0, 1, 2) → fp32 values (0, +1, −1): c − 3·(c >> 1), in int8, cast once."""
    signed = torch.bitwise_right_shift(codes, 1).mul_(3).view(torch.int8)
    return torch.sub(codes.view(torch.int8), signed, out=signed).to(torch.float32)
