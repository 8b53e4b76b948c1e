"""DGC's momentum correction: the new momentum and velocity of a group, in as few passes as possible.

The torch way is two passes over the group (u' = g + m·u, then v' = v + u'; a third
before them for a clipped gradient's product), and DGC's
selection then reads v' a third time for its block peaks.  Where the native kernels take
the tensors (contiguous fp32 on the CPU) one pass writes u' and v' and keeps the block
peaks of v'; they are attached to v' (:func:`~.selection.attach_peaks`) so that the
:class:`~.selection.BlockPeaks` of the compressor that sends v' finds them instead of
reading v' again.  Both paths give the same bits (``tests/test_native_kernels.py``).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import native
from .selection import BLOCK, attach_peaks


def _native_takes(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() and native.usable(t) for t in tensors)


def momentum_correction(gradient: torch.Tensor, momentum: torch.Tensor, velocity: torch.Tensor,
                        factor: float, nesterov: bool, new_momentum: torch.Tensor,
                        new_velocity: torch.Tensor, scale: Optional[float] = None):
    """(u', v') written into ``new_momentum`` and ``new_velocity`` (never into the inputs, so
    a rolled-back step finds them intact): u' = g + m·u, v' = v + u' (Nesterov:
    u' = m·(u + g), v' = v + u' + g), with g = ``gradient`` · ``scale`` when a scale is
    given (local clipping's factor: the native pass applies it on the way, without a
    clipped copy of the gradient)."""
    if _native_takes(gradient, momentum, velocity, new_momentum, new_velocity):
        peaks = native.dgc_accumulate(gradient, momentum, velocity, factor, nesterov,
                                      new_momentum, new_velocity, BLOCK, 1.0 if scale is None else scale)
        attach_peaks(new_velocity, peaks)
        return new_momentum, new_velocity
    if scale is not None:
        gradient = gradient * scale
    if nesterov:
        u = torch.add(momentum, gradient, out=new_momentum).mul_(factor)
        return u, torch.add(velocity, u, out=new_velocity).add_(gradient)
    u = torch.add(gradient, momentum, alpha=factor, out=new_momentum)
    return u, torch.add(velocity, u, out=new_velocity)
