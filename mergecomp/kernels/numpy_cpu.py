"""The numpy backend: CPU fast paths through numpy's vectorised loops.

Why numpy: on the CPU some of torch's elementwise kernels cost several times numpy's SIMD
loops for the same work: a sign test of the float's bits into bool (``numpy.less``), 8
flags into 1 byte (``numpy.packbits``), a 256-row table lookup (``numpy.take``), the
integer hash of the random lanes, a count of set bytes, rand-k's index permutation.  Where torch is as fast (broadcast
products, conversions, clamps, 2- and 4-bit lane packing) the kernels keep torch.  A CPU
tensor and its ``.numpy()`` share memory, so the functions here read torch tensors and
return torch tensors without copies.  The ops of :mod:`mergecomp.kernels` call
them for CPU tensors only and keep their torch ops on every other device; both paths give
the same bits (``tests/test_fast_paths.py`` compares them).  bfloat16, which numpy lacks,
is handled as raw bytes or int16 bits.
"""
from __future__ import annotations

import numpy as np
import torch

from .hashing import HASH_MULTIPLIERS


def on_cpu(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in host memory, where the numpy paths apply."""
    return tensor.device.type == "cpu"


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The numpy array that shares ``tensor``'s memory (a CPU tensor of a numpy dtype)."""
    return tensor.detach().numpy()


def negative_flags(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (bool) ← ``bits < 0``, elementwise: the sign bit of floats read as same-width ints."""
    np.less(as_numpy(bits), 0, out=as_numpy(out))
    return out


def count_nonzero(flags: torch.Tensor) -> int:
    """How many of ``flags`` (uint8 or bool) are set."""
    return int(np.count_nonzero(as_numpy(flags)))


def pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """⌈n/8⌉ new bytes from n flags (uint8 0/1 or bool), the first flag in the top bit."""
    return torch.from_numpy(np.packbits(as_numpy(flags)))


def unpack_flags(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The first ``numel`` flags of :func:`pack_flags`' bytes, as new uint8 0/1."""
    return torch.from_numpy(np.unpackbits(as_numpy(packed), count=numel))


#: Table rows narrower than this go through torch's gather: numpy's take handles rows of
#: 16 and 32 bytes (4 or 8 fp32) in one move each, but 8-byte items take a much slower
#: path, which also page-faults its output.
MIN_TAKE_ROW_BYTES = 16


def take_rows(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """New (len(packed) × table columns) tensor: row ``packed[i]`` of ``table`` for each byte.

    ``table`` is read as raw bytes, so any dtype works (bfloat16 too) and the values are
    copied bit for bit.  Each row is one numpy element of ``MIN_TAKE_ROW_BYTES`` or more
    bytes, and the output is allocated by torch (numpy's take into its own new array is
    slower on the same rows).
    """
    table = table.contiguous()
    row_bytes = table.shape[1] * table.element_size()
    if row_bytes < MIN_TAKE_ROW_BYTES:
        raise ValueError(f"take_rows needs rows of at least {MIN_TAKE_ROW_BYTES} bytes, got {row_bytes}")
    element = np.dtype(f"V{row_bytes}")
    rows = as_numpy(table.view(torch.uint8)).view(element).reshape(-1)
    out = torch.empty(len(packed), table.shape[1], dtype=table.dtype)
    # "clip" skips the bounds check of "raise" (a byte cannot exceed the 256 rows anyway).
    np.take(rows, as_numpy(packed), out=as_numpy(out.view(torch.uint8)).view(element).reshape(-1), mode="clip")
    return out


def hash_words(words: torch.Tensor, multipliers, spare: torch.Tensor) -> None:
    """In place on int32 ``words``: for each multiplier, w ← w·m, then w ← w ^ (w >>> 16).

    The same bits as the torch version (32-bit wrapping products, logical shifts); numpy's
    unsigned words make the shift logical without a mask.  ``spare`` is int32 work space
    of the same length.
    """
    unsigned = as_numpy(words).view(np.uint32)
    spare = as_numpy(spare).view(np.uint32)
    for multiplier in multipliers:
        np.multiply(unsigned, np.uint32(multiplier % (1 << 32)), out=unsigned)
        np.right_shift(unsigned, np.uint32(16), out=spare)
        np.bitwise_xor(unsigned, spare, out=unsigned)


def _feistel_words(values: np.ndarray, half: int, keys) -> np.ndarray:
    """``kernels.subsets.feistel`` on uint32 words: wrapping products, logical shifts."""
    left, right = values >> np.uint32(half), values & np.uint32((1 << half) - 1)
    shift, sixteen = np.uint32(32 - half), np.uint32(16)
    multipliers = [np.uint32(m) for m in HASH_MULTIPLIERS]
    for key in keys:
        mixed = right ^ np.uint32(key)
        for multiplier in multipliers:
            np.multiply(mixed, multiplier, out=mixed)
            mixed ^= mixed >> sixteen
        mixed >>= shift
        mixed ^= left
        left, right = right, mixed
    return (left << np.uint32(half)) | right


def feistel_subset(numel: int, k: int, half: int, keys) -> torch.Tensor:
    """``kernels.random_subset`` on the CPU: π(0..k−1) as new int64, cycle walking the
    values at or above ``numel`` (the Feistel network of :mod:`mergecomp.kernels.subsets`)."""
    values = _feistel_words(np.arange(k, dtype=np.uint32), half, keys)
    outside = np.flatnonzero(values >= numel)
    while outside.size:
        walked = _feistel_words(values[outside], half, keys)
        values[outside] = walked
        outside = outside[walked >= numel]
    return torch.from_numpy(values.astype(np.int64))
