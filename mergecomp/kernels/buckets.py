"""Fixed-size buckets: per-bucket scales for the quantisers (QSGD, TernGrad).

A fused buffer mixes layers whose gradients differ by orders of magnitude; one scale per
bucket of ``bucket_size`` consecutive elements keeps the quantisation error of each
bucket proportional to its own magnitude.  The last bucket may be short: it is padded with
zeros, which change neither a norm nor a maximum.

:func:`bucket_norms` and :func:`bucket_peaks` take the whole tensor and pick the backend:
one native pass for fp32 on the CPU where the kernels are built, else torch reductions over
the buckets as (rows × bucket_size) views (:func:`bucket_parts`), on the tensor's device.
"""
from __future__ import annotations

from typing import List

import torch

from . import native
from .scratch import Scratch


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


def bucket_parts(tensor: torch.Tensor, bucket_size: int, scratch: Scratch) -> List[torch.Tensor]:
    """``tensor`` as (rows × bucket_size) pieces, in order, without copying the whole buckets.

    The whole buckets are a view of the input (read them, never write them); a partial last
    bucket is a zero-padded copy in ``scratch``.  Per-bucket statistics are then one
    reduction per piece, concatenated — no n-element workspace copy is needed for them.
    """
    flat = tensor.reshape(-1)
    n = flat.numel()
    rows, rest = divmod(n, bucket_size)
    parts = [flat[: rows * bucket_size].view(rows, bucket_size)] if rows else []
    if rest:
        tail = scratch.get("tail", bucket_size, flat.dtype, flat.device)
        tail[:rest].copy_(flat[rows * bucket_size:])
        tail[rest:].zero_()
        parts.append(tail.view(1, bucket_size))
    return parts


def per_bucket(parts: List[torch.Tensor], statistic) -> torch.Tensor:
    """``statistic`` (a (rows × size) → (rows,) reduction) over every piece, as one tensor."""
    values = [statistic(part) for part in parts]
    return values[0] if len(values) == 1 else torch.cat(values)


def bucket_peaks(tensor: torch.Tensor, bucket_size: int, scratch: Scratch) -> torch.Tensor:
    """max |v| of each bucket of ``bucket_size`` elements of ``tensor``, as fp32."""
    if tensor.dtype == torch.float32 and native.usable(tensor):
        return native.bucket_peaks(tensor, bucket_size)  # one pass instead of two
    return peaks_of_parts(bucket_parts(tensor, bucket_size, scratch))


def bucket_norms(tensor: torch.Tensor, bucket_size: int, scratch: Scratch) -> torch.Tensor:
    """‖v‖₂ of each bucket of ``bucket_size`` elements of ``tensor``, as fp32, without
    overflow for |v| ~ 1e30 or underflow for 1e-30."""
    if tensor.dtype == torch.float32 and native.usable(tensor):
        return native.bucket_norms(tensor, bucket_size)  # one pass, no rescue needed
    return norms_of_parts(bucket_parts(tensor, bucket_size, scratch))


def peaks_of_parts(parts: List[torch.Tensor]) -> torch.Tensor:
    """max |v| of each bucket, in fp32 (two plain reductions: no |v| temporary).

    A bucket of zeros gives +0.0 whatever the signs of its zeros (adding +0.0 turns −0.0
    into +0.0), the value the native kernel sends too.
    """
    return per_bucket(parts, lambda p: torch.maximum(p.amax(dim=1), p.amin(dim=1).neg()).float().add_(0.0))


def _fp32_row_norms(rows: torch.Tensor) -> torch.Tensor:
    """‖row‖₂ of each row as fp32 (fp64 rows are reduced in fp64 first: torch refuses to
    narrow them inside the reduction)."""
    if rows.dtype == torch.float64:
        return torch.linalg.vector_norm(rows, dim=1).float()
    return torch.linalg.vector_norm(rows, dim=1, dtype=torch.float32)


def norms_of_parts(parts: List[torch.Tensor]) -> torch.Tensor:
    """‖v‖₂ of each bucket in fp32, without overflow for |v| ~ 1e30 or underflow for 1e-30.

    The plain fp32 norm squares the values, so it overflows above ~1e19 and loses buckets
    below ~1e-19; those (rare) buckets are recomputed as peak · ‖v / peak‖.
    """
    norms = per_bucket(parts, _fp32_row_norms)
    suspect = ~(torch.isfinite(norms) & (norms >= 1e-15))
    if bool(suspect.any()):  # only the suspect rows are gathered and redone
        start = 0
        for part in parts:
            redo = suspect[start: start + part.shape[0]].nonzero().view(-1)
            if redo.numel():
                picked = part[redo].float()
                peaks = picked.abs().amax(dim=1)
                safe = torch.where(peaks > 0, peaks, torch.ones_like(peaks))
                norms[start + redo] = peaks * torch.linalg.vector_norm(picked / safe[:, None], dim=1)
            start += part.shape[0]
    return norms
