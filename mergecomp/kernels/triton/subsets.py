"""Rand-k's indices drawn on the GPU: the keyed permutation of :mod:`mergecomp.kernels.subsets`.

Why: rand-k's indices were drawn by numpy's sampler on the host and copied to the GPU,
which made rand-k the slowest compressor there although it sends only k values (4k bytes
in fp32, no indices: every rank derives them from the shared seed).  Each thread here
evaluates π(j) for one j < k — the Feistel rounds of the torch path on uint32 words,
repeated while the value is at or above n (cycle walking) — and writes it: the same k
integers as the CPU for the same key, without a host round trip.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..permutation import check_subset, half_bits, round_keys
from .common import grid, hash32, on_device

#: Indices per program.
INDICES_PER_PROGRAM = 1024


@triton.jit
def _round(left, right, key, shift):
    """(L, R) → (R, L xor the top bits of hash32(R xor K))."""
    return right, left ^ (hash32(right ^ key.to(tl.uint32)) >> shift)


@triton.jit
def _feistel(values, half, key0, key1, key2, key3, key4, key5):
    """One pass of the network (the six rounds of ``kernels.permutation.ROUNDS``) over uint32
    ``values`` below 2^(2·half)."""
    shift = 32 - half
    left = values >> half
    right = values & ((tl.full((), 1, tl.uint32) << half) - 1)
    left, right = _round(left, right, key0, shift)
    left, right = _round(left, right, key1, shift)
    left, right = _round(left, right, key2, shift)
    left, right = _round(left, right, key3, shift)
    left, right = _round(left, right, key4, shift)
    left, right = _round(left, right, key5, shift)
    return (left << half) | right


@triton.jit(do_not_specialize=["k", "numel", "half", "key0", "key1", "key2", "key3", "key4", "key5"])
def _subset_kernel(out_ptr, k, numel, half, key0, key1, key2, key3, key4, key5, BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = j < k
    half = half.to(tl.uint32)
    limit = numel.to(tl.int64)
    values = _feistel(tl.where(live, j, 0).to(tl.uint32), half, key0, key1, key2, key3, key4, key5)
    while tl.max(tl.where(live & (values.to(tl.int64) >= limit), 1, 0)) > 0:  # cycle walking
        walked = _feistel(values, half, key0, key1, key2, key3, key4, key5)
        values = tl.where(values.to(tl.int64) >= limit, walked, values)
    tl.store(out_ptr + j, values.to(tl.int64), mask=live)


def random_subset(numel: int, k: int, key: int, device) -> torch.Tensor:
    """``kernels.random_subset`` on the GPU: the same k int64 indices, drawn on ``device``."""
    check_subset(numel, k)
    out = torch.empty(k, dtype=torch.int64, device=device)
    if k:
        keys = round_keys(key)
        if len(keys) != 6:
            raise AssertionError(f"the kernel unrolls 6 Feistel rounds, kernels.permutation.ROUNDS is {len(keys)}")
        with on_device(out):
            _subset_kernel[grid(k, INDICES_PER_PROGRAM)](out, k, numel, half_bits(numel), *keys,
                                                        BLOCK=INDICES_PER_PROGRAM)
    return out
