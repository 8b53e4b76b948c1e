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


# Fast path for 1, 2 and 4 bits (little-endian machines, CPUs and GPUs alike): the 8 codes
# of one int64 word w sit at bit positions 8j.  Multiplying by M = Σ_j 2^(56 + (p−1−j)·b − 8j)
# (p = 8/b codes per byte) moves code j of the word's first p bytes to bits 56 + (p−1−j)·b,
# the top byte in most-significant-first order; the other products land at distinct
# multiples of b (no two overlap, so nothing carries into the top byte) or beyond bit 63
# (dropped).  Output byte m of the word uses w >> 8pm.  Unpacking multiplies a byte by
# Σ_j 2^((8+b)·j) (copies 8 + b bits apart), shifts by 8 − b and masks b bits per byte.
# A few integer ops per 8 elements, instead of one shift-and-or pass per code position.
_LITTLE_ENDIAN = sys.byteorder == "little"


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _gather_multiplier(bits: int) -> int:
    per_byte = 8 // bits
    return _signed(sum(1 << (56 + (per_byte - 1 - j) * bits - 8 * j) for j in range(per_byte)))


def _spread_multiplier(bits: int) -> int:
    return _signed(sum(1 << ((8 + bits) * j) for j in range(8 // bits)) % (1 << 64))


def _byte_mask(bits: int) -> int:
    return _signed(sum(((1 << bits) - 1) << (8 * j) for j in range(8 // bits)))


def _pack_words(flat: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack ``flat`` (a multiple of 8 codes) into ``out`` (bits bytes per 8 codes)."""
    if flat.storage_offset() % 8:
        flat = flat.clone()  # an int64 view needs 8-byte alignment
    words = flat.view(torch.int64)
    multiplier = _gather_multiplier(bits)
    per_word = out.view(-1, bits)
    for m in range(bits):
        source = words if m == 0 else words >> (64 // bits * m)
        per_word[:, m].copy_((source * multiplier).view(torch.uint8).view(-1, 8)[:, 7])


def _unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_words`: 8/bits codes per packed byte."""
    spread = packed.to(torch.int64).mul_(_spread_multiplier(bits))
    spread.bitwise_right_shift_(8 - bits).bitwise_and_(_byte_mask(bits))
    codes = spread.view(torch.uint8).view(-1, 8)
    return codes.reshape(-1) if bits == 1 else codes[:, : 8 // bits].reshape(-1)


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
    words = full // bits if _LITTLE_ENDIAN else 0  # whole int64 words of 8 codes
    if words:
        _pack_words(flat[: words * 8], bits, out[: words * bits])
    if full > words * bits:
        done = words * bits
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
    if _LITTLE_ENDIAN and bits == 1:  # wider codes: 8 int64 bytes per packed byte cost more than shifts
        return _unpack_words(packed[:need], bits)[:numel]
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
