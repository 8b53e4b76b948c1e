"""Fixed-size buckets: per-bucket scales for the quantisers (QSGD, TernGrad).

A fused buffer mixes layers whose gradients differ by orders of magnitude; one scale per
bucket of ``bucket_size`` consecutive elements keeps the quantisation error of each
bucket proportional to its own magnitude.  The last bucket may be short: it is padded with
zeros, which change neither a norm nor a maximum.
"""
from __future__ import annotations

import torch

from .packing import Scratch


def check_bucket_size(bucket_size) -> int:
    """Validate a positive integer bucket size; ValueError with the value otherwise."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1:
        raise ValueError(f"bucket_size must be a positive integer, got {bucket_size!r}; "
                         f"512 is the usual choice")
    return bucket_size


def num_buckets(numel: int, bucket_size: int) -> int:
    return (numel + bucket_size - 1) // bucket_size


def padded_fp32_buckets(tensor: torch.Tensor, bucket_size: int, scratch: Scratch) -> torch.Tensor:
    """A (buckets × bucket_size) fp32 scratch copy of ``tensor``, zero-padded at the end.

    The copy is the compressor's workspace (it is modified in place), so the caller's
    gradient is never touched.  It lives in ``scratch``: do not keep it past the call.
    """
    flat = tensor.reshape(-1)
    n = flat.numel()
    rows = num_buckets(n, bucket_size)
    work = scratch.get("buckets", rows * bucket_size, torch.float32, flat.device)
    work[:n].copy_(flat)
    work[n:].zero_()
    return work.view(rows, bucket_size)


def scale_buckets_(values: torch.Tensor, scales: torch.Tensor, bucket_size: int) -> torch.Tensor:
    """Multiply flat ``values`` in place by their bucket's entry of ``scales``; return them."""
    n = values.numel()
    full = n // bucket_size
    if full:
        values[: full * bucket_size].view(full, bucket_size).mul_(scales[:full, None])
    if n > full * bucket_size:
        values[full * bucket_size:].mul_(scales[full])
    return values
