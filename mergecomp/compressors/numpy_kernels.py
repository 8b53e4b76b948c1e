"""CPU fast paths through numpy's vectorised loops, for the quantisers' elementwise work.

Why numpy: on one CPU core, some of torch's kernels cost 1–3 ns per element where numpy's
SIMD loops do the same work in 0.1–0.4 ns.  Measured here on 1M fp32 elements, one thread:

- sign test of the float's bits into bool: ``torch.lt`` 1.27 ms, ``numpy.less`` 0.19 ms;
- 8 flags into 1 byte, first flag in the top bit: torch lane multiply 0.36 ms,
  ``numpy.packbits`` 0.13 ms;
- 256-row table to 1M fp32 values (1-bit decode): ``torch.index_select`` 1.0 ms,
  ``numpy.take`` 0.4–0.7 ms.

Where torch is as fast or faster (broadcast products, conversions, clamps, 2- and 4-bit
lane packing) the callers keep torch.  At 1M elements the tensor stays in cache and a
``clone()`` costs 0.2–0.6 ms, so those ns per element decide whether a compressor costs 3×
or 10× a clone.  A CPU tensor and its ``.numpy()`` share memory, so the functions here read
torch tensors and return torch tensors without copies; the callers (``packing``,
``quantize``, ``onebit``) use them for CPU tensors and keep their torch ops, one kernel each
on a GPU, on every other device.  Both paths give the same bits (tests compare them on the
CPU).  bfloat16, which numpy lacks, is handled as raw bytes or int16 bits.
"""
from __future__ import annotations

import numpy as np
import torch


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
#: 16 and 32 bytes (4 or 8 fp32) in one move each, but 8-byte items take a path ~10×
#: slower here, which also page-faults its output.
MIN_TAKE_ROW_BYTES = 16


def take_rows(table: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """New (len(packed) × table columns) tensor: row ``packed[i]`` of ``table`` for each byte.

    ``table`` is read as raw bytes, so any dtype works (bfloat16 too) and the values are
    copied bit for bit.  Each row is one numpy element of ``MIN_TAKE_ROW_BYTES`` or more
    bytes, and the output is allocated by torch (numpy's take into its own new array is
    about 3× slower on the same rows).
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
