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
    """Gathers all payloads, decodes each with the local context, aggregates."""

    def _launch(self, payload, ctx, name):
        return self.backend.allgather_async(payload, same_shapes=self.compressor.fixed_size)

    def _combine(self, result, handle):
        decoded = [self.compressor.decompress(payload, handle.ctx).reshape(-1) for payload in result]
        return self.compressor.aggregate(decoded)
