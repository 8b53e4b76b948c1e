"""Elementwise building blocks of the quantisers: random bits, stochastic rounding.

They exist because the obvious torch expressions are slow on the CPU for what they do:
``torch.rand`` draws 32 random bits per element, one at a time, through the
Mersenne Twister.  The versions here are a handful of vectorised passes over the input's
own device and dtype (random bits from a counter hash under a key: the caller's, or one
drawn from torch's generator), and write into reusable
:class:`~mergecomp.kernels.scratch.Scratch` buffers instead of allocating
n-element temporaries on every step.

:func:`quantize_packed` and :func:`dequantize_packed` are the quantisers' two ops: fp32 on
the CPU goes through one fused native pass where the kernels are built, CUDA tensors
through one Triton kernel where Triton is present (:mod:`.triton.quantize`), everything
else through the torch ops below on the tensor's device (numpy for the CPU's integer
hash); all give the same bits for the same key.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import native, numpy_cpu
from . import triton as gpu
from .buckets import bucket_parts
from .hashing import HASH_MULTIPLIERS, as_int32
from .packing import decode_values, pack_bits, unpack_bits
from .scratch import Scratch

#: Stochastic rounding works on levels scaled by 2^16 in fp32, exact below 2^24.
ROUNDING_BITS = 16
MAX_ROUNDED_LEVEL = 255


#: The multipliers of the integer hash behind :func:`random_int16` (:mod:`.hashing`), as the
#: int32 values torch multiplies by.
_HASH_MULTIPLIERS = tuple(as_int32(m) for m in HASH_MULTIPLIERS)


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

    torch's CPU generator (the Mersenne Twister) draws 32 random bits at a time, one word
    after another: it costs more than all the arithmetic of a quantiser.  Here each call draws one 31-bit
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
    if numpy_cpu.on_cpu(words):
        numpy_cpu.hash_words(words, _HASH_MULTIPLIERS, spare)
        return words.view(torch.int16)[:numel]
    for multiplier in _HASH_MULTIPLIERS:
        words.mul_(multiplier)
        _xorshift_right(words, 16, spare)
    return words.view(torch.int16)[:numel]


def stochastic_codes(parts: List[torch.Tensor], factors: torch.Tensor, offset: int, numel: int,
                     scratch: Scratch, key: Optional[int] = None) -> torch.Tensor:
    """uint8 codes c = ⌊offset + f_b·v + u⌋ for each element v of bucket b, u uniform in [0, 1).

    ``parts`` are the buckets (:func:`~mergecomp.kernels.buckets.bucket_parts`),
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

    ``levels`` are small integers, as fp32 (from :func:`~mergecomp.kernels.packing.decode_values`,
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
                    scratch: Scratch, key: Optional[int] = None) -> torch.Tensor:
    """``pack_bits(stochastic_codes(parts, factors, offset, ...), bits)``: the packed codes.

    CUDA tensors go through one Triton kernel where Triton is present, fp32 CPU tensors
    through the fused native kernel (one pass each, the same bits, the same random lanes
    for the same key), everything else through the torch ops on ``tensor``'s buckets
    (:func:`~mergecomp.kernels.buckets.bucket_parts`).  All use the random lanes of ``key``
    (one drawn from torch's default generator when None).
    """
    if key is None:
        key = random_key(tensor.numel())
    if gpu.usable(tensor):
        from .triton import quantize as triton_quantize
        return triton_quantize.quantize_packed(tensor, bucket_size, factors, offset, bits, key)
    if tensor.dtype == torch.float32 and native.usable(tensor):
        return native.stochastic_codes(tensor, bucket_size, factors, offset, key, bits)
    parts = bucket_parts(tensor, bucket_size, scratch)
    return pack_bits(stochastic_codes(parts, factors, offset, tensor.numel(), scratch, key), bits)


def dequantize_packed(packed: torch.Tensor, bits: int, numel: int, offset: int, scales: torch.Tensor,
                      bucket_size: int, dtype: torch.dtype, scratch: Scratch) -> torch.Tensor:
    """Inverse of :func:`quantize_packed`: new tensor of ``dtype``, (c − offset)·scale_b.

    On a GPU with Triton, and on the CPU where the native kernels are built, one pass;
    elsewhere, for 1 and 2 bits, a 256-row table gather of c − offset (rows of 4 and 8
    values), then the scaling, and for wider codes unpacking.
    """
    if gpu.usable(packed):
        from .triton import quantize as triton_quantize
        return triton_quantize.dequantize_packed(packed, bits, numel, offset, scales, bucket_size, dtype)
    if native.usable(packed):
        values = native.dequantize(packed, numel, bits, bucket_size, scales, offset)
        return values if dtype == torch.float32 else values.to(dtype)
    if bits <= 2:
        levels = torch.arange(-offset, (1 << bits) - offset, dtype=torch.float32, device=packed.device)
        return scale_levels(decode_values(packed, bits, numel, levels), scales, bucket_size, dtype)
    return dequantize(unpack_bits(packed, bits, numel, scratch), offset, scales, bucket_size, dtype)
