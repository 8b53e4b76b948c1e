"""What the Triton kernels share: the launch on the tensor's device, and the counter hash.

Triton launches on the current CUDA device and stream; :func:`on_device` makes the
tensor's device current for the launch (a process may hold tensors on several GPUs), so
the kernel runs where its data lives, on the stream torch is using there.  A CPU tensor is
accepted only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the
kernels are tested without a GPU.

:func:`hash32` is the lowbias32 tail of :mod:`mergecomp.kernels.hashing` on unsigned
32-bit words (wrapping products, logical shifts): the same bits as the torch, numpy and C
versions, which is what lets a GPU round and draw indices exactly as a CPU does.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import interpreting
from ..hashing import HASH_MULTIPLIERS

HASH_MULTIPLIER_1: tl.constexpr = tl.constexpr(HASH_MULTIPLIERS[0])
HASH_MULTIPLIER_2: tl.constexpr = tl.constexpr(HASH_MULTIPLIERS[1])


def on_device(*tensors: torch.Tensor):
    """The context to launch a kernel on ``tensors`` in: their CUDA device made current
    (or nothing to do for CPU tensors under the interpreter).  ValueError when they live
    on different devices, or on the CPU without the interpreter."""
    device = tensors[0].device
    for tensor in tensors[1:]:
        if tensor.device != device:
            raise ValueError(f"a Triton kernel got tensors on {device} and {tensor.device}: "
                             f"move them to one device first")
    if device.type == "cuda":
        return torch.cuda.device(device)
    if device.type == "cpu" and interpreting():
        return contextlib.nullcontext()
    raise ValueError(f"the Triton kernels take CUDA tensors, got one on {device}; CPU tensors run "
                     f"only in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported)")


def grid(count: int, block: int):
    """One program per ``block`` items of ``count`` (at least one program)."""
    return (max(1, triton.cdiv(count, block)),)


@triton.jit
def hash32(words):
    """lowbias32's tail on uint32 words: w·m₁, w ^ (w >> 16), w·m₂, w ^ (w >> 16)."""
    words = words * tl.full((), HASH_MULTIPLIER_1, tl.uint32)
    words = words ^ (words >> 16)
    words = words * tl.full((), HASH_MULTIPLIER_2, tl.uint32)
    return words ^ (words >> 16)


@triton.jit
def random_int16(index, key):
    """The int16 random lane of element ``index`` (int64) under ``key``, as int32: the word
    hash32(key + index // 2), its low half for even indices and its high half for odd ones,
    read as signed 16 bits (the lanes of ``kernels.random_int16``'s int32 words read as
    int16 on a little-endian machine)."""
    words = hash32((key + index // 2).to(tl.uint32))
    lanes = ((words >> ((index % 2) * 16).to(tl.uint32)) & 0xFFFF).to(tl.int32)
    return tl.where(lanes >= 32768, lanes - 65536, lanes)


@triton.jit
def round_to(values, dtype: tl.constexpr):
    """fp32 ``values`` as ``dtype``, rounded to nearest, ties to even, as torch converts.

    bfloat16 is rounded in integers (add 0x7FFF plus the lowest kept bit, drop 16 bits; NaN
    becomes torch's 0x7FC0): the GPU would round the same way in its conversion, but Triton's
    interpreter truncates, and the CPU tests must see the GPU's bits.
    """
    if dtype == tl.bfloat16:
        bits = values.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(values != values, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return values.to(dtype)  # fp16: the interpreter's numpy conversion rounds to nearest too


@triton.jit
def widen(values):
    """16-bit floats as fp32 (exact), others as they are: comparisons and |·| of bfloat16
    done in fp32 give the same answers, and Triton's interpreter, which holds bfloat16 as
    raw 16-bit integers, gets them right too."""
    if values.dtype.primitive_bitwidth == 16:
        return values.to(tl.float32)
    else:
        return values
