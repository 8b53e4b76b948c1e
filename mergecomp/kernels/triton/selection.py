"""Threshold selection on the GPU: DGC's sample, and the ordered compaction of |g| ≥ t.

DGC (and GradDrop, and top-k's candidates) send the elements whose magnitude passes a
threshold: c values and c int32 indices on the wire, c ≤ k.  The CPU path reads the tensor
once as block peaks and tests only the blocks that pass, to spare the CPU's slow bool
passes; on a GPU that chain (peaks, a bool mask, nonzero, a gather, a second mask) cost
more than ``torch.topk`` itself.  Here:

* :func:`sample_magnitudes` writes DGC's strided sample |g[i·stride]| (NaN as 0, ±Inf as
  the dtype's largest value) in one kernel; the threshold is then ``torch.topk`` of those
  m ≈ n/100 values, as on the CPU;
* :func:`indices_at_least` finds every i with |g[i]| ≥ t in two reads of the tensor: a
  count per block of :data:`BLOCK` elements, their running sum (torch's cumsum over n/BLOCK
  counts, which also gives the total, the one number the host needs), then each block
  writes its indices from its start, in order.  The indices come out ascending, exactly
  the CPU path's, so what follows (DGC's cap at k, the payload) is the same.

The threshold stays on the device (a 0-d tensor read by the kernels), so nothing waits for
the host but the count.  A NaN never passes (|NaN| ≥ t is false), as on the CPU.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import grid, on_device, round_to, widen

#: Elements per program of the compaction.
BLOCK = 2048


@triton.jit
def _sample_kernel(x_ptr, largest_ptr, out_ptr, count, stride, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    largest = widen(tl.load(largest_ptr))
    magnitudes = tl.abs(widen(tl.load(x_ptr + i * stride, mask=live, other=0)))
    magnitudes = tl.where(magnitudes != magnitudes, 0, magnitudes)  # NaN → 0
    magnitudes = tl.where(magnitudes > largest, largest, magnitudes)  # +Inf → the largest finite
    tl.store(out_ptr + i, round_to(magnitudes, out_ptr.dtype.element_ty), mask=live)  # exact: a value of the dtype


@triton.jit
def _count_kernel(x_ptr, threshold_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    threshold = widen(tl.load(threshold_ptr))
    passing = (tl.abs(widen(tl.load(x_ptr + i, mask=i < numel, other=0))) >= threshold) & (i < numel)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(passing.to(tl.int64), axis=0))


@triton.jit
def _write_kernel(x_ptr, threshold_ptr, ends_ptr, counts_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """Block b writes its passing indices, ascending, from ends[b] − counts[b] on."""
    program = tl.program_id(0)
    i = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    threshold = widen(tl.load(threshold_ptr))
    passing = (tl.abs(widen(tl.load(x_ptr + i, mask=i < numel, other=0))) >= threshold) & (i < numel)
    start = tl.load(ends_ptr + program) - tl.load(counts_ptr + program)
    slot = start + tl.cumsum(passing.to(tl.int64), axis=0) - 1
    tl.store(out_ptr + slot, i, mask=passing)


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


@functools.lru_cache(maxsize=16)
def _largest(dtype: torch.dtype, device: str) -> torch.Tensor:
    """The dtype's largest finite value, as a 1-element tensor on ``device``."""
    return torch.full((1,), torch.finfo(dtype).max, dtype=dtype, device=device)


def sample_magnitudes(flat: torch.Tensor, stride: int) -> torch.Tensor:
    """New tensor of ``flat``'s dtype: |flat[::stride]|, NaN as 0 and +Inf as the largest finite."""
    flat = _flat(flat)
    count = (flat.numel() + stride - 1) // stride
    out = torch.empty(count, dtype=flat.dtype, device=flat.device)
    if count:
        with on_device(flat):
            _sample_kernel[grid(count, BLOCK)](flat, _largest(flat.dtype, str(flat.device)), out, count, stride,
                                               BLOCK=BLOCK)
    return out


def indices_at_least(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Ascending int64 indices i with |flat[i]| ≥ ``threshold`` (a 0-d tensor of ``flat``'s
    dtype, on its device, or a number)."""
    flat = _flat(flat)
    threshold = torch.as_tensor(threshold, dtype=flat.dtype, device=flat.device).reshape(1)
    programs = grid(flat.numel(), BLOCK)
    counts = torch.empty(programs[0], dtype=torch.int64, device=flat.device)
    if not flat.numel():
        return counts[:0]
    with on_device(flat, threshold):
        _count_kernel[programs](flat, threshold, counts, flat.numel(), BLOCK=BLOCK)
        ends = torch.cumsum(counts, 0)
        out = torch.empty(int(ends[-1]), dtype=torch.int64, device=flat.device)
        if out.numel():
            _write_kernel[programs](flat, threshold, ends, counts, out, flat.numel(), BLOCK=BLOCK)
    return out
