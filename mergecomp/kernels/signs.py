"""Sign bits: the one-bit codes of signSGD, EF-SignSGD, SIGNUM and 1-bit SGD.

What travels is the IEEE sign bit (set for negatives and for −0.0): reading it is one
integer pass over the float's bits, where ``x < 0`` and ``torch.where`` go through bool
tensors at several times the cost.  Bits are packed 8 to a byte, the first element in the
top bit (:func:`~mergecomp.kernels.packing.pack_bits`).

Backends: on the CPU one native pass reads and packs the signs (and, for 1-bit SGD, sums
both sides) where the kernels are built; on a GPU one Triton kernel does the same
(:mod:`.triton.packing`); elsewhere numpy (CPU) or torch (any device) make a flag pass and
a packing pass.  The bits are the same; 1-bit SGD's means are sums, whose
last bits differ between the native pass (double) and the torch reductions (fp32).
"""
from __future__ import annotations

import functools
from typing import Tuple

import torch

from . import native, numpy_cpu
from . import triton as gpu
from .packing import decode_values, pack_bits
from .scratch import Scratch

#: The integer type that has the same bytes as each floating type (for sign-bit tricks).
_SAME_WIDTH = {torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16, torch.float64: torch.int64}


def same_width_int(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose elements have the bytes of ``dtype``'s (float32 → int32)."""
    try:
        return _SAME_WIDTH[dtype]
    except KeyError:
        raise TypeError(f"expected a floating tensor (float16, bfloat16, float32 or float64), "
                        f"got {dtype}") from None


def sign_bits(tensor: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """Flat uint8 tensor, 1 where the sign bit of ``tensor`` is set (negative, or −0.0), else 0.

    The float's bits read as a same-width integer are negative exactly when the sign bit
    is set: one integer comparison into a bool buffer, whose bytes are already 0/1, read as
    uint8 (a shift then a narrowing copy and a mask took three passes; a float ``x < 0``
    misses −0.0).  The comparison must write bool: asked for uint8 directly, torch computes
    a bool temporary and casts it, several times slower.
    """
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bits = flat.view(same_width_int(flat.dtype))
    negative = scratch.get("sign_bits", flat.numel(), torch.bool, flat.device)
    if numpy_cpu.on_cpu(bits):
        numpy_cpu.negative_flags(bits, negative)
    else:
        torch.lt(bits, 0, out=negative)
    return negative.view(torch.uint8)


def pack_signs(tensor: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """⌈n/8⌉ bytes: bit i is set where element i has its sign bit set (is negative, or −0.0)."""
    if gpu.usable(tensor):
        from .triton import packing as triton_packing
        return triton_packing.pack_signs(tensor)
    if native.usable(tensor):
        return native.pack_signs(tensor)
    return pack_bits(sign_bits(tensor, scratch), 1)


@functools.lru_cache(maxsize=16)
def plus_minus_one(dtype: torch.dtype, device: str) -> torch.Tensor:
    """The decode table of a sign bit: clear → +1, set → −1."""
    return torch.tensor([1, -1], dtype=dtype, device=device)


def unpack_signs(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """New flat ±1 tensor of ``dtype`` from :func:`pack_signs`' bytes: one table gather
    writes the output (a clear bit becomes +1, a set bit −1)."""
    return decode_values(packed, 1, numel, plus_minus_one(dtype, str(packed.device)))


def signs_and_side_means(tensor: torch.Tensor, scratch: Scratch) -> Tuple[torch.Tensor, torch.Tensor]:
    """(packed sign bits, fp32 [mean of the non-negative elements, mean of the negative ones]).

    The side with the sign bit set is "negative" (−0.0 included); an empty side has mean 0.
    Both side sums come from two reductions: sum(g⁺) = (Σg + Σ|g|)/2, sum(g⁻) = (Σg − Σ|g|)/2.
    """
    if gpu.usable(tensor):
        # One pass: the sign bits, both sums (fp32, per program, then summed) and the count.
        from .triton import packing as triton_packing
        packed, total, absolute, num_negative = triton_packing.signs_and_side_sums(tensor)
        num_positive = tensor.numel() - num_negative
        return packed, torch.stack([(total + absolute) / 2 / num_positive.clamp(min=1),
                                    (total - absolute) / 2 / num_negative.clamp(min=1)])
    if tensor.dtype == torch.float32 and native.usable(tensor):
        # One pass: the sign bits and both sums, in double.
        packed, total, absolute, num_negative = native.onebit_encode(tensor)
        num_positive = tensor.numel() - num_negative
        means = torch.tensor([(total + absolute) / 2 / max(num_positive, 1),
                              (total - absolute) / 2 / max(num_negative, 1)], dtype=torch.float32)
        return packed, means
    flat = tensor.reshape(-1)
    negative = sign_bits(flat, scratch)  # 1 where the sign bit is set
    total = flat.sum(dtype=torch.float32)
    magnitudes = torch.abs(flat, out=scratch.get("abs", flat.numel(), flat.dtype, flat.device))
    absolute = magnitudes.sum(dtype=torch.float32)
    if numpy_cpu.on_cpu(negative):  # numpy counts bytes several times faster
        num_negative = torch.tensor(numpy_cpu.count_nonzero(negative))
    elif flat.numel() < 2 ** 31:  # faster than count_nonzero
        num_negative = negative.sum(dtype=torch.int32)
    else:
        num_negative = torch.count_nonzero(negative)
    num_positive = flat.numel() - num_negative
    means = torch.stack([(total + absolute) / 2 / num_positive.clamp(min=1),
                         (total - absolute) / 2 / num_negative.clamp(min=1)])
    return pack_bits(negative, 1), means
