"""Allgather: every rank receives every rank's payload and decodes each one.

Carries any compressor, including payloads whose size differs per rank (DGC) or is zero.
Each rank receives N payloads, so traffic grows with the world size: use it for
compressors that shrink the gradient a lot.
"""
from __future__ import annotations

from . import register
from .base import Communicator


@register("allgather")
class AllgatherCommunicator(Communicator):
    """Gathers all payloads and sums them with the local context (``decompress_sum``)."""

    def _launch(self, payload, ctx, name):
        return self.backend.allgather_async(payload, same_shapes=self.compressor.fixed_size)

    def _combine(self, result, handle):
        return self.compressor.decompress_sum(result, handle.ctx)
