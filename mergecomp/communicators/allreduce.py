"""Allreduce: every rank ends with the elementwise sum of all payloads.

The cheapest exchange (a ring moves 2·(N−1)/N of the payload per rank), but only for
compressors whose payloads add up: FP32/FP16/BF16, shared-index rand-k, PowerSGD.
"""
from __future__ import annotations

from . import register
from .cost import SendCost, collective_cost
from .base import Communicator


@register("allreduce")
class AllreduceCommunicator(Communicator):
    """Sums payloads over ranks, then decodes the sum once."""

    def __init__(self, compressor, memory, backend):
        super().__init__(compressor, memory, backend)
        if not (compressor.summable or compressor.multi_round):
            raise ValueError(
                f"the allreduce communicator cannot carry compressor {compressor.name!r}: its "
                "payloads from different ranks cannot be added elementwise (e.g. different "
                "indices or scales per rank). Use communicator='allgather' or 'ps' with it, or a "
                "summable compressor (none, fp16, bf16, randk, powersgd) with allreduce.")

    def _launch(self, payload, ctx, name):
        return self.backend.allreduce_async(payload)

    def _combine(self, result, handle):
        return self.compressor.decompress(result, handle.ctx).reshape(-1)

    # -- cost model (mergecomp.planning.costmodel.communicator_formula) ---------------------------
    #: The collectives the formula below prices with; the profile measures them.
    cost_collectives = ("allreduce",)
    #: start() launches the allreduce without waiting; finish() decodes the sum once: the
    #: times of both in the live run are local work (see costmodel.phases_are_local).
    phases_are_local = True

    @classmethod
    def send_cost(cls, codec, profile):
        """A compressed group: one allreduce of the payload, then one decode of the sum."""
        allreduce = collective_cost(profile, "allreduce", "the allreduce communicator")
        return SendCost(codec.encode, codec.wire, allreduce, codec.decode)
