"""Reusable per-thread work buffers for the kernels.

The quantisers and selectors work in n-element temporaries; allocating (and page-faulting)
a fresh one on every step costs about as much as the work itself, so each compressor keeps
a :class:`Scratch` and the kernels take their work space from it.
"""
from __future__ import annotations

import threading
from typing import Dict, Tuple

import torch


class Scratch:
    """Per-thread reusable work buffers, keyed by a purpose tag, dtype and device.

    ``get("rand", n, torch.float32, device)`` returns an n-element tensor whose contents
    are garbage; it is reused (grown when needed) by later calls with the same tag, so a
    compressor pays the allocation once instead of on every step.  Buffers are per thread
    because communicators may compress groups from several threads at once.  Never put a
    scratch buffer in a payload or context: the next call overwrites it.
    """

    def __init__(self):
        self._local = threading.local()

    def get(self, tag: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buffers: Dict[Tuple[str, torch.dtype, torch.device], torch.Tensor] = \
            self._local.__dict__.setdefault("buffers", {})
        key = (tag, dtype, torch.device(device))
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            buffers[key] = buf
        return buf[:numel]

    def at_least(self, tag: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """The whole buffer of ``tag``: at least ``numel`` elements, more when an earlier call
        grew it (for output of unknown length: take what room there is, ask again if short)."""
        self.get(tag, numel, dtype, device)
        return self._local.__dict__["buffers"][(tag, dtype, torch.device(device))]

    def counter(self, numel: int, device) -> torch.Tensor:
        """0, 1, ..., numel − 1 as int32, kept (and grown) between calls: read it, never write it."""
        buffers = self._local.__dict__.setdefault("counters", {})
        device = torch.device(device)
        count = buffers.get(device)
        if count is None or count.numel() < numel:
            count = buffers[device] = torch.arange(max(numel, 1), dtype=torch.int32, device=device)
        return count[:numel]

    def __getstate__(self):
        return {}  # buffers are a cache: copies and pickles start empty

    def __setstate__(self, state):
        self._local = threading.local()

    def clear(self) -> None:
        """Free this thread's buffers (e.g. after the plan changed to smaller groups)."""
        self._local.__dict__.pop("buffers", None)
        self._local.__dict__.pop("counters", None)
