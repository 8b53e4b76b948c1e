"""The sparse decode: a payload's values set, added or subtracted at their indices.

Top-k, DGC, GradDrop and rand-k decode by scattering c values into a dense buffer; the
allgather communicator adds every rank's payload into one buffer, rank after rank; error
feedback subtracts what was sent.  :func:`scatter` is that one operation; :func:`divide_at`
averages such a sum where it is not zero.  The torch path
is ``index_put_``/``index_add_`` after widening the indices to int64 and converting the
values to the buffer's dtype; a CUDA buffer goes through one Triton kernel that reads both
as they are (:mod:`.triton.scatter`), with the same bits.
"""
from __future__ import annotations

import torch

from . import triton as gpu

#: What :func:`scatter` does at each index.
MODES = ("set", "add", "subtract")


def scatter(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, mode: str = "add") -> torch.Tensor:
    """``out`` (a flat tensor, changed in place and returned) with ``values`` converted to its
    dtype and written (``"set"``), added (``"add"``) or subtracted (``"subtract"``) at
    ``indices`` (int32 or int64, distinct within one call for ``"set"``)."""
    if mode not in MODES:
        raise ValueError(f"scatter mode must be one of {MODES}, got {mode!r}")
    if gpu.usable(out) and out.is_contiguous() and out.dim() == 1:
        from .triton import scatter as triton_scatter
        return triton_scatter.scatter(out, indices, values, mode)
    indices, values = indices.long(), values.to(out.dtype)
    if mode == "set":
        out[indices] = values
    else:
        out.index_add_(0, indices, values, alpha=1 if mode == "add" else -1)
    return out


def divide_at(out: torch.Tensor, indices: torch.Tensor, divisor: int) -> torch.Tensor:
    """``out`` (flat, changed in place and returned) divided by ``divisor`` at ``indices`` only
    (repeats allowed): the average of a sparse sum, which is zero elsewhere, for O(c) instead
    of a pass over the buffer.  Each element gets the same IEEE division as ``out.div_``."""
    indices = indices.long()
    return out.index_copy_(0, indices, out.index_select(0, indices).div_(divisor))
