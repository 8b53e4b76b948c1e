"""Bit packing on the GPU: codes into bytes, bytes back into codes or values, signs into bits.

The wire format is :mod:`mergecomp.kernels.packing`'s: n codes of b bits are one stream of
n·b bits, most significant bit first, in ⌈n·b/8⌉ bytes (the last byte zero-padded), so a
byte holds 8/b whole codes when b divides 8 and codes straddle bytes otherwise.  On the wire:
1-bit signs n/8 bytes (signSGD, EF-SignSGD, SIGNUM, 1-bit SGD), TernGrad's and TBQ's 2-bit
codes n/4, QSGD's ⌈log₂(2s+1)⌉-bit codes n·b/8.

Why kernels: the torch path packs with one shift-and-or pass per code position, or a
multiply on integer lanes plus copies, and unpacks through a 256-row table; here each
program reads its codes and writes its bytes once.  Packing a byte gathers its 8/b codes
(b | 8) or its 8 bits (other widths); unpacking reads the one or two bytes a code lies in.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import grid, on_device

#: Packed bytes per program (each reads 8/b codes per byte).
BYTES_PER_PROGRAM = 1024
#: Codes (or elements) per program when unpacking and decoding.
CODES_PER_PROGRAM = 2048


@triton.jit
def _pack_kernel(codes_ptr, out_ptr, numel, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[j] = bits 8j .. 8j + 7 of the stream of BITS-bit codes, first bit on top."""
    byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = byte < nbytes
    if 8 % BITS == 0:  # 8/BITS whole codes per byte, the first in the top bits
        PER_BYTE: tl.constexpr = 8 // BITS
        lane = tl.arange(0, PER_BYTE)
        index = byte[:, None] * PER_BYTE + lane[None, :]
        codes = tl.load(codes_ptr + index, mask=live[:, None] & (index < numel), other=0).to(tl.int32)
        packed = tl.sum(codes << ((PER_BYTE - 1 - lane) * BITS)[None, :], axis=1)
    else:  # bit t of the byte is bit (BITS − 1 − p % BITS) of code p // BITS, p = 8·byte + t
        bit = tl.arange(0, 8)
        position = byte[:, None] * 8 + bit[None, :]
        index = position // BITS
        codes = tl.load(codes_ptr + index, mask=live[:, None] & (index < numel), other=0).to(tl.int32)
        bits = (codes >> (BITS - 1 - position % BITS).to(tl.int32)) & 1
        packed = tl.sum(bits << (7 - bit)[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=live)


@triton.jit
def _code_at(packed_ptr, index, live, nbytes, BITS: tl.constexpr):
    """The BITS-bit code number ``index`` of a packed stream, as int32."""
    position = index * BITS
    first = position // 8
    word = tl.load(packed_ptr + first, mask=live, other=0).to(tl.int32)
    if 8 % BITS == 0:  # inside one byte
        return (word >> (8 - BITS - position % 8).to(tl.int32)) & ((1 << BITS) - 1)
    second = tl.load(packed_ptr + first + 1, mask=live & (first + 1 < nbytes), other=0).to(tl.int32)
    word = (word << 8) | second  # a code spans at most two bytes
    return (word >> (16 - BITS - position % 8).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _unpack_kernel(packed_ptr, out_ptr, numel, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = index < numel
    codes = _code_at(packed_ptr, index, live, nbytes, BITS)
    tl.store(out_ptr + index, codes.to(tl.uint8), mask=live)


@triton.jit
def _decode_kernel(packed_ptr, values_ptr, out_ptr, numel, nbytes, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[i] = values[code i]: the table's entries copied bit for bit."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = index < numel
    codes = _code_at(packed_ptr, index, live, nbytes, BITS)
    tl.store(out_ptr + index, tl.load(values_ptr + codes, mask=live), mask=live)


@triton.jit
def _signs_kernel(bits_ptr, values_ptr, out_ptr, totals_ptr, magnitudes_ptr, negatives_ptr, numel, nbytes,
                  SUMS: tl.constexpr, BLOCK: tl.constexpr):
    """out[j]: the sign bits of elements 8j .. 8j + 7, the first on top (``bits_ptr`` is the
    input read as same-width integers, negative exactly when the sign bit is set).  With
    SUMS, this program's Σv, Σ|v| (fp32) and count of set bits go to its slot of the
    partial-sum buffers (summed by torch afterwards, in a fixed order)."""
    program = tl.program_id(0)
    byte = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lane = tl.arange(0, 8)
    index = byte[:, None] * 8 + lane[None, :]
    live = (byte < nbytes)[:, None] & (index < numel)
    negative = (tl.load(bits_ptr + index, mask=live, other=0) < 0).to(tl.int32)
    packed = tl.sum(negative << (7 - lane)[None, :], axis=1)
    tl.store(out_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)
    if SUMS:
        values = tl.load(values_ptr + index, mask=live, other=0).to(tl.float32)
        tl.store(totals_ptr + program, tl.sum(tl.sum(values, axis=1), axis=0))
        tl.store(magnitudes_ptr + program, tl.sum(tl.sum(tl.abs(values), axis=1), axis=0))
        tl.store(negatives_ptr + program, tl.sum(tl.sum(negative, axis=1), axis=0).to(tl.int64))


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """⌈n·bits/8⌉ new bytes from n uint8 codes below 2**bits (``kernels.pack_bits``' bits)."""
    flat = _flat(codes).view(torch.uint8)
    nbytes = (flat.numel() * bits + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    if nbytes:
        with on_device(flat):
            _pack_kernel[grid(nbytes, BYTES_PER_PROGRAM)](flat, out, flat.numel(), nbytes, BITS=bits,
                                                          BLOCK=BYTES_PER_PROGRAM)
    return out


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first ``numel`` codes of :func:`pack_bits`' bytes, as new flat uint8."""
    packed = _flat(packed)
    out = torch.empty(numel, dtype=torch.uint8, device=packed.device)
    if numel:
        with on_device(packed):
            _unpack_kernel[grid(numel, CODES_PER_PROGRAM)](packed, out, numel, packed.numel(), BITS=bits,
                                                           BLOCK=CODES_PER_PROGRAM)
    return out


def decode_values(packed: torch.Tensor, bits: int, numel: int, values: torch.Tensor) -> torch.Tensor:
    """New flat tensor of ``values``' dtype: ``values[code]`` for the first ``numel`` codes
    (the 2**bits entries of ``values`` moved to ``packed``'s device if they are not there)."""
    packed = _flat(packed)
    values = values.to(packed.device).contiguous()
    out = torch.empty(numel, dtype=values.dtype, device=packed.device)
    if numel:
        with on_device(packed, values):
            _decode_kernel[grid(numel, CODES_PER_PROGRAM)](packed, values, out, numel, packed.numel(), BITS=bits,
                                                           BLOCK=CODES_PER_PROGRAM)
    return out


#: Same-width integer view of each float dtype, whose sign is the float's sign bit.
_SAME_WIDTH = {torch.float32: torch.int32, torch.float16: torch.int16,
               torch.bfloat16: torch.int16, torch.float64: torch.int64}

#: Packed bytes per program of the sign kernel (8 elements each).
SIGN_BYTES_PER_PROGRAM = 256


def _signs(tensor: torch.Tensor, sums: bool):
    flat = _flat(tensor)
    if flat.dtype not in _SAME_WIDTH:
        raise TypeError(f"sign bits need a float16, bfloat16, float32 or float64 tensor, got {flat.dtype}")
    nbytes = (flat.numel() + 7) // 8
    out = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    programs = grid(nbytes, SIGN_BYTES_PER_PROGRAM)
    partials = [torch.zeros(programs[0], dtype=dtype, device=flat.device)
                for dtype in (torch.float32, torch.float32, torch.int64)] if sums else [out, out, out]
    if nbytes:
        with on_device(flat):
            _signs_kernel[programs](flat.view(_SAME_WIDTH[flat.dtype]), flat, out, *partials, flat.numel(), nbytes,
                                    SUMS=sums, BLOCK=SIGN_BYTES_PER_PROGRAM)
    return out, partials


def pack_signs(tensor: torch.Tensor) -> torch.Tensor:
    """⌈n/8⌉ new bytes: bit i set where element i's sign bit is set (negative, or −0.0)."""
    return _signs(tensor, sums=False)[0]


def signs_and_side_sums(tensor: torch.Tensor):
    """(packed sign bits, Σv, Σ|v|, number of set sign bits), the sums as 0-d fp32 tensors and
    the count as 0-d int64, all on the tensor's device, in one read of the tensor: 1-bit
    SGD's encoder.  The sums are each program's fp32 sum, then torch's sum of those, in a
    fixed order (the same bits on every run, not those of one torch reduction)."""
    packed, (totals, magnitudes, negatives) = _signs(tensor, sums=True)
    return packed, totals.sum(), magnitudes.sum(), negatives.sum()
