"""Is a tensor finite?  The check every exchange runs before a compressor sees a gradient and
after the average arrives: a NaN must never reach a residual, a compressor's state or a
parameter (a sparsifier could drop it, an SVD would fail, error feedback would keep it).

The check must not wait for the host: it returns a 0-d bool tensor on the tensor's device,
which the step's agreement allreduce carries.  The torch path is one reduction (a sum: NaN
and ±Inf survive it, as Inf − Inf = NaN); 16-bit tensors are summed in fp32 so a large
finite gradient does not overflow.  A sparse allgather's check reads only the received
indices.  On a GPU with Triton one kernel tests every element instead
(:mod:`.triton.finite`), through the indices without gathering them first.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import triton as gpu


def nonfinite_flag(tensor: torch.Tensor, indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A 0-d bool tensor on ``tensor``'s device: True when it holds a NaN or an Inf (only the
    elements of the flattened tensor at ``indices`` are read when they are given)."""
    if gpu.usable(tensor) and tensor.is_floating_point():
        from .triton import finite as triton_finite
        return triton_finite.nonfinite_flag(tensor, indices)
    if indices is not None:
        tensor = tensor.reshape(-1).index_select(0, indices)
    if tensor.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=tensor.device)
    if tensor.dtype in (torch.float16, torch.bfloat16):
        total = tensor.sum(dtype=torch.float32)
    elif tensor.is_complex():
        total = torch.view_as_real(tensor).sum()
    else:
        total = tensor.sum()
    return ~torch.isfinite(total)


def zero_if(tensor: torch.Tensor, flag: torch.Tensor) -> None:
    """Zero ``tensor`` in place where ``flag`` (0-d bool) is True, so a compressor never sees
    a NaN.  On the CPU a branch (no pass when finite); elsewhere without a host sync."""
    if tensor.device.type == "cpu":
        if bool(flag):
            tensor.zero_()
    else:
        tensor.masked_fill_(flag, 0)
