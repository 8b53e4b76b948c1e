"""Bit packing for wire formats: n codes of b bits travel in exactly ⌈n·b/8⌉ bytes.

Quantising compressors (signSGD, TernGrad, QSGD, ...) produce small integer codes, one per
element, in a ``uint8`` tensor.  Sending those bytes as they are would spend 8 bits on a
1-bit sign; :func:`pack_bits` puts 8/b codes into each byte instead (first code in the
most significant bits) and :func:`unpack_bits` undoes it.  Both are vectorised torch ops
on the input's device: the only Python loops run over the ≤ 8 code positions in a byte,
never over elements.  Widths that do not divide 8 (3, 5, 6, 7 bits) are packed as
bit-planes through the 1-bit path, so they also cost exactly ⌈n·b/8⌉ bytes.

:class:`Scratch` hands out reusable work buffers so the hot path of a compressor does not
allocate (and page-fault) a fresh n-element tensor on every step.
"""
from __future__ import annotations

import math
import sys
import threading
from typing import Dict, Tuple

import torch


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


# 1-bit fast path: eight 0/1 bytes read as one little-endian int64 word w hold bit j at
# position 8j.  w · 0x8040201008040201 (= Σ 2^(63−9j)) moves bit j to 63 − j, the top byte,
# in MSB-first order, with no carries (the copies are 9 bits apart); unpacking multiplies
# a byte by Σ 2^(9j), masks one bit per byte and shifts it into place.  Two integer ops per
# 8 elements instead of 16 shifts and ors.
_GATHER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_SPREAD = 0x8040201008040201 - (1 << 64)
_ONE_PER_BYTE = 0x0101010101010101
_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_ones(flat: torch.Tensor, out: torch.Tensor) -> None:
    """out[i] = the 8 flags flat[8i:8i+8] (0/1 bytes), most significant first."""
    if flat.storage_offset() % 8:
        flat = flat.clone()  # an int64 view needs 8-byte alignment
    words = flat.view(torch.int64)
    gathered = (words * _GATHER).view(torch.uint8).view(-1, 8)
    out.copy_(gathered[:, 7])


def _unpack_ones(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_ones`: 8 bytes of 0/1 per packed byte."""
    spread = packed.to(torch.int64).mul_(_SPREAD).bitwise_right_shift_(7).bitwise_and_(_ONE_PER_BYTE)
    return spread.view(torch.uint8)


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
    if 8 % bits:
        planes = _bit_planes(flat, bits)
        return pack_bits(planes, 1)
    per_byte = 8 // bits
    full, rest = divmod(n, per_byte)
    out = torch.empty(full + (1 if rest else 0), dtype=torch.uint8, device=flat.device)
    if full and bits == 1 and _LITTLE_ENDIAN:
        _pack_ones(flat[: full * per_byte], out[:full])
    elif full:
        _pack_rows(flat[: full * per_byte].view(full, per_byte), bits, out[:full])
    if rest:
        tail = torch.zeros(per_byte, dtype=torch.uint8, device=flat.device)
        tail[:rest] = flat[full * per_byte:]
        _pack_rows(tail.view(1, per_byte), bits, out[full:])
    return out


def _bit_planes(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """n codes → n·bits single bits, most significant first (n × bits, flattened)."""
    shifts = torch.arange(bits - 1, -1, -1, dtype=torch.uint8, device=flat.device)
    return torch.bitwise_and(flat.unsqueeze(1) >> shifts, 1).view(-1)


def unpack_bits(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` codes, as a flat uint8 tensor."""
    _check(packed, bits)
    need = packed_nbytes(numel, bits)
    if packed.numel() < need:
        raise ValueError(f"{numel} codes of {bits} bits need {need} packed bytes, "
                         f"got {packed.numel()}: the payload was truncated or mismatched")
    packed = packed.reshape(-1)
    if bits == 8:
        return packed[:numel]
    if 8 % bits:
        planes = unpack_bits(packed, 1, numel * bits).view(numel, bits)
        codes = planes[:, 0].clone()
        for j in range(1, bits):
            codes.bitwise_left_shift_(1).bitwise_or_(planes[:, j])
        return codes
    if bits == 1 and _LITTLE_ENDIAN:
        return _unpack_ones(packed[: need])[:numel]
    per_byte = 8 // bits
    shifts = _shifts(bits, per_byte, packed.device)
    codes = torch.bitwise_and(packed.unsqueeze(1) >> shifts, (1 << bits) - 1)
    return codes.view(-1)[:numel]


class Scratch:
    """Per-thread reusable work buffers, keyed by a purpose tag, dtype and device.

    ``get("rand", n, torch.float32, device)`` returns an n-element tensor whose contents
    are garbage; it is reused (grown when needed) by later calls with the same tag, so a
    compressor pays the allocation once instead of on every step.  Buffers are per thread
    because communicators may compress groups from several threads at once.  Never put a
    scratch buffer in a payload or context: the next call overwrites it.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, tag: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buffers: Dict[Tuple[str, torch.dtype, torch.device], torch.Tensor] = \
            self._local.__dict__.setdefault("buffers", {})
        key = (tag, dtype, torch.device(device))
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            buffers[key] = buf
        return buf[:numel]

    def __getstate__(self):
        return {}  # buffers are a cache: copies and pickles start empty

    def __setstate__(self, state):
        self._local = threading.local()

    def clear(self) -> None:
        """Free this thread's buffers (e.g. after the plan changed to smaller groups)."""
        self._local.__dict__.pop("buffers", None)
