"""The sparse decode on the GPU: values written, added or subtracted at their indices.

A sparsifier's payload is c values and c int32 indices (8c bytes in fp32); decoding
scatters them into a dense buffer, and the allgather communicator adds every rank's
payload into one buffer, rank after rank (``SparseCompressor.decompress_sum``); error
feedback subtracts what was sent.  The torch path widens the indices to int64 and
converts the values to the buffer's dtype (two copies) before ``index_add_``; here one
kernel reads both as they are.

Adds are atomic, so an index repeated within one payload is still summed; a payload's
indices are distinct (top-k, DGC, GradDrop, rand-k), so every element gets at most one add
per launch and the result does not depend on the order the GPU runs them in: the same
bits as ``index_add_`` (each add is the buffer's dtype, rounded once).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import grid, on_device, round_to

#: Payload entries per program.
BLOCK = 1024

#: What :func:`scatter` does at each index.
MODES = {"set": 0, "add": 1, "subtract": -1}


@triton.jit
def _scatter_kernel(out_ptr, indices_ptr, values_ptr, count, MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    where = out_ptr + tl.load(indices_ptr + i, mask=live, other=0)
    values = tl.load(values_ptr + i, mask=live, other=0)
    if values.dtype != out_ptr.dtype.element_ty:  # as torch's .to(): widening is exact, narrowing rounds
        values = round_to(values.to(tl.float32), out_ptr.dtype.element_ty)
    if MODE == 0:
        tl.store(where, values, mask=live)
    elif MODE == 1:
        tl.atomic_add(where, values, mask=live, sem="relaxed")
    else:
        tl.atomic_add(where, -values, mask=live, sem="relaxed")


def scatter(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, mode: str = "add") -> torch.Tensor:
    """``out`` (flat, contiguous) with ``values`` set, added or subtracted (``mode``) at
    ``indices`` (int32 or int64), the values converted to ``out``'s dtype; returns ``out``."""
    if mode not in MODES:
        raise ValueError(f"scatter mode must be one of {sorted(MODES)}, got {mode!r}")
    if not out.is_contiguous() or out.dim() != 1:
        raise ValueError(f"scatter writes into a flat contiguous tensor, got shape {tuple(out.shape)}")
    indices = indices.reshape(-1).contiguous()
    values = values.reshape(-1).contiguous()
    if indices.numel() != values.numel():
        raise ValueError(f"a sparse payload needs one index per value, got {indices.numel()} indices "
                         f"and {values.numel()} values")
    if indices.numel():
        with on_device(out, indices, values):
            _scatter_kernel[grid(indices.numel(), BLOCK)](out, indices, values, indices.numel(),
                                                          MODE=MODES[mode], BLOCK=BLOCK)
    return out
