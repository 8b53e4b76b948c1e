"""Stochastic rounding on the GPU, packed as it is made, and its inverse.

QSGD and TernGrad send, per element v of bucket b, the code c = ⌊offset + f_b·v + u⌋ with
u uniform in [0, 1) (``kernels.quantize.stochastic_codes``: E[c] − offset = f_b·v, so the
decode (c − offset)/f_b is unbiased), in ⌈log₂(2·offset + 1)⌉ bits.  On the wire: TernGrad
n/4 bytes of 2-bit codes + 4 bytes per bucket of 512; QSGD (s = 7) n/2 bytes of 4-bit codes
+ 4 bytes per bucket of 128.

Why a kernel: the torch path makes the product, the offset, the random bits (a counter
hash, four integer passes), the sum, the conversion, the clamp and the packing as separate
passes, each over an n-element fp32 or int32 buffer.  Here one program reads 8/b elements per
output byte, draws their random bits, rounds and packs them, and writes the byte.

Same bits as the CPU: u comes from the same counter hash under the same key
(:func:`~mergecomp.kernels.triton.common.random_int16`: u = ½ + r·2^-16 for the element's
16-bit lane r), and the float operations are the torch path's, in its order, each rounded
once: fp32(f·v), + (offset + ½), + r·2^-16 (exact), truncated to an integer, capped at
2·offset.  The kernel is compiled with ``enable_fp_fusion=False``, since a fused
multiply-add would round f·v + offset once instead of twice and change a code now and then.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import grid, on_device, random_int16, round_to
from .packing import pack_bits

#: Packed bytes per program.
BYTES_PER_PROGRAM = 512
#: Elements per program when decoding.
CODES_PER_PROGRAM = 2048


@triton.jit
def _rounded_codes(x_ptr, factors_ptr, index, live, bucket_size, key, offset):
    """c = min(⌊fp32(f_b·v) + (offset + ½) + r·2^-16⌋, 2·offset) for elements ``index``."""
    values = tl.load(x_ptr + index, mask=live, other=0)
    factors = tl.load(factors_ptr + index // bucket_size, mask=live, other=0)
    levels = (values * factors).to(tl.float32)  # fp64 inputs: the product in fp64, then fp32, as torch
    levels = levels + (offset + 0.5)  # exact in fp32, as the torch path's constant
    levels = levels + random_int16(index, key).to(tl.float32) * (1.0 / 65536)
    return tl.minimum(levels.to(tl.int32), 2 * offset)


@triton.jit
def _quantize_kernel(x_ptr, factors_ptr, out_ptr, numel, nbytes, bucket_size, key, offset,
                     BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[j]: the 8/BITS codes of elements (8/BITS)·j .. packed into byte j, first on top
    (BITS dividing 8; BITS = 8 writes the codes themselves, for other widths to pack)."""
    PER_BYTE: tl.constexpr = 8 // BITS
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, PER_BYTE)
    index = byte[:, None] * PER_BYTE + lane[None, :]
    live = (byte < nbytes)[:, None] & (index < numel)
    codes = _rounded_codes(x_ptr, factors_ptr, index, live, bucket_size, key, offset)
    codes = tl.where(live, codes, 0)  # the padding of the last byte is zero
    packed = tl.sum(codes << ((PER_BYTE - 1 - lane) * BITS)[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)


@triton.jit
def _dequantize_kernel(packed_ptr, scales_ptr, out_ptr, numel, nbytes, bucket_size, offset,
                       BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = fp32(c_i − offset)·scale_b in fp32 (one rounding), cast to the output dtype."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = index < numel
    position = index * BITS
    first = position // 8
    word = tl.load(packed_ptr + first, mask=live, other=0).to(tl.int32)
    if 8 % BITS != 0:  # a code may span two bytes
        second = tl.load(packed_ptr + first + 1, mask=live & (first + 1 < nbytes), other=0).to(tl.int32)
        word = (word << 8) | second
        codes = (word >> (16 - BITS - position % 8).to(tl.int32)) & ((1 << BITS) - 1)
    else:
        codes = (word >> (8 - BITS - position % 8).to(tl.int32)) & ((1 << BITS) - 1)
    scales = tl.load(scales_ptr + index // bucket_size, mask=live, other=0)
    values = (codes - offset).to(tl.float32) * scales
    tl.store(out_ptr + index, round_to(values, out_ptr.dtype.element_ty), mask=live)


def quantize_packed(tensor: torch.Tensor, bucket_size: int, factors: torch.Tensor, offset: int, bits: int,
                    key: int) -> torch.Tensor:
    """``kernels.quantize_packed`` on the GPU: the packed codes, ⌈n·bits/8⌉ bytes, the same
    bits for the same ``key``.  Widths that do not divide 8 round into a byte per code,
    then pack (two kernels)."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    factors = factors.to(device=flat.device, dtype=torch.float32).contiguous()
    numel = flat.numel()
    width = bits if 8 % bits == 0 else 8
    nbytes = (numel * width + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if numel:
        with on_device(flat, factors):
            _quantize_kernel[grid(nbytes, BYTES_PER_PROGRAM)](
                flat, factors, out, numel, nbytes, bucket_size, key, offset, BITS=width,
                BLOCK=BYTES_PER_PROGRAM, enable_fp_fusion=False)
    return out if width == bits else pack_bits(out, bits)


def dequantize_packed(packed: torch.Tensor, bits: int, numel: int, offset: int, scales: torch.Tensor,
                      bucket_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``kernels.dequantize_packed`` on the GPU: new flat tensor of ``dtype``, (c − offset)·scale_b."""
    packed = packed.reshape(-1).contiguous()
    scales = scales.to(device=packed.device, dtype=torch.float32).contiguous()
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    if numel:
        with on_device(packed, scales):
            _dequantize_kernel[grid(numel, CODES_PER_PROGRAM)](
                packed, scales, out, numel, packed.numel(), bucket_size, offset, BITS=bits,
                BLOCK=CODES_PER_PROGRAM, enable_fp_fusion=False)
    return out
