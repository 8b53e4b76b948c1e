"""Elementwise building blocks of the quantisers: sign bits, random bits, stochastic rounding.

They exist because the obvious torch expressions are slow on the CPU for what they do:
``x < 0`` and ``torch.where`` go through bool tensors (about 1 ns and 6 ns per element on
one core, against 0.1–0.3 ns for an integer op), and ``torch.rand`` draws 32 random bits
per element through the Mersenne Twister (about 8 ns per element; even full-range int64
words cost 1.5 ns per 16 bits).  The versions here are a handful of vectorised passes over
the input's own device and dtype (random bits from a counter hash under a key: the
caller's, or one drawn from torch's generator), and write into reusable
:class:`~mergecomp.compressors.packing.Scratch` buffers instead of allocating n-element
temporaries on every step.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import native, numpy_kernels
from .buckets import bucket_parts
from .packing import Scratch, decode_values, pack_bits, unpack_bits

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
    """Flat uint8 tensor, 1 where the sign bit of ``tensor`` is set (negative, or −0.0), else 0.

    The float's bits read as a same-width integer are negative exactly when the sign bit
    is set: one integer comparison into a bool buffer, whose bytes are already 0/1, read as
    uint8 (a shift then a narrowing copy and a mask took three passes; a float ``x < 0``
    misses −0.0).  The comparison must write bool: asked for uint8 directly, torch computes
    a bool temporary and casts it, five times slower at 25M elements.
    """
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    bits = flat.view(same_width_int(flat.dtype))
    negative = scratch.get("sign_bits", flat.numel(), torch.bool, flat.device)
    if numpy_kernels.on_cpu(bits):
        numpy_kernels.negative_flags(bits, negative)
    else:
        torch.lt(bits, 0, out=negative)
    return negative.view(torch.uint8)


#: Constants of the integer hash behind :func:`random_int16` (C. Wellons' "lowbias32").
_HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B - (1 << 32))


def _xorshift_right(words: torch.Tensor, shift: int, spare: torch.Tensor) -> torch.Tensor:
    """words ^= words >>> shift (a logical shift: torch's >> on int32 is arithmetic, hence the mask)."""
    torch.bitwise_right_shift(words, shift, out=spare).bitwise_and_((1 << (32 - shift)) - 1)
    return words.bitwise_xor_(spare)


def random_key(numel: int) -> int:
    """The 31-bit counter start of one :func:`random_int16` call, from torch's default generator
    (chosen so that the ⌈numel/2⌉ counters do not wrap)."""
    return int(torch.randint(0, (1 << 31) - (numel + 1) // 2, (1,)))


def random_int16(numel: int, device, scratch: Scratch, key: Optional[int] = None) -> torch.Tensor:
    """``numel`` int16 values, each uniform over all 65536 values, from ``key`` (a
    :func:`random_key`; drawn from torch's default generator when None).

    torch's CPU generator (the Mersenne Twister) costs about 3 ns per 32 random bits, one at
    a time: more than all the arithmetic of a quantiser.  Here each call draws one 31-bit
    key k from the default generator (so ``torch.manual_seed`` makes the result
    reproducible, as with ``torch.rand``), or takes the caller's (a compressor's private
    stream, :mod:`~mergecomp.compressors.streams`), and hashes the counters k, k + 1, ... with an
    integer hash (multiply, xor-shift, multiply, xor-shift: the last four steps of
    Wellons' lowbias32, a bijection of 32-bit words that mixes every input bit into both
    halves), as counter-based generators such as Philox do.  Each 32-bit word
    gives two int16 lanes; since the hash is a bijection and k is uniform, every lane is
    uniform over its 65536 values.  A handful of vectorised integer passes over n/2 words.
    Reuses scratch buffers: consume the result before the next call.
    """
    count = (numel + 1) // 2
    key = random_key(numel) if key is None else key
    words = torch.add(scratch.counter(count, device), key,
                      out=scratch.get("random_words", count, torch.int32, device))
    spare = scratch.get("random_spare", count, torch.int32, device)
    if numpy_kernels.on_cpu(words):
        numpy_kernels.hash_words(words, _HASH_MULTIPLIERS, spare)
        return words.view(torch.int16)[:numel]
    for multiplier in _HASH_MULTIPLIERS:
        words.mul_(multiplier)
        _xorshift_right(words, 16, spare)
    return words.view(torch.int16)[:numel]


def stochastic_codes(parts: List[torch.Tensor], factors: torch.Tensor, offset: int, numel: int,
                     scratch: Scratch, key: Optional[int] = None) -> torch.Tensor:
    """uint8 codes c = ⌊offset + f_b·v + u⌋ for each element v of bucket b, u uniform in [0, 1).

    ``parts`` are the buckets (:func:`~mergecomp.compressors.buckets.bucket_parts`),
    ``factors`` one fp32 f_b per bucket with |f_b·v| ≤ offset, so c ∈ [0, 2·offset] (clamped
    there against fp32 rounding).  Stochastic rounding is unbiased, E⌊L + u⌋ = L for any
    real L, so E[c] − offset = f_b·v: a signed level rounds to either neighbour with the
    right odds, and the integer offset makes the code non-negative without a sign pass.

    In fp32: L + ½ = f_b·v + offset + ½, plus r·2^-16 for a 16-bit random r ∈ [−2^15, 2^15)
    (so u = ½ + r·2^-16 takes the 65536 values k·2^-16), then the float→int8 conversion,
    which truncates, i.e. floors the positive sum.  The mean is exact up to the 16-bit
    resolution of u and fp32 rounding (ulp ≤ 2^-16 below 256; together under 2^-16 of a
    level).  Five passes over the data plus the random bits (:func:`random_int16`, from
    ``key``), in two
    n-element fp32 scratch buffers; 2·offset + 1 must stay below 256 (above 127 the last
    conversion goes through uint8, which is several times slower on the CPU).
    """
    if not 0 < 2 * offset < MAX_ROUNDED_LEVEL:
        raise ValueError(f"stochastic codes need 0 < 2·offset < {MAX_ROUNDED_LEVEL}, got offset {offset!r}")
    size = parts[0].shape[1]
    rows = sum(part.shape[0] for part in parts)
    device = parts[0].device
    levels = scratch.get("levels", rows * size, torch.float32, device)
    factors = factors.to(torch.float32)
    row = 0
    for part in parts:
        count = part.shape[0]
        torch.mul(part, factors[row: row + count, None], out=levels[row * size: (row + count) * size].view(count, size))
        row += count
    levels = levels[:numel].add_(offset + 0.5)
    noise = scratch.get("noise", numel, torch.float32, device).copy_(random_int16(numel, device, scratch, key))
    levels.add_(noise, alpha=2.0 ** -ROUNDING_BITS)
    codes = scratch.get("codes", numel, torch.uint8, device)
    if 2 * offset + 1 <= 127:  # fp32 → int8 is vectorised, fp32 → uint8 is not
        codes.view(torch.int8).copy_(levels)
    else:
        codes.copy_(levels)
    return codes.clamp_max_(2 * offset)


def scale_levels(levels: torch.Tensor, scales: torch.Tensor, bucket_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Tensor of ``dtype``: ℓ·scale_b for each signed integer level ℓ of bucket b.

    ``levels`` are small integers, as fp32 (from :func:`~mergecomp.compressors.packing.decode_values`,
    then scaled in place and returned when ``dtype`` is fp32) or an integer type (converted
    exactly), so each value is rounded once, by the product.
    """
    n = levels.numel()
    values = levels.to(torch.float32)
    scales = scales.to(torch.float32)
    full = n // bucket_size
    if full:
        values[: full * bucket_size].view(full, bucket_size).mul_(scales[:full, None])
    if n > full * bucket_size:
        values[full * bucket_size:].mul_(scales[full])
    return values if dtype == torch.float32 else values.to(dtype)


def dequantize(codes: torch.Tensor, offset: int, scales: torch.Tensor, bucket_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """New tensor of ``dtype``: (c − offset)·scale_b for each code c of bucket b (inverse of
    :func:`stochastic_codes` with scale_b = 1/f_b).  c − offset is exact in fp32, so each
    value is rounded once, by the product (as the native kernel does)."""
    values = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device).copy_(codes)
    return scale_levels(values.sub_(offset), scales, bucket_size, dtype)


def quantize_packed(tensor: torch.Tensor, bucket_size: int, factors: torch.Tensor, offset: int, bits: int,
                    scratch: Scratch, parts: Optional[List[torch.Tensor]] = None,
                    key: Optional[int] = None) -> torch.Tensor:
    """``pack_bits(stochastic_codes(parts, factors, offset, ...), bits)``: the packed codes.

    fp32 CPU tensors go through the fused native kernel (one pass, the same bits, the
    same random lanes for the same generator state), everything else through the torch
    ops on ``tensor``'s buckets (``parts``, from
    :func:`~mergecomp.compressors.buckets.bucket_parts`, made here when not given).  Both
    use the random lanes of ``key`` (one drawn from torch's default generator when None).
    """
    if key is None:
        key = random_key(tensor.numel())
    if tensor.dtype == torch.float32 and native.usable(tensor):
        return native.stochastic_codes(tensor, bucket_size, factors, offset, key, bits)
    if parts is None:
        parts = bucket_parts(tensor, bucket_size, scratch)
    return pack_bits(stochastic_codes(parts, factors, offset, tensor.numel(), scratch, key), bits)


def dequantize_packed(packed: torch.Tensor, bits: int, numel: int, offset: int, scales: torch.Tensor,
                      bucket_size: int, dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
    """Inverse of :func:`quantize_packed`: new tensor of ``dtype``, (c − offset)·scale_b.

    On the CPU one native pass; elsewhere, for 1 and 2 bits, a 256-row table gather of
    c − offset (rows of 4 and 8 values), then the scaling, and for wider codes unpacking.
    """
    if native.usable(packed):
        values = native.dequantize(packed, numel, bits, bucket_size, scales, offset)
        return values if dtype == torch.float32 else values.to(dtype)
    if bits <= 2:
        levels = torch.arange(-offset, (1 << bits) - offset, dtype=torch.float32, device=packed.device)
        return scale_levels(decode_values(packed, bits, numel, levels), scales, bucket_size, dtype)
    return dequantize(unpack_bits(packed, bits, numel, scratch), offset, scales, bucket_size, dtype)
