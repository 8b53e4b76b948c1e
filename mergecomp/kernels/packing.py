"""Bit packing for wire formats: n codes of b bits travel in exactly ⌈n·b/8⌉ bytes.

Quantising compressors (signSGD, TernGrad, QSGD, ...) produce small integer codes, one per
element, in a ``uint8`` tensor.  Sending those bytes as they are would spend 8 bits on a
1-bit sign; :func:`pack_bits` puts 8/b codes into each byte instead (first code in the
most significant bits) and :func:`unpack_bits` undoes it.  Both are vectorised torch ops
on the input's device: the only Python loops run over the ≤ 8 code positions in a byte,
never over elements.  Widths that do not divide 8 (3, 5, 6, 7 bits) are packed as
bit-planes through the 1-bit path, so they also cost exactly ⌈n·b/8⌉ bytes.
On the CPU, 1-bit packing and unpacking go through numpy's packbits/unpackbits and the
1-bit table decode through the native kernel where it is built (:mod:`.native`); CUDA
tensors go through one Triton kernel per call where Triton is present
(:mod:`.triton.packing`); the torch ops here serve every other case, with the same bits.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Optional

import torch

from . import native, numpy_cpu
from . import triton as gpu
from .scratch import Scratch


def bits_for(num_codes: int) -> int:
    """Fewest bits that can hold ``num_codes`` distinct codes (at least 1)."""
    if int(num_codes) < 1:
        raise ValueError(f"num_codes must be at least 1, got {num_codes!r}")
    return max(1, math.ceil(math.log2(int(num_codes))))


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that ``numel`` codes of ``bits`` bits occupy once packed: ⌈numel·bits/8⌉."""
    return (int(numel) * int(bits) + 7) // 8


def _check(codes: torch.Tensor, bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}")
    if codes.dtype not in (torch.uint8, torch.bool):
        raise TypeError(f"codes must be a uint8 (or bool) tensor, got {codes.dtype}; "
                        f"convert with .to(torch.uint8) after making them non-negative")


def _shifts(bits: int, per_byte: int, device) -> torch.Tensor:
    return torch.arange(bits * (per_byte - 1), -1, -bits, dtype=torch.uint8, device=device)


# Fast path for 1, 2 and 4 bits on little-endian machines (CPUs and GPUs alike): the p = 8/b
# codes of one packed byte sit in one integer word of p bytes (a "lane": int64 for 1 bit,
# int32 for 2, int16 for 4), code j at bit 8j.  Multiplying the word by
# M = Σ_j 2^(8(p−1) + (p−1−j)·b − 8j) moves code j to bit 8(p−1) + (p−1−j)·b, inside the
# top byte in most-significant-first order; every other partial product lands at a
# distinct multiple of b outside the top byte or beyond the word (dropped), so nothing
# carries into it.  Unpacking multiplies a byte by Σ_j 2^((8+b)·j) (copies 8 + b bits
# apart), shifts by 8 − b and masks b bits per byte.  A few integer ops per packed byte
# instead of one shift-and-or pass per code position.
_LITTLE_ENDIAN = sys.byteorder == "little"

#: The integer word that holds the 8/b code bytes of one packed byte.
_LANE = {1: torch.int64, 2: torch.int32, 4: torch.int16}


def _wrap(value: int, width: int) -> int:
    """``value`` modulo 2**width, as the signed integer torch stores in a word of that width."""
    value %= 1 << width
    return value - (1 << width) if value >= 1 << (width - 1) else value


def _gather_multiplier(bits: int) -> int:
    per_byte = 8 // bits
    top = 8 * (per_byte - 1)
    return _wrap(sum(1 << (top + (per_byte - 1 - j) * bits - 8 * j) for j in range(per_byte)), 8 * per_byte)


def _pack_lanes(flat: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack ``flat`` (a multiple of 8/bits codes) into ``out``, one byte per lane."""
    per_byte = 8 // bits
    if flat.storage_offset() % per_byte:
        flat = flat.clone()  # a lane view needs its natural alignment
    product = flat.view(_LANE[bits]) * _gather_multiplier(bits)
    if bits == 1:  # the top byte, read in place (faster than shifting int64 words)
        out.copy_(product.view(torch.uint8).view(-1, 8)[:, 7])
    else:  # shifted down, the cast to uint8 keeps the low byte
        out.copy_(product.bitwise_right_shift_(8 * (per_byte - 1)))


def _unpack_lanes(packed: torch.Tensor, bits: int, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Inverse of :func:`_pack_lanes`: 8/bits codes per packed byte, as flat uint8.

    The lane word is wide enough for every bit that matters: copy j of the byte (shifted
    by (8 + b)·j) puts the code bits that end up in byte j at bits 8j + 8 − b .. 8j + 7,
    inside the word, and the copies do not overlap, so the products that overflow the word
    only lose bits that the mask drops anyway.
    """
    per_byte = 8 // bits
    lane = _LANE[bits]
    width = 8 * per_byte
    spread = _wrap(sum(1 << ((8 + bits) * j) for j in range(per_byte)), width)
    mask = _wrap(sum(((1 << bits) - 1) << (8 * j) for j in range(per_byte)), width)
    lanes = _buffer(scratch, "unpack_lanes", packed.numel(), lane, packed.device).copy_(packed)
    lanes.mul_(spread).bitwise_right_shift_(8 - bits).bitwise_and_(mask)
    return lanes.view(torch.uint8)


def _buffer(scratch: Optional[Scratch], tag: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    if scratch is None:
        return torch.empty(numel, dtype=dtype, device=device)
    return scratch.get(tag, numel, dtype, device)


def _pack_rows(rows: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """out[i] = rows[i, 0] << (8-b) | rows[i, 1] << (8-2b) | ... (rows is m × 8/b)."""
    per_byte = rows.shape[1]
    torch.bitwise_left_shift(rows[:, 0], bits * (per_byte - 1), out=out)
    if per_byte == 1:
        return
    shifted = torch.empty_like(out)
    for j in range(1, per_byte):
        torch.bitwise_left_shift(rows[:, j], bits * (per_byte - 1 - j), out=shifted)
        out.bitwise_or_(shifted)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack the codes (uint8 values < 2**bits, any shape) into ⌈n·bits/8⌉ bytes.

    Codes must already lie in [0, 2**bits): a larger code would spill into its
    neighbour's bits (the compressors produce valid codes by construction, and checking
    would cost a pass over the data).
    """
    _check(codes, bits)
    flat = codes.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    if gpu.usable(flat):
        from .triton import packing as triton_packing
        return triton_packing.pack_bits(flat, bits)
    if 8 % bits:
        planes = _bit_planes(flat, bits)
        return pack_bits(planes, 1)
    if bits == 1 and numpy_cpu.on_cpu(flat):
        return numpy_cpu.pack_flags(flat)
    per_byte = 8 // bits
    full, rest = divmod(n, per_byte)
    out = torch.empty(full + (1 if rest else 0), dtype=torch.uint8, device=flat.device)
    done = full if _LITTLE_ENDIAN else 0  # bytes packed through the lanes
    if done:
        _pack_lanes(flat[: done * per_byte], bits, out[:done])
    if full > done:
        _pack_rows(flat[done * per_byte: full * per_byte].view(full - done, per_byte), bits, out[done:full])
    if rest:
        tail = torch.zeros(per_byte, dtype=torch.uint8, device=flat.device)
        tail[:rest] = flat[full * per_byte:]
        _pack_rows(tail.view(1, per_byte), bits, out[full:])
    return out


def _bit_planes(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """n codes → n·bits single bits, most significant first (n × bits, flattened)."""
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8, device=flat.device)
    return torch.bitwise_and(flat.unsqueeze(1) >> shifts, 1).view(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int, scratch: Optional[Scratch] = None) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes, as a flat uint8 tensor.

    With a ``scratch``, the codes (and the work buffers) live in it, so the hot path does
    not allocate: consume them before the next call with the same scratch.
    """
    _check(packed, bits)
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} packed bytes, "
                         f"got {packed.numel()}: the payload was truncated or mismatched")
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:numel]
    if gpu.usable(packed):
        from .triton import packing as triton_packing
        return triton_packing.unpack_bits(packed.view(torch.uint8), bits, numel)
    if 8 % bits:
        planes = unpack_bits(packed, 1, numel * bits).view(numel, bits)
        codes = planes[:, 0].clone()
        for j in range(1, bits):
            codes.bitwise_left_shift_(1).bitwise_or_(planes[:, j])
        return codes
    if bits == 1 and numpy_cpu.on_cpu(packed):
        return numpy_cpu.unpack_flags(packed[:need], numel)
    if _LITTLE_ENDIAN:
        return _unpack_lanes(packed[:need], bits, scratch)[:numel]
    per_byte = 8 // bits
    shifts = _shifts(bits, per_byte, packed.device)
    codes = torch.bitwise_and(packed.unsqueeze(1) >> shifts, (1 << bits) - 1)
    return codes.view(-1)[:numel]


@functools.lru_cache(maxsize=8)
def _codes_of_bytes(bits: int, device: str) -> torch.Tensor:
    """(256 × 8/bits) int64: the codes byte value v holds, first code (top bits) first."""
    per_byte = 8 // bits
    shifts = torch.arange(bits * (per_byte - 1), -1, -bits)
    return ((torch.arange(256).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).to(device)


def decode_values(packed: torch.Tensor, bits: int, numel: int, values: torch.Tensor) -> torch.Tensor:
    """New flat tensor of ``values``' dtype and device: ``values[code]`` for the first
    ``numel`` codes of ``packed``.

    The decoder's whole output in one gather: a packed byte can take only 256 values, so
    the 8/bits outputs of each (``values`` of its codes: ±1 for signs, the two means of
    1-bit SGD, the levels ``code − offset`` of a quantiser) are laid out once per call as
    a 256-row table (8 KB for 1 bit in fp32), and each packed byte copies its row.  One
    pass that writes the output, where unpacking, converting and mapping took three to
    five; the values are copied bit for bit.  ``values`` holds 2**bits entries (codes
    that never occur may map to anything).  Widths that do not divide 8 unpack first.
    """
    _check(packed, bits)
    if values.dim() != 1 or values.numel() != 1 << bits:
        raise ValueError(f"decode_values needs {1 << bits} values, one per {bits}-bit code, "
                         f"got a tensor of shape {tuple(values.shape)}")
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} packed bytes, "
                         f"got {packed.numel()}: the payload was truncated or mismatched")
    packed = packed.reshape(-1)[:need].view(torch.uint8)
    if gpu.usable(packed):
        from .triton import packing as triton_packing
        return triton_packing.decode_values(packed, bits, numel, values)
    if bits == 1 and values.element_size() in (2, 4, 8) and native.usable(packed) and native.usable(values):
        return native.decode_bits(packed, numel, values)
    if 8 % bits:
        return values[unpack_bits(packed, bits, numel).long()]
    table = values[_codes_of_bytes(bits, str(values.device))]
    if (numpy_cpu.on_cpu(packed) and numpy_cpu.on_cpu(table)
            and table[0].numel() * table.element_size() >= numpy_cpu.MIN_TAKE_ROW_BYTES):
        rows = numpy_cpu.take_rows(table, packed)
    else:
        rows = table.index_select(0, packed.to(device=table.device, dtype=torch.int64))
    return rows.view(-1)[:numel]
