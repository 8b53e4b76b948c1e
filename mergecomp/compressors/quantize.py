"""Elementwise building blocks of the quantisers: sign bits, random bits, stochastic rounding.

They exist because the obvious torch expressions are slow on the CPU for what they do:
``x < 0`` and ``torch.where`` go through bool tensors (about 1 ns and 6 ns per element on
one core, against 0.1–0.3 ns for an integer op), and ``torch.rand`` draws 32 random bits
per element through the Mersenne Twister (about 8 ns per element).  The versions here are
a handful of integer passes over the input's own device and dtype, and write into reusable
:class:`~mergecomp.compressors.packing.Scratch` buffers instead of allocating n-element
temporaries on every step.
"""
from __future__ import annotations

from typing import List

import torch

from .packing import Scratch

#: The integer type that has the same bytes as each floating type (for sign-bit tricks).
_SAME_WIDTH = {torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16, torch.float64: torch.int64}

#: Stochastic rounding works on levels scaled by 2^16 in fp32, exact below 2^24.
ROUNDING_BITS = 16
MAX_ROUNDED_LEVEL = 255


def same_width_int(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype whose elements have the bytes of ``dtype``'s (float32 → int32)."""
    try:
        return _SAME_WIDTH[dtype]
    except KeyError:
        raise TypeError(f"expected a floating tensor (float16, bfloat16, float32 or float64), "
                        f"got {dtype}") from None


def sign_mask(tensor: torch.Tensor, scratch: Scratch, tag: str = "sign") -> torch.Tensor:
    """Flat integer tensor, −1 where the IEEE sign bit of ``tensor`` is set, 0 elsewhere.

    The arithmetic right shift of the float's bits by (width − 1): one integer pass.  Note
    that −0.0 has its sign bit set (``x < 0`` would say no); the sign compressors and 1-bit
    SGD, which send this bit, say so in their docstrings.
    """
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bits = flat.view(same_width_int(flat.dtype))
    out = scratch.get(tag, flat.numel(), bits.dtype, flat.device)
    return torch.bitwise_right_shift(bits, bits.element_size() * 8 - 1, out=out)


def sign_bits(tensor: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """Flat uint8 tensor, 1 where the sign bit of ``tensor`` is set (negative, or −0.0), else 0."""
    mask = sign_mask(tensor, scratch, "sign_bits_wide")
    codes = scratch.get("sign_bits", mask.numel(), torch.uint8, mask.device)
    codes.copy_(mask)  # −1 becomes 255: the cast keeps the low byte
    return codes.bitwise_and_(1)


def select_by_code(codes: torch.Tensor, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """New tensor of ``dtype``: ``values[1]`` where ``codes`` (uint8 0/1) is 1, ``values[0]`` else.

    Bit-exact (the chosen value's bits are copied, not recomputed as a + c·(b − a)) and
    without bool tensors: bits = bits(v0) XOR c · (bits(v0) XOR bits(v1)), in integers.
    """
    wide = same_width_int(dtype)
    pair = values.to(dtype).reshape(2).contiguous().view(wide)
    first, difference = int(pair[0]), int(pair[0] ^ pair[1])
    chosen = codes.to(wide).mul_(difference).bitwise_xor_(first)
    return chosen.view(dtype)


def random_int16(numel: int, device, scratch: Scratch) -> torch.Tensor:
    """``numel`` int16 values, each uniform over all 65536 values, from torch's default generator.

    Drawn as full-range int64 words (four lanes each): a quarter of the generator calls of
    one draw per element, and reproducible under ``torch.manual_seed`` like ``torch.rand``.
    Reuses a scratch buffer: consume the result before the next call.
    """
    words = scratch.get("random_words", (numel + 3) // 4, torch.int64, device)
    words.random_(-2 ** 63, None)
    return words.view(torch.int16)[:numel]


def stochastic_codes(parts: List[torch.Tensor], factors: torch.Tensor, offset: int, numel: int,
                     scratch: Scratch) -> torch.Tensor:
    """uint8 codes c = ⌊offset + f_b·v + u⌋ for each element v of bucket b, u uniform in [0, 1).

    ``parts`` are the buckets (:func:`~mergecomp.compressors.buckets.bucket_parts`),
    ``factors`` one fp32 f_b per bucket with |f_b·v| ≤ offset, so c ∈ [0, 2·offset] (clamped
    there against fp32 rounding).  Stochastic rounding is unbiased, E⌊L + u⌋ = L for any
    real L, so E[c] − offset = f_b·v: a signed level rounds to either neighbour with the
    right odds, and the integer offset makes the code non-negative without a sign pass.

    The level is computed in fp32 times 2^16, cast (a floor, since it is positive), plus 16
    random bits, shifted down by 16: the mean is exact up to the 16-bit resolution of u
    and fp32 rounding near 2^24 (together under 2^-16 of a level).  Six passes over the
    data and one n-element fp32 scratch (reused in place for the integers); 2·offset + 1
    must stay below 256.
    """
    if not 0 < 2 * offset < MAX_ROUNDED_LEVEL:
        raise ValueError(f"stochastic codes need 0 < 2·offset < {MAX_ROUNDED_LEVEL}, got offset {offset!r}")
    size = parts[0].shape[1]
    rows = sum(part.shape[0] for part in parts)
    device = parts[0].device
    work = scratch.get("levels", rows * size, torch.float32, device)
    scaled = factors.to(torch.float32) * float(1 << ROUNDING_BITS)
    row = 0
    for part in parts:
        count = part.shape[0]
        torch.mul(part, scaled[row: row + count, None], out=work[row * size: (row + count) * size].view(count, size))
        row += count
    # 2^16·(offset + f·v) + 2^15 is positive and exact enough in fp32 (below 2^24).
    work.add_(float((offset << ROUNDING_BITS) + (1 << (ROUNDING_BITS - 1))))
    levels = work.view(torch.int32)
    levels.copy_(work)  # in place, element by element: the cast truncates, i.e. floors
    levels.add_(random_int16(levels.numel(), device, scratch))  # now F + u16, u16 in 0..65535
    levels.bitwise_right_shift_(ROUNDING_BITS).clamp_(0, 2 * offset)
    codes = scratch.get("codes", numel, torch.uint8, device)
    return codes.copy_(levels[:numel])


def dequantize(codes: torch.Tensor, offset: int, scales: torch.Tensor, bucket_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """New tensor of ``dtype``: (c − offset)·scale_b for each code c of bucket b (inverse of
    :func:`stochastic_codes` with scale_b = 1/f_b)."""
    n = codes.numel()
    values = torch.empty(n, dtype=torch.float32, device=codes.device).copy_(codes)
    scales = scales.to(torch.float32)
    biases = scales * -float(offset)
    full = n // bucket_size
    if full:
        rows = values[: full * bucket_size].view(full, bucket_size)
        rows.mul_(scales[:full, None]).add_(biases[:full, None])
    if n > full * bucket_size:
        values[full * bucket_size:].mul_(scales[full]).add_(biases[full])
    return values if dtype == torch.float32 else values.to(dtype)
