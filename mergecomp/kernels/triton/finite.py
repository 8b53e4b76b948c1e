"""The non-finite check on the GPU: does a tensor, or some of its elements, hold a NaN or an Inf?

After every exchange each rank checks what it received (the runtime drops a step whose
average is not finite, on every rank).  The torch path sums the tensor and tests the sum,
one reduction; a sparse allgather's check reads only the received indices, which the torch
path first gathers into a new tensor.  Here one kernel reads the elements (through the
indices, when given) and sets a flag where v − v is not 0, which holds exactly for NaN and
±Inf: no gather, no temporary, and a large finite sum that overflows is not taken for an Inf.
Nothing travels: the flag stays on the device, for the step's agreement allreduce.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .common import grid, on_device, widen

#: Elements per program.
BLOCK = 4096


@triton.jit
def _nonfinite_kernel(x_ptr, indices_ptr, flag_ptr, count, GATHER: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    if GATHER:
        i = tl.load(indices_ptr + i, mask=live, other=0)
    values = widen(tl.load(x_ptr + i, mask=live, other=0))
    bad = tl.max(((values - values) != 0).to(tl.int32), axis=0)  # NaN − NaN and Inf − Inf are NaN
    tl.atomic_max(flag_ptr, bad, sem="relaxed")


def nonfinite_flag(tensor: torch.Tensor, indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """0-d bool on ``tensor``'s device: True when ``tensor`` (flattened; only the elements at
    ``indices`` when given) holds a NaN or an Inf."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if indices is not None:
        indices = indices.reshape(-1).contiguous()
    count = flat.numel() if indices is None else indices.numel()
    flag = torch.zeros(1, dtype=torch.int32, device=flat.device)
    if count:
        with on_device(flat, flag):
            _nonfinite_kernel[grid(count, BLOCK)](flat, flat if indices is None else indices, flag, count,
                                                  GATHER=indices is not None, BLOCK=BLOCK)
    return flag.reshape(()).bool()
