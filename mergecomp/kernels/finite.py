"""Is a tensor finite?  The check every exchange runs before a compressor sees a gradient and
after the average arrives: a NaN must never reach a residual, a compressor's state or a
parameter (a sparsifier could drop it, an SVD would fail, error feedback would keep it)."""
from __future__ import annotations

import torch


def nonfinite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on ``tensor``'s device: True when it holds a NaN or an Inf.

    One read pass (a sum: NaN and ±Inf survive it, as Inf − Inf = NaN), no host sync.
    16-bit tensors are summed in float32 so a large finite gradient does not overflow.
    """
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
